"""One request body -> what the workers run, checked (pure functions, no I/O): an embeddings
request's token ids per input; a completion's prompt ids and sampling (a decoder's).

The body is OpenAI's (and Hugging Face TEI's) shape, so their clients work unchanged:
`{"input": ..., "model": ..., "encoding_format": ..., "dimensions": ..., "truncate": ...,
"user": ...}`. Every refusal is a `RequestError` whose message says what is wrong, which input
(by index) when it is one input, and what to send instead.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass

import numpy as np

from hepti.errors import HeptiError

FIELDS = ("input", "model", "encoding_format", "dimensions", "truncate", "user")
ENCODINGS = ("float", "base64")
INPUT_SHAPES = ('a string, a list of strings, a list of token ids (one input) or a list of '
                'lists of token ids, e.g. {"input": ["A cat sat.", "A dog sat."]}')


class RequestError(HeptiError):
    """A request the service refuses: HTTP `status`, a message for the client, and a short
    machine-readable `code` (OpenAI's error shape carries both)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; more is refused with 413 before any work is queued."""
    max_body_bytes: int = 8 * 1024 * 1024
    max_inputs: int = 256
    max_request_tokens: int = 65536


@dataclass
class ParsedRequest:
    inputs: list[np.ndarray]   # int64 token ids [L_i] per input, in request order
    prompt_tokens: int         # sum of the L_i (after truncation)
    encoding_format: str       # "float" | "base64"


def parse_embeddings_request(body: bytes, content_type: str | None, service,
                             limits: Limits) -> ParsedRequest:
    """Check the content type, decode the JSON body and check it (`check_embeddings_request`)."""
    check_content_type(content_type)
    return check_embeddings_request(decode_json(body), service, limits)


def check_content_type(content_type: str | None) -> None:
    """application/json, optionally with charset=utf-8; anything else is a 415."""
    fix = "send the header Content-Type: application/json (the body is UTF-8 JSON)"
    media, *params = (content_type or "").split(";")
    if media.strip().lower() != "application/json":
        raise RequestError(415, f"Content-Type is {content_type or 'missing'!r}; {fix}",
                           "unsupported_media_type")
    for param in params:
        name, _, value = param.partition("=")
        if (name.strip().lower() == "charset"
                and value.strip().strip('"').lower().replace("-", "") != "utf8"):
            raise RequestError(415, f"charset {value.strip()!r} is not supported; {fix}",
                               "unsupported_media_type")


def decode_json(body: bytes) -> dict:
    """The body as a JSON object (400 when it is not UTF-8, not JSON, or not an object)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not UTF-8 (byte {e.start}); encode it as UTF-8",
                           "invalid_json") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"the body is not valid JSON ({e.msg} at line {e.lineno} column "
                           f"{e.colno}); send a JSON object such as {{\"input\": \"A cat sat.\"}}",
                           "invalid_json") from None
    if not isinstance(obj, dict):
        raise RequestError(400, f"the body is {_a(obj)} (JSON); send a JSON object such "
                           "as {\"input\": \"A cat sat.\"}", "invalid_json")
    return obj


def check_embeddings_request(obj: dict, service, limits: Limits) -> ParsedRequest:
    """A decoded request object -> token ids per input, every field checked.

    Texts are tokenised with `service.tokenizer` (which adds the model's special tokens); ids
    are used as given. With `"truncate": true` an input longer than `service.max_tokens` is cut
    to that length: a text keeps its final special token (e.g. BERT's [SEP]), i.e. the ids
    before it are cut; ids sent by the client are cut at the end, as they are.
    """
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise RequestError(400, f"unknown field {', '.join(map(_with_hint, unknown))}; the "
                           f"fields are {', '.join(FIELDS)}", "unknown_field")
    _check_optional(obj, "model", str, "the model's name, a string (it is ignored: the served "
                    "model answers)")
    _check_optional(obj, "truncate", bool, "true or false")
    encoding = obj.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise RequestError(400, f"encoding_format is {encoding!r}; send \"float\" (a list of "
                           "numbers) or \"base64\" (little-endian float32 bytes)", "invalid_value")
    dims = obj.get("dimensions")
    if dims is not None and (type(dims) is not int or dims != service.hidden_size):
        raise RequestError(400, f"dimensions is {dims!r}, but this model's embeddings have "
                           f"{service.hidden_size}; leave dimensions out or send "
                           f"{service.hidden_size}", "invalid_value")

    texts, ids = _split_input(obj.get("input"))
    n = len(texts if texts is not None else ids)
    if n > limits.max_inputs:
        raise RequestError(413, f"{n} inputs in one request; at most {limits.max_inputs} are "
                           "taken: split them over several requests", "too_many_inputs")
    truncate = bool(obj.get("truncate"))
    if texts is not None:
        inputs = _tokenize(texts, service, truncate)
    else:
        inputs = [_check_ids(i, x, service, truncate) for i, x in enumerate(ids)]
    total = sum(len(x) for x in inputs)
    if total > limits.max_request_tokens:
        raise RequestError(413, f"the inputs have {total} tokens in all; one request takes at "
                           f"most {limits.max_request_tokens}: split them over several requests",
                           "request_too_large")
    return ParsedRequest(inputs, total, encoding)


def _with_hint(key: str, fields=FIELDS) -> str:
    """An unknown field's name, with the known one it is likely a typo of."""
    close = difflib.get_close_matches(key, fields, n=1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _check_optional(obj: dict, key: str, kind: type, what: str) -> None:
    value = obj.get(key)
    if value is not None and type(value) is not kind:
        raise RequestError(400, f"{key} is {_a(value)}; send {what}, or leave it out",
                           "invalid_value")


def _split_input(value) -> tuple[list[str] | None, list[list] | None]:
    """`input` -> (texts, None) or (None, id lists), after checking its shape."""
    if value is None:
        raise RequestError(400, f"input is missing; send {INPUT_SHAPES}", "missing_input")
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _a(value)
        raise RequestError(400, f"input is {what}; send {INPUT_SHAPES}", "invalid_input")
    elif all(_json_type(x) == "number" for x in value):
        value = [value]   # the token ids of one input
    kinds = {_json_type(x) for x in value}
    if kinds != {"string"} and kinds != {"list"}:
        first = _json_type(value[0])
        odd = next((i for i, x in enumerate(value) if _json_type(x) != first), None)
        what = (f"element 0 is {_a(value[0])}" if odd is None else
                f"it mixes types: element 0 is {_a(value[0])}, element {odd} is {_a(value[odd])}")
        raise RequestError(400, f"input is a list, but {what}; send {INPUT_SHAPES}",
                           "invalid_input")
    # An empty string is embedded, as `hepti run --text ""` and a blank line of --input are
    # (sentence-transformers' behaviour: the tokenizer's special tokens alone); an empty list
    # of token ids has no token at all to embed.
    for i, x in enumerate(value):
        if isinstance(x, list) and not x:
            raise RequestError(400, f"input {i} is an empty list of token ids; every input "
                               "needs at least one token: drop it or send its token ids",
                               "empty_input")
    return (value, None) if kinds == {"string"} else (None, value)


def _tokenize(texts: list[str], service, truncate: bool) -> list[np.ndarray]:
    tok = service.tokenizer
    if tok is None:
        raise RequestError(400, f"the model {service.name!r} has no tokenizer.json, so texts "
                           "cannot become token ids; send token ids instead, e.g. "
                           '{"input": [[101, 7592, 102]]}', "no_tokenizer")
    if tok.padding is not None or tok.truncation is not None:
        # a bug in the service, not the request: padded or cut ids would be wrong answers
        raise ValueError("the service's tokenizer pads or truncates; call its no_padding() and "
                         "no_truncation() (the request checks decide lengths)")
    out = []
    for i, enc in enumerate(tok.encode_batch(texts)):
        ids = enc.ids
        if not ids:
            raise RequestError(400, f"input {i} has no tokens after tokenisation; drop it or "
                               "send some text", "empty_input")
        if len(ids) > service.max_tokens:
            _refuse_unless_truncating(i, len(ids), service.max_tokens, truncate)
            most = service.max_tokens
            ids = ids[:most - 1] + ids[-1:] if enc.special_tokens_mask[-1] else ids[:most]
        out.append(np.array(ids, np.int64))
    return out


def _check_ids(i: int, ids: list, service, truncate: bool) -> np.ndarray:
    for j, t in enumerate(ids):
        if type(t) is not int:
            raise RequestError(400, f"input {i}, position {j}: {t!r} is not a token id; token "
                               "ids are whole numbers", "invalid_token_id")
        if not 0 <= t < service.vocab_size:
            raise RequestError(400, f"input {i}, position {j}: token id {t} is outside the "
                               f"model's vocabulary [0, {service.vocab_size}); use ids from the "
                               f"model's own tokenizer", "invalid_token_id")
    if len(ids) > service.max_tokens:
        _refuse_unless_truncating(i, len(ids), service.max_tokens, truncate)
        ids = ids[:service.max_tokens]
    return np.array(ids, np.int64)


def _refuse_unless_truncating(i: int, n: int, most: int, truncate: bool) -> None:
    """Refuse an input of `n` tokens when the model takes `most`, unless told to truncate."""
    if not truncate:
        raise RequestError(413, f"input {i} has {n} tokens; the model takes at most {most}: "
                           "shorten or split it, or send \"truncate\": true to cut it to "
                           f"{most} tokens", "input_too_long")


def _json_type(x) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if x is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list",
            dict: "object"}.get(type(x), type(x).__name__)


def _a(x) -> str:
    """A decoded value's JSON type with its article, for messages: "a string", "an object"."""
    kind = _json_type(x)
    return kind if kind == "null" else f"an {kind}" if kind == "object" else f"a {kind}"


# --- completions (a decoder) -------------------------------------------------------------------

COMPLETION_FIELDS = ("prompt", "model", "max_tokens", "temperature", "top_p", "seed", "stream",
                     "stop", "n", "user")
CHAT_FIELDS = tuple("messages" if f == "prompt" else f for f in COMPLETION_FIELDS) + \
    ("max_completion_tokens",)
MAX_STOPS = 4  # stop strings per request, as OpenAI takes
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)
CHAT_MAX_TOKENS = 256  # /v1/chat/completions': this many, or what the context has left
MESSAGES_SHAPE = ('a list of {"role": "system" | "user" | "assistant", "content": "text"}, e.g. '
                  '[{"role": "user", "content": "What is the capital of France?"}]')


@dataclass
class CompletionRequest:
    ids: list[int]          # the prompt's token ids (a chat's rendered by the chat template)
    sampling: dict          # max_tokens, temperature, top_p, seed (the workers' "generate")
    stream: bool
    stop: list[str]         # strings that end the text (not included in it)
    chat: bool


def check_completion_request(obj: dict, service, chat: bool, render_chat) -> CompletionRequest:
    """A decoded /v1/completions (or, `chat`, /v1/chat/completions) body -> the prompt's ids
    and the sampling, every field checked. `render_chat(messages) -> text` is the model's chat
    template (hepti.model.chat); its InputError becomes a 400."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = [k for k in obj if k not in fields]
    if unknown:
        hints = ", ".join(_with_hint(k, fields) for k in unknown)
        raise RequestError(400, f"unknown field {hints}; the fields are {', '.join(fields)}",
                           "unknown_field")
    _check_optional(obj, "model", str, "the model's name, a string (it is ignored: the served "
                    "model answers)")
    _check_optional(obj, "stream", bool, "true (server-sent events) or false")
    _check_optional(obj, "user", str, "a string")
    if obj.get("n", 1) != 1 or type(obj.get("n", 1)) is not int:
        raise RequestError(400, f"n is {obj['n']!r}; this service makes one choice a request: "
                           "send 1 or leave it out", "invalid_value")
    tok = service.tokenizer
    if tok is None:
        raise RequestError(400, f"the model {service.name!r} has no tokenizer.json, so a text "
                           "prompt cannot become token ids; re-convert it from its GGUF",
                           "no_tokenizer")
    if chat:
        text = render_chat(_messages(obj.get("messages")))
    else:
        text = obj.get("prompt")
        if text is None:
            raise RequestError(400, 'prompt is missing; send the text to continue, e.g. '
                               '{"prompt": "Once upon a time", "max_tokens": 32}',
                               "missing_prompt")
        if not isinstance(text, str):
            raise RequestError(400, f"prompt is {_a(text)}; send one string", "invalid_prompt")
    ids = tok.encode(text).ids
    if not ids:
        raise RequestError(400, "the prompt has no tokens; send some text", "empty_prompt")
    room = service.max_tokens - len(ids)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in obj else "max_tokens"
    most = obj.get(key)
    if most is None:
        most = min(CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS, room)
    elif type(most) is not int or most < 1:
        raise RequestError(400, f"{key} is {most!r}; send a whole number of new tokens, at "
                           "least 1", "invalid_value")
    if room < 1 or most > room:
        raise RequestError(400, f"the prompt ({len(ids)} tokens) and {key} {most} do not fit "
                           f"the model's context of {service.max_tokens} tokens; shorten the "
                           f"prompt or ask for at most {max(room, 0)} tokens",
                           "context_length_exceeded")
    temperature = _number(obj, "temperature", 1.0, "0 (greedy) or more, e.g. 0.7",
                          lambda v: v >= 0)
    top_p = _number(obj, "top_p", 1.0, "a probability in (0, 1], e.g. 0.9", lambda v: 0 < v <= 1)
    seed = obj.get("seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    elif type(seed) is not int or seed < 0:
        raise RequestError(400, f"seed is {seed!r}; send a whole number, 0 or more (the same "
                           "seed gives the same tokens)", "invalid_value")
    return CompletionRequest(ids, {"max_tokens": most, "temperature": temperature,
                                   "top_p": top_p, "seed": seed},
                             bool(obj.get("stream")), _stops(obj.get("stop")), chat)


def _messages(value) -> list[dict]:
    if value is None:
        raise RequestError(400, f"messages is missing; send {MESSAGES_SHAPE}", "missing_messages")
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else _a(value)
        raise RequestError(400, f"messages is {what}; send {MESSAGES_SHAPE}", "invalid_messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise RequestError(400, f"message {i} is {json.dumps(m)[:80]}; each message is "
                               f"{MESSAGES_SHAPE}", "invalid_messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _number(obj: dict, key: str, default: float, what: str, ok) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not ok(value):
        raise RequestError(400, f"{key} is {value!r}; send {what}", "invalid_value")
    return float(value)


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 0 < len(stops) <= MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop is {json.dumps(value)[:80]}; send a non-empty string or "
                           f"a list of at most {MAX_STOPS} of them", "invalid_value")
    return stops
