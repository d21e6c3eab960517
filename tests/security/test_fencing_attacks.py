"""Attacks on checkpoint fencing, each against the real thing: lease files on local disk and on S3 (moto's server
on loopback, through s3fs), racing processes, a holder in another PID namespace (``unshare``), pods with a stolen
run id, real ``orch launch`` runs for the default checkpoint dir, a lost lease and copied checkpoints.

Every process a test starts is ended by PID; ports are picked free; temporary directories are pytest's."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchestrator.checkpoint import CheckpointFenced, CheckpointManager, CheckpointStorage, step_dirname
from orchestrator.checkpoint.fence import LeaseFence
from orchestrator.checkpoint.lease import Lease, LeaseFollower, LeaseKeeper, lease_name
from orchestrator.checkpoint.lease_record import pid_namespace
from orchestrator.errors import ConfigError
from orchproc import orch_env, orch_here, read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for

pytestmark = pytest.mark.timeout(300)

TRIALS = 40
SECRET = "the-runs-secret"
SLOW_RUN = ["conf=cpu_gloo", "launcher=local", "model._target_=testmodels.SlowMLM", "+model.delay_s=0.03"]


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """Where leases are taken: a local directory, or a prefix of a bucket on the moto server."""
    if request.param == "local":
        return str(tmp_path / "leases")
    return f"s3://{request.getfixturevalue('s3_bucket')}/leases"


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- two takers at the same instant -------------------------------------------------------------------------------

RACER = r"""
import json, os, sys, time
from orchestrator.checkpoint.lease import Lease
from orchestrator.errors import ConfigError

base, trials, me, sync = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
for t in range(trials):
    lease = Lease(f"{base}/trial-{t}", f"racer-{me}", 60.0, "checkpoint.url")
    lease.files.generations()  # connect (S3) before the start, so both start from the same point
    open(f"{sync}/ready-{t}-{me}", "w").close()
    while not os.path.exists(f"{sync}/go-{t}"):
        pass  # spin: both racers leave this loop within microseconds of the go file appearing
    t0 = time.time()
    try:
        lease.acquire()
        won = True
    except ConfigError:
        won = False
    with open(f"{sync}/result-{t}-{me}.tmp", "w") as f:
        json.dump({"won": won, "t0": t0, "t1": time.time()}, f)
    os.rename(f"{sync}/result-{t}-{me}.tmp", f"{sync}/result-{t}-{me}")
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_racing_for_one_lease_have_exactly_one_winner(root, tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, root, str(TRIALS), str(i), str(sync)], env=orch_env(),
                               stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    winners, overlapping = [], 0
    try:
        for t in range(TRIALS):
            if t % 2:  # every other trial races for a stale lease: the takeover must be as exclusive as a first take
                write_stale_lease(f"{root}/trial-{t}")

            def ready() -> bool:
                assert all(r.poll() is None for r in racers), [r.stderr.read() for r in racers if r.poll() is not None]
                return all((sync / f"ready-{t}-{i}").exists() for i in (0, 1))

            wait_for(ready, 120, f"both racers ready for trial {t}", interval=0.01)
            (sync / f"go-{t}").touch()
            wait_for(lambda: all((sync / f"result-{t}-{i}").exists() for i in (0, 1)), 60, f"trial {t}", 0.01)
            results = [json.loads((sync / f"result-{t}-{i}").read_text()) for i in (0, 1)]
            winners.append(sum(r["won"] for r in results))
            a, b = results
            overlapping += a["t0"] < b["t1"] and b["t0"] < a["t1"]  # both were inside acquire() at once
            won = [i for i in (0, 1) if results[i]["won"]]
            if len(won) == 1:
                assert Lease(f"{root}/trial-{t}", "judge", 60.0, "checkpoint.url").read().run_id == f"racer-{won[0]}"
    finally:
        for racer in racers:
            stop_tree(racer.pid)
            racer.wait(timeout=30)
    assert winners == [1] * TRIALS, f"winners per trial: {winners}"
    assert overlapping >= TRIALS // 2, f"only {overlapping} of {TRIALS} trials raced at the same time"


def write_stale_lease(url: str) -> None:
    """Generation 1 of a run whose holder stopped renewing it long ago."""
    dead = Lease(url, "dead-run", 1.0, "checkpoint.url")
    assert dead.files.create(1, dead._record())
    dead.files.write(1, dataclasses.replace(dead._record(), heartbeat_t=time.time() - 3600))


def test_two_takers_of_one_stale_lease_cannot_both_win(root):
    """Both judged generation 1 stale; whichever creates generation 2 first wins, the other is refused, even
    the one that judged it before the winner existed."""
    stale = Lease(root, "dead-run", 1.0, "checkpoint.url")
    stale.acquire()
    stale.held = False  # it never beats again, and never removes its file
    time.sleep(1.2)
    first, second = Lease(root, "taker-a", 60.0, "checkpoint.url"), Lease(root, "taker-b", 60.0, "checkpoint.url")
    gen, judged = first.files.current()
    assert not judged.is_live(time.time())
    first.acquire()
    # second judged the same stale generation 1 before first took it: its create of generation 2 fails, and
    # the generation it finds then is first's, live.
    assert not second.files.create(gen + 1, second._record())
    with pytest.raises(ConfigError, match="is in use by live run taker-a"):
        second.acquire()
    assert first.read().run_id == "taker-a" and first.files.generations() == [2]


# -- another PID namespace ----------------------------------------------------------------------------------------

HOLDER = r"""
import sys, time
from orchestrator.checkpoint.lease import Lease, LeaseKeeper
LeaseKeeper([Lease(sys.argv[1], sys.argv[2], float(sys.argv[3]), "checkpoint.url")]).acquire()
print("HELD", flush=True)
time.sleep(600)
"""

TAKER = r"""
import sys
from orchestrator.checkpoint.lease import Lease
from orchestrator.errors import ConfigError
try:
    Lease(sys.argv[1], "taker", 60.0, "checkpoint.url").acquire()
    print("TOOK")
except ConfigError as e:
    print("REFUSED", e)
"""


def in_new_pid_namespace(*argv: str) -> list[str]:
    """``argv`` as PID 1 of a new PID namespace with its own /proc (same host name, same kernel); ending the
    ``unshare`` process ends it too."""
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]


@pytest.fixture
def unshare():
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(in_new_pid_namespace("true"), capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this machine does not allow a new PID namespace: {probe.stderr.strip()}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_holder_in_another_pid_namespace_keeps_its_lease_until_its_heartbeat_stops(unshare, tmp_path):
    url, timeout_s = str(tmp_path / "ckpt"), 3.0
    holder = subprocess.Popen(in_new_pid_namespace(sys.executable, "-c", HOLDER, url, "ns-run", str(timeout_s)),
                              stdout=subprocess.PIPE, text=True, env=orch_env(), start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        record = Lease(url, "x", 60.0, "checkpoint.url").read()
        assert record.pid_ns != pid_namespace() and record.host == socket.gethostname()
        # Its PID means another process here (PID 1 of its namespace), yet its heartbeats say it lives.
        with pytest.raises(ConfigError, match="is in use by live run ns-run"):
            Lease(url, "taker", 60.0, "checkpoint.url").acquire()
        stop_tree(holder.pid)
        holder.wait(timeout=30)
        # Gone: from another namespace only its heartbeat's age tells, so the lease waits for its timeout.
        with pytest.raises(ConfigError, match="is in use by live run ns-run"):
            Lease(url, "taker", 60.0, "checkpoint.url").acquire()
        time.sleep(timeout_s + 0.5)
        taker = Lease(url, "taker", 60.0, "checkpoint.url")
        taker.acquire()
        assert taker.read().run_id == "taker"
    finally:
        stop_tree(holder.pid)
        holder.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_taker_in_another_pid_namespace_does_not_take_a_live_lease(unshare, tmp_path):
    """The audited gap: in its own namespace the holder's PID is no process, and the same host name made that
    look like a dead holder."""
    url = str(tmp_path / "ckpt")
    keeper = LeaseKeeper([Lease(url, "host-run", 60.0, "checkpoint.url")]).acquire()
    try:
        taker = subprocess.run(in_new_pid_namespace(sys.executable, "-c", TAKER, url), capture_output=True,
                               text=True, env=orch_env(), timeout=120)
        assert taker.stdout.startswith("REFUSED") and "is in use by live run host-run" in taker.stdout, (
            taker.stdout + taker.stderr)
        assert keeper.leases[0].read().run_id == "host-run"
    finally:
        keeper.release()


# -- pods with a stolen run id ------------------------------------------------------------------------------------

def test_a_pod_with_a_stolen_run_id_cannot_take_verify_or_delete_the_runs_lease(root):
    node0 = Lease(root, "job-r", 60.0, "checkpoint.url", shared=True, secret=SECRET)
    node0.acquire()
    for secret in (None, "a-guess"):
        thief = Lease(root, "job-r", 0.0, "checkpoint.url", shared=True, secret=secret)
        with pytest.raises(ConfigError, match="cannot prove it belongs to that run"):
            thief.acquire()  # it waits out its own timeout (node 0's lease might have been going stale), and
            # tries again: in vain. A timeout of 0 s keeps that to one retry, a second later.
        thief.release()  # nothing of its own to remove, and nothing else
        with pytest.raises(ConfigError, match="has no live lease of run job-r: .*proof"):
            LeaseFollower(root, "job-r", 5.0, "checkpoint.url", secret).acquire()
        refusal = LeaseFence(root, "job-r", secret).refusal()
        assert refusal is not None and refusal.lost_to == "job-r (another secret)"
    with pytest.raises(ConfigError, match="has no live lease of run other-job: it is held by run job-r"):
        LeaseFollower(root, "other-job", 5.0, "checkpoint.url", SECRET).acquire()
    record = node0.read()
    assert record.token == node0.token and SECRET not in json.dumps(record.to_doc())
    assert node0.renew()

    # A real replacement of node 0 (the run's secret) takes over at once; the old holder learns it lost.
    follower = LeaseFollower(root, "job-r", 5.0, "checkpoint.url", SECRET)
    follower.acquire()
    replacement = Lease(root, "job-r", 60.0, "checkpoint.url", shared=True, secret=SECRET)
    replacement.acquire()
    assert not node0.renew() and follower.renew() and LeaseFence(root, "job-r", SECRET).refusal() is None
    node0.release()  # no longer its lease: left alone
    assert replacement.read().token == replacement.token


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_second_launches_against_a_live_run_exit_2_and_touch_nothing(tmp_path, capsys, monkeypatch):
    """A real first launch (run.id known to the attacker, default checkpoint dir), then: a launch that names that
    checkpoint dir, a pod (node 0) with the first run's id, and a pod (node 1) with it. Each exits 2 with one
    line naming the key, the value, the live run and the fix, leaves no run dir, and the first run's leases are
    untouched. The second launches are refused before they start anything: the CLI's main in this process."""
    first_dir, run_id = tmp_path / "first", "live-run-1"
    first = start_orch("launch", *SLOW_RUN, "trainer.max_steps=4000", f"run.dir={first_dir}", f"run.id={run_id}",
                       log=tmp_path / "first.log")
    try:
        wait_for(lambda: [e for e in read_jsonl(first_dir / "events.jsonl") if e["event"] == "launch_started"],
                 120, "the first launch")
        ckpt = first_dir / "checkpoints"
        leases_before = {p.name: p.read_text() for p in ckpt.glob(".orch-lease.*")}
        assert len(leases_before) == 1, "the default checkpoint dir is leased"
        pod = ["rendezvous.external=true", f"rendezvous.port={free_port()}", f"run.id={run_id}",
               "run.lease_timeout_s=2"]  # how long a pod waits for the live lease to go stale: in vain
        attempts = {
            "checkpoint.url": ([], "is in use by live run live-run-1"),
            "node 0 pod": (["cluster.node_index=0", *pod], "cannot prove it belongs to that run"),
            "node 1 pod": (["cluster.node_index=1", *pod], f"has no live lease of run {run_id}"),
        }
        monkeypatch.setenv("ORCH_RUN_SECRET", "")
        for i, (name, (extra, words)) in enumerate(attempts.items()):
            second_dir = tmp_path / f"second-{i}"
            result = orch_here(capsys, "launch", *SLOW_RUN, f"run.dir={second_dir}", f"checkpoint.url={ckpt}", *extra)
            assert result.returncode == 2 and result.stderr.count("\n") == 1, (name, result.stderr)
            assert result.stderr.startswith(f"orch: error: checkpoint.url='{ckpt}' ") and "Fix:" in result.stderr, (
                name, result.stderr)
            assert words in result.stderr, (name, result.stderr)
            assert not second_dir.exists(), name
            assert {p.name: p.read_text() for p in ckpt.glob(".orch-lease.*")}.keys() == leases_before.keys(), name
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        stop_tree(first.pid)


# -- a lost lease stops the run ----------------------------------------------------------------------------------

def steal(url: str, run_id: str = "thief") -> float:
    """Another run takes the lease on ``url`` (the next generation, as a takeover after a stale judgment
    would), with a heartbeat that keeps it live; returns when."""
    mine = Lease(url, run_id, 60.0, "checkpoint.url")
    gen = max(mine.files.generations() or [0])
    record = mine._record()
    assert mine.files.create(gen + 1, record)
    return record.heartbeat_t


def reason_of(fence: LeaseFence):
    """``fence`` as CheckpointManager's fence: the reason it refuses, or None."""
    def check():
        verdict = fence.refusal()
        return verdict.reason if verdict else None
    return check


def test_a_commit_is_refused_once_the_lease_is_another_runs(root):
    holder = Lease(root, "run-a", 60.0, "checkpoint.url", secret=SECRET)
    holder.acquire()
    fence = LeaseFence(root, "run-a", SECRET)
    manager = CheckpointManager(root, keep_last=1, async_save=False, run_id="run-a", fence=reason_of(fence))
    manager.save(1, state(1))
    steal(root)
    with pytest.raises(CheckpointFenced, match="refused, nothing committed: the lease on .* is held by run thief"):
        manager.save(2, state(2))
    assert manager.storage.list_steps() == [1] and manager.load().step == 1  # no step 2, no partial files
    assert not [n for n in manager.storage.list_files("") if n.startswith(".step_")]
    assert fence.lost is not None and fence.lost.lost_to == "thief"
    # Once lost, always refused, without looking again: even if the thief's file were gone.
    fence.files = None
    with pytest.raises(CheckpointFenced):
        manager.save(3, state(3))
    assert manager.storage.list_steps() == [1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_lease_is_taken_stops_writing_and_fails_naming_the_thief(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "orch.log"
    proc = start_orch("launch", *SLOW_RUN, "trainer.max_steps=4000", "checkpoint.every_n_steps=2",
                      "checkpoint.async_save=false", f"run.dir={run_dir}", log=log)
    try:
        def saved() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            return any(e["event"] == "checkpoint_saved" for e in read_jsonl(run_dir / "events.jsonl"))

        wait_for(saved, 150, "a first checkpoint")
        url = str(run_dir / "checkpoints")
        stolen_t = steal(url)
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    output = log.read_text()
    reason = f"lease on checkpoint.url={url} lost to run thief"
    assert f"run failed: {reason}" in output
    result = summary(run_dir)
    assert result["status"] == "failed" and result["failure_reason"] == reason
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e for e in events if e["event"] == "lease_lost"]
    assert lost and lost[0]["reason"] == reason and lost[0]["by"] == "worker"  # a fence check saw it first
    # The worker's fence is checked before a save commits and before retention deletes anything: whichever saw
    # the theft first, any save tried after it was refused (one may not have been tried before the run ended).
    failed = [e for e in events if e["event"] == "checkpoint_failed" and e["t"] >= lost[0]["t"]]
    assert all("refused, nothing committed" in e["error"] for e in failed), failed
    assert not [e for e in events if e["event"] == "checkpoint_saved" and e["t"] > lost[0]["t"]]
    for step_dir in Path(url).glob("step_*"):  # nothing committed after the theft
        assert json.loads((step_dir / "manifest.json").read_text())["created_t"] < stolen_t
    thief = Lease(url, "x", 60.0, "checkpoint.url").read()
    assert thief is not None and thief.run_id == "thief"  # the losing run removed nothing of the thief's


# -- retention and copied checkpoints ------------------------------------------------------------------------------

def test_retention_never_deletes_steps_copied_from_another_run(root, tmp_path):
    origin = str(tmp_path / "origin")
    a = CheckpointManager(origin, keep_last=3, async_save=False, run_id="run-a")
    for step in (1, 2, 3):
        a.save(step, state(step))
    copy = CheckpointStorage(root)
    for step in (1, 2, 3):
        for name in os.listdir(Path(origin) / step_dirname(step)):
            copy.write_bytes(f"{step_dirname(step)}/{name}", (Path(origin) / step_dirname(step) / name).read_bytes())

    b = CheckpointManager(root, keep_last=1, async_save=False, run_id="run-b")
    assert b.load().step == 3  # resumes from the copy
    for step in (4, 5):
        b.save(step, state(step))
    assert [(i.step, i.run_id) for i in b.list()] == [(1, "run-a"), (2, "run-a"), (3, "run-a"), (5, "run-b")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_launch_resuming_from_copied_checkpoints_keeps_the_copies(tmp_path):
    common = ["launch", "conf=cpu_gloo", "launcher=local", "cluster.nnodes=1", "checkpoint.every_n_steps=2"]
    first = run_orch(*common, "trainer.max_steps=6", "checkpoint.keep_last=3", f"run.dir={tmp_path / 'a'}",
                     timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    copied = tmp_path / "b" / "checkpoints"
    copied.mkdir(parents=True)
    for step_dir in (tmp_path / "a" / "checkpoints").glob("step_*"):
        shutil.copytree(step_dir, copied / step_dir.name)
    second = run_orch(*common, "trainer.max_steps=10", "checkpoint.keep_last=1", f"run.dir={tmp_path / 'b'}",
                      timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    loaded = [e for e in read_jsonl(tmp_path / "b" / "events.jsonl") if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[0]["step"] == 6
    assert sorted(p.name for p in copied.glob("step_*")) == [step_dirname(s) for s in (2, 4, 6, 10)]


def test_a_background_save_refused_by_the_fence_is_reported_as_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    Lease(url, "run-a", 60.0, "checkpoint.url").acquire()
    manager = CheckpointManager(url, async_save=True, run_id="run-a", fence=reason_of(LeaseFence(url, "run-a")))
    manager.save(1, state(1))
    manager.wait()
    steal(url)
    manager.save(2, state(2))  # the copy to CPU returns; the write is refused in the background
    with pytest.raises(CheckpointFenced, match="step 2 .* refused, nothing committed: .* held by run thief"):
        manager.wait()
    assert manager.storage.list_steps() == [1]
