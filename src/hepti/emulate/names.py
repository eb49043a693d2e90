"""Names and addresses of one emulation run, derived from the launcher's process id.

Every object a run creates carries its owner's pid, so several runs can coexist and a run whose
launcher died can be told apart from one still going:

| object                         | name                                  |
|--------------------------------|---------------------------------------|
| network namespace of device i  | `hepti-<pid>-<i>` (head: `hepti-<pid>-head`) |
| bridge (root namespace)        | `hpt<pid>br`                          |
| veth, root end, device i       | `hpt<pid>v<i>` (head: `hpt<pid>vh`); the namespace end is `emu0` |
| cgroup (each hierarchy)        | `hepti-emu-<pid>/dev<i>` and `.../head` |
| run directory                  | `/run/hepti-emulate/<pid>/`           |

Interface names stay within Linux's 15 characters for any pid (at most 7 digits). The bridge
has no address: the subnet 10.213.0.0/24 exists only inside the namespaces (head .1, device i
.10+i), so several runs can use it at once, each on its own bridge.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

NETNS_PREFIX = "hepti-"
LINK_PREFIX = "hpt"
CGROUP_PREFIX = "hepti-emu-"
RUN_ROOT = Path("/run/hepti-emulate")
INNER_IFACE = "emu0"  # the device end of each veth, inside its namespace
SUBNET_PREFIX = "10.213.0."
PREFIX_LEN = 24
HEAD_HOST = 1
FIRST_DEVICE_HOST = 10

NETNS_RE = re.compile(r"^hepti-(\d+)-(head|\d+)$")
LINK_RE = re.compile(r"^hpt(\d+)(br|vh|v\d+)$")
CGROUP_RE = re.compile(r"^hepti-emu-(\d+)$")


@dataclass(frozen=True)
class RunNames:
    """Every name and address used by the run of launcher `pid` with `n_devices` devices."""

    pid: int
    n_devices: int

    @property
    def bridge(self) -> str:
        return f"{LINK_PREFIX}{self.pid}br"

    @property
    def head_netns(self) -> str:
        return f"{NETNS_PREFIX}{self.pid}-head"

    @property
    def head_veth(self) -> str:
        return f"{LINK_PREFIX}{self.pid}vh"

    @property
    def head_address(self) -> str:
        return f"{SUBNET_PREFIX}{HEAD_HOST}"

    def netns(self, i: int) -> str:
        return f"{NETNS_PREFIX}{self.pid}-{i}"

    def veth(self, i: int) -> str:
        return f"{LINK_PREFIX}{self.pid}v{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET_PREFIX}{FIRST_DEVICE_HOST + i}"

    @property
    def cgroup_group(self) -> str:
        return f"{CGROUP_PREFIX}{self.pid}"

    def cgroup_leaf(self, i: int | None) -> str:
        """Relative cgroup path of device i, or of the head (COMMAND, mpiexec) when i is None."""
        return f"{self.cgroup_group}/{'head' if i is None else f'dev{i}'}"

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / str(self.pid)

    def all_netns(self) -> list[str]:
        return [self.head_netns] + [self.netns(i) for i in range(self.n_devices)]

    def all_veths(self) -> list[str]:
        return [self.head_veth] + [self.veth(i) for i in range(self.n_devices)]


def owner_of_netns(name: str) -> int | None:
    m = NETNS_RE.match(name)
    return int(m.group(1)) if m else None


def owner_of_link(name: str) -> int | None:
    m = LINK_RE.match(name)
    return int(m.group(1)) if m else None
