"""The emulated-cluster spec: a JSON file that lists devices and, optionally, changes over time.

Schema (JSON object):

    {
      "name": "emu-mixed4",                       # required; letters, digits, - _ .
      "description": "free text",                 # optional
      "devices": [                                # required; 1..64 devices, rank i runs on device i
        {"name": "pi4-a",                         # required; a hostname: a-z 0-9 -, unique
         "cpu": 0.5,                              # required; cores (0.01 .. machine cores)
         "mem": "600MiB",                         # optional; cap with unit, or null = no cap
         "link_mbit": 940},                       # optional; Mbit/s each way, or null = unshaped
        ...],
      "schedule": [                               # optional; applied by the launcher while it runs
        {"t": 20.0, "device": 2, "link_mbit": 100},      # device by index or by name
        {"t": 30.0, "device": "pi4-c", "cpu": 0.1},
        {"t": 40.0, "device": 1, "loss": 100},           # its link drops every packet ...
        {"t": 70.0, "device": 1, "loss": 0},             # ... and is back
        {"t": 50.0, "device": "pi4-b", "mem_hog": "500MiB"},  # another program takes memory ...
        {"t": 80.0, "device": "pi4-b", "mem_hog": 0},    # ... and lets it go
        {"t": 85.0, "device": 1, "mem_hog": {"leave": "25MiB"}},  # all it has free but 25 MiB
        {"t": 90.0, "device": 0, "mem": "700MiB"},       # the device's cap itself changes
        {"t": 95.0, "device": 2, "hang": true},          # it hangs: every process frozen ...
        {"t": 99.0, "device": 2, "hang": false}]         # ... and runs on
    }

- `cpu` is a CFS quota: 0.25 means a quarter of one core's time, spread over any cores.
- `mem` takes B, KB/MB/GB (powers of 1000), KiB/MiB/GiB or K/M/G (powers of 1024). It caps
  everything the device's processes use (their RSS and the page cache they fault in); going over
  it is a real out-of-memory kill.
- `link_mbit` is the TCP payload rate the device gets to or from the switch, i.e. what iperf or
  `hepti profile` measures (a gigabit Raspberry Pi 4 measures about 940). The shaper's wire rate
  is set higher by the Ethernet/IP/TCP header overhead so that the payload rate is the figure
  given. A transfer between devices i and j runs at min(link_i, link_j).
- A schedule event changes `link_mbit`, `cpu`, `loss`, `mem`, `mem_hog` and/or `hang` of one
  device at `t` seconds after COMMAND starts.
- `mem_hog` is memory that another program on the device takes (and touches, so it is really
  used) from `t` on, on top of what the device's ranks use, inside the device's cap: a board
  whose other service grows, or someone opening a browser on the laptop. 0 lets it go; a new
  size replaces the old. This is the realistic way to squeeze a device that is in use: its
  ranks see their free memory fall, and if the program takes more than is free the kernel's
  OOM killer picks a victim in the device (the largest process: usually a rank), as on a real
  device. Only on a device with a `mem` cap (elsewhere it would take the host's memory, which
  no rank would see), and less than that cap (the program would be killed by it at once).
- `mem_hog: {"leave": SIZE}` sizes that program from the device as it is at `t`: it takes
  everything the device has free but SIZE, so the ranks are left SIZE free on any machine
  (a fixed size tuned on one machine leaves nothing, and the OOM killer acts at once, where
  the ranks and Python take more memory). Free is the cap less what the device uses, page
  cache not counted as used: the kernel reclaims that cache before it OOM-kills, and a rank
  counts it as free too (hepti.resources.available_memory), so SIZE is what a rank then
  reads. The launcher logs the bytes the program took (and records them in the summary's
  `schedule_applied`, `mem_hog_bytes`); if that is below 16 MiB (the smallest program) it
  takes nothing and the event is recorded as failed. SIZE may be 0 and must be below the
  device's cap at `t` less those 16 MiB.
- `mem` changes the device's cap itself (as `mem` of a device, at least 64 MiB). Raising it
  always works, and so does lowering it while the device uses less. Lowering it below what
  the device's processes use and the kernel cannot reclaim (anonymous memory: there is no
  swap) does not OOM-kill in cgroup v1: the kernel refuses the write (EBUSY). The launcher
  then leaves the cap where it was and says so, on stderr and in the summary's
  `schedule_applied` (`"failed"`): a cap that silently stayed would make a scenario read as
  something it was not, and taking the memory from under the ranks is what `mem_hog` is for.
  (cgroup v2 reclaims, then OOM-kills instead; untested here.)
- `loss` is the percentage of the device's packets its link drops, both ways: 100 is a silent
  link (a board's Wi-Fi gone quiet: nothing arrives, no connection is closed, no error is
  seen), 0 the link restored, shaped as before. Only 0 and 100: a share in between needs tc's
  `netem`, which this kernel lacks (DESIGN.md); a link that never comes back has no 0 after
  its 100.
- `hang: true` freezes every process of the device where it stands (the cgroup freezer), as a
  board whose kernel hung: nothing exits, no socket closes, its link stays up, and a process
  started on it later freezes too; `false` lets them run on. A device that never comes back
  has no `false`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from hepti.errors import HeptiError

MAX_DEVICES = 64
MIN_CPU = 0.01  # cores; below this the CFS period would have to exceed a second
MIN_MEM = 64 << 20  # an MPI rank with Python and numpy cannot even start below this
# Another program's memory (`mem_hog`): at least this much, or 0 (it lets go). The program
# itself, a bare `python -S`, holds about 8 MiB before it takes anything (hepti.emulate.hog).
MIN_HOG = 16 << 20
MAX_LINK_MBIT = 100_000.0
SPEC_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
DEVICE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # RFC 1123 host label
MEM_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "k": 1 << 10, "m": 1 << 20,
             "g": 1 << 30, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
TOP_FIELDS = ("name", "description", "devices", "schedule")
DEVICE_FIELDS = ("name", "cpu", "mem", "link_mbit")
EVENT_FIELDS = ("t", "device", "link_mbit", "cpu", "loss", "mem", "mem_hog", "hang")
CHANGES = EVENT_FIELDS[2:]  # what an event may change; it must change one of them
LOSS_VALUES = (0.0, 100.0)  # percent: restored, silent (no netem here for anything between)


class EmulateError(HeptiError):
    """`hepti emulate` cannot set up, run or tear down an emulated cluster; the message says why."""


class SpecError(EmulateError, ValueError):
    """A cluster spec that cannot be emulated; the message names the field."""


@dataclass(frozen=True)
class Device:
    """One emulated device: CPU share in cores, memory cap in bytes, link rate in Mbit/s."""

    name: str
    cpu: float
    mem_bytes: int | None = None
    link_mbit: float | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "cpu": self.cpu,
                "mem": None if self.mem_bytes is None else format_mem(self.mem_bytes),
                "mem_bytes": self.mem_bytes, "link_mbit": self.link_mbit}


@dataclass(frozen=True)
class ScheduleEvent:
    """At `t` seconds after COMMAND starts, set device `device`'s link rate, CPU share, packet
    loss (percent: 100 silent, 0 restored), memory cap (bytes) the memory another
    program on it holds (bytes, 0: none) and/or whether it hangs."""

    t: float
    device: int
    link_mbit: float | None = None
    cpu: float | None = None
    loss: float | None = None
    mem_bytes: int | None = None
    hog_bytes: int | None = None
    hog_leave: int | None = None  # mem_hog {"leave": bytes}: all the device has free but this
    hang: bool | None = None

    @property
    def has_hog(self) -> bool:
        """Whether the event starts, replaces or stops another program (`mem_hog`)."""
        return self.hog_bytes is not None or self.hog_leave is not None

    @property
    def takes_memory(self) -> bool:
        """Whether the event squeezes the device's memory (a cap, or a program taking some)."""
        return bool(self.mem_bytes or self.hog_bytes) or self.hog_leave is not None

    def to_dict(self) -> dict:
        d = {"t": self.t, "device": self.device}
        if self.link_mbit is not None:
            d["link_mbit"] = self.link_mbit
        if self.cpu is not None:
            d["cpu"] = self.cpu
        if self.loss is not None:
            d["loss"] = self.loss
        if self.mem_bytes is not None:
            d["mem"] = format_mem(self.mem_bytes)
        if self.hog_bytes is not None:
            d["mem_hog"] = format_mem(self.hog_bytes) if self.hog_bytes else 0
        if self.hog_leave is not None:
            d["mem_hog"] = {"leave": format_mem(self.hog_leave) if self.hog_leave else 0}
        if self.hang is not None:
            d["hang"] = self.hang
        return d


@dataclass(frozen=True)
class ClusterSpec:
    """A validated spec; `devices[i]` is where MPI rank i runs."""

    name: str
    devices: tuple[Device, ...]
    schedule: tuple[ScheduleEvent, ...] = ()
    description: str = ""
    source: str = field(default="spec", compare=False)

    @property
    def total_cpu(self) -> float:
        return sum(d.cpu for d in self.devices)

    def peak_cpu(self) -> float:
        """Largest total CPU share over the whole schedule (the schedule may raise shares)."""
        cpus = [d.cpu for d in self.devices]
        peak = sum(cpus)
        for ev in self.schedule:
            if ev.cpu is not None:
                cpus[ev.device] = ev.cpu
                peak = max(peak, sum(cpus))
        return peak

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "devices": [d.to_dict() for d in self.devices],
                "schedule": [e.to_dict() for e in self.schedule]}


def parse_mem(value, what: str = "mem", minimum: int = MIN_MEM) -> int:
    """Bytes from '600MiB', '1.5GB', '512M' or a plain integer of bytes, at least `minimum`."""
    if isinstance(value, bool):
        raise SpecError(f"{what}: {value!r} is not a size; write e.g. \"600MiB\"")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in MEM_UNITS:
            raise SpecError(f"{what}: {value!r} is not a size; write a number with one of the units "
                            "B, KB, MB, GB (x1000), KiB, MiB, GiB or K, M, G (x1024), e.g. \"600MiB\"")
        n = int(float(m.group(1)) * MEM_UNITS[unit])
    else:
        raise SpecError(f"{what}: {value!r} is not a size; write e.g. \"600MiB\"")
    if n < minimum:
        raise SpecError(f"{what}: {value!r} is {n} bytes; a rank needs at least "
                        f"{format_mem(minimum)} to start (Python, numpy and MPI)")
    return n


HOG_FIELDS = ("leave",)  # mem_hog as an object: sized from the device's free memory at t


def parse_hog(value, what: str = "mem_hog") -> tuple[int | None, int | None]:
    """(bytes, None) for another program of a fixed size (`mem_hog`: a size as `mem` takes it,
    or 0: it lets go); (None, leave) for `{"leave": SIZE}`, all the device has free but SIZE."""
    if isinstance(value, dict):
        if not value:
            raise SpecError(f"{what}: an empty object; give {{\"leave\": SIZE}} (the program takes "
                            "all the device has free but SIZE), a size, or 0")
        _check_fields(value, HOG_FIELDS, what)
        leave = value["leave"]
        if isinstance(leave, int) and not isinstance(leave, bool) and leave < 0:
            raise SpecError(f"{what}.leave: {leave!r} is negative; give what the program leaves "
                            "free, 0 or a size, e.g. \"25MiB\"")
        return None, parse_mem(leave, f"{what}.leave", minimum=0)
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise SpecError(f"{what}: {value!r} is negative; give 0 (the program lets its memory go) "
                        "or a size, e.g. \"500MiB\"")
    n = parse_mem(value, what, minimum=0)
    if 0 < n < MIN_HOG:
        raise SpecError(f"{what}: {value!r} is below {format_mem(MIN_HOG)}; give 0 (the program "
                        f"lets its memory go) or at least {format_mem(MIN_HOG)}")
    return n, None


def format_mem(n: int) -> str:
    """'600MiB' style text for a byte count (exact when it is a whole number of MiB/GiB)."""
    if n % (1 << 30) == 0:
        return f"{n >> 30}GiB"
    if n % (1 << 20) == 0:
        return f"{n >> 20}MiB"
    return f"{n / (1 << 20):.1f}MiB"


def _number(value, what: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{what}: {value!r} is not a number")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi:
        raise SpecError(f"{what}: {value!r} is out of range; give a number in [{lo:g}, {hi:g}]")
    return v


def _check_fields(d, known: tuple[str, ...], what: str) -> None:
    if not isinstance(d, dict):
        raise SpecError(f"{what}: expected a JSON object, got {type(d).__name__}")
    unknown = [k for k in d if k not in known]
    if unknown:
        raise SpecError(f"{what}: unknown field {unknown[0]!r}; known fields: {', '.join(known)}")


def _device(d, i: int, src: str) -> Device:
    """Validate devices[i]."""
    what = f"{src}: devices[{i}]"
    _check_fields(d, DEVICE_FIELDS, what)
    for k in ("name", "cpu"):
        if k not in d:
            raise SpecError(f"{what}: missing {k!r}")
    name = d["name"]
    if not isinstance(name, str) or not DEVICE_NAME.match(name):
        raise SpecError(f"{what}.name: {name!r} must be a hostname label (a-z, 0-9 and '-', "
                        "at most 63, not starting or ending with '-'), e.g. \"pi4-a\"")
    cpu = _number(d["cpu"], f"{what}.cpu", MIN_CPU, 4096)
    mem = d.get("mem")
    mem_bytes = None if mem is None else parse_mem(mem, f"{what}.mem")
    link = d.get("link_mbit")
    link_mbit = None if link is None else _number(link, f"{what}.link_mbit", 0.1, MAX_LINK_MBIT)
    return Device(name=name, cpu=cpu, mem_bytes=mem_bytes, link_mbit=link_mbit)


def _event(d, j: int, devices: list[Device], src: str) -> ScheduleEvent:
    """Validate schedule[j] against the devices."""
    what = f"{src}: schedule[{j}]"
    _check_fields(d, EVENT_FIELDS, what)
    for k in ("t", "device"):
        if k not in d:
            raise SpecError(f"{what}: missing {k!r}")
    t = _number(d["t"], f"{what}.t", 0.0, 1e7)
    dev = d["device"]
    names = [x.name for x in devices]
    if isinstance(dev, str) and dev in names:
        index = names.index(dev)
    elif isinstance(dev, int) and not isinstance(dev, bool) and 0 <= dev < len(devices):
        index = dev
    else:
        raise SpecError(f"{what}.device: {dev!r} is not a device; give an index 0..{len(devices) - 1} "
                        f"or a name ({', '.join(names)})")
    if not any(k in d for k in CHANGES):
        raise SpecError(f"{what}: changes nothing; give {', '.join(CHANGES[:-1])} and/or {CHANGES[-1]}")
    link = None if d.get("link_mbit") is None else _number(d["link_mbit"], f"{what}.link_mbit",
                                                          0.1, MAX_LINK_MBIT)
    if link is not None and devices[index].link_mbit is None:
        raise SpecError(f"{what}: device {devices[index].name} has no link_mbit, so its link is "
                        "not shaped and cannot change rate; give it a link_mbit")
    cpu = None if d.get("cpu") is None else _number(d["cpu"], f"{what}.cpu", MIN_CPU, 4096)
    loss = None if d.get("loss") is None else _number(d["loss"], f"{what}.loss", 0.0, 100.0)
    if loss is not None and loss not in LOSS_VALUES:
        raise SpecError(f"{what}.loss: {d['loss']!r}: only 0 (the link restored) or 100 (silent: "
                        "every packet dropped, both ways) can be emulated here; dropping a share "
                        "of the packets needs tc's netem qdisc, which this kernel does not have "
                        "(`tc qdisc add ... netem` fails)")
    mem = None if d.get("mem") is None else parse_mem(d["mem"], f"{what}.mem")
    hog, leave = (None, None) if d.get("mem_hog") is None else \
        parse_hog(d["mem_hog"], f"{what}.mem_hog")
    hang = d.get("hang")
    if hang is not None and not isinstance(hang, bool):
        raise SpecError(f"{what}.hang: {hang!r} must be true (the device hangs) or false (it runs on)")
    return ScheduleEvent(t=t, device=index, link_mbit=link, cpu=cpu, loss=loss, mem_bytes=mem,
                         hog_bytes=hog, hog_leave=leave, hang=hang)


def _check_hogs(devices: list[Device], events: list[ScheduleEvent], src: str) -> None:
    """Every `mem_hog` in time order against the device's cap at that moment (its `mem`, as
    changed by earlier `mem` events): it needs a cap, and must stay below it; one that leaves
    a size free must leave less than the cap, with room for the smallest program beside it."""
    caps = [dev.mem_bytes for dev in devices]
    for ev in events:
        if ev.mem_bytes is not None:
            caps[ev.device] = ev.mem_bytes
        if not ev.hog_bytes and ev.hog_leave is None:
            continue
        name, cap = devices[ev.device].name, caps[ev.device]
        what = f"{src}: the schedule's mem_hog at t={ev.t:g} on {name}"
        if cap is None:
            raise SpecError(f"{what}: {name} has no mem cap, so the program would take the "
                            "host's memory, which none of its ranks would see; give the device a mem")
        if ev.hog_leave is not None:
            if ev.hog_leave > cap - MIN_HOG:
                raise SpecError(f"{what}: leave {format_mem(ev.hog_leave)} is not below {name}'s "
                                f"cap of {format_mem(cap)} then less {format_mem(MIN_HOG)} (the "
                                "smallest program), so the program could never take anything. "
                                "Leave less, or raise the cap")
            continue
        if ev.hog_bytes >= cap:
            raise SpecError(f"{what}: {format_mem(ev.hog_bytes)} is not below {name}'s cap of "
                            f"{format_mem(cap)} then; the program would be killed by the cap "
                            "itself. Take less, or raise the cap")


def parse_spec(d, source: str = "spec") -> ClusterSpec:
    """Validate a spec dict; raise SpecError naming the first bad field."""
    _check_fields(d, TOP_FIELDS, source)
    name = d.get("name")
    if not isinstance(name, str) or not SPEC_NAME.match(name):
        raise SpecError(f"{source}: name {name!r} must be 1-63 letters, digits, '-', '_' or '.'")
    desc = d.get("description", "")
    if not isinstance(desc, str):
        raise SpecError(f"{source}: description must be a string")
    raw = d.get("devices")
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"{source}: devices must be a non-empty list of device objects")
    if len(raw) > MAX_DEVICES:
        raise SpecError(f"{source}: {len(raw)} devices; at most {MAX_DEVICES} can be emulated")
    devices = [_device(x, i, source) for i, x in enumerate(raw)]
    seen: set[str] = set()
    for i, dev in enumerate(devices):
        if dev.name in seen:
            raise SpecError(f"{source}: devices[{i}].name {dev.name!r} is used twice; names must differ")
        seen.add(dev.name)
    raw_sched = d.get("schedule", [])
    if not isinstance(raw_sched, list):
        raise SpecError(f"{source}: schedule must be a list of events")
    events = [_event(x, j, devices, source) for j, x in enumerate(raw_sched)]
    events.sort(key=lambda e: e.t)  # stable: events at the same t keep file order
    _check_hogs(devices, events, source)
    return ClusterSpec(name=name, description=desc, devices=tuple(devices), schedule=tuple(events),
                       source=source)


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a spec file."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file; see hostfiles/README.md for the shipped ones") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read it ({e.strerror})") from None
    return parse_spec(d, source=str(path))


def check_cpu_fits(spec: ClusterSpec, cpu_count: int) -> None:
    """Refuse a spec whose CPU shares (at any point of its schedule) exceed the machine's cores."""
    for i, dev in enumerate(spec.devices):
        if dev.cpu > cpu_count:
            raise SpecError(f"{spec.source}: devices[{i}] ({dev.name}) asks for {dev.cpu:g} cores but "
                            f"this machine has {cpu_count}; lower its cpu")
    peak = spec.peak_cpu()
    if peak > cpu_count + 1e-9:
        raise SpecError(f"{spec.source}: the devices ask for {peak:g} cores in total but this machine "
                        f"has {cpu_count}; an emulated device would then run slower than its share. "
                        f"Lower the cpu values so they sum to at most {cpu_count}")
