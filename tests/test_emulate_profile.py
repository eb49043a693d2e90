"""The profile's view of emulated devices: each rank's caps as its own cgroups set them (read
from a cgroup tree built here), and the profile cache keyed by them, so a profile made under one
spec is never reused under another whose devices have the same names (emu-mixed4, emu-tight and
emu-starved).
"""
from __future__ import annotations

from pathlib import Path



from hepti.emulate.cgroups import cpu_quota
from hepti.emulate.spec import load_spec
from hepti.emulate.state import DEVICE_ENV, STATE_ENV, write_state
from hepti.parallel.profiling import (cgroup_dirs, cpu_limit, memory_limit, profile_cache_path,
                                      resource_limits)

from test_emulate import HOSTFILES

GIB = 1 << 30


# -- caps from the process's own cgroups (a real cgroup tree, in files) ----------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")
    return tmp_path


def _mountinfo(root: Path, v1: bool = True, v2: bool = False) -> str:
    lines = []
    if v1:
        lines += [f"32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu",
                  f"35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory"]
    if v2:
        lines.append(f"41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw")
    return "\n".join(["22 1 8:1 / / rw,relatime - ext4 /dev/vda rw", *lines]) + "\n"


def test_caps_are_read_from_the_own_group_and_its_ancestors(tmp_path):
    """cgroup v1 as `hepti emulate` sets a device up: quota in the device's leaf, a looser
    memory limit on an ancestor, and "no limit" values (quota -1, v1's huge limit) ignored."""
    root = _tree(tmp_path, {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
        "cpu/emu/cpu.cfs_quota_us": "-1", "cpu/emu/cpu.cfs_period_us": "100000",
        "cpu/emu/dev1/cpu.cfs_quota_us": "2500", "cpu/emu/dev1/cpu.cfs_period_us": "10000",
        "memory/memory.limit_in_bytes": str((1 << 63) - 4096),
        "memory/emu/memory.limit_in_bytes": str(2 * GIB),
        "memory/emu/dev1/memory.limit_in_bytes": str(320 << 20)})
    own = "4:memory:/emu/dev1\n1:cpu:/emu/dev1\n0::/\n"
    paths = {"proc_cgroup": own, "mountinfo": _mountinfo(root)}
    assert cgroup_dirs("cpu", **paths) == [f"{root}/cpu/emu/dev1", f"{root}/cpu/emu", f"{root}/cpu"]
    assert cpu_limit(**paths) == (0.25, 0.01)
    assert memory_limit(**paths) == 320 << 20
    # an ancestor's tighter caps bind the leaf
    (root / "memory/emu/memory.limit_in_bytes").write_text(str(300 << 20))
    (root / "cpu/emu/cpu.cfs_quota_us").write_text("10000")  # 0.1 core at a 100 ms period
    assert memory_limit(**paths) == 300 << 20 and cpu_limit(**paths) == (0.1, 0.1)
    # not in the capped group: no caps
    free = {"proc_cgroup": "4:memory:/\n1:cpu:/\n", "mountinfo": _mountinfo(root)}
    assert cpu_limit(**free) == (None, None) and memory_limit(**free) is None


def test_caps_from_cgroup_v2_and_a_container_mount_root(tmp_path):
    root = _tree(tmp_path, {"unified/app/cpu.max": "50000 100000", "unified/app/memory.max": "max",
                            "unified/cpu.max": "max 100000"})
    paths = {"proc_cgroup": "0::/app\n", "mountinfo": _mountinfo(root, v1=False, v2=True)}
    assert cpu_limit(**paths) == (0.5, 0.1) and memory_limit(**paths) is None
    # a container sees its own group as the mount's root: /proc/self/cgroup names the full path
    mi = f"50 1 0:29 /docker/abc {root}/cpu rw - cgroup cgroup rw,cpu\n"
    _tree(tmp_path, {"cpu/cpu.cfs_quota_us": "150000", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_dirs("cpu", proc_cgroup="1:cpu:/docker/abc\n", mountinfo=mi) == [f"{root}/cpu"]
    assert cpu_limit(proc_cgroup="1:cpu:/docker/abc\n", mountinfo=mi) == (1.5, 0.1)


def test_emulated_device_is_part_of_the_caps(tmp_path, monkeypatch):
    """Under `hepti emulate` the launcher's state file names the spec and the device now."""
    state = tmp_path / "state.json"
    write_state(state, {"spec": "emu-tight", "devices": [
        {"name": "minipc-a", "cpu": 0.5, "mem_bytes": 560 << 20, "link_mbit": 940.0, "netns": "x"}]})
    monkeypatch.setenv(STATE_ENV, str(state))
    monkeypatch.setenv(DEVICE_ENV, "0")
    assert resource_limits()["emulated"] == {"spec": "emu-tight", "name": "minipc-a", "cpu": 0.5,
                                             "mem_bytes": 560 << 20, "link_mbit": 940.0}
    monkeypatch.delenv(STATE_ENV)
    assert "emulated" not in resource_limits()


def _limits_under(spec_name: str) -> tuple[list[str], list[dict]]:
    """(host names, per-rank caps) as the ranks of this shipped spec report them."""
    spec = load_spec(HOSTFILES / f"{spec_name}.json")
    hosts, limits = [], []
    for d in spec.devices:
        quota, period = cpu_quota(d.cpu)
        hosts.append(d.name)
        limits.append({"cpu_cores": round(quota / period, 4), "cpu_period_s": period / 1e6,
                       "mem_limit_bytes": d.mem_bytes,
                       "emulated": {"spec": spec.name, "name": d.name, "cpu": d.cpu,
                                    "mem_bytes": d.mem_bytes, "link_mbit": d.link_mbit}})
    return hosts, limits


def test_cache_never_mixes_specs_with_the_same_device_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HEPTI_CACHE", str(tmp_path))
    specs = ("emu-mixed4", "emu-tight", "emu-starved")
    seen = {}
    for name in specs:
        hosts, limits = _limits_under(name)
        assert hosts == _limits_under("emu-mixed4")[0]  # the collision this key exists for
        seen[name] = profile_cache_path(None, "bert-base", 4, hosts=hosts, limits=limits, rows=256)
        assert profile_cache_path(None, "bert-base", 4, hosts=hosts, limits=limits, rows=256) == seen[name]
    assert len(set(seen.values())) == len(specs)
    # the caps alone separate them (no spec name, e.g. caps set by hand or by a container)
    bare = {n: [{k: v for k, v in lim.items() if k != "emulated"} for lim in _limits_under(n)[1]]
            for n in specs}
    assert len({profile_cache_path(None, "m", 4, hosts=["h"] * 4, limits=b) for b in bare.values()}) == 3
    # and so do the link rates, which no cgroup shows (emu-pair-940-full vs -240-full)
    pair = {n: _limits_under(n) for n in ("emu-pair-940-full", "emu-pair-240-full")}
    assert pair["emu-pair-940-full"][0] == pair["emu-pair-240-full"][0]
    assert len({profile_cache_path(None, "m", 2, hosts=h, limits=lim) for h, lim in pair.values()}) == 2
    # the shape and threads a profile was measured at count too
    hosts, limits = _limits_under("emu-tight")
    assert profile_cache_path(None, "bert-base", 4, hosts=hosts, limits=limits, rows=128) != seen["emu-tight"]
    assert profile_cache_path(None, "bert-base", 4, hosts=hosts, limits=limits, rows=256,
                              threads=2) != seen["emu-tight"]
