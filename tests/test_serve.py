"""hepti serve end to end: the front end's queue and batcher driving real MPI workers (launched by
the test, as `hepti serve` does), every answer checked against the single-device engine; a
worker rank killed mid-request; workers that cannot start. The HTTP layer's own checks are in
test_serve_http.py."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from hepti import cli
from hepti.model.pooling import pool
from hepti.serve import ServiceUnavailable, replan
from hepti.serve.protocol import split_frames
from hepti.serve.supervisor import LATE_AFTER_S, Supervisor, rank_hosts, read_hostfile
from test_distributed_launch import mpiexec


def single_device(model_dir, inputs, normalize=True):
    """Each input alone (no padding) through the single-device engine, mean-pooled."""
    from hepti.inputs import Batch
    from hepti.parallel.single import SingleDevice
    from hepti.weights import WeightStore
    eng = SingleDevice.from_store(WeightStore(model_dir))
    rows = []
    for x in inputs:
        ids = np.asarray(x, np.int64)[None]
        mask = np.ones_like(ids)
        b = Batch(ids, mask, np.zeros_like(ids))
        rows.append(pool(eng.run(b), mask, "mean", normalize)[0])
    return np.stack(rows)


def texts_ids(sup, texts):
    return [np.array(e.ids, np.int64) for e in sup.tokenizer.encode_batch(texts)]


TEXTS = ["A cat sat.", "A dog sat on the mat, and then it slept for a very long time indeed.",
         "hello", "Edge devices differ in speed, memory and link.", "x " * 60]


@pytest.fixture
def served(minilm_dir):
    mpiexec()  # skips without one
    made = []

    def start(n, *worker_args, spare=False, **kw):
        """A service without the spare job it keeps for a relaunch (an n-1 rank copy loading
        beside the test) unless the test relaunches: tests/test_serve_stall.py checks spares."""
        s = Supervisor(minilm_dir, n, worker_args=list(worker_args), spare=spare, **kw).start()
        made.append(s)
        return s
    yield start
    for s in made:
        s.stop()


def test_answers_equal_the_single_device_engine_and_requests_are_batched(served, minilm_dir):
    sup = served(2, "--strategy", "tensor", max_batch_tokens=4096)
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    got = {}

    def ask(i):
        got[i] = sup.embed([ids[i % len(ids)]])

    first = sup.embed(ids)  # several inputs of different lengths in one request: one padded batch
    np.testing.assert_allclose(first, want, atol=2e-5)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(20)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i in range(20):
        np.testing.assert_allclose(got[i][0], want[i % len(ids)], atol=2e-5)
    m = sup.metrics()
    assert m["requests"]["answered"] == 21 and m["requests"]["failed"] == 0
    assert m["batches"]["count"] < 21  # requests that came while a batch ran shared the next one
    assert m["plan"]["strategy"] == "tensor" and len(m["ranks"]) == 2
    json.dumps(m)


def test_token_ids_on_a_model_without_a_tokenizer(tiny_dir):
    mpiexec()
    sup = Supervisor(tiny_dir, 2, worker_args=["--strategy", "rows"], spare=False).start()
    try:
        assert sup.tokenizer is None
        ids = [np.array([2, 5, 7, 9, 11]), np.array([3, 4]), np.arange(1, 30)]
        np.testing.assert_allclose(sup.embed(ids), single_device(tiny_dir, ids), atol=2e-5)
    finally:
        sup.stop()


@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_rank_loses_no_accepted_request(served, minilm_dir, victim):
    """kill -9 of a worker rank (the primary, or another) while requests are in flight: the job ends, the front end
    relaunches on the ranks left (one fewer here, on one machine) and answers every request,
    each equal to the single-device embeddings."""
    sup = served(3, "--strategy", "tensor", spare=True)  # the relaunch as it is served
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    sup.embed(ids[:1])  # the workers are up
    got, errors, done_at = {}, {}, {}

    def ask(i):
        try:
            got[i] = sup.embed(ids)
            done_at[i] = time.monotonic()
        except Exception as e:  # noqa: BLE001 - recorded, asserted below
            errors[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    time.sleep(0.05)
    pid = next(r["pid"] for r in sup.ranks if r["rank"] == victim)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    [t.join(300) for t in threads]
    assert not errors, errors
    assert sorted(got) == list(range(8))
    for i in range(8):
        np.testing.assert_allclose(got[i], want, atol=2e-5)
    first = sup.launches[0]
    assert first.get("lost") == {"rank": victim, "host": "localhost"}, first
    # relaunched on 2 (the slot is probed, and taken back once the 2-rank job has served a
    # while: tests/test_serve_stall.py)
    assert sup.launches[1]["n"] == 2 and sup.health()["status"] in ("ok", "relaunching")
    after = sorted(t - killed_at for t in done_at.values() if t > killed_at)
    print(f"\nkill -9 of rank {victim}: next answer {after[0]:.2f} s later (relaunch on 2 ranks "
          f"{sup.launches[1]['ready_s']:.2f} s); all 8 requests answered")


def test_workers_that_cannot_start_end_the_service_with_their_error(minilm_dir):
    mpiexec()
    sup = Supervisor(minilm_dir, 2, worker_args=["--strategy", "tensor", "--ratios", "1,2,3"],
                     request_timeout_s=120).start()
    try:
        with pytest.raises(ServiceUnavailable, match="ratio"):
            sup.embed([np.array([101, 102])])
        assert sup.health()["status"] == "failed"
        assert len(sup.launches) == 2  # tried twice, then gave up
    finally:
        sup.stop()


def test_hostfile_slots_map_ranks_as_hydra_does(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# a comment\nalpha:2\nbeta\n\ngamma:1\n")
    entries = read_hostfile(f)
    assert entries == [("alpha", 2), ("beta", 1), ("gamma", 1)]
    assert rank_hosts(entries, 6) == [0, 0, 1, 2, 0, 0]


def test_split_frames_keeps_a_partial_frame_for_later():
    import struct
    frame = lambda head: struct.pack(">I", len(head)) + head  # noqa: E731
    one, two = frame(b'{"op": "beat", "batch": 3}'), frame(b'{"op": "beat", "batch": null}')
    stream = one + two
    for cut in range(len(stream) + 1):  # however the bytes arrive, the same beats come out
        heads, rest = split_frames(stream[:cut])
        more, rest = split_frames(rest + stream[cut:])
        assert heads + more == [{"op": "beat", "batch": 3}, {"op": "beat", "batch": None}]
        assert rest == b""
    with pytest.raises(ValueError, match="not a hepti serve peer"):
        split_frames(b"GET / HTTP/1.1\r\n", max_header=4096)
    with pytest.raises(ValueError):
        split_frames(frame(b"not json"))


def start_cli(args, env=None):
    """`hepti serve ... --port 0` as a user starts it; -> (process, base URL, what it wrote on
    stderr until then) once it listens."""
    p = subprocess.Popen([sys.executable, "-m", "hepti", "serve", "--port", "0", *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    said = ""
    for line in p.stderr:
        if "listening on http://" in line:
            url = line.split("listening on ")[1].split()[0]
            threading.Thread(target=p.stderr.read, daemon=True).start()  # keep the pipe drained
            return p, url, said
        said += line
    raise AssertionError(f"hepti serve never listened (exit {p.wait()}): {said}")


def http(url, body=None, headers=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_ready(url, timeout=120):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        code, body = http(url + "/health")
        if code == 200:
            return body
        assert body["status"] in ("starting", "relaunching"), body
        time.sleep(0.3)
    raise AssertionError("the workers were not ready")


def test_the_command_serves_http_and_stops_cleanly_on_ctrl_c(minilm_dir):
    mpiexec()
    p, url, said = start_cli(["--model", minilm_dir, "-n", "2", "--strategy", "rows",
                              "--api-key", "s3cret"])
    try:
        # a key on the command line is seen by every user (ps): the service says so
        assert "--api-key puts the key on the command line" in said, said
        assert wait_ready(url)["world_size"] == 2
        key = {"Authorization": "Bearer s3cret"}
        code, body = http(url + "/v1/embeddings", {"input": TEXTS[:2]})
        assert code == 401 and body["error"]["type"] == "authentication_error"
        code, body = http(url + "/v1/embeddings", {"input": [[]]}, key)  # bad: 400, still serving
        assert code == 400
        code, body = http(url + "/v1/embeddings", {"input": TEXTS[:2]}, key)
        assert code == 200, body
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
        tok.no_padding()  # the file pads to 128; the service embeds each input's own tokens
        want = single_device(minilm_dir, [e.ids for e in tok.encode_batch(TEXTS[:2])])
        np.testing.assert_allclose(got, want, atol=2e-5)
        assert body["usage"]["prompt_tokens"] == sum(len(e.ids) for e in tok.encode_batch(TEXTS[:2]))
        code, m = http(url + "/metrics", headers=key)
        assert code == 200 and m["plan"]["strategy"] == "rows" and m["requests"]["answered"] == 1
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0
    assert subprocess.run(["pgrep", "-f", f"hepti.serve.worker --model {minilm_dir}"]).returncode == 1


def test_an_api_key_file_is_read_and_enforced(tiny_dir, tmp_path):
    """--api-key-file FILE: its first line, stripped, is the key (kept out of `ps`); no
    warning about the command line."""
    mpiexec()
    key_file = tmp_path / "key"
    key_file.write_text("  k3y-in-a-file \nnot this line\n")
    env = {k: v for k, v in os.environ.items() if k != "HEPTI_API_KEY"}
    p, url, said = start_cli(["--model", tiny_dir, "-n", "1", "--api-key-file", key_file], env)
    try:
        assert "--api-key" not in said, said
        wait_ready(url)
        for headers, status in [({}, 401), ({"Authorization": "Bearer not this line"}, 401),
                                ({"Authorization": "Bearer k3y-in-a-file"}, 200)]:
            code, body = http(url + "/v1/embeddings", {"input": [[2, 5, 7]]}, headers)
            assert code == status, body
            if status == 401:  # where the key comes from
                assert "--api-key-file" in body["error"]["message"], body
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("\n  \nkey on line 3\n", "its first line is empty"),
    ("dir", "is a directory"),
])
def test_a_bad_api_key_file_is_a_clear_error(tiny_dir, tmp_path, content, needle, capsys,
                                             monkeypatch):
    """`hepti serve` refuses the file before it listens or starts a worker, so its command
    runs here in-process (`hepti.cli.main`, what `python -m hepti` returns as the exit code):
    a Python start per case bought nothing the other command-line tests do not check."""
    monkeypatch.delenv("HEPTI_API_KEY", raising=False)
    path = tmp_path / "key"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    code = cli.main(["serve", "--model", str(tiny_dir), "--port", "0", "--api-key-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--api-key-file {path}: " in err and needle in err, err


def test_a_stopped_rank_is_named_late_by_health_then_recovers(minilm_dir):
    """SIGSTOP of worker rank 1 (a hung device) for less than the stall deadline (here
    --stall-floor 600; tests/test_serve_stall.py lets it pass): it stops beating on its watch
    line, so /health turns 503 "degraded" and names it (rank, host, how long silent), and a
    request that times out meanwhile names it too. After SIGCONT it beats again: /health is ok
    and a request is answered exactly."""
    mpiexec()
    p, url, _ = start_cli(["--model", minilm_dir, "-n", "2", "--strategy", "rows",
                           "--request-timeout", "4", "--stall-floor", "600"])
    stopped = None
    try:
        wait_ready(url)
        texts = TEXTS[:2]
        deadline = time.monotonic() + 120  # the first batch may compile kernels past 4 s
        while http(url + "/v1/embeddings", {"input": texts})[0] != 200:
            assert time.monotonic() < deadline, "no answer before the rank was stopped"
        code, m = http(url + "/metrics")
        victim = next(r for r in m["ranks"] if r["rank"] == 1)
        assert not victim["late"] and victim["silent_s"] < LATE_AFTER_S, victim
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = victim["pid"]
        deadline = time.monotonic() + 30
        while True:
            code, health = http(url + "/health")
            if health.get("late"):
                break
            assert time.monotonic() < deadline, f"/health never named the stopped rank: {health}"
            time.sleep(0.3)
        assert code == 503 and health["status"] == "degraded", health
        [late] = health["late"]
        assert (late["rank"], late["host"]) == (1, victim["host"]), late
        assert late["silent_s"] >= LATE_AFTER_S
        code, body = http(url + "/v1/embeddings", {"input": texts})
        assert code == 503 and "rank 1 on " + victim["host"] in body["error"]["message"], body
        code, m = http(url + "/metrics")
        assert m["status"] == "degraded" and [r["late"] for r in m["ranks"]] == [False, True]
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        deadline = time.monotonic() + 30
        while (health := http(url + "/health"))[0] != 200:
            assert time.monotonic() < deadline, health
            time.sleep(0.3)
        assert health[1]["status"] == "ok" and health[1]["late"] == []
        code, body = http(url + "/v1/embeddings", {"input": texts})
        assert code == 200, body
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
        tok.no_padding()
        want = single_device(minilm_dir, [e.ids for e in tok.encode_batch(texts)])
        got = np.array([d["embedding"] for d in body["data"]], np.float32)
        np.testing.assert_allclose(got, want, atol=2e-5)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        p.send_signal(signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def test_jsonl_mode_answers_every_line_in_order(tiny_dir):
    mpiexec()
    lines = [json.dumps({"id": "a", "input": [2, 5, 7]}), "not json",
             json.dumps({"id": "c", "input": [[3, 4], [9, 9, 9, 9]]}), ""]
    p = subprocess.run([sys.executable, "-m", "hepti", "serve", "--model", str(tiny_dir), "-n", "2",
                        "--strategy", "tensor", "--jsonl"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=300)
    out = [json.loads(x) for x in p.stdout.splitlines()]
    assert p.returncode == 1, p.stderr[-2000:]  # one line was an error
    assert [o.get("id") for o in out] == ["a", None, "c"]
    assert out[1]["status"] == 400 and "error" in out[1]
    want = single_device(tiny_dir, [[2, 5, 7], [3, 4], [9, 9, 9, 9]])
    got = [out[0]["data"][0]["embedding"], *(d["embedding"] for d in out[2]["data"])]
    np.testing.assert_allclose(np.array(got, np.float32), want, atol=2e-5)


def test_a_plan_switch_mid_serving_keeps_every_answer_exact(served, minilm_dir, monkeypatch):
    """switch_plan while requests flow (what a re-plan does): the ranks load the new slices
    beside the serving plan, then switch together between batches. Every answer before, during
    and after equals the single-device one; a switch that leaves a rank's weights as they were
    (rows -> rows) reads nothing, and neither does the switch back to the first plan, whose
    slices each rank kept."""
    # the re-planner's own decisions are not what this tests: on a busy host (two CPU burners
    # beside it) it measured a real slowdown and switched a fourth time
    monkeypatch.setattr(replan, "COOLDOWN_S", math.inf)
    sup = served(2, "--strategy", "tensor", replan=True)
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    sup.embed(ids[:1])
    first = dict(sup.plan)
    plans = [{"hepti_plan": 1, "strategy": "rows", "world_size": 2,
              "ratios": {d: [0.3, 0.7] for d in ("heads", "ffn", "rows")}},
             {"hepti_plan": 1, "strategy": "rows", "world_size": 2,
              "ratios": {d: [0.6, 0.4] for d in ("heads", "ffn", "rows")}},
             first]
    for plan in plans:
        epoch = sup.epoch
        sup.switch_plan(plan)
        deadline = time.monotonic() + 120
        while sup.epoch == epoch:
            np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
            assert time.monotonic() < deadline, sup.metrics()["replans"]
        np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
        assert sup.metrics()["plan"]["ratios"]["rows"] == plan["ratios"]["rows"]
    switched = [e for e in sup.replans if "switched_at" in e]
    assert len(switched) == 3, sup.replans
    to_rows, rows_to_rows, back = switched
    assert all(b > 0 for b in to_rows["bytes_read"])  # tensor slices -> the whole model
    assert rows_to_rows["bytes_read"] == [0, 0]  # rows keeps every layer: nothing read
    assert back["bytes_read"] == [0, 0]  # the tensor slices were kept beside rows'
    assert back["new_strategy"] == "tensor"


def test_a_switch_with_no_room_for_both_plans_reads_after_letting_the_old_go(served, minilm_dir,
                                                                              monkeypatch):
    """A rank without the memory to hold the next plan's slices beside the current ones (here
    every rank: $HEPTI_SERVE_LOAD_ROOM asks for far more than any host has) lets the current
    ones go at the switch and reads the next then: a longer stall, every answer exact."""
    monkeypatch.setattr(replan, "COOLDOWN_S", math.inf)  # only the switch asked for
    monkeypatch.setenv("HEPTI_SERVE_LOAD_ROOM", "1e9")
    sup = served(2, "--strategy", "tensor", replan=True)
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
    epoch = sup.epoch
    sup.switch_plan({"hepti_plan": 1, "strategy": "tensor", "world_size": 2,
                     "ratios": {d: [0.75, 0.25] for d in ("heads", "ffn", "rows")}})
    deadline = time.monotonic() + 120
    while sup.epoch == epoch:
        np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
        assert time.monotonic() < deadline, sup.metrics()["replans"]
    np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
    switched = [e for e in sup.replans if "switched_at" in e]
    assert len(switched) == 1 and all(b > 0 for b in switched[0]["bytes_read"]), switched
    assert switched[0]["deferred_ranks"] == [0, 1]


def test_an_idle_rank_keeps_a_standby_copy_and_joins_without_reading(served, minilm_dir, monkeypatch):
    """With the re-planner on, a rank the plan leaves idle loads the whole model beside it;
    a switch that gives it rows then reads nothing, and every answer stays exact."""
    monkeypatch.setattr(replan, "COOLDOWN_S", math.inf)  # only the switch asked for
    sup = served(2, "--strategy", "rows", "--ratios", "1,0", replan=True)
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    deadline = time.monotonic() + 60
    while sup.watcher is None or sup.watcher.held[1] is None:  # the standby copy is in
        assert not any(e.get("decision") == "stopped" for e in sup.replans), sup.replans
        np.testing.assert_allclose(sup.embed(ids[:2]), want[:2], atol=2e-5)
        assert time.monotonic() < deadline, "rank 1 never reported its standby copy"
    epoch = sup.epoch
    sup.switch_plan({"hepti_plan": 1, "strategy": "rows", "world_size": 2,
                     "ratios": {d: [0.5, 0.5] for d in ("heads", "ffn", "rows")}})
    while sup.epoch == epoch:
        np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
        assert time.monotonic() < deadline + 60, sup.metrics()["replans"]
    np.testing.assert_allclose(sup.embed(ids), want, atol=2e-5)
    switched = [e for e in sup.replans if "switched_at" in e]
    assert switched[-1]["bytes_read"] == [0, 0]


def test_replan_ab_pauses_the_monitor_on_every_other_run_of_batches(served, minilm_dir):
    """--replan-ab 2 (bench-adapt --quiet-ab): of the batch ids (from 1), runs of two take
    turns: 0-1 report to the monitor, 2-3 do not (the workers skip the report's gather, so the
    front end gets no per-rank times), 4-5 do, and so on; every answer is exact either way,
    and /metrics gives each run's latencies."""
    sup = served(2, "--strategy", "rows", replan=True, replan_ab=2)
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids[:1])
    deadline = time.monotonic() + 300
    while sup.watcher is None:  # it comes with the workers' hello
        assert time.monotonic() < deadline and sup.health()["status"] in ("starting", "ok")
        time.sleep(0.1)
    reported = []
    after = sup.watcher.after_batch
    sup.watcher.after_batch = lambda *a, **k: (reported.append(sup.counts["batches"]), after(*a, **k))
    for _ in range(8):  # batches 1..8, one at a time
        np.testing.assert_allclose(sup.embed(ids[:1]), want, atol=2e-5)
    # the report follows the answer, which goes ahead: batch 8's may still be on its way
    deadline = time.monotonic() + 30
    while len(reported) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reported == [1, 4, 5, 8], reported
    runs = sup.metrics()["monitor_ab"]["runs"]
    assert [(r["run"], r["monitor"], len(r["latencies_ms"])) for r in runs] == \
        [(0, True, 1), (1, False, 2), (2, True, 2), (3, False, 2), (4, True, 1)]
