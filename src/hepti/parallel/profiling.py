"""`hepti profile`: measure every rank's speed, memory and link, as a profile for the planner.

All ranks measure at the same time, so ranks sharing a machine see each other's load as they
will during a run. Per rank:
- GeMM FLOP/s with the engine's own kernel (`hepti.kernels.gemm` on `pack_b` weights) on one
  layer's four GeMMs at the model's shapes, for a few row counts m up to M = batch * seq_len:
  a table by the GeMM's smallest dimension (small slices run slower per FLOP);
- the fixed cost of one kernel call (Python and dispatch), charged per operation;
- attention FLOP/s (`hepti.kernels.attention`), timed inside that layer's work, for the same
  row counts: a table by the FLOPs of one call;
- elementwise elements/s (`add_layernorm`) on [M, C];
- memory available to hepti: MemAvailable (or the cgroup's limit minus usage other than page
  cache, if lower), shared by the ranks on the same machine, and at most the user's cap;
- optionally, reading a file from local disk (page cache dropped first);
- turning stored weights into packed slices (HDF5 read + checks + pack_b), bytes/s: the CPU
  work `stream` adds to every layer;
- a decoder (issue 46): its GeMM table on the MLP's projection, RMSNorm's elements/s, a decode
  step's per-call cost (`measure_decoder`), and the bytes/s of a one-row GeMV in float32 and
  int8, what decode is bound by, timed with every rank at once after a barrier (they share the
  machine's memory bandwidth as they decode: `measure_gemvs`); then the decode step's one-row
  allreduce and greedy's allgather, calibrated, and a decode step's syncs as rank 0 with its
  n - 1 fastest others meet them (`decode_syncs`: GeMV segments each followed at once by the
  allreduce, no barrier; their jitter and seconds; `calibrate_decoder_collectives`); no
  encoder layer or weight loading;
- its link: MPI ping-pong with rank 0 at a few message sizes, least-squares fitted to
  one-way time = latency + bytes / bandwidth. Rank 0's own link is taken as the fastest path it
  measured (a star's path is as slow as its slower end).
Under `hepti emulate` (unless HEPTI_EMULATE_STRETCH=0) each timing round is stretched as one
unit of work, as the runtime's compute spans are (hepti.emulate.stretch), so the profile measures
the stretched device as it would a slow board.

The measurements are in three modules: a rank's compute (hepti.parallel.profile_compute, and
for a CNN hepti.parallel.profile_cnn; neither communicates) and the links and collectives
(hepti.parallel.profile_links); the caps come from hepti.resources. This module runs them in
order on every rank, puts each rank's figures into one profile, and caches it.

A run takes a few seconds. `cached_profile` keeps the result per hostfile, model, world size,
shape and every rank's caps (cgroup CPU quota and memory limit, emulated device) under
$HEPTI_CACHE (default ~/.cache/hepti) and measures again when it is older than asked.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from hepti.config import ModelConfig
from hepti.emulate import stretch as _stretch
from hepti.emulate.state import current_device, read_state
from hepti.errors import PlanError
from hepti.families import family
from hepti.graph.cnn import CONV, build
from hepti.graph.split import conv_rows, streamed_convs
from hepti.model.cnn import CNNModel, Weights
from hepti.parallel.bands import BandExecutor, btsearch_order, head_rows
from hepti.parallel.comm import Comm
from hepti.parallel.profile_cnn import (BAND_MIN_S, measure_band_costs, measure_cnn_ops,
                                        measure_layout_rate, pooled_band, pooled_overhead,
                                        stream_fit)
from hepti.parallel.profile_compute import (measure_call_overhead, measure_decoder, measure_disk,
                                            measure_elementwise, measure_gemvs, measure_layer,
                                            measure_probe, measure_weight_load)
from hepti.parallel.profile_links import (barrier, calibrate_collectives,
                                          calibrate_decoder_collectives, measure_collectives,
                                          measure_links)
from hepti.plan import coedge
from hepti.plan.decoder import SYNCS_KEY
from hepti.plan.profile import NETWORK_DEFAULTS, SCHEMA_VERSION, Profile, load_profile, profile_from_dict
from hepti.resources import (_return_freed_memory, available_memory, cgroup_memory_stat, cpu_limit,
                             memory_limit, process_rss)

MEMORY_STAT_KEYS = ("total_rss", "total_cache", "total_mapped_file", "total_active_file",
                    "total_inactive_file", "anon", "file", "file_mapped", "active_file",
                    "inactive_file")  # kept in the profile: what the cgroup's usage is made of
# $HEPTI_PROFILE_LEAN=1, read once: a profile without its optional parts (weight-load rate, speed
# probe, disk read; an encoder's collectives' calibration), for a test that checks only the
# speeds, memory and links (tests/test_emulate_profile.py): ~4 s of a MiniLM profile's 19 with
# a 0.25-core emulated device
LEAN = os.environ.get("HEPTI_PROFILE_LEAN") == "1"


def resource_limits() -> dict:
    """This rank's caps as its own cgroups set them, and its emulated device (spec name, CPU
    share, memory cap, link rate now) when it runs under `hepti emulate`: what makes two
    clusters with the same host names differ (the profile cache's key, and a record in the
    profile)."""
    cores, period = cpu_limit()
    out = {"cpu_cores": None if cores is None else round(cores, 4),
           "cpu_period_s": period, "mem_limit_bytes": memory_limit()}
    state = read_state()
    device = current_device(state)
    if state is not None and device is not None:
        out["emulated"] = {"spec": state.get("spec"), "stretch": _stretch.ON,
                           **{k: device.get(k) for k in ("name", "cpu", "mem_bytes", "link_mbit")}}
    return out


def measure_profile(comm, config: ModelConfig, seq_len: int, mem_cap: float | None = None,
                    batch: int = 1, threads: int = 1, hostfile: str | None = None,
                    disk: bool = True) -> dict:
    """Measure every rank (all ranks call this) -> the same profile dict on every rank."""
    comm = getattr(comm, "mpi", comm)  # a hepti Comm or an mpi4py communicator
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    t_start = time.perf_counter()
    rank, size = comm.Get_rank(), comm.Get_size()
    M = batch * seq_len
    barrier(comm)
    decoder = family(config).executor == "decoder"
    if decoder:  # its GeMM table, RMSNorm, a decode call (no encoder layer graph to time)
        compute = measure_decoder(config, M, threads, ranks=size)
        barrier(comm)  # every rank's GeMV at once: they share the memory bandwidth
        compute.update(measure_gemvs(config.hidden_size, threads, config=config, ranks=size))
    else:
        gemm, attention = measure_layer(config, batch, seq_len, threads)
        compute = {"gemm_flops": gemm, "attention_flops": attention,
                   "elementwise_per_s": measure_elementwise(config, M),
                   "weight_load_Bps": None if LEAN else measure_weight_load(config),
                   "call_overhead_s": measure_call_overhead()}
    barrier(comm)
    probe_s = None if LEAN else measure_probe(config.hidden_size)  # after the barrier: see it
    disk_bps = measure_disk() if disk and not LEAN else None
    on_host = _ranks_on_host(comm)
    memory, mem_source = _device_memory(on_host, mem_cap)
    barrier(comm)
    links = measure_links(comm)
    mine = {"rank": rank, "host": MPI.Get_processor_name(), **compute,
            "memory_bytes": float(memory), "disk_read_Bps": disk_bps,
            "probe_s": probe_s,
            "measured": {"memory_source": mem_source, "ranks_on_host": on_host,
                         "rss_bytes": process_rss() or 0,
                         "rss_file_bytes": resident_file_bytes(), "threads": threads,
                         "cgroup_memory_stat": {k: v for k, v in cgroup_memory_stat().items()
                                                if k in MEMORY_STAT_KEYS},
                         "limits": resource_limits()}}
    devices = _with_links(comm.allgather(mine), links)
    for d in devices:
        for k in ("disk_read_Bps", "weight_load_Bps", "probe_s"):
            if d.get(k, 0) is None:
                del d[k]
    elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
    prof = {"hepti_profile": SCHEMA_VERSION, "created": time.time(), "source": "measured",
            "hostfile": hostfile, "model": config.name or None, "model_shape": config.shape,
            "seq_len": seq_len,
            "network": dict(NETWORK_DEFAULTS), "devices": devices,
            "measure_s": elapsed, "batch": batch}
    prof = comm.bcast(prof, root=0)
    if size > 1:  # the collectives each family's programs price, at its sizes
        if decoder:
            prof["network"]["calibration"], prof[SYNCS_KEY] = calibrate_decoder_collectives(
                comm, prof, config)
        elif not LEAN:
            prof["network"]["calibration"] = calibrate_collectives(comm, prof, config, M)
    profile_from_dict(prof, "measured profile")  # the schema check the planner will make
    return prof


def _ranks_on_host(comm) -> int:
    """Collective: how many ranks of `comm` (an mpi4py communicator) share this rank's host."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    n = local.Get_size()
    local.Free()
    return n


def resident_file_bytes(status: str | None = None) -> int:
    """Bytes of this process's resident file-backed pages (/proc/self/status RssFile, or from
    `status`, that file's text; 0 if unreadable): the code and data of the interpreter, NumPy,
    LLVM, Numba's kernels and MPI that the process runs from, 114-132 MiB for a decoder's rank."""
    try:
        text = status if status is not None else Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("RssFile:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return 0
    return 0


def _device_memory(on_host: int, mem_cap: float | None) -> tuple[float, str]:
    """(bytes, source): the memory this rank has for a model now, its share of the host's
    available memory (`hepti.resources.available_memory`, after handing the heap's freed pages
    back: the probes' garbage is not the device's use), at most `mem_cap`.

    Not less the file pages the process runs from: taking them off (a helper's change of
    2026-11-29, 1-6 MiB under emulation) made `hepti serve`'s memory re-plan come too late
    in tests/test_serve_memory.py's squeeze (node-b OOM-killed in 4 of 18 runs, against 0 of
    17 before and 0 of 8 after taking it back out): the re-planner reads free memory as
    `available_memory` gives it, and the plan must count memory the same way."""
    _return_freed_memory()
    avail, source = available_memory()
    memory = avail / on_host
    return (memory if mem_cap is None else min(memory, float(mem_cap))), source


def _memory_as_now(comm, prof: dict, mem_cap: float | None) -> dict:
    """`prof` with each device's memory_bytes lowered to what its rank has now, if less.

    The profile measures memory before the collectives' calibration, whose buffers (a
    decoder's: a layer's int8 weights per group size, MPI's windows) the process keeps in part
    after it, so the process that measured a profile has less than its figure says, where a
    later process that reads it from the cache has what it says: a fresh `auto` on emu-mixed4
    planned rank 0's int8 share at 777-814 of its 891 MiB and was OOM-killed at the 1 GiB cap,
    where the same plan from the cache ran at 879 MiB of RSS. The cache keeps the measured
    figure; only this process's plan sees the lower one."""
    on_host = _ranks_on_host(comm)
    now = comm.allgather(_device_memory(on_host, mem_cap)[0])
    out = json.loads(json.dumps(prof))
    for d, m in zip(out["devices"], now):
        d["memory_bytes"] = float(min(d["memory_bytes"], m))
    return out


def _with_links(devices: list[dict], links: list[dict]) -> list[dict]:
    """Each device's link figures from `measure_links` (rank 0's: its fastest path's latency
    and the highest bandwidth any rank reached it at)."""
    paths = {p["rank"]: p for p in links}
    if len(devices) > 1:
        fastest = min(paths.values(), key=lambda p: (p["latency_s"], -p["bandwidth_Bps"]))
        devices[0]["latency_s"] = fastest["latency_s"]
        devices[0]["bandwidth_Bps"] = max(p["bandwidth_Bps"] for p in paths.values())
        for r in range(1, len(devices)):
            devices[r]["latency_s"] = paths[r]["latency_s"]
            devices[r]["bandwidth_Bps"] = paths[r]["bandwidth_Bps"]
            devices[r]["measured"]["ping_pong"] = paths[r]["points"]
    else:  # one rank: no link is used; any positive figures will do
        devices[0]["latency_s"], devices[0]["bandwidth_Bps"] = 0.0, 1e12
    return devices


def measure_cnn_profile(comm, store, h: int, w: int, batch: int = 1, threads: int = 1,
                        mem_cap: float | None = None, hostfile: str | None = None,
                        power: list | None = None, band_min_s: float = BAND_MIN_S) -> dict:
    """A CNN's profile (all ranks call this): every op timed on every rank at h x w (the
    profile's `cnn` table, which hepti.plan.coedge plans from), each rank's memory, and its
    link to rank 0. `power`: declared (compute W, transmit W) per rank, for the energy
    objective; nothing measures power here. `band_min_s`: `measure_band_costs`' `min_s`."""
    comm = getattr(comm, "mpi", comm)
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    t_start = time.perf_counter()
    rank = comm.Get_rank()
    model = CNNModel.from_store(store, threads)
    graph = model.graph
    barrier(comm)
    op_s = measure_cnn_ops(model, h, w, batch)
    overhead = measure_call_overhead()
    layout = measure_layout_rate()
    barrier(comm)  # every rank at once, as a forward has them
    band, spread, stream, joined = measure_band_costs(model, h, w, batch, read=store.read,
                                                      min_s=band_min_s)
    fetch_s, conv_load = stream_fit(stream, graph)
    barrier(comm)
    on_host = _ranks_on_host(comm)
    per_row, shapes = graph.flops_per_row(h, w), graph.shapes(h, w)
    conv_flops = batch * sum(per_row[op.name] * shapes[op.output][0]
                             for op in graph.ops if op.kind == CONV)
    conv_s = sum(t for op, t in zip(graph.ops, op_s) if op.kind == CONV)
    del model
    memory, mem_source = _device_memory(on_host, mem_cap)
    barrier(comm)
    links = measure_links(comm)
    collectives = measure_collectives(comm)
    mine = {"rank": rank, "host": MPI.Get_processor_name(),
            "gemm_flops": conv_flops / max(conv_s, 1e-9),  # the convolutions' overall rate
            "memory_bytes": float(memory), "call_overhead_s": overhead,
            "weight_load_Bps": conv_load,
            "measured": {"memory_source": mem_source, "ranks_on_host": on_host,
                         "threads": threads, "limits": resource_limits()}}
    devices = _with_links(comm.allgather(mine), links)
    all_op_s = comm.allgather(op_s)
    all_layout = comm.allgather(layout)
    all_fetch = comm.allgather(fetch_s)
    all_stream = comm.allgather(stream)
    all_band = comm.allgather(band)
    all_spread = comm.allgather(spread)
    all_joined = comm.allgather(joined)
    cfg = store.config
    elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
    table = {"arch": cfg.arch, "ops": [op.name for op in graph.ops],
             "input": [h, w], "batch": batch, "op_s": all_op_s,
             "layout_s_per_byte": pooled_overhead(all_op_s, all_layout),
             "layout_s_per_byte_measured": all_layout,
             "fetch_overhead_s": all_fetch, "op_stream_measured": all_stream,
             "op_band_s": [[None if ab is None else list(ab) for ab in r]
                           for r in pooled_band(all_band)],
             "op_band_measured": all_band, "band_spread": [r for r, _ in all_spread],
             "band_sigma_s": [a for _, a in all_spread],
             "allgather_s": {str(k): list(v) for k, v in collectives.items()}}
    if any(j is not None for j in all_joined):  # a network with inverted blocks
        table["op_joined_ranges"] = [list(r) for r in next(j for j in all_joined if j)[0]]
        table["op_joined_measured"] = [[[f, list(a), list(b)] for f, a, b in j[1]] if j else []
                                       for j in all_joined]
    if power is not None:
        table["power"] = [list(p) for p in power]
    prof = {"hepti_profile": SCHEMA_VERSION, "created": time.time(), "source": "measured",
            "hostfile": hostfile, "model": cfg.name or None, "model_shape": cfg.shape,
            "seq_len": None, "network": dict(NETWORK_DEFAULTS), "devices": devices,
            "measure_s": elapsed, "batch": batch, "cnn": table}
    prof = comm.bcast(prof, root=0)
    profile_from_dict(prof, "measured profile")
    if comm.Get_size() > 1:
        # each device's link credit (rank 0's: the largest of its paths', as its bandwidth)
        credit = {p["rank"]: float(p.get("credit_bytes", 0.0)) for p in links}
        prof["cnn"]["link_credit_bytes"] = [max(credit.values())] + [
            credit[r] for r in range(1, comm.Get_size())]
        resume, points = measure_exchange_resume(comm, store, prof, h, w, batch, threads)
        prof["cnn"]["exchange_resume_s"] = resume
        prof["cnn"]["exchange_resume_measured"] = points
        profile_from_dict(prof, "measured profile")
    return prof


RESUME_FORWARDS = 5  # the reference forwards `measure_exchange_resume` times (after one warm-up)


def measure_exchange_resume(comm, store, prof: dict, h: int, w: int, batch: int = 1,
                            threads: int = 1) -> tuple[list[float], list[list[float]]]:
    """(per rank, seconds of compute each halo exchange it takes part in adds beyond what its
    bands cost; per rank [measured compute, predicted compute, exchanges]): the planner's
    `even` split (every rank a band, every op a group) run for real, the band executor's
    forward with its halo exchanges over the links, each rank's compute (the tracer's, as a
    run reports it: median of `RESUME_FORWARDS`) against what the profile's band timings
    predict for it (hepti.plan.coedge `predict`, from `prof` as measured so far), the
    difference over its exchanges; at least 0. The band timings are taken with every rank
    computing and no message sent (hepti.parallel.profile_cnn `_Unsent`); in a forward a rank
    waits at each exchange, then computes the next op after the wait. On emu-mixed4
    (2026-12-01) MobileNetV2's one-group-per-op splits ran their ranks' compute at 1.03-1.8x
    the band timings' (launch to launch), where a group of the whole net, one exchange, ran
    at 0.9-1.1x. hepti.plan.coedge charges it to each exchange (`CNNCosts.exchange_work`)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    graph = build(store.config)
    costs = coedge.CNNCosts.from_profile(profile_from_dict(prof, "measured profile"), graph)
    try:  # the same on every rank (one profile): all go on, or none
        split = coedge.plan_cnn(graph, costs, h, w, batch, "even", fuse=False)["split"]
    except PlanError:  # no even split here (a map too small for the ranks): no figure
        return [0.0] * size, []
    predicted = coedge.predict(graph, split, costs, h, w, batch)["per_rank"][rank]["compute_s"]
    world = Comm(comm)
    weights = Weights(graph, store.read, head_rows(graph, split, rank, size),
                      conv_rows(graph, split, rank, size), streamed_convs(graph, split))
    ex = BandExecutor(world, graph, split, weights, threads, btsearch_order(graph))
    x = (np.random.default_rng(7).standard_normal((batch, 3, h, w), dtype=np.float32)
         if rank == 0 else None)
    exchanges = sum(1 for grp in ex.program(h, w) if grp.sends or grp.recvs)
    times = []
    for k in range(RESUME_FORWARDS + 1):
        barrier(comm)
        world.tracer.reset()
        with world.tracer.span("reference", "batch"):
            ex.forward(x)
        if k:
            times.append(world.tracer.seconds.get("compute", 0.0))
    measured = statistics.median(times)
    per = max(0.0, measured - predicted) / exchanges if exchanges else 0.0
    del ex, weights
    world.close()
    barrier(comm)
    return (comm.allgather(per), comm.allgather([measured, predicted, exchanges]))


# --- cache -------------------------------------------------------------------------------------

# Part of the cache key: bump it when what a profile measures changes, so cached profiles
# measured the old way are measured again (2: attention timed inside a layer, by call size;
# 3: its part of the layer scaled to the windowed layer time; 4: collectives calibrated through
# the runtime's direct-exchange verbs; 5: the MLP's GeMMs timed as one `ffn` call; 6: ranks on
# one host calibrate the shared-memory transport; 7: a CNN's halo exchange's own work and its
# streamed convs' load rate; 8: a CNN op's fixed seconds, timed on a band of one row, a
# split by channels' layout copy, and a streamed conv's fixed cost a fetch; 9: a CNN op's
# cost on two bands, as the band executor runs them, their spread, and its allgathers among
# 2..N ranks; 10: a streamed conv's fetch timed inside the band executor's forward, and the
# whole-map, one-row and 32x32 timings that the bands replaced no longer made; 11: the band
# rounds timed for at least `BAND_MIN_S`; 12: the allgathers timed on long messages too,
# a second line past a link's burst; 13: the speed probe's `probe_s`, and every timing round
# starts level on an emulated device, `stretch.settle`; 14: a decoder's GeMVs timed on every
# rank at once, its call overhead on its own layer, its one-row collectives calibrated; 15: a
# decode step's syncs, per group (GeMV segments each followed by the allreduce, no barrier),
# and a decode call's cost on a rank's real layer shape, cold, outside its GeMVs; 16: a
# device's memory less the file pages the process runs from (taken back out: `_device_memory`
# says why); 17: a decode step's work outside its layers (`token_overhead_s`), timed with the
# calls in a whole step of `LlamaModel.forward`, and a decoder's GeMV bytes/s on a rank's real
# layer shapes); 18: a CNN's bands and whole map timed in a few groups too, where runs of
# inverted blocks run as one call (`op_joined_measured`); 19: a link's credit (the bytes it passes
# at once after an idle spell) and a CNN's reference forward on the `even` split
# (`exchange_resume_s`).
PROFILER_REVISION = 19


def cache_dir() -> Path:
    return Path(os.environ.get("HEPTI_CACHE") or Path.home() / ".cache" / "hepti")


def profile_cache_path(hostfile: str | None, model_name: str, world_size: int,
                       hosts: list[str] | None = None, limits: list[dict] | None = None,
                       rows: int | None = None, threads: int = 1) -> Path:
    """Where the profile of this hostfile (its contents count) or these rank host names, model
    and world size is kept. Also keyed by each rank's caps (`resource_limits`: its cgroup CPU
    quota and memory limit, its emulated device and spec), so that clusters with the same host
    names but other caps or links (emu-mixed4, emu-tight and emu-starved) never share a profile,
    and by the token rows per batch and threads the speeds were measured at, and by
    `PROFILER_REVISION`."""
    host_text = ",".join(hosts) if hosts else ""
    if hostfile:
        try:
            host_text = Path(hostfile).read_text()
        except OSError:
            host_text = str(Path(hostfile).resolve())
    key = json.dumps([host_text, str(model_name), int(world_size), limits or None, rows, int(threads),
                      PROFILER_REVISION], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(model_name))[:40]
    return cache_dir() / f"profile-{safe}-n{world_size}-{digest}.json"


def cached_profile(comm, config: ModelConfig, seq_len: int, hostfile: str | None = None,
                   max_age_s: float = 24 * 3600, mem_cap: float | None = None, batch: int = 1,
                   threads: int = 1, refresh: bool = False,
                   as_now: bool = True) -> tuple[Profile, bool, Path]:
    """(profile, measured_now, cache file): the cached profile if fresh enough, else measure and
    cache it; a profile measured now holds each rank's memory as it is after the measuring
    (`_memory_as_now`) unless as_now=False (`hepti profile` writes the measured figures).
    All ranks call this; rank 0 decides and writes the file. Without a hostfile the cache is
    keyed by every rank's host name, in rank order; with or without one, also by every rank's
    caps (see `profile_cache_path`)."""
    comm = getattr(comm, "mpi", comm)
    size = comm.Get_size()
    hosts = comm.allgather(os.uname().nodename)
    limits = comm.allgather(resource_limits())
    path = profile_cache_path(hostfile, config.name, size, hosts=hosts, limits=limits,
                              rows=batch * seq_len, threads=threads)
    text = None
    if comm.Get_rank() == 0 and path.exists() and not refresh:
        try:
            load_profile(path, world_size=size, max_age_s=max_age_s)
            text = path.read_text()
        except PlanError:
            text = None  # stale, from another world size, or damaged: measure again
    text = comm.bcast(text, root=0)
    if text is not None:
        return profile_from_dict(json.loads(text), str(path)), False, path
    prof = measure_profile(comm, config, seq_len, mem_cap, batch, threads, hostfile)
    if comm.Get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof, indent=2) + "\n")
        tmp.replace(path)
    comm.Barrier()
    if as_now:
        prof = _memory_as_now(comm, prof, mem_cap)
    return profile_from_dict(prof, "measured profile"), True, path
