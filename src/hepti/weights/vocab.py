"""The tokenizer of a random decoder (`hepti convert --random llama-1b`): small, made from nothing.

A random model has no tokenizer of its own, but `hepti generate`, distributed-llama's converter
and llama.cpp all want one with exactly the config's vocabulary size. Training a BPE would be
overkill and borrowing SmolLM2's would tie a benchmark model to an installed package, so this
writes a GPT-2-style byte-level BPE whose vocabulary is, by id:

| ids                 | tokens                                                          |
|---------------------|-----------------------------------------------------------------|
| 0, 1, 2             | `<|endoftext|>`, `<|im_start|>` (BOS), `<|im_end|>` (EOS): control |
| 3 .. 258            | the 256 byte symbols (GPT-2's byte-to-unicode map)              |
| 259 .. 960          | 702 merges: "Ġ" + a-z, then every pair of a-z ("Ġt", "th", ...)  |
| 961 .. V-1          | `<|reserved_N|>`, never produced by encoding                    |

Any text encodes (bytes are always there) and decodes back to itself, the ids match SmolLM2's
special tokens (and `config.PRESET_DEFAULTS["llama"]`'s BOS/EOS), and the tokenizer is built by
the same function that rebuilds a GGUF's (`hepti.weights.gguf.build_bpe_tokenizer`), so the
exported GGUF tokenises as the converted folder does. Random weights generate reserved tokens
most of the time: text from this model is noise by design, only its speed is measured.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from hepti.errors import ConfigError
from hepti.weights.gguf import TOKEN_CONTROL, TOKEN_NORMAL, build_bpe_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
# SmolLM2's ChatML template without its default system prompt
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (as byte-level BPE uses)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def random_vocab(vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """tokens (id = position), merges ("a b" lines) and GGUF token types of the table above."""
    sym = byte_symbols()
    space = sym[ord(" ")]  # "Ġ"
    letters = string.ascii_lowercase
    merges = [f"{space} {a}" for a in letters] + [f"{a} {b}" for a in letters for b in letters]
    tokens = list(SPECIALS) + sym + [m.replace(" ", "") for m in merges]
    if vocab_size < len(tokens):
        raise ConfigError(f"a random decoder's vocabulary must hold at least {len(tokens)} "
                          f"tokens (specials, bytes, merges), got vocab_size {vocab_size}")
    tokens += [f"<|reserved_{i}|>" for i in range(vocab_size - len(tokens))]
    types = [TOKEN_CONTROL] * len(SPECIALS) + [TOKEN_NORMAL] * (vocab_size - len(SPECIALS))
    return tokens, merges, types


def write_random_tokenizer(vocab_size: int, folder: str | Path) -> dict[str, Path]:
    """tokenizer.json and tokenizer_config.json of the table above into `folder`; returns
    {file name: path}, as `write_model`'s copy_files takes them."""
    folder = Path(folder)
    tokens, merges, types = random_vocab(vocab_size)
    tok = build_bpe_tokenizer(tokens, merges, types, pre="default")
    tok.save(str(folder / "tokenizer.json"))
    meta = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "bos_token": SPECIALS[BOS_ID], "eos_token": SPECIALS[EOS_ID],
            "unk_token": None, "pad_token": None, "add_bos_token": False,
            "tokenizer_pre": "default"}
    (folder / "tokenizer_config.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {n: folder / n for n in ("tokenizer.json", "tokenizer_config.json")}
