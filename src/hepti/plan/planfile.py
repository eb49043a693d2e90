"""The plan file: what `hepti plan --json` writes and `hepti run --plan` reads.

Schema (version 1), JSON object:

    {
      "hepti_plan": 1,
      "strategy": "rows" | "tensor" | "stream" | "even" | "pipeline" | "single" | "bands"
                  | "mixed",
      "world_size": N,
      "ratios": {"heads": [N floats], "ffn": [N floats], "rows": [N floats]},
      "counts": {"heads": [N ints], "ffn": [N ints], "rows": [N ints]},   # informative
      "layers": [[start, stop), ...] per rank,       # pipeline only, else null
      "mem_budget": bytes per rank or null,          # stream only
      "groups": [[start, stop), ...] or null,        # bands (a CNN): fused groups of ops
      "head": "cols" | "primary" or null,            # bands: how the linear head is split
      "group_ratios": [[N floats] per group] or null, # bands: a group's own rows split
      "group_dims": ["rows" | "channels" per group] or null,  # bands: how each group splits
      "group_streamed": [bool per group] or null,    # bands: weights read as each op runs
      "assignment": {op: split} or null,             # mixed only: each operator's split
      "primary": rank,                               # embeds and collects (default 0)
      "model": "name", "seq_len": L, "batch": B,     # what the plan was made for
      "model_shape": {"layers": .., "hidden": .., "heads": .., "ffn": ..},   # checked at run
      "predicted_latency_s": float or null,
      "predicted": {"per_rank": [{"compute_s": .., "comm_s": {kind: s}, "mem_bytes": ..}]},
      "solve_s": float or null,
      "explanation": "one or two sentences"
    }

The primary runs what the model does once per batch on one device (the embeddings) and holds
each batch's output; rank 0, where `hepti run` reads its inputs and writes its outputs, hands
it each batch and gets its output back when it is another rank (a primary other than 0 is the
planner's choice where rank 0 would otherwise be kept busy, or hold the model, for that alone).

A CNN's plan is "bands" (hepti.plan.coedge): `ratios` has "rows" alone, every feature map's
share of rows per rank, and `groups` the fused groups of its spatial ops (hepti.graph.split).
`group_dims` (GenEFlow's plans) splits some groups by output channels instead of rows; null
reads as rows everywhere. `group_streamed` marks the groups whose weights are streamed from
local files as each op runs; null reads as all resident.

A "mixed" plan (hepti.plan.genetic: GenEFlow) splits some blocks of a transformer layer by
token rows and others by heads or FFN columns: `assignment` names each operator's split
(hepti.graph.ir: "rows", "cols", "k", "unit", "primary"), `ratios` every dimension's shares as
for tensor. The runtime lowers it with hepti.graph.lower.schedule like any other strategy.
Plans without the field read as before (it defaults to null).

Only `strategy`, `world_size` and `ratios` (or `layers` for pipeline) are needed to run; the
runtime recomputes integer counts from the ratios with `hepti.counts.counts`, because the token
row count depends on the actual input. Everything else is the planner's account of itself.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hepti.errors import PlanError
from hepti.config import model_mismatch
from hepti.plan.strategies import names

STRATEGIES = names(in_plan=True)  # hepti.plan.strategies
DIMS = ("heads", "ffn", "rows")
SCHEMA_VERSION = 1


@dataclass
class Plan:
    strategy: str
    world_size: int
    ratios: dict[str, list[float]]
    layers: list[list[int]] | None = None
    mem_budget: int | None = None
    primary: int = 0
    counts: dict[str, list[int]] | None = None
    model: str = ""
    model_shape: dict | None = None
    seq_len: int | None = None
    batch: int | None = None
    predicted_latency_s: float | None = None
    predicted: dict = field(default_factory=dict)
    solve_s: float | None = None
    explanation: str = ""
    groups: list[list[int]] | None = None
    head: str | None = None
    group_ratios: list[list[float]] | None = None
    group_dims: list[str] | None = None
    group_streamed: list[bool] | None = None
    assignment: dict[str, str] | None = None

    def validate(self, world_size: int | None = None) -> "Plan":
        """Raise PlanError (saying what to change) unless this plan can run on world_size ranks."""
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if world_size is not None and self.world_size != world_size:
            raise PlanError(
                f"the plan is for {self.world_size} ranks but the job has {world_size}; launch with "
                f"`mpiexec -n {self.world_size}` or make a plan for {world_size} ranks")
        for dim in (("rows",) if self.strategy == "bands" else DIMS):
            vec = self.ratios.get(dim)
            if vec is None:
                raise PlanError(f"the plan lacks ratios for {dim!r}; give heads, ffn and rows")
            check_ratio_vector(vec, self.world_size, f"{dim} ratios")
        if self.group_dims is not None:
            n_groups = len(self.groups) if self.groups else None
            if (not isinstance(self.group_dims, list)
                    or any(d not in ("rows", "channels") for d in self.group_dims)
                    or (n_groups is not None and len(self.group_dims) != n_groups)):
                raise PlanError(f"group_dims {self.group_dims!r}: give \"rows\" or \"channels\" "
                                f"for each of the plan's groups, or leave it out (rows)")
        if self.group_streamed is not None:
            n_groups = len(self.groups) if self.groups else None
            if (not isinstance(self.group_streamed, list)
                    or any(not isinstance(x, bool) for x in self.group_streamed)
                    or (n_groups is not None and len(self.group_streamed) != n_groups)):
                raise PlanError(f"group_streamed {self.group_streamed!r}: give true or false for "
                                f"each of the plan's groups, or leave it out (all resident)")
        if self.strategy == "mixed" and not isinstance(self.assignment, dict):
            raise PlanError("a mixed plan needs `assignment`: each operator's split, e.g. "
                            "{\"qkv\": \"cols\", \"ffn up\": \"rows\", ...}; make one with "
                            "`hepti plan --search genetic`")
        if self.strategy == "pipeline":
            if self.layers is None or len(self.layers) != self.world_size:
                raise PlanError("a pipeline plan needs `layers`: one [start, stop) range per rank")
        if (not isinstance(self.primary, int) or isinstance(self.primary, bool)
                or not 0 <= self.primary < self.world_size):
            raise PlanError(f"primary {self.primary!r} is not a rank of the {self.world_size}; "
                            f"give 0 to {self.world_size - 1}, or leave it out (rank 0)")
        if self.primary != 0 and self.strategy in ("pipeline", "single"):
            raise PlanError(f"a {self.strategy} plan's primary is rank 0 (its stages start there); "
                            f"drop \"primary\": {self.primary}")
        return self

    def check_model(self, config, source: str = "the plan") -> list[str]:
        """Raise PlanError unless this plan fits `config` (the model's shape, a pipeline's layer
        ranges); return warnings for what differs harmlessly."""
        why, fatal = model_mismatch(self.model, self.model_shape, config)
        remake = (f"make a plan for this model: hepti plan --model MODEL_DIR --profile "
                  f"PROFILE.json --strategy {self.strategy} --out PLAN.json")
        if fatal:
            raise PlanError(f"{source} does not fit this model: {why}; {remake}")
        if self.strategy == "pipeline":
            L, at = config.num_hidden_layers, 0
            for r, pair in enumerate(self.layers):
                try:
                    a, b = (int(x) for x in pair)
                except (TypeError, ValueError):
                    raise PlanError(f"{source}: rank {r}'s layers {pair!r} are not a [start, stop) "
                                    f"pair; {remake}") from None
                if a != at or b < a:
                    raise PlanError(f"{source}: rank {r}'s layers [{a}, {b}) do not follow on from "
                                    f"layer {at}; the ranges must cover 0..{L} in order; {remake}")
                at = b
            if at != L:
                raise PlanError(f"{source}: its layer ranges cover {at} layers but the model has "
                                f"{L}; {remake}")
        return [f"{source}: {why}; its shape matches, so it is used"] if why else []

    def to_dict(self) -> dict:
        """The plan file's JSON object (what `from_dict` reads)."""
        return {"hepti_plan": SCHEMA_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        if not isinstance(d, dict) or d.get("hepti_plan") != SCHEMA_VERSION:
            raise PlanError(f"{source}: not a hepti plan (version {SCHEMA_VERSION}); make one with "
                            "`hepti plan --json`")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("strategy", "world_size", "ratios"):
            if k not in known:
                raise PlanError(f"{source}: missing {k!r}")
        try:
            return cls(**known)
        except TypeError as e:
            raise PlanError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"{path}: no such plan file") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))


def check_ratio_vector(vec, world_size: int, what: str) -> list[float]:
    """A ratio vector must have one finite, non-negative share per rank and not be all zeros."""
    try:
        vals = [float(x) for x in vec]
    except (TypeError, ValueError):
        raise PlanError(f"{what} {vec!r} must be a list of numbers") from None
    if len(vals) != world_size:
        raise PlanError(f"{what} {vals} has {len(vals)} entries but there are {world_size} ranks; "
                        f"give exactly one share per rank")
    for i, v in enumerate(vals):
        if not math.isfinite(v) or v < 0:
            raise PlanError(f"{what} {vals}: entry {i} is {v}; shares must be finite and >= 0")
    if sum(vals) <= 0:
        raise PlanError(f"{what} {vals} is all zeros; at least one rank needs a positive share")
    s = sum(vals)
    return [v / s for v in vals]


def parse_bytes(text: str | None, flag: str = "--mem-budget") -> int | None:
    """'512MiB', '2GB', '1e9' -> bytes, which must be positive."""
    if text is None:
        return None
    t = str(text).strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    low = t.lower()
    value = None
    for u in sorted(units, key=len, reverse=True):
        if low.endswith(u):
            try:
                value = int(float(low[: -len(u)]) * units[u])
            except ValueError:
                pass
            break
    if value is None:
        try:
            value = int(float(t))
        except (ValueError, OverflowError):
            raise PlanError(f"{flag} {text!r}: not a size; write e.g. 64MiB or 200000000") from None
    if value <= 0:
        raise PlanError(f"{flag} {text!r}: must be a positive size, e.g. 64MiB")
    return value


def parse_ratios(text: str, world_size: int) -> dict[str, list[float]]:
    """Parse `--ratios`: one vector for every dimension ("0.5,0.3,0.2") or one per dimension
    ("heads=0.5,0.5;ffn=0.6,0.4;rows=0.5,0.5"; a missing dimension takes the first one given)."""
    text = text.strip()
    if not text:
        raise PlanError("--ratios is empty; give e.g. 0.5,0.5")

    def vec(s: str, what: str) -> list[float]:
        try:
            vals = [float(x) for x in s.split(",") if x.strip() != ""]
        except ValueError:
            raise PlanError(f"--ratios {what} {s!r}: not a comma-separated list of numbers") from None
        return check_ratio_vector(vals, world_size, f"--ratios {what}")

    if "=" not in text:
        v = vec(text, "vector")
        return {d: list(v) for d in DIMS}
    out: dict[str, list[float]] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        if "=" not in part:
            raise PlanError(f"--ratios part {part!r}: expected DIM=v1,v2,... with DIM in {DIMS}")
        dim, s = part.split("=", 1)
        dim = dim.strip()
        if dim not in DIMS:
            raise PlanError(f"--ratios: unknown dimension {dim!r}; use {', '.join(DIMS)}")
        out[dim] = vec(s, dim)
    first = next(iter(out.values()))
    return {d: out.get(d, list(first)) for d in DIMS}
