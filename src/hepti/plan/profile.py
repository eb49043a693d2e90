"""Device profiles: what the planner knows about each rank (speed, memory, link), and their checks.

A profile is measured by `hepti profile` (hepti.parallel.profiling) or written by hand; the
planner does not care which. Schema (version 1), a JSON object:

    {
      "hepti_profile": 1,
      "created": 1718000000.0,          # unix time the figures were taken
      "source": "measured" | "declared",
      "hostfile": "hostfiles/lab" | null, "model": "all-MiniLM-L6-v2" | null,
      "model_shape": {"layers": 6, "hidden": 384, "heads": 12, "ffn": 1536} | null,
                                        # a measured profile's model, checked against the run's
      "seq_len": 128 | null,            # what a measured profile was measured for (informative)
      "network": {...},                 # optional MPICH thresholds, see NETWORK_DEFAULTS
      "devices": [                      # one per rank, ranks 0..N-1
        {"rank": 0, "host": "pi-a",
         "gemm_flops": 2.5e10,          # GeMM FLOP/s: a number, or a table [[size, flops], ...]
                                        #   by the GeMM's smallest dimension (interpolated)
         "attention_flops": 1.5e10,     # optional; FLOP/s of the attention kernel (default: GeMM):
                                        #   a number, or a table by the FLOPs of one call
         "elementwise_per_s": 4e8,      # optional; elements/s of add+LayerNorm, GeLU
                                        #   (default: GeMM FLOP/s / 100)
         "memory_bytes": 4e9,           # RAM hepti may use on this device
         "reserved_bytes": 1.2e8,       # optional; part of memory_bytes the process itself
                                        #   takes (Python, libraries); default 0
         "latency_s": 1e-4,             # this device's link to the switch: latency ...
         "bandwidth_Bps": 1.17e8,       # ... and bandwidth in bytes/s (full duplex)
         "disk_read_Bps": 2e8,          # optional; reading weight slices from local disk
         "weight_load_Bps": 4e8,        # optional; stored bytes/s of turning weights into a
                                        #   packed layer slice on this rank's own CPU (checksum,
                                        #   copy, pack); `stream` pays it per layer (default:
                                        #   not counted)
         "gemv_Bps": 1.2e10,            # optional; bytes/s of float32 weights a one-row GeMM
                                        #   (GeMV) reads: what a decoder's decode step is bound
                                        #   by (default: an estimate from gemm_flops, see
                                        #   `gemv_estimates`)
         "gemv_int8_Bps": 6e9,          # optional; the same for int8 weights (stored bytes,
                                        #   scales included; default: gemv_Bps)
         "call_overhead_s": 2e-5,       # optional; fixed cost of one kernel call (default 0;
                                        #   a decoder's profile: of one of a decode step's
                                        #   calls, timed on its own layer)
         "token_overhead_s": 5e-4,      # optional; a decoder's decode step's work outside its
                                        #   layers and its head's GeMV, on this rank (the
                                        #   embedding, RoPE's tables, the final norm, the
                                        #   token's choice; default 0)
         "probe_s": 3e-4}               # optional; seconds of the speed probe's GeMM
                                        #   (hepti.parallel.profile_compute.SpeedProbe): what
                                        #   an idle rank's probes while serving are compared with
      ]
    }

A minimal declared profile of two devices:

    {"hepti_profile": 1, "created": 0, "source": "declared",
     "devices": [
       {"rank": 0, "gemm_flops": 5e10, "memory_bytes": 2e9, "latency_s": 1e-4, "bandwidth_Bps": 1.2e8},
       {"rank": 1, "gemm_flops": 2e10, "memory_bytes": 1e9, "latency_s": 2e-3, "bandwidth_Bps": 1.2e7}]}

Declared profiles do not go stale (nobody re-measures a hand-written figure); measured ones do.
"""
from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from hepti.errors import PlanError
from hepti.config import model_mismatch

SCHEMA_VERSION = 1
SOURCES = ("measured", "declared")
ELEMENTWISE_PER_GEMM_FLOP = 1 / 100  # default elements/s per GeMM FLOP/s when not declared
# A profile without GeMV figures (older files, encoders' profiles): bytes/s of a float32 GeMV
# taken as the GeMM peak FLOP/s times this (a GeMV does 0.5 FLOP a byte but runs far below the
# GeMM's peak: on a shared 2-core box, 2026-11-29, 32.7 GFLOP/s GeMM and 3.8 GB/s GeMV at
# SmolLM2's width), and int8 bytes/s (stored bytes, scales included) as this multiple of the
# float32 rate (the same box: 1.5x alone, 0.5-0.7x with two ranks profiling at once: taken
# as 1, an estimate either way)
GEMV_BYTES_PER_GEMM_FLOP = 1 / 8
GEMV_INT8_PER_F32 = 1.0

# MPICH's Bcast algorithm switch points (bytes), its documented defaults. A profile may override
# them under "network" (e.g. after tuning MPIR_CVAR_*): they pick the step counts the cost model
# uses. The row verbs are hepti's own direct exchanges (hepti.parallel.comm) and have none.
NETWORK_DEFAULTS = {
    "bcast_short_bytes": 12288,           # MPIR_CVAR_BCAST_SHORT_MSG_SIZE: binomial below
    "bcast_min_procs": 8,                 # MPIR_CVAR_BCAST_MIN_PROCS: binomial below this size
}
# settings of MPI's Allgatherv and Reduce_scatter algorithms, which profiles measured before the
# row verbs became direct exchanges carry: read and ignored
RETIRED_NETWORK_KEYS = ("allgather_short_bytes", "allgather_long_bytes", "reduce_scatter_long_bytes")


class SpeedTable:
    """A speed that depends on problem size: piecewise linear in log(size), flat beyond the ends."""

    def __init__(self, points: list[tuple[float, float]]):
        pts = sorted((float(s), float(v)) for s, v in points)
        self.sizes = [s for s, _ in pts]
        self.values = [v for _, v in pts]
        self._memo: dict[float, float] = {}  # the planner asks the same sizes many times

    def at(self, size: float) -> float:
        s, v = self.sizes, self.values
        if len(s) == 1 or size <= s[0]:
            return v[0]
        if size >= s[-1]:
            return v[-1]
        got = self._memo.get(size)
        if got is None:
            j = bisect.bisect_right(s, size)
            x0, x1 = math.log(s[j - 1]), math.log(s[j])
            w = (math.log(size) - x0) / (x1 - x0)
            got = v[j - 1] + w * (v[j] - v[j - 1])
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[size] = got
        return got

    @property
    def peak(self) -> float:
        return max(self.values)

    def to_json(self):
        if len(self.sizes) == 1 and self.sizes[0] == 0:
            return self.values[0]
        return [[s, v] for s, v in zip(self.sizes, self.values)]


@dataclass
class Device:
    """One rank's figures. Speeds in FLOP/s (elements/s for elementwise), bytes, seconds."""

    rank: int
    gemm: SpeedTable
    attention: SpeedTable
    elementwise_per_s: float
    memory_bytes: float
    latency_s: float
    bandwidth_Bps: float
    host: str = ""
    reserved_bytes: float = 0.0
    disk_read_Bps: float | None = None
    call_overhead_s: float = 0.0
    token_overhead_s: float = 0.0  # a decode step's work outside its layers (decoders)
    weight_load_Bps: float | None = None  # CPU speed of loading weight slices (None: not counted)
    probe_s: float | None = None  # the speed probe's seconds (profile_compute.SpeedProbe)
    gemv_Bps: float | None = None  # float32 GeMV bytes/s (None: estimated, `gemv_estimates`)
    gemv_int8_Bps: float | None = None  # int8 GeMV bytes/s (None: estimated)

    def gemv_bytes_per_s(self, int8: bool = False) -> float:
        """Bytes/s of weights a GeMV reads: measured or declared, else the estimate of
        GEMV_BYTES_PER_GEMM_FLOP (and GEMV_INT8_PER_F32); `Profile.gemv_estimates` says which
        ranks were estimated."""
        f32 = self.gemv_Bps or self.gemm.peak * GEMV_BYTES_PER_GEMM_FLOP
        if not int8:
            return f32
        return self.gemv_int8_Bps or f32 * GEMV_INT8_PER_F32

    def gemm_flops(self, size: float = math.inf) -> float:
        return self.gemm.at(size)

    def attention_flops(self, size: float = math.inf) -> float:
        return self.attention.at(size)

    @property
    def usable_bytes(self) -> float:
        """Memory left for weights, activations and buffers."""
        return self.memory_bytes - self.reserved_bytes

    def to_json(self) -> dict:
        d = {"rank": self.rank, "host": self.host, "gemm_flops": self.gemm.to_json(),
             "attention_flops": self.attention.to_json(),
             "elementwise_per_s": self.elementwise_per_s, "memory_bytes": self.memory_bytes,
             "reserved_bytes": self.reserved_bytes, "latency_s": self.latency_s,
             "bandwidth_Bps": self.bandwidth_Bps}
        if self.disk_read_Bps is not None:
            d["disk_read_Bps"] = self.disk_read_Bps
        if self.call_overhead_s:
            d["call_overhead_s"] = self.call_overhead_s
        if self.token_overhead_s:
            d["token_overhead_s"] = self.token_overhead_s
        if self.weight_load_Bps is not None:
            d["weight_load_Bps"] = self.weight_load_Bps
        if self.probe_s is not None:
            d["probe_s"] = self.probe_s
        for k in ("gemv_Bps", "gemv_int8_Bps"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


@dataclass
class Profile:
    devices: list[Device]
    created: float = 0.0
    source: str = "declared"
    hostfile: str | None = None
    model: str | None = None
    model_shape: dict | None = None
    seq_len: int | None = None
    network: dict = field(default_factory=lambda: dict(NETWORK_DEFAULTS))
    extra: dict = field(default_factory=dict)  # anything else a measurement recorded

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.created

    def to_dict(self) -> dict:
        d = {"hepti_profile": SCHEMA_VERSION, "created": self.created, "source": self.source,
             "hostfile": self.hostfile, "model": self.model, "model_shape": self.model_shape,
             "seq_len": self.seq_len, "network": dict(self.network),
             "devices": [dev.to_json() for dev in self.devices]}
        d.update({k: v for k, v in self.extra.items() if k not in d})
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def check_model(self, config, source: str = "the profile") -> list[str]:
        """Raise PlanError unless this profile was measured for `config`'s shape (its speed
        tables are by that model's GeMM sizes); declared profiles name no model and always fit.
        Returns warnings for what differs harmlessly."""
        why, fatal = model_mismatch(self.model, self.model_shape, config)
        if fatal:
            raise PlanError(f"{source} does not fit this model: {why}; measure this model: "
                            f"mpiexec -n {self.world_size} hepti profile --model MODEL_DIR "
                            f"--out PROFILE.json")
        return [f"{source}: {why}; its shape matches, so it is used"] if why else []

    def gemv_estimates(self, int8: bool = False) -> list[str]:
        """One note per rank whose GeMV bytes/s the profile does not hold (an older profile,
        or one measured for an encoder), with the estimate used instead: a decoder's plan
        prints them."""
        key = "gemv_int8_Bps" if int8 else "gemv_Bps"
        out = []
        for d in self.devices:
            if getattr(d, key) is None:
                out.append(f"rank {d.rank}: the profile has no {key}; estimated "
                           f"{d.gemv_bytes_per_s(int8) / 1e9:.1f} GB/s from its GeMM speed "
                           "(measure it: mpiexec -n N hepti profile --model DECODER_DIR)")
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


def _speed(value, what: str) -> SpeedTable:
    """A positive number, or a non-empty table [[size, speed], ...] of positive numbers."""
    if isinstance(value, bool):
        raise PlanError(f"{what} must be a number (FLOP/s) or a table [[size, flops], ...]")
    if isinstance(value, (int, float)):
        v = float(value)
        if not math.isfinite(v) or v <= 0:
            raise PlanError(f"{what} is {value}; a speed must be a positive number")
        return SpeedTable([(0.0, v)])
    if isinstance(value, list) and value:
        pts = []
        for p in value:
            if not (isinstance(p, (list, tuple)) and len(p) == 2
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in p)):
                raise PlanError(f"{what}: table entry {p!r} must be a pair [size, flops]")
            s, v = float(p[0]), float(p[1])
            if not (math.isfinite(s) and s > 0 and math.isfinite(v) and v > 0):
                raise PlanError(f"{what}: table entry {p!r} needs a positive size and a positive speed")
            pts.append((s, v))
        return SpeedTable(pts)
    raise PlanError(f"{what} must be a number (FLOP/s) or a table [[size, flops], ...]; got {value!r}")


def _positive(d: dict, key: str, what: str, optional: bool = False, zero_ok: bool = False):
    if key not in d or d[key] is None:
        if optional:
            return None
        raise PlanError(f"{what} lacks {key!r}; every device needs rank, gemm_flops, memory_bytes, "
                        "latency_s and bandwidth_Bps (see hepti.plan.profile for the schema)")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise PlanError(f"{what}: {key} must be a number, got {v!r}")
    v = float(v)
    if v < 0 or (v == 0 and not zero_ok):
        hint = {"memory_bytes": "a device without memory cannot take part; remove it from the "
                                "hostfile or declare the RAM hepti may use",
                "bandwidth_Bps": "a link without bandwidth cannot carry a message; re-measure it "
                                 "with `hepti profile`"}.get(key, "it must be positive")
        raise PlanError(f"{what}: {key} is {d[key]}; {hint}")
    return v


def device_from_dict(d: dict, index: int) -> Device:
    what = f"device {index}"
    if not isinstance(d, dict):
        raise PlanError(f"{what} must be an object with rank, gemm_flops, memory_bytes, latency_s, "
                        f"bandwidth_Bps; got {d!r}")
    if "rank" not in d:
        raise PlanError(f"{what} lacks 'rank'")
    rank = d["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise PlanError(f"{what}: rank must be an integer, got {rank!r}")
    what = f"device of rank {rank}"
    if "gemm_flops" not in d:
        raise PlanError(f"{what} lacks 'gemm_flops' (its GeMM speed in FLOP/s)")
    gemm = _speed(d["gemm_flops"], f"{what}: gemm_flops")
    attention = (_speed(d["attention_flops"], f"{what}: attention_flops")
                 if d.get("attention_flops") is not None else gemm)
    elem = _positive(d, "elementwise_per_s", what, optional=True)
    if elem is None:
        elem = gemm.peak * ELEMENTWISE_PER_GEMM_FLOP
    mem = _positive(d, "memory_bytes", what)
    reserved = _positive(d, "reserved_bytes", what, optional=True, zero_ok=True) or 0.0
    if reserved >= mem:
        raise PlanError(f"{what}: reserved_bytes {reserved:.0f} leaves nothing of memory_bytes "
                        f"{mem:.0f} for the model; free memory on that device or lower the reserve")
    return Device(
        rank=rank, host=str(d.get("host", "")), gemm=gemm, attention=attention,
        elementwise_per_s=elem, memory_bytes=mem, reserved_bytes=reserved,
        latency_s=_positive(d, "latency_s", what, zero_ok=True),
        bandwidth_Bps=_positive(d, "bandwidth_Bps", what),
        disk_read_Bps=_positive(d, "disk_read_Bps", what, optional=True),
        call_overhead_s=_positive(d, "call_overhead_s", what, optional=True, zero_ok=True) or 0.0,
        token_overhead_s=_positive(d, "token_overhead_s", what, optional=True, zero_ok=True)
        or 0.0,
        weight_load_Bps=_positive(d, "weight_load_Bps", what, optional=True),
        probe_s=_positive(d, "probe_s", what, optional=True),
        gemv_Bps=_positive(d, "gemv_Bps", what, optional=True),
        gemv_int8_Bps=_positive(d, "gemv_int8_Bps", what, optional=True))


def profile_from_dict(d, source_name: str = "profile") -> Profile:
    """Validate a parsed profile; raise PlanError saying what is wrong and how to fix it."""
    if not isinstance(d, dict) or d.get("hepti_profile") != SCHEMA_VERSION:
        raise PlanError(f"{source_name}: not a hepti profile (version {SCHEMA_VERSION}); measure "
                        "one with `mpiexec -n N hepti profile` or write one as in hepti.plan.profile")
    for k in ("created", "source", "devices"):
        if k not in d:
            raise PlanError(f"{source_name}: missing {k!r}")
    created = d["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise PlanError(f"{source_name}: 'created' must be a unix time in seconds, got {created!r}")
    if d["source"] not in SOURCES:
        raise PlanError(f"{source_name}: source {d['source']!r} must be one of {', '.join(SOURCES)}")
    devs = d["devices"]
    if not isinstance(devs, list) or not devs:
        raise PlanError(f"{source_name}: 'devices' must be a non-empty list, one entry per rank")
    try:
        devices = [device_from_dict(x, i) for i, x in enumerate(devs)]
    except PlanError as e:
        raise PlanError(f"{source_name}: {e}") from None
    ranks = sorted(dev.rank for dev in devices)
    if ranks != list(range(len(devices))):
        raise PlanError(f"{source_name}: device ranks {ranks} must be 0..{len(devices) - 1}, each once")
    devices.sort(key=lambda dev: dev.rank)
    network = dict(NETWORK_DEFAULTS)
    for k, v in (d.get("network") or {}).items():
        if k == "calibration":  # {collective kind: measured / modelled time}, from hepti profile
            if not isinstance(v, dict) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in v.values()):
                raise PlanError(f"{source_name}: network calibration must map collective kinds to "
                                f"positive factors, got {v!r}")
            network[k] = {str(kind): float(x) for kind, x in v.items()}
            continue
        if k in RETIRED_NETWORK_KEYS:
            continue
        if k not in NETWORK_DEFAULTS:
            raise PlanError(f"{source_name}: unknown network setting {k!r}; known: "
                            f"{', '.join(NETWORK_DEFAULTS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise PlanError(f"{source_name}: network {k} must be a positive number, got {v!r}")
        network[k] = v
    known = {"hepti_profile", "created", "source", "hostfile", "model", "model_shape", "seq_len",
             "network", "devices"}
    shape = d.get("model_shape")
    if shape is not None and not isinstance(shape, dict):
        raise PlanError(f"{source_name}: model_shape must be an object like "
                        '{"layers": 6, "hidden": 384, "heads": 12, "ffn": 1536}')
    return Profile(devices=devices, created=float(created), source=d["source"],
                   hostfile=d.get("hostfile"), model=d.get("model"), model_shape=shape,
                   seq_len=d.get("seq_len"),
                   network=network, extra={k: v for k, v in d.items() if k not in known})


def format_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def check_profile(profile: Profile, world_size: int | None = None, max_age_s: float | None = None,
                  source_name: str = "profile", now: float | None = None) -> Profile:
    """Check a profile against the job: its rank count, and (measured profiles) its age."""
    if world_size is not None and profile.world_size != world_size:
        raise PlanError(
            f"{source_name} describes {profile.world_size} devices but the job has {world_size} "
            f"ranks; re-profile this hostfile with `mpiexec -n {world_size} hepti profile`, or launch "
            f"with -n {profile.world_size}")
    if max_age_s is not None and profile.source == "measured":
        age = profile.age_s(now)
        if age > max_age_s:
            raise PlanError(
                f"{source_name} was measured {format_age(age)} ago, older than the limit of "
                f"{format_age(max_age_s)}; devices and links change, so re-measure it with "
                f"`mpiexec -n {profile.world_size} hepti profile` (or raise --max-age)")
    return profile


def load_profile(path: str | Path, world_size: int | None = None,
                 max_age_s: float | None = None) -> Profile:
    """Read and check a profile file (PlanError with a clear message on any problem)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanError(f"{path}: no such profile; measure one with `mpiexec -n N hepti profile`") from None
    except OSError as e:
        raise PlanError(f"{path}: cannot read the profile ({e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON ({e}); fix the file or re-measure it with "
                        "`hepti profile`") from None
    prof = profile_from_dict(d, str(path))
    return check_profile(prof, world_size, max_age_s, str(path))


def declared_profile(devices: list[dict], **kw) -> Profile:
    """A profile from device dicts (the schema's fields), e.g. for tests and what-if planning."""
    d = {"hepti_profile": SCHEMA_VERSION, "created": kw.pop("created", time.time()),
         "source": "declared", "devices": [dict(dev, rank=dev.get("rank", i)) for i, dev in enumerate(devices)]}
    d.update(kw)
    return profile_from_dict(d, "declared profile")
