"""Fencing between writers: leases on run dirs and checkpoint URLs (local and S3 through moto), retention that
deletes only its own run's steps, re-saves on object stores that never lose the committed step, safetensors
checkpoints and export. Attacks on the fencing (racing takers, PID namespaces, stolen run ids, lost leases) are
in tests/security/test_fencing_attacks.py."""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch

from orchestrator.checkpoint import CheckpointError, CheckpointManager, step_dirname
from orchestrator.checkpoint.lease import LEGACY_LEASE_NAME, Lease, LeaseKeeper, LeaseRecord, lease_name
from orchestrator.errors import ConfigError
from orchproc import orch_here, read_jsonl, start_orch, stop_tree, unused_pid, wait_for


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step)), "b": torch.arange(3)},
            "trainer": {"step": step, "ratio": float("inf"), 7: (1, None, "x")}}


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/ckpt"


def write_record(url: str, gen: int = 1, **changes) -> None:
    """A lease file of generation ``gen`` (0: the file orch wrote before generations) held by another run."""
    lease = Lease(url, "other-run", 60.0, "checkpoint.url")
    record = {"run_id": "other-run", "token": "t" * 32, "host": "another-host", "pid": 1, "pid_start_t": 0.0,
              "timeout_s": 60.0, "heartbeat_t": time.time(), **changes}
    lease.storage.makedirs()
    lease.storage.write_bytes(lease_name(gen), json.dumps(record).encode())


def test_live_lease_is_refused_naming_the_run_and_a_stale_one_is_taken_over(url):
    write_record(url)
    with pytest.raises(ConfigError, match=r"checkpoint.url=.* is in use by live run other-run \(pid 1 on another-host"):
        Lease(url, "second-run", 60.0, "checkpoint.url").acquire()

    write_record(url, heartbeat_t=time.time() - 61)  # not renewed within its timeout: stale
    mine = Lease(url, "second-run", 60.0, "checkpoint.url")
    mine.acquire()
    assert mine.read().run_id == "second-run"
    mine.release()
    assert mine.read() is None


def test_lease_of_a_dead_process_of_this_kernel_and_pid_namespace_is_taken_over_at_once(tmp_path):
    import socket

    from orchestrator.checkpoint.lease_record import boot_id, pid_namespace

    write_record(str(tmp_path), host=socket.gethostname(), pid=unused_pid(), pid_start_t=1.0,
                 boot_id=boot_id(), pid_ns=pid_namespace())
    mine = Lease(str(tmp_path), "next-run", 60.0, "run.dir")
    mine.acquire()
    assert mine.gen == 2 and sorted(p.name for p in tmp_path.iterdir()) == [lease_name(2)]  # the dead one's is gone


def test_an_old_lease_file_is_judged_by_its_heartbeat_alone(tmp_path):
    """A lease orch wrote before boot ids and PID namespaces (``.orch-lease.json``): its host name cannot tell
    whether its PID is one of ours, so only a heartbeat older than its timeout frees it."""
    import socket

    write_record(str(tmp_path), gen=0, host=socket.gethostname(), pid=2 ** 22 + 1, pid_start_t=1.0)
    with pytest.raises(ConfigError, match="is in use by live run other-run"):
        Lease(str(tmp_path), "next-run", 60.0, "run.dir").acquire()
    write_record(str(tmp_path), gen=0, heartbeat_t=time.time() - 61)
    mine = Lease(str(tmp_path), "next-run", 60.0, "run.dir")
    mine.acquire()
    assert mine.gen == 1 and not (tmp_path / LEGACY_LEASE_NAME).exists()
    mine.release()
    assert list(tmp_path.iterdir()) == []


def test_heartbeats_renew_the_lease_and_report_a_takeover(tmp_path):
    lost = []
    keeper = LeaseKeeper([Lease(str(tmp_path), "run-a", 1.0, "run.dir")], on_lost=lost.append).acquire()
    try:
        first = keeper.leases[0].read().heartbeat_t
        wait_for(lambda: keeper.leases[0].read().heartbeat_t > first, 5, "a heartbeat")
        write_record(str(tmp_path), gen=2, run_id="run-b")  # another run took it (the next generation)
        wait_for(lambda: lost, 5, "the takeover to be noticed")
    finally:
        keeper.release()
    assert LeaseRecord.parse(json.loads((tmp_path / lease_name(2)).read_text())).run_id == "run-b"  # not ours


def test_a_rewritten_lease_file_is_lost_and_left_alone(tmp_path):
    lost = []
    keeper = LeaseKeeper([Lease(str(tmp_path), "run-a", 1.0, "run.dir")], on_lost=lost.append).acquire()
    try:
        write_record(str(tmp_path), gen=1, run_id="run-b")  # a writer without an exclusive create overwrote it
        wait_for(lambda: lost, 5, "the overwrite to be noticed")
    finally:
        keeper.release()
    assert LeaseRecord.parse(json.loads((tmp_path / lease_name(1)).read_text())).run_id == "run-b"


def test_retention_deletes_only_its_own_runs_steps(url):
    CheckpointManager(url, keep_last=1, async_save=False, run_id="x").save(1, state(1))  # an unrelated run
    a = CheckpointManager(url, keep_last=2, async_save=False, run_id="a")
    for step in (2, 3, 4):
        a.save(step, state(step))
    assert [i.step for i in a.list()] == [1, 3, 4]  # x's step 1 is not a's to delete

    b = CheckpointManager(url, keep_last=2, async_save=False, run_id="b")
    assert b.load().step == 4  # resumes from a's step 4
    for step in (5, 6, 7):
        b.save(step, state(step))
    infos = b.list()
    assert [i.step for i in infos] == [1, 3, 4, 6, 7]  # b's 5 goes; a's steps (it resumed from them) and x's stay
    assert infos[-1].run_id == "b" and infos[-1].lineage == ("a", "b")
    manifest = json.loads(b.storage.read_bytes(f"{step_dirname(6)}/manifest.json"))
    assert manifest["resumed_from"] == {"run_id": "a", "step": 4}


def test_object_store_resave_keeps_the_committed_step_until_the_new_one_is(s3_bucket):
    url = f"s3://{s3_bucket}/resave"
    manager = CheckpointManager(url, keep_last=2, async_save=False, run_id="r")
    manager.save(5, state(5))
    before = set(manager.storage.list_files(step_dirname(5)))

    calls = []

    def fail_second_file(storage, relpath, data):
        calls.append(relpath)
        assert manager.load(5).state["model"]["w"][0] == 5.0  # the committed step is intact while writing
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        storage.write_bytes(relpath, data)

    manager._write_payload = fail_second_file
    with pytest.raises(CheckpointError, match="disk full"):
        manager.save(5, state(50))
    assert set(manager.storage.list_files(step_dirname(5))) == before  # partial files removed
    assert manager.load(5).state["model"]["w"][0] == 5.0

    del manager._write_payload
    manager.save(5, state(55))
    after = set(manager.storage.list_files(step_dirname(5)))
    assert not (after & before - {"manifest.json"})  # the old payloads are gone, after the switch
    assert manager.load(5).state["model"]["w"][0] == 55.0


def test_failed_new_save_on_an_object_store_leaves_nothing(s3_bucket):
    manager = CheckpointManager(f"s3://{s3_bucket}/fresh", async_save=False)
    manager._write_payload = lambda storage, relpath, data: (storage.write_bytes(relpath, data), 1 / 0)
    with pytest.raises(CheckpointError):
        manager.save(1, state(1))
    assert manager.storage.list_steps() == []


def test_safetensors_checkpoint_round_trips_without_unpickling(url, monkeypatch):
    manager = CheckpointManager(url, async_save=True, format="safetensors")
    saved = state(3)
    saved["model"]["h"] = torch.randn(2, 3, dtype=torch.bfloat16)
    manager.save(3, saved)
    manager.wait()
    files = sorted(manager.storage.list_files(step_dirname(3)))
    assert files == ["manifest.json", "model.json", "model.safetensors", "trainer.json", "trainer.safetensors"]

    def no_unpickling(*args, **kwargs):
        raise AssertionError("unpickling while loading a safetensors checkpoint")

    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    loaded = CheckpointManager(url).load()
    assert loaded.state["trainer"] == saved["trainer"]
    for key, tensor in saved["model"].items():
        assert torch.equal(loaded.state["model"][key], tensor) and loaded.state["model"][key].dtype == tensor.dtype


def test_ckpt_export_writes_model_weights_loadable_with_safetensors(tmp_path, capsys):
    from safetensors.torch import load_file

    url = str(tmp_path / "ckpt")
    CheckpointManager(url, async_save=False).save(2, state(2))
    out = tmp_path / "model.safetensors"
    result = orch_here(capsys, "ckpt", "export", url, "--format", "safetensors", "-o", str(out))
    assert result.returncode == 0, result.stderr
    weights = load_file(str(out))
    assert set(weights) == {"w", "b"} and torch.equal(weights["w"], torch.full((4,), 2.0))


def test_ckpt_inspect_exits_2_for_a_checkpoint_load_skips(tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    manager = CheckpointManager(url, async_save=False, format="safetensors")
    manager.save(1, state(1))
    assert orch_here(capsys, "ckpt", "inspect", url).returncode == 0
    # A skeleton that parses as JSON and matches its (rewritten) checksum, but is not one orch wrote.
    stepdir = tmp_path / "ckpt" / step_dirname(1)
    (stepdir / "trainer.json").write_text('{"evil": 1}')
    manifest = json.loads((stepdir / "manifest.json").read_text())
    import hashlib

    data = (stepdir / "trainer.json").read_bytes()
    manifest["files"]["trainer.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (stepdir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="cannot be read back safely"):
        assert manager.load() is None  # load() skips it...
    result = orch_here(capsys, "ckpt", "inspect", url)
    assert result.returncode == 2 and result.stderr.count("\n") == 1  # ...and inspect says so, and why
    assert "is not a valid checkpoint: payload 'trainer' cannot be read back safely" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_second_launch_on_a_live_checkpoint_url_exits_2_naming_the_first(tmp_path, s3_bucket, capsys):
    """A real first launch holds the S3 lease; the second, refused before it starts anything, runs the CLI's
    main in this process (the orch command's own process is tests/test_bad_inputs.py's)."""
    ckpt = f"checkpoint.url=s3://{s3_bucket}/shared"
    common = ["launch", "conf=cpu_gloo", "launcher=local", "model._target_=testmodels.SlowMLM", "+model.delay_s=0.03",
              "trainer.max_steps=400", ckpt]
    first = start_orch(*common, f"run.dir={tmp_path / 'first'}", log=tmp_path / "first.log")
    try:
        started = wait_for(lambda: [e for e in read_jsonl(tmp_path / "first" / "events.jsonl")
                                    if e["event"] == "launch_started"], 120, "the first launch")
        second = orch_here(capsys, *common, f"run.dir={tmp_path / 'second'}")
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert f"is in use by live run {started[0]['run_id']}" in second.stderr and "checkpoint.url" in second.stderr
        assert not (tmp_path / "second").exists()
    finally:
        stop_tree(first.pid)


def test_exclusive_create_is_atomic_on_local_disk_and_s3(url):
    from orchestrator.checkpoint import CheckpointStorage

    storage = CheckpointStorage(url)
    storage.makedirs()
    assert storage.atomic_create  # a hard link locally, If-None-Match: * on S3 (moto's server honours it)
    assert storage.create_exclusive("x.json", b"first")
    assert not storage.create_exclusive("x.json", b"second")
    assert storage.read_bytes("x.json") == b"first" and sorted(storage.list_files("")) == ["x.json"]


def test_run_leases_cover_every_checkpoint_url_a_run_writes(tmp_path):
    from orchestrator.checkpoint.lease import LeaseFollower
    from orchestrator.config.compose import compose_config
    from orchestrator.preflight import run_leases

    def leases(*overrides):
        cfg = compose_config("cpu_gloo", [f"run.dir={tmp_path / 'run'}", *overrides])
        return [(type(lease).__name__, lease.setting, lease.url) for lease in run_leases(cfg, "r").leases]

    run = str(tmp_path / "run")
    assert leases() == [("Lease", "run.dir", run), ("Lease", "checkpoint.url", f"{run}/checkpoints")]  # the default
    assert leases(f"checkpoint.url={tmp_path / 'ck'}")[1] == ("Lease", "checkpoint.url", str(tmp_path / "ck"))
    assert leases(f"checkpoint.url={run}") == [("Lease", "run.dir", run)]  # one root, one lease
    assert leases("cluster.nnodes=1", "checkpoint.url=memory://ck") == [("Lease", "run.dir", run)]
    pod = ["rendezvous.external=true", "rendezvous.port=29400", "run.id=r", "checkpoint.url=s3://b/ck"]
    assert leases("cluster.node_index=1", *pod) == [(LeaseFollower.__name__, "checkpoint.url", "s3://b/ck")]
    node0 = run_leases(compose_config("cpu_gloo", [f"run.dir={run}", "cluster.node_index=0", *pod]), "r", "s").leases
    assert [(lease.shared, lease.secret) for lease in node0] == [(True, "s"), (True, "s")]
