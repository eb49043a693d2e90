"""Reading inference inputs (texts, text files, id arrays) and checking output paths, up front.

Every check here runs before any model work, so a bad flag loses nothing. Row i of every output
is input i: a blank line of an --input file is the empty text (as sentence-transformers embeds
it), never skipped. `InputSource` hands out batch k on demand, so the primary holds the texts
but never all their token ids at once.
"""
from __future__ import annotations

from pathlib import Path
import hashlib
import logging
import tempfile

import numpy as np

from hepti.errors import InputError
from hepti.model.batch import Batch
from hepti.model.bert import validate_inputs


def read_texts(texts: list[str] | None, input_file: str | None) -> list[str]:
    """--text as given, or one text per line of --input (blank lines kept as empty texts)."""
    if texts:
        return list(texts)
    path = Path(input_file)
    if not path.is_file():
        raise InputError(f"--input {path}: no such file")
    try:
        # split on newlines only: str.splitlines() would also split at \x0b, \x1c, U+2028 and
        # others inside a line, and row i would no longer be line i
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--input {path}: not UTF-8 text ({e})") from None
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    if lines and lines[-1] == "":  # the newline that ends the last line starts no new one
        lines.pop()
    if not lines:
        raise InputError(f"--input {path} is empty; it needs one text per line")
    return lines


def read_ids(path: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """An .npz with `ids` [n, L] and optional `mask`, `token_type` [n, L]."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--input-ids {p}: no such file")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad file
        raise InputError(f"--input-ids {p}: not a readable .npz file ({e})") from None
    if not hasattr(z, "files"):
        raise InputError(f"--input-ids {p}: expected an .npz archive with an `ids` array")
    if "ids" not in z.files:
        raise InputError(f"--input-ids {p} has no array `ids` (it has: {', '.join(z.files) or 'none'});"
                         " save it with np.savez(path, ids=..., mask=...)")
    ids = z["ids"]
    if ids.ndim == 1:
        ids = ids[None]
    mask = z["mask"] if "mask" in z.files else None
    tt = z["token_type"] if "token_type" in z.files else None
    return ids, mask, tt


NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file (numpy.lib.format)


def read_npy(path: str, flag: str) -> np.ndarray:
    """One array from a .npy file. Anything else is refused by its first bytes, before numpy
    tries to read it: np.load would take a file that is not .npy for a pickle and answer with
    advice on unpickling, which hepti never does."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {p}: no such file")
    with open(p, "rb") as f:
        head = f.read(len(NPY_MAGIC))
    if head != NPY_MAGIC:
        what = "an .npz archive" if head.startswith(b"PK") else "not a .npy file"
        raise InputError(f"{flag} {p} is {what}; give one array saved with numpy.save(path, "
                         "arr) (image files go to --image)")
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise InputError(f"{flag} {p}: a damaged .npy file ({e})") from None


def check_output_path(path: str | None, flag: str = "--output") -> None:
    """Fail before any work if `path` (given with `flag`) could not be written: its folder must
    exist and take a new file (tried for real: permission bits say nothing to root, and /proc
    refuses files whatever they say), and it must not be a folder itself."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file name, e.g. {p / 'out'}"
                         f"{'.npy' if flag == '--output' else '.json'}")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: folder {parent} does not exist; create it first "
                         f"(mkdir -p {parent})")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{p.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write into {parent} ({e.strerror or e}); "
                         "choose a folder you can write to") from None


def npy_output_path(path: str | None, force: bool = False, resume: bool = False) -> Path | None:
    """--output names a .npy file: checked, and refused without the suffix (np.save would
    silently write NAME.npy instead), or when a file of that name exists, unless `force` says
    to replace it (as `hepti convert` asks for --force). `resume` continues an interrupted run,
    which left OUT.npy.partial and no OUT.npy; its check is hepti.output's."""
    if path is None:
        return None
    check_output_path(path)
    p = Path(path)
    if p.suffix != ".npy":
        raise InputError(f"--output {path}: hepti writes a NumPy array, so the name must end in "
                         f".npy; use --output {p.name}.npy")
    if p.exists() and not force:
        what = "a finished run's output" if resume else "a file"
        raise InputError(f"--output {path}: {what} is already there; add --force to replace it, "
                         "or choose another name")
    return p


class InputSource:
    """A run's inputs, handed out one batch at a time: batch k holds rows [k*bs, (k+1)*bs).

    Made (and so checked) whole before any work. `lengths` is each batch's token count T,
    known up front so an output of hidden states [n, L, C] can be laid out before the first
    batch. `digest` identifies the inputs, so --resume continues only the same job."""

    def __init__(self, n: int, batch_size: int, lengths: list[int], make_batch, digest: str):
        self.n, self.batch_size, self.lengths = n, batch_size, lengths
        self._make, self.digest = make_batch, digest

    @property
    def n_batches(self) -> int:
        return len(self.lengths)

    def rows(self, k: int) -> tuple[int, int]:
        return k * self.batch_size, min(self.n, (k + 1) * self.batch_size)

    def batch(self, k: int) -> Batch:
        return self._make(*self.rows(k))

    @classmethod
    def from_ids(cls, path: str, config, batch_size: int) -> "InputSource":
        """--input-ids: arrays ids [n, L] and optional mask, token_type, checked whole."""
        ids, mask, tt = read_ids(path)
        ids = np.asarray(ids)
        mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
        tt = np.zeros(ids.shape, np.int64) if tt is None else np.asarray(tt)
        if mask.shape != ids.shape or tt.shape != ids.shape:
            raise InputError(f"--input-ids: mask/token_type shapes {mask.shape}/{tt.shape} differ "
                             f"from ids {ids.shape}")
        validate_inputs(config, ids, mask, tt)
        n = len(ids)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        return cls(n, batch_size, [ids.shape[1]] * -(-n // batch_size),
                   lambda a, b: Batch(ids[a:b], mask[a:b], tt[a:b]), digest)

    @classmethod
    def from_pixels(cls, pixels: np.ndarray, config, batch_size: int, digest: str) -> "InputSource":
        """Checked pixels [n, 3, H, W] (hepti.images.check_pixels), T = config.seq_len tokens."""
        n, T = len(pixels), config.seq_len
        return cls(n, batch_size, [T] * -(-n // batch_size),
                   lambda a, b: Batch(None, np.ones((b - a, T), np.int64), None, pixels[a:b]),
                   digest)

    @classmethod
    def from_texts(cls, texts: list[str], tokenizer, batch_size: int, seq: int | None,
                   pad_id: int) -> "InputSource":
        """Texts, tokenised batch by batch; with `seq`, every batch padded to seq tokens."""
        raw = tokenizer.token_counts(texts)
        counts = np.minimum(raw, tokenizer.max_len)
        long = np.flatnonzero(raw > tokenizer.max_len)
        if len(long):
            logging.getLogger("hepti").warning(
                "%d input(s) longer than %d tokens will be truncated (first: input %d)",
                len(long), tokenizer.max_len, long[0])
        n = len(texts)
        lengths = [seq or int(counts[a:a + batch_size].max()) for a in range(0, n, batch_size)]

        def make(a: int, b: int) -> Batch:
            batch = Batch(*tokenizer.encode(texts[a:b]))
            return pad_to(batch, seq, pad_id) if seq else batch

        h = hashlib.sha256()
        for t in texts:
            h.update(t.encode("utf-8", "surrogatepass") + b"\n")
        return cls(n, batch_size, lengths, make, h.hexdigest())


def pad_to(batch: Batch, length: int, pad_id: int) -> Batch:
    """Pad a batch with padding tokens to `length` (for fixed-shape benchmarks)."""
    B, T = batch.ids.shape
    if T > length:
        raise InputError(f"inputs have {T} tokens, more than --seq {length}")
    if T == length:
        return batch
    ids = np.full((B, length), pad_id, np.int64)
    mask = np.zeros((B, length), np.int64)
    tt = np.zeros((B, length), np.int64)
    ids[:, :T], mask[:, :T], tt[:, :T] = batch.ids, batch.mask, batch.token_type
    return Batch(ids, mask, tt)
