"""What every benchmark shares: interleaved rounds, one launcher, and the result document.

- **Interleaved rounds** (`interleave`, `summarise`). This machine is shared, and its speed
  drifts over minutes, so variants are never timed one block after another: each round runs
  every variant once, the order rotating by one each round (round k starts k variants on), so a
  slow spell falls on all of them alike and none always follows the same neighbour. The figure
  is each variant's median over rounds, and its ratio to a named baseline two ways: the ratio of
  the medians, and the median of the per-round ratios (each round's pair ran minutes apart at
  most, so a drift across the rounds moves it less).
- **One launcher** (`command`, `launch`): a hepti command, under `mpiexec -n N` when it has
  ranks, and under `hepti emulate --cluster SPEC` when it has a spec; with the environment it
  needs (another tree's `src/` on PYTHONPATH, HEPTI_CACHE, ...), a time limit, the load average
  around it, and a clear error naming the command and the tail of its stderr when it fails.
- **The result document** (`result_doc`, `write_json`, `write_csv`): every results/*.json
  starts with the same provenance (benchmark, date, commit, machine, command line, load
  average); a CSV beside it where the bench writes one.

`checkout(REV)` puts another commit's tree in a temporary git worktree, for the benches that
compare this tree against REV (`hepti bench against`, `hepti bench file --against`).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hepti.emulate.command import find_mpiexec
from hepti.info import cpu_model

ROOT = Path(__file__).resolve().parents[3]  # the checkout whose src/ is running
# the emulated clusters shipped in the repo: bin/bench-*.sh run from its root; else beside the code
HOSTFILES = Path("hostfiles") if Path("hostfiles/emu-mixed4.json").exists() else ROOT / "hostfiles"


def at_least(minimum: int):
    """An argparse type: a whole number, `minimum` or more (rounds, repeats, ranks, warm-ups)."""
    def whole_number(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}")
        return v
    return whole_number


positive_int = at_least(1)


# --- interleaved rounds ---------------------------------------------------------------------

def round_order(variants: Sequence[str], k: int) -> list[str]:
    """The order of round k: the variants rotated k places (round 0 in the given order)."""
    variants = list(variants)
    if not variants:
        return []
    j = k % len(variants)
    return variants[j:] + variants[:j]


def alternate(variants: Sequence[str], k: int) -> list[str]:
    """The order of round k for a sweep (shares 0 to 1): forward in even rounds, backward in odd
    ones, so that neighbours stay neighbours and each end of the sweep goes first in turn."""
    return list(variants) if k % 2 == 0 else list(variants)[::-1]


def interleave(variants: Sequence[str], rounds: int, run: Callable[[str, int], object],
               bar=None, order: Callable[[Sequence[str], int], list] = round_order) -> dict[str, list]:
    """Run `run(variant, k)` for every variant in every round k (0 .. rounds-1), in the round's
    `order` (default `round_order`; `alternate` for a sweep); each variant's results in round
    order. `bar` (a tqdm, optional) is advanced once per run."""
    if rounds < 1:
        raise ValueError(f"rounds must be 1 or more, got {rounds}")
    out: dict[str, list] = {v: [] for v in variants}
    for k in range(rounds):
        for v in order(variants, k):
            out[v].append(run(v, k))
            if bar is not None:
                bar.update(1)
    return out


def summarise(times: dict[str, Sequence[float]], baseline: str | None = None) -> dict[str, dict]:
    """Per variant: the median of its times, how many, and against `baseline` (if named) the
    ratio of medians (`ratio`: variant / baseline, below 1 is faster) and the median of the
    per-round ratios (`paired_ratio`)."""
    if baseline is not None and baseline not in times:
        raise ValueError(f"baseline {baseline!r} is not one of the variants {list(times)}")
    out = {}
    for v, ts in times.items():
        row = {"median": statistics.median(ts) if ts else None, "runs": len(ts)}
        if baseline is not None and ts and times[baseline]:
            base = times[baseline]
            row["ratio"] = row["median"] / statistics.median(base)
            row["paired_ratio"] = statistics.median(t / b for t, b in zip(ts, base))
        out[v] = row
    return out


# --- the launcher -----------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """A benchmark's launch failed or ran out of time; the message names the command."""


def hepti_cmd() -> list[str]:
    """hepti in this Python (the venv the bin/bench-*.sh scripts set up)."""
    return [sys.executable, "-m", "hepti"]


def mpiexec() -> str:
    """MPICH's mpiexec: next to this Python first, then on PATH (a clear error if neither)."""
    return find_mpiexec()


def command(argv: Sequence[str], ranks: int | None = None, spec=None,
            emulate: Sequence[str] = (), timeout: float | None = None) -> list[str]:
    """argv (a whole command: `hepti_cmd() + [...]`, or any program) under `mpiexec -n ranks`
    if `ranks` is given (None: as is, for a single process or a `hepti serve` that starts its
    own ranks), and under `hepti emulate --cluster spec [emulate...] [--timeout S] --` if a
    spec is given."""
    cmd = [str(a) for a in argv]
    if ranks is not None:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd
    if spec is not None:
        limit = ["--timeout", f"{timeout:g}"] if timeout is not None else []
        cmd = hepti_cmd() + ["emulate", "--cluster", str(spec), *emulate, *limit, "--"] + cmd
    return cmd


@dataclass
class Launch:
    """One finished launch: its command, exit code, output, wall time, and the 1-minute load
    average just before and just after (a figure taken under a load spike says so)."""
    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    loadavg_1min: list[float]

    def json(self):
        """The JSON object the command printed on stdout, or a LaunchError saying what came."""
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            raise LaunchError(f"{shlex.join(self.cmd)} printed no JSON object on stdout:\n"
                              f"{self.stdout[-500:]}{self.stderr[-1500:]}") from None


def launch(argv: Sequence[str], *, ranks: int | None = None, spec=None,
           emulate: Sequence[str] = (), env: dict | None = None, pythonpath=None,
           timeout: float = 1800, check: bool = True) -> Launch:
    """Run `command(argv, ranks, spec, emulate)` to its end. `env` adds to this environment;
    `pythonpath` runs another tree's src/. Under a spec the emulator's own time limit is
    `timeout` (it stops every device's processes), and this process waits a minute more.
    With `check`, a failure or a time-out raises LaunchError with the command and the tail
    of its stderr; without, the caller reads `rc` (hetero sorts refusals, OOM and time-outs)."""
    cmd = command(argv, ranks, spec, emulate, timeout if spec is not None else None)
    full_env = dict(os.environ, **(env or {}))
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    where = f" (PYTHONPATH={pythonpath})" if pythonpath is not None else ""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=full_env,
                           timeout=timeout + (60 if spec is not None else 0))
    except subprocess.TimeoutExpired as e:
        raise LaunchError(f"{shlex.join(cmd)}{where} did not finish in {timeout:g} s; "
                          f"its stderr ended:\n{_text(e.stderr)[-2000:]}") from None
    res = Launch(cmd, p.returncode, p.stdout, p.stderr, time.perf_counter() - t0,
                 [round(load_before, 2), round(os.getloadavg()[0], 2)])
    if check and p.returncode != 0:
        raise LaunchError(f"{shlex.join(cmd)}{where} failed (exit {p.returncode}):\n"
                          f"{p.stderr[-2000:]}")
    return res


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def wait_ready(url: str, proc, timeout: float) -> None:
    """Wait for a `hepti serve` this bench started (Popen `proc`) to answer /health with ok;
    a RuntimeError if it exits first or is not ready in `timeout` seconds."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited ({proc.returncode}) before it was ready")
        try:
            if json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())["status"] == "ok":
                return
        except Exception:  # noqa: BLE001 - not up yet (refused, 503)
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the service was not ready in {timeout:g} s")


@contextmanager
def service(cmd: Sequence[str], url: str, log_path, ready_timeout: float = 600,
            stop=signal.SIGTERM) -> Iterator[subprocess.Popen]:
    """A long-running command (`hepti serve`, perhaps under `command(..., spec=...)`) with its
    output in `log_path`, yielded once `url` answers /health; stopped with `stop` at the end
    (SIGINT lets `hepti emulate` tear its devices down), killed if it has not ended 2 minutes
    later."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, ready_timeout)
            yield proc
        finally:
            proc.send_signal(stop)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """The src/ folder of commit `rev` of this checkout, in a temporary git worktree removed
    at the end (a clear error if git cannot check it out)."""
    tmp = Path(tempfile.mkdtemp(prefix="hepti-rev-"))
    tree = tmp / "tree"
    p = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise LaunchError(f"cannot check out {rev!r} from {ROOT}: {p.stderr.strip()}")
    try:
        yield tree / "src"
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


# --- the result document ----------------------------------------------------------------------

def git_commit() -> str | None:
    """The commit of the hepti tree being measured (with '+dirty' if its code, src/ bin/
    setup.py, has uncommitted changes; results/ written by earlier benchmarks do not count),
    or None outside a git checkout."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                                "--", "src", "bin", "setup.py"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty else "")


def command_line() -> str:
    """This process's command line as a user would type it: `hepti bench NAME ...` when it
    came through the hepti command, `python -m MODULE ...` when run as a module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name in ("hepti", "hepti.__main__") or Path(sys.argv[0]).name == "hepti":
        head = ["hepti"]
    elif name:
        head = ["python", "-m", name.removesuffix(".__main__")]
    else:
        head = [sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def result_doc(benchmark: str, commit: str | None = None, **fields) -> dict:
    """The head every results/*.json shares (what ran, when, at which commit, on which
    machine, by which command line, under what load: this project's machine is shared and not
    always the same CPU), then fields. A long run passes the `commit` it took when it started
    (git_commit()); otherwise it is taken now. A `command` field overrides the command line."""
    return {"benchmark": benchmark, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commit": commit or git_commit(),
            "machine": {"cores": os.cpu_count(), "cpu": cpu_model(), "node": os.uname().nodename},
            "command": fields.pop("command", None) or command_line(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            **fields}


def write_json(doc: dict, path, compact: bool = False) -> None:
    """A result file under results/ (its folder made if missing); `compact`: one line, for a
    file that keeps whole profiles (indented, GenEFlow's CNN grid came to 6.6 MB, 2.7 flat)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    Path(path).write_text(text + "\n")


def csv_text(rows: Sequence[dict], fields: Sequence[str]) -> str:
    """A CSV of `rows` with the columns `fields` (keys not among them are left out; a missing
    or None value is an empty cell)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in fields})
    return buf.getvalue()


def write_csv(rows: Sequence[dict], fields: Sequence[str], path) -> None:
    """`csv_text` to a file (its folder made if missing), beside the bench's JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(csv_text(rows, fields))


def drop_stale(path, program: str, why: str) -> None:
    """Remove an earlier run's output that this run did not write again (a plot it could not
    draw, a table with nothing in it), saying so on stderr: left in place beside this run's
    JSON, it would read as this run's."""
    path = Path(path)
    if path.exists():
        path.unlink()
        print(f"{program}: removed {path}, an earlier run's: {why}", file=sys.stderr)
