"""The HTTP front end of `hepti serve`, and its --jsonl mode: request bodies in, embeddings out.

No MPI here. The service (hepti.serve.supervisor.Supervisor, used duck-typed: `name`,
`hidden_size`, `max_tokens`, `vocab_size`, `tokenizer`, `embed`, `health`, `metrics`) owns the
workers; this module checks each request (hepti.serve.requests), calls `service.embed`, and
answers in OpenAI's shape, so OpenAI's and TEI's clients work unchanged.
"""
from __future__ import annotations

import base64
import hmac
import itertools
import json
import logging
import os
import queue
import socket
import socketserver
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import numpy as np

from hepti.errors import InputError
from hepti.model.chat import TextStream, render_chat
from hepti.serve import ServiceUnavailable
from hepti.serve.defaults import READ_TIMEOUT_S, ROUTES_HELP  # noqa: F401 (ROUTES_HELP: the routes it serves)
from hepti.serve.requests import (CompletionRequest, Limits, ParsedRequest, RequestError,
                                  check_completion_request, check_content_type,
                                  check_embeddings_request, decode_json, parse_embeddings_request)

ROUTES = {"/v1/embeddings": "POST", "/embeddings": "POST", "/health": "GET", "/metrics": "GET",
          "/v1/completions": "POST", "/completions": "POST",
          "/v1/chat/completions": "POST", "/chat/completions": "POST"}
EMBEDDINGS = ("/v1/embeddings", "/embeddings")  # an encoder's; the others a decoder's
CHAT = ("/v1/chat/completions", "/chat/completions")
ROUTE_LIST = "POST /v1/embeddings (or /embeddings), GET /health, GET /metrics"
DECODER_ROUTE_LIST = ("POST /v1/completions, POST /v1/chat/completions (or without /v1), "
                      "GET /health, GET /metrics")
RETRY_AFTER_S = 5      # what a 503 tells clients to wait
IDLE_TIMEOUT_S = 60    # a kept-alive connection idle this long is closed (it holds a thread)
# A body refused unread (413, 401, 404...) is still read and dropped after the answer, up to
# this many bytes and this many seconds (and no byte READ_TIMEOUT_S apart): Python's urllib
# and http.client send the whole body before they read, and a server that closes on an unread
# body makes them fail with a broken pipe instead of reading the answer. A 50 MB body is
# drained (~0.1 s on one machine, ~4 s at 100 Mbit/s); past the bound (a body declared at
# 10 GB) the connection closes at once, and such a client sees the broken pipe.
DRAIN_MAX_BYTES = 128 << 20
DRAIN_MAX_S = 30.0



def make_server(service, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                limits: Limits = Limits(), sock: socket.socket | None = None,
                log: logging.Logger | None = None,
                read_timeout_s: float = READ_TIMEOUT_S) -> EmbeddingsServer:
    """An HTTP server for `service` (not yet serving: call its serve_forever()).

    `sock`, an already bound and listening socket, is used instead of binding host:port (the
    caller may have made it in another network namespace). A body not whole `read_timeout_s`
    after its headers is answered 408."""
    return EmbeddingsServer(service, (host, port), api_key, limits,
                            log or logging.getLogger("hepti"), sock, read_timeout_s)


class EmbeddingsServer(ThreadingHTTPServer):
    """One daemon thread per connection; the routes' state lives here for the handlers."""
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, service, address: tuple[str, int], api_key: str | None, limits: Limits,
                 log: logging.Logger, sock: socket.socket | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S):
        self.service, self.api_key, self.limits, self.log = service, api_key, limits, log
        self.read_timeout_s = read_timeout_s
        if sock is not None:
            self.address_family = sock.family
        elif ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler, bind_and_activate=sock is None)
        if sock is not None:
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()

    def server_bind(self):
        # HTTPServer's own would look up the host's FQDN: a DNS query that can hang offline
        socketserver.TCPServer.server_bind(self)

    def handle_error(self, request, client_address):
        """A client that went away is routine; anything else is logged with its traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            self.log.debug("connection from %s lost", client_address[0])
        else:
            self.log.exception("error while serving %s", client_address[0])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: every answer carries a Content-Length
    server_version = "hepti"
    timeout = IDLE_TIMEOUT_S
    server: EmbeddingsServer
    _body_unread = False   # a body is declared and not read: answering must close the connection

    def _route(self):
        self._body_unread = self._declares_body()
        path = urlsplit(self.path).path
        refusal = self._refusal(path)
        if refusal:
            self._send_error(*refusal)
            self._drain_body()
            return
        srv = self.server
        if ROUTES[path] == "POST" and path not in EMBEDDINGS:
            self._completions(path in CHAT)
        elif ROUTES[path] == "POST":
            def embeddings():
                req = parse_embeddings_request(self._read_body(), self.headers["Content-Type"],
                                               srv.service, srv.limits)
                return 200, embeddings_answer(srv.service, req)
            self._send(*answer(embeddings, srv.log))
        elif path == "/health":
            def health():
                state = srv.service.health()
                return (200 if state.get("status") == "ok" else 503), state
            self._send(*answer(health, srv.log))
        else:
            self._send(*answer(lambda: (200, srv.service.metrics()), srv.log))

    def _completions(self, chat: bool) -> None:
        """A decoder's completion: the whole answer, or (stream) server-sent events from the
        first token on. Until the first token comes, a failure is an error answer with its
        status; after it, an error event ends the stream. A client that goes away cancels
        the generation."""
        srv = self.server
        gen = None

        def start():
            nonlocal gen
            check_content_type(self.headers["Content-Type"])
            req = check_completion_request(decode_json(self._read_body()), srv.service, chat,
                                           lambda m: _render(srv.service, m))
            gen = Completion(srv.service, req)
            gen.first()  # waits for the first token (or the failure) before any header goes
            return 200, None
        status, payload = answer(start, srv.log)
        if status != 200:
            if gen is not None:
                gen.cancel()
            self._send(status, payload)
            return
        try:
            if not gen.req.stream:
                self._send(*answer(lambda: (200, gen.whole()), srv.log))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the stream ends with the connection
            self.end_headers()
            self.close_connection = True
            try:
                for chunk in gen.chunks():
                    self.wfile.write(b"data: " + json.dumps(chunk, separators=(",", ":"))
                                     .encode() + b"\n\n")
                    self.wfile.flush()
            except (ServiceUnavailable, RuntimeError) as e:
                body = error_json(503, f"the generation stopped: {e}; retry later",
                                  "service_unavailable")
                self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (ConnectionError, TimeoutError):  # the client went away: stop generating
            srv.log.debug("a completion's client went away; its generation is cancelled")
        finally:
            gen.cancel()

    # every method comes to _route, which answers 405 where a route does not take it
    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _route

    def handle_expect_100(self):
        """Refuse before the client sends its body (so an oversize one costs nothing)."""
        refusal = self._refusal(urlsplit(self.path).path)
        if refusal is None:
            return super().handle_expect_100()
        self._body_unread = True
        self._send_error(*refusal)
        return False

    def _refusal(self, path: str) -> tuple | None:
        """(status, message, code, headers) when the request is refused before its body is
        read: API key, route, method, body size. None when it may go on."""
        key = self.server.api_key
        if key and not (path == "/health" and self.command in ("GET", "HEAD")):
            scheme, _, token = (self.headers["Authorization"] or "").partition(" ")
            if scheme.lower() != "bearer" \
                    or not hmac.compare_digest(token.strip().encode(), key.encode()):
                what = "is wrong" if token else "is missing"
                return (401, f"the API key {what}; send the header Authorization: Bearer <key> "
                        "with the key this server was started with (--api-key-file, "
                        "$HEPTI_API_KEY or --api-key)",
                        "invalid_api_key", [("WWW-Authenticate", "Bearer")])
        method = ROUTES.get(path)
        decoder = bool(getattr(self.server.service, "decoder", False))
        if method is None:
            routes = DECODER_ROUTE_LIST if decoder else ROUTE_LIST
            return (404, f"no route {path!r}; the routes are {routes}", "not_found", [])
        if method == "POST" and (path in EMBEDDINGS) == decoder:
            name = getattr(self.server.service, "name", "the model")
            serves = ("text generation: POST /v1/completions and /v1/chat/completions" if decoder
                      else "embeddings: POST /v1/embeddings")
            return (404, f"{path} is not served here: {name} is a "
                    f"{'decoder' if decoder else 'text encoder'}, which answers {serves}",
                    "not_found", [])
        allowed = "GET, HEAD" if method == "GET" else method
        if self.command not in allowed.split(", "):
            return (405, f"{path} takes {allowed}, not {self.command}", "method_not_allowed",
                    [("Allow", allowed)])
        if method != "POST":
            return None
        length = self.headers["Content-Length"]
        if "Transfer-Encoding" in self.headers or length is None:
            return (411, "the body's length is unknown; send it whole with a Content-Length "
                    "header (chunked transfer encoding is not read)", "length_required", [])
        if not length.isdigit():
            return (400, f"Content-Length is {length!r}; send the body's size in bytes",
                    "invalid_content_length", [])
        most = self.server.limits.max_body_bytes
        if int(length) > most:
            return (413, f"the body has {int(length)} bytes; at most {most} are read: split "
                    "the inputs over several requests", "body_too_large", [])
        return None

    def _drain_body(self) -> None:
        """After answering a request whose body was refused unread: end our side of the
        connection (the client sees the whole answer and the close), then read and drop the
        body, within DRAIN_MAX_BYTES and DRAIN_MAX_S, so a client that sends it all before
        reading gets the answer (see DRAIN_MAX_BYTES). The body is the Content-Length's bytes,
        or a chunked one's chunks up to its last: closing with a chunk still coming would reset
        the connection under a client still sending (http.client's BrokenPipeError)."""
        length = self.headers["Content-Length"]
        chunked = "chunked" in (self.headers["Transfer-Encoding"] or "").lower()
        if not chunked and (length is None or not length.isdigit()
                            or not 0 < int(length) <= DRAIN_MAX_BYTES):
            return
        deadline = time.monotonic() + DRAIN_MAX_S
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            if chunked:
                self._drop_chunks(deadline)
            else:
                self._drop(int(length), deadline)
        except (OSError, ValueError):   # timed out, the client went away, or a malformed
            pass                        # chunk: the connection closes anyway
        self.close_connection = True

    def _wait(self, deadline: float) -> None:
        wait = deadline - time.monotonic()
        if wait <= 0:
            raise TimeoutError
        self.connection.settimeout(min(wait, self.server.read_timeout_s))

    def _drop(self, left: int, deadline: float) -> None:
        """Read and drop `left` bytes of the body, until the deadline or the client closes."""
        sink = memoryview(bytearray(1 << 16))
        while left > 0:
            self._wait(deadline)
            k = self.rfile.readinto1(sink[:min(left, len(sink))])
            if k == 0:   # the client closed
                return
            left -= k

    def _drop_chunks(self, deadline: float) -> None:
        """Read and drop a chunked body through its last chunk and trailers, DRAIN_MAX_BYTES
        at most (ValueError past it, or on a chunk size that is not hex)."""
        budget = DRAIN_MAX_BYTES
        while True:
            self._wait(deadline)
            line = self.rfile.readline(1024)
            if not line:
                return
            size = int(line.split(b";")[0].strip(), 16)
            budget -= size + len(line) + 2
            if budget < 0:
                raise ValueError("the chunked body is over DRAIN_MAX_BYTES")
            if size == 0:
                break
            self._drop(size + 2, deadline)   # the chunk and its CRLF
        while line.strip():   # the trailer lines, up to the empty one
            self._wait(deadline)
            line = self.rfile.readline(1024)

    def _declares_body(self) -> bool:
        length = self.headers["Content-Length"]
        return "Transfer-Encoding" in self.headers or (length is not None and length != "0")

    def _read_body(self) -> bytes:
        """The whole body, within the read timeout of now (408 if not: the client announced
        more than it sends, or sends it too slowly)."""
        n = int(self.headers["Content-Length"])
        timeout = self.server.read_timeout_s
        deadline = time.monotonic() + timeout
        body = bytearray(n)
        view, got = memoryview(body), 0
        try:
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                k = self.rfile.readinto1(view[got:])
                if k == 0:   # the client went away
                    break
                got += k
        except TimeoutError:
            self._body_unread = True
            raise RequestError(408, f"the body did not arrive within {timeout:g} s: {got} of "
                               f"{n} bytes came; send the whole body its Content-Length "
                               "announces, at once (the server's --read-timeout sets the wait)",
                               "request_timeout") from None
        finally:
            self.connection.settimeout(self.timeout)
        self._body_unread = got < n
        if self._body_unread:
            raise RequestError(400, f"the body ended after {got} of {n} bytes; send the "
                               "whole body", "incomplete_body")
        return bytes(body)

    def _send_error(self, status: int, message: str, code: str, headers=()):
        self._send(status, error_json(status, message, code), headers)

    def _send(self, status: int, payload: dict, headers=()):
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 503:
            self.send_header("Retry-After", str(RETRY_AFTER_S))
        for name, value in headers:
            self.send_header(name, value)
        if self._body_unread:   # what is left of the body would be read as the next request
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        """The base class's own refusals (bad request line, unknown method...) in our shape."""
        self._body_unread = True
        phrase = HTTPStatus(code).phrase
        self._send_error(code, message or phrase, phrase.lower().replace(" ", "_"))

    def log_message(self, format, *args):
        self.server.log.debug("%s " + format, self.address_string(), *args)


def answer(fn, log: logging.Logger) -> tuple[int, dict]:
    """fn() -> (status, JSON), with its exceptions turned into OpenAI-shaped errors: a refused
    request's status, 503 when the service is unavailable, 500 (logged) for anything else."""
    try:
        return fn()
    except RequestError as e:
        return e.status, error_json(e.status, e.message, e.code)
    except ServiceUnavailable as e:
        return 503, error_json(503, f"the service is unavailable: {e}; retry later",
                               "service_unavailable")
    except Exception as e:
        log.exception("request failed")
        return 500, error_json(500, f"{type(e).__name__}: {e}", "internal_error")


def error_json(status: int, message: str, code: str) -> dict:
    kind = ("authentication_error" if status == 401 else "service_unavailable" if status == 503
            else "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code}}


def _render(service, messages: list[dict]) -> str:
    """A chat's messages in the served model's chat template; a template that cannot render
    them is the request's 400."""
    try:
        return render_chat(messages, service.chat_meta, service.name,
                           "send the prompt to /v1/completions in the model's format instead")
    except InputError as e:
        raise RequestError(400, str(e), "chat_template") from None


class Completion:
    """One completion's answer as its tokens come (`service.generate` / `service.tokens`): the
    text grows by hepti.model.chat's TextStream; a stop string ends it (the text before it is
    kept, the generation cancelled), and what could still become one is held back until it
    cannot. `whole()` is the non-streamed answer, `chunks()` the streamed one's events."""

    def __init__(self, service, req: CompletionRequest):
        self.service, self.req = service, req
        self.gen = service.generate(req.ids, req.sampling)
        self.events = service.tokens(self.gen)
        self.text = TextStream(service.tokenizer)
        self.full, self.shown, self.made, self.reason = "", 0, 0, None
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())
        self._first: list = []

    def first(self) -> None:
        """Wait for the first event (a token, or the failure, raised here)."""
        self._first = [next(self.events)]

    def cancel(self) -> None:
        self.gen.cancel.set()

    def pieces(self):
        """The text as it may be shown, piece by piece (one a token, often ""), then sets
        `reason`."""
        for kind, value in itertools.chain(self._first, self.events):
            if kind == "done":
                self.reason = "stop" if value in ("stop", "cancelled") else "length"
                self.full += self.text.flush()
                yield self._release(len(self.full))
                return
            self.made += 1
            self.full += self.text.push(value)
            cut = min((i for i in (self.full.find(s) for s in self.req.stop) if i >= 0),
                      default=-1)
            if cut >= 0:  # a stop string: the text ends before it
                self.full, self.reason = self.full[:cut], "stop"
                self.cancel()
                yield self._release(cut)
                return
            yield self._release(len(self.full) - self._held())

    def _held(self) -> int:
        """How many characters at the end might begin a stop string."""
        return max((k for s in self.req.stop for k in range(len(s) - 1, 0, -1)
                    if self.full.endswith(s[:k])), default=0)

    def _release(self, upto: int) -> str:
        piece = self.full[self.shown:upto]
        self.shown = max(self.shown, upto)
        return piece

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.service.name}

    def _usage(self) -> dict:
        n = len(self.req.ids)
        return {"prompt_tokens": n, "completion_tokens": self.made,
                "total_tokens": n + self.made}

    def whole(self) -> dict:
        text = "".join(self.pieces())
        if self.req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.reason}
            return {**self._envelope("chat.completion"), "choices": [choice],
                    "usage": self._usage()}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.reason}
        return {**self._envelope("text_completion"), "choices": [choice], "usage": self._usage()}

    def chunks(self):
        """The streamed answer's chunks: one per token that adds text (a chat's first carries
        the role), then one with the finish reason (and the usage)."""
        chat = self.req.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield {**self._envelope(kind), "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None}]}
        for piece in self.pieces():
            if piece:
                yield {**self._envelope(kind), "choices": [
                    {"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                    else {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
        yield {**self._envelope(kind), "choices": [
            {"index": 0, "delta": {}, "finish_reason": self.reason} if chat
            else {"index": 0, "text": "", "logprobs": None, "finish_reason": self.reason}],
            "usage": self._usage()}


def embeddings_answer(service, req: ParsedRequest) -> dict:
    """Embed a checked request; OpenAI's answer: one item per input, in request order."""
    vectors = service.embed(req.inputs)   # [n, C] float32
    expected = (len(req.inputs), service.hidden_size)
    if vectors.shape != expected:
        raise RuntimeError(f"the service returned embeddings of shape {vectors.shape} for "
                           f"shape {expected}")
    if not np.isfinite(vectors).all():
        raise RuntimeError("the embeddings have non-finite values (NaN or inf): the model's "
                           "weights or its arithmetic are broken")
    if req.encoding_format == "base64":
        rows = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        rows = shortest_floats(vectors).tolist()
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e}
                     for i, e in enumerate(rows)],
            "model": service.name,
            "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens}}


def shortest_floats(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> float64 [...] whose repr (what json writes) is the shortest decimal that
    reads back as the same float32: 0.1f becomes 0.1, not 0.10000000149011612.

    Each value is rounded to 6, 7, 8, then 9 significant digits and the first that round-trips
    is kept (9 always does; 6 is never longer than needed). The decimal is exact where its power
    of ten is (1e-14 < |x| < 1e22); beyond, a value reads back the same but may print longer.
    Vectorised: a 256 x 768 answer takes ~110 ms with json's formatting (~7 ms as base64)."""
    x64 = x.astype(np.float64).ravel()
    out = x64.copy()
    todo = np.flatnonzero(np.isfinite(x64) & (x64 != 0))
    exponent = np.floor(np.log10(np.abs(x64[todo])))
    for digits in (6, 7, 8, 9):
        v = x64[todo]
        k = digits - 1 - exponent   # keep k decimals: v ~ m / 10**k, m of `digits` digits
        r = np.where(k >= 0, np.round(v * 10.0 ** k) / 10.0 ** k,
                     np.round(v / 10.0 ** -k) * 10.0 ** -k)
        same = r.astype(np.float32) == v.astype(np.float32)
        out[todo[same]] = r[same]
        todo, exponent = todo[~same], exponent[~same]
    return out.reshape(x.shape)


def serve_jsonl(service, stdin, stdout, limits: Limits = Limits(),
                log: logging.Logger | None = None, workers: int = 8) -> int:
    """The --jsonl mode: each non-blank line of `stdin` is one request body (as POST
    /v1/embeddings takes, plus an optional "id" echoed back); one JSON line is written to
    `stdout` (a text stream) per request line, in input order, flushed at once. Returns the
    number of error lines.

    `workers` requests are in flight at once, so the service can batch them. Give `stdin` as
    bytes (sys.stdin.buffer): a line that is not UTF-8 is then an error line, not the end."""
    log = log or logging.getLogger("hepti")
    pool = ThreadPoolExecutor(workers, thread_name_prefix="hepti-jsonl")
    pending: queue.Queue = queue.Queue(4 * workers)   # futures in input order; bounded, so a
    read_failure: list[BaseException] = []            # long input is not all read ahead

    def read():
        try:
            for line in stdin:
                if line.strip():
                    pending.put(pool.submit(_jsonl_answer, service, line, limits, log))
        except BaseException as e:
            read_failure.append(e)
        finally:
            pending.put(None)

    # reading in a thread of its own: an answer is written as soon as it is ready, even
    # while the next line has not come yet (a client that waits for each answer)
    threading.Thread(target=read, name="hepti-jsonl-read", daemon=True).start()
    errors = 0
    try:
        while (future := pending.get()) is not None:
            failed, text = future.result()
            stdout.write(text + "\n")
            stdout.flush()
            errors += failed
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if read_failure:
        raise read_failure[0]
    return errors


def _jsonl_answer(service, line: str | bytes, limits: Limits,
                  log: logging.Logger) -> tuple[bool, str]:
    """One request line -> (is it an error, the answer line)."""
    obj = {}

    def embeddings():
        nonlocal obj
        body = line if isinstance(line, bytes) else line.encode("utf-8")
        if len(body) > limits.max_body_bytes:
            raise RequestError(413, f"the line has {len(body)} bytes; at most "
                               f"{limits.max_body_bytes} are read: split the inputs over "
                               "several lines", "body_too_large")
        obj = decode_json(body)
        request = {k: v for k, v in obj.items() if k != "id"}
        return 200, embeddings_answer(service, check_embeddings_request(request, service, limits))

    status, payload = answer(embeddings, log)
    if status == 200:
        payload = {"id": obj["id"], **payload} if "id" in obj else payload
    else:
        payload = {"id": obj.get("id"), **payload, "status": status}
    return status != 200, json.dumps(payload, separators=(",", ":"))
