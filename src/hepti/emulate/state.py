"""The live state of an emulated cluster, readable by the ranks while they run.

The launcher writes a JSON file and passes its path to COMMAND (and so to every rank) in
`HEPTI_EMULATE_STATE`; it rewrites the file (atomically: write, then rename) each time a
schedule event changes a device. Each rank also gets `HEPTI_EMULATE_DEVICE` (its device index)
and runs with the device's name as its hostname. Content (version 1):

    {"hepti_emulate_state": 1, "spec": "emu-mixed4", "launcher_pid": 1234,
     "started_at": unix time COMMAND started, "updated_at": unix time of this version,
     "devices": [{"name", "cpu", "mem", "mem_bytes", "link_mbit", "address", "netns",
                  "loss"}, ...],  # now (loss: percent of packets dropped, 0 or 100)
     "applied": [{"t", "device", "link_mbit"?, "cpu"?, "loss"?, "applied_at": unix time}, ...],
     "pending": [{"t", "device", ...}, ...]}

The runtime's re-partitioning reads it with `read_state()`; it does not import MPI.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

STATE_ENV = "HEPTI_EMULATE_STATE"
DEVICE_ENV = "HEPTI_EMULATE_DEVICE"
HOST_NETNS_ENV = "HEPTI_EMULATE_HOST_NETNS"  # COMMAND's way back to the host's network namespace
STATE_VERSION = 1


def write_state(path: str | Path, state: dict) -> None:
    """Replace the state file in one step, so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"hepti_emulate_state": STATE_VERSION, **state}, indent=1))
    os.replace(tmp, path)


def read_state(path: str | Path | None = None) -> dict | None:
    """The current emulation state, or None when not running under `hepti emulate`."""
    path = path or os.environ.get(STATE_ENV)
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def current_device(state: dict | None = None) -> dict | None:
    """This process's device entry (name, cpu, mem, link_mbit ...) as it is now, or None."""
    index = os.environ.get(DEVICE_ENV)
    state = state if state is not None else read_state()
    if state is None or index is None or not index.isdigit():
        return None
    devices = state.get("devices", [])
    return devices[int(index)] if int(index) < len(devices) else None
