"""A decoder's text around its token ids: the chat template, the end-of-sequence tokens, and the
text of tokens as they come. Shared by `hepti generate` and `hepti serve`'s completions; no MPI
here (serve's front end, outside MPI, renders and streams with it).

The chat template is Jinja code from the model's files: it is rendered in Jinja's immutable
sandbox (as transformers does), never run as Python.
"""
from __future__ import annotations

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hepti.errors import InputError

ROLES = ("system", "user", "assistant")


def render_chat(messages: list[dict], meta: dict, model, fix: str) -> str:
    """A list of {"role", "content"} messages rendered by the model's chat template, with the
    assistant's turn opened. The template adds its default system prompt when the list has
    none. `fix` ends the errors: what the caller can do instead (it differs between the CLI
    and the HTTP API)."""
    template = meta.get("chat_template")
    if not template:
        raise InputError(f"{model} has no chat template (tokenizer_config.json); {fix}")
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=meta.get("bos_token") or "", eos_token=meta.get("eos_token") or "")
    except TemplateError as e:
        raise InputError(f"{model}: its chat template cannot be rendered ({e}); {fix}") from None


def stop_ids(cfg, tok, meta) -> tuple[int, ...]:
    """The model's end-of-sequence tokens: its config's and its chat template's EOS."""
    out = {cfg.eos_token_id} if cfg.eos_token_id is not None else set()
    if tok is not None and meta.get("eos_token"):
        eos = tok.token_to_id(meta["eos_token"])
        if eos is not None:
            out.add(eos)
    return tuple(sorted(out))


class TextStream:
    """The text of the tokens made so far, given out as it grows: `push(token)` returns the
    new text (often ""). Decoding the whole list each time keeps a character that spans tokens
    whole; one still incomplete (U+FFFD at the end) waits for the next token, and `flush()`
    gives what is left at the end."""

    def __init__(self, tok):
        self.tok, self.ids, self.text = tok, [], ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self.tok.decode(self.ids)) if self.ids else ""

    def _take(self, text: str) -> str:
        new = text[len(self.text):]
        self.text = text
        return new
