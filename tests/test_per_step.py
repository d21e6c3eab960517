"""fault_tolerance.mode=per_step (torchft): survivors never restart, a returning node heals from a live peer,
and the committed lineage trains every sample once with a constant global batch."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from orchestrator.ft import torchft_problem
from orchestrator.rundir import read_jsonl
from orchestrator.runtime.sampler import GlobalBatchSampler
from orchproc import orch_here, run_orch, start_orch, stop_tree, summary, wait_for

needs_torchft = pytest.mark.skipif(torchft_problem() is not None, reason=str(torchft_problem()))

G, MICRO, SAMPLES = 24, 4, 480  # 20 steps per epoch
SECRET = "per-step-test-secret-3f9c2a"


def audit_samples(run_dir: Path, max_steps: int, seed: int = 0) -> dict[int, list[int]]:
    """The committed lineage from every rank's records: each step's data position is the previous one plus
    the global batch, each rank drew exactly what the sampler assigns its (world, rank) at that position, no two
    ranks drew the same sample in a step, and each step's slice is the next G of the epoch's permutation.
    Returns step -> the ids its records hold."""
    records = [r for f in sorted((run_dir / "samples").glob("node*-rank*.jsonl")) for r in read_jsonl(f)]
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    assert sorted(by_step) == list(range(1, max_steps + 1)), "every step of the lineage was committed and recorded"
    ids_by_step: dict[int, list[int]] = {}
    for step, recs in by_step.items():
        assert {r["start_sample"] for r in recs} == {(step - 1) * G}, f"step {step}: data position"
        ids: list[int] = []
        for r in recs:
            expected = GlobalBatchSampler(SAMPLES, G, MICRO, r["world_size"], r["job_rank"], seed=seed,
                                          start_sample=r["start_sample"])
            it = iter(expected)
            drawn = [i for _ in range(expected.accumulation_steps) for i in next(it)]
            assert r["ids"] == drawn, f"step {step}: rank {r['job_rank']} of {r['world_size']} drew its share"
            ids += r["ids"]
        assert len(ids) == len(set(ids)), f"step {step}: no sample twice"
        ids_by_step[step] = ids
    return ids_by_step


def kill_second_group(run_dir: Path, after_step: int) -> float:
    """Once both replica groups are in the quorum and a step past ``after_step`` is logged, SIGKILL node 1's
    agent and workers (``orch chaos kill-node``); returns when it was killed."""
    wait_for(lambda: any(e["event"] == "quorum_changed" and e["replicas"] == 2
                         for e in read_jsonl(run_dir / "events.jsonl")), 180, "both replica groups in the quorum")
    wait_for(lambda: any(m["step"] >= after_step for m in read_jsonl(run_dir / "metrics.jsonl")), 120,
             f"step {after_step}")
    killed = time.time()
    kill = run_orch("chaos", "kill-node", str(run_dir), "--node", "1", timeout=30)
    assert kill.returncode == 0, kill.stderr
    return killed


@needs_torchft
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_killed_node_returns_and_heals_from_a_peer_with_every_sample_once(tmp_path):
    run_dir = tmp_path / "run"
    steps = 900
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2",
                      "fault_tolerance.mode=per_step", f"trainer.max_steps={steps}", "trainer.log_every=1",
                      "trainer.record_sample_ids=true", f"data.dataset.num_samples={SAMPLES}",
                      "checkpoint.every_n_steps=50", f"run.dir={run_dir}", log=tmp_path / "orch.log",
                      env={"ORCH_RUN_SECRET": SECRET})
    try:
        events = lambda: read_jsonl(run_dir / "events.jsonl")  # noqa: E731
        killed = kill_second_group(run_dir, after_step=40)
        # The returning node healed and is in the quorum again; then node 0 (the survivor) gets a notice: it
        # leaves at the next step boundary with nothing to save, node 1 holding the state.
        back = wait_for(lambda: [e for e in events() if e["event"] == "replica_healed" and e["node"] == 1
                                 and e["t"] > killed], 180, "the returning node 1 healing from node 0")[0]
        wait_for(lambda: [e for e in events() if e["event"] == "quorum_changed" and e["replicas"] == 2
                          and e["t"] > back["t"]], 60, "both groups in the quorum again")
        preempt = run_orch("chaos", "preempt", str(run_dir), "--node", "0", "--grace", "30", timeout=60)
        assert preempt.returncode == 0, preempt.stderr
        assert proc.wait(timeout=300) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)

    evs = read_jsonl(run_dir / "events.jsonl")
    kill_t = next(e["t"] for e in evs if e["event"] == "chaos_kill")
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == steps
    # The survivor never restarted: one worker start per agent, no torchrun restart, no restore from storage.
    assert not [e for e in evs if e["event"] == "restart"]
    assert not [e for e in evs if e["event"] == "checkpoint_loaded"]
    shrink = next(e for e in evs if e["event"] == "quorum_changed" and e["t"] > kill_t)
    assert shrink["replicas"] == 1 and shrink["t"] - kill_t < 15, shrink
    assert s["recoveries"] and s["recoveries"][0]["mttr_s"] < 15
    # The returning node (a new agent for node 1) healed from node 0, bit-identical, without reading storage.
    healed = [e for e in evs if e["event"] == "replica_healed" and e["t"] > kill_t]
    assert healed, "the returning node healed from a peer"
    h = healed[0]
    assert h["node"] == 1 and h["source_node"] == 0 and h["checkpoint_read"] is False and h["step"] > 40
    assert h["params_sha256"] == h["source_params_sha256"]
    grown = [e for e in evs if e["event"] == "quorum_changed" and e["t"] > h["t"]]
    assert grown and grown[0]["replicas"] == 2 and grown[0]["step"] == h["step"] + 1

    for f in run_dir.rglob("*"):  # the run's secret reached agents and workers, and nothing the run wrote
        assert not f.is_file() or SECRET.encode() not in f.read_bytes(), f
    assert SECRET not in (tmp_path / "orch.log").read_text()
    left = [e for e in evs if e["event"] == "replica_left"]
    assert left and left[0]["node"] == 0, "the noticed group left at a step boundary"
    assert not [e for e in evs if e["event"] == "emergency_checkpoint"], "its peer held the state: nothing saved"
    assert [e for e in evs if e["event"] == "node_preempted" and e["node"] == 0]
    # The quorum service took each departed group out at once, not after its heartbeats aged out: the killed
    # one when the controller saw its agent exit, the noticed one when it announced it leaves (before its exit).
    dropped = [e for e in evs if e["event"] == "replica_dropped"]
    assert [e for e in dropped if e["replica_id"].startswith("node1-") and e["cause"] == "agent_exited"
            and e["t"] > kill_t], dropped
    gone0 = next(e for e in evs if e["event"] == "node_preempted" and e["node"] == 0)
    assert [e for e in dropped if e["replica_id"].startswith("node0-") and e["cause"] == "left"
            and left[0]["t"] - 5 < e["t"] <= gone0["t"]], dropped
    # Goodput splits the per_step costs out of the step windows.
    assert {"quorum_wait_s", "healing_s", "discarded_s"} <= set(s["goodput"]["badput"])
    # The step windows stay contiguous when the leader changes (a healed group takes over its peer's open
    # window, with the peer's quorum time so far), so nothing is left unexplained but start-up slivers.
    assert s["goodput"]["badput"]["other_s"] < 3.0, s["goodput"]["badput"]
    # A kill between two steps discards none (the next quorum simply leaves the dead group out); one during a
    # step's all-reduce discards that step: either way nothing committed is lost.
    discarded = [e for e in evs if e["event"] == "step_discarded"]
    assert (s["goodput"]["badput"]["discarded_s"] > 0) == bool(discarded) and s["goodput"]["lost_steps"] == 0

    ids_by_step = audit_samples(run_dir, steps)
    kill_steps = {e["step"] for e in evs if e["event"] == "step_discarded"}
    for step, ids in ids_by_step.items():
        # Every rank's record of a committed step is there, except a rank killed between its all-reduce and
        # its record (its samples still reached the committed gradient).
        assert len(ids) == G or (step - 1 in kill_steps or step in kill_steps or len(ids) == G // 2), step
    for epoch in range(steps * G // SAMPLES):
        seen = sorted(i for step in range(epoch * 20 + 1, epoch * 20 + 21)
                      for i in GlobalBatchSampler(SAMPLES, G, G, 1, 0, start_sample=(step - 1) * G).__iter__().__next__())
        assert seen == list(range(SAMPLES)), f"epoch {epoch}: the lineage's slices cover every sample once"


@needs_torchft
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_group_is_left_behind_without_waiting_out_the_collective_timeout(tmp_path):
    """Node 1's agent and worker are stopped (SIGSTOP: a frozen VM, whose connections stay open, so no
    collective fails and no agent exits). The quorum service drops it when its heartbeats age out
    (``heartbeat_timeout_ms``, 1 s) and tells the survivor's watch, which aborts its process group at once: its
    next committed step comes long before ``collective_timeout_s`` (30 s here) would have ended its wait."""
    import signal

    from orchestrator.chaos import kill_node

    run_dir = tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2",
                      "fault_tolerance.mode=per_step", "fault_tolerance.collective_timeout_s=30",
                      "hang.enabled=false", "trainer.max_steps=100000", "trainer.log_every=1",
                      f"data.dataset.num_samples={SAMPLES}", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    stopped_pids: list[int] = []
    try:
        events = lambda: read_jsonl(run_dir / "events.jsonl")  # noqa: E731
        wait_for(lambda: any(e["event"] == "quorum_changed" and e["replicas"] == 2 for e in events()), 180,
                 "both replica groups in the quorum")
        wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 20, 120, "20 steps together")
        stopped = time.time()
        stopped_pids = kill_node(str(run_dir), 1, signal.SIGSTOP)
        alone = wait_for(lambda: [e for e in events() if e["event"] == "quorum_changed" and e["replicas"] == 1
                                  and e["t"] > stopped], 60, "the survivor's first step without node 1")[0]
        paused = alone["t"] - stopped
        assert paused < 15, f"the survivor waited {paused:.1f} s: the collective timeout (30 s), not the watch"
        # A step aborted in flight is discarded (and redone in the next quorum), naming the group it lost.
        for e in events():
            if e["event"] == "step_discarded" and e["t"] > stopped and e["node"] == 0:
                assert "lost node1-" in e["error"], e
    finally:
        for pid in stopped_pids:  # a stopped process ends on SIGKILL; SIGTERM would wait for a SIGCONT
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stop_tree(proc.pid)


# -- the fast tier: wire format, transport, sampler, config and plan ------------------------------------------

def test_wire_round_trips_a_training_state_without_pickle():
    import pickle
    import random

    from orchestrator.checkpoint.wire import WireError, decode, encode

    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "rng": random.getstate(),
             "torch_rng": torch.get_rng_state(), "scale": float("inf"), "nested": (1, [2.5, None], {"k": "v"})}
    back = decode(encode(state))
    assert torch.equal(back["model"]["weight"], model.weight.detach())
    assert list(back["optim"]["state"]) == [0, 1]  # int keys stay ints: the optimizer loads them
    torch.optim.AdamW(torch.nn.Linear(4, 3).parameters()).load_state_dict(back["optim"])
    assert back["rng"] == random.getstate() and back["scale"] == float("inf") and back["nested"] == (1, [2.5, None], {"k": "v"})
    with pytest.raises(WireError):
        encode({"f": lambda: 0})

    class Boom:
        def __reduce__(self):
            return (print, ("pickled payload ran",))

    with pytest.raises(WireError):
        decode(pickle.dumps(Boom()))  # a pickle is refused, never loaded


@needs_torchft
def test_peer_transport_serves_only_a_holder_of_the_secret_only_on_its_address():
    from datetime import timedelta

    from orchestrator.ft.transport import PeerStateTransport
    from orchestrator.trust.handshake import HandshakeError

    refused: list[str] = []
    served = PeerStateTransport(timedelta(seconds=2), address="127.0.0.1", secret="s3cret",
                                on_refused=lambda peer, why: refused.append(peer))
    peer = PeerStateTransport(timedelta(seconds=2), address="127.0.0.1", secret="s3cret")
    stranger = PeerStateTransport(timedelta(seconds=2), address="127.0.0.1", secret="guess")
    try:
        assert served._gate.address[0] == "127.0.0.1"
        url = served.metadata()
        served.send_checkpoint([1], 7, {"w": torch.arange(4.0)}, timedelta(seconds=2))
        assert torch.equal(peer.recv_checkpoint(0, url, 7, timedelta(seconds=2))["w"], torch.arange(4.0))
        with pytest.raises(HandshakeError, match="could not prove"):  # neither side proves to the other
            stranger.recv_checkpoint(0, url, 7, timedelta(seconds=2))
        deadline = time.monotonic() + 10  # the server learns of it when the stranger hangs up
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused, "the stranger was reported"
        served.disallow_checkpoint()
        with pytest.raises(RuntimeError, match="not staged"):  # nothing staged: nothing served
            peer.recv_checkpoint(0, url, 7, timedelta(seconds=2))
    finally:
        for t in (served, peer, stranger):
            t.shutdown()


@needs_torchft
def test_a_heal_source_waits_until_its_peer_fetched_the_state_but_not_for_a_peer_that_never_comes():
    import threading
    from datetime import timedelta

    from orchestrator.ft.transport import PeerStateTransport

    source = PeerStateTransport(timedelta(seconds=5), address="127.0.0.1", secret="s3cret")
    peer = PeerStateTransport(timedelta(seconds=5), address="127.0.0.1", secret="s3cret")
    try:
        assert source.wait_served(0.1, 1.0), "nobody to heal: no wait"
        source.send_checkpoint([1], 3, {"w": torch.arange(3.0)}, timedelta(seconds=2))
        started = time.monotonic()
        assert not source.wait_served(0.3, 5.0) and time.monotonic() - started < 3, "a peer that never fetches"
        source.send_checkpoint([1], 4, {"w": torch.arange(4.0)}, timedelta(seconds=2))
        got = {}
        fetch = threading.Timer(0.3, lambda: got.update(sd=peer.recv_checkpoint(0, source.metadata(), 4,
                                                                                  timedelta(seconds=5))))
        fetch.start()
        assert source.wait_served(3.0, 10.0), "the peer fetched it"
        fetch.join(10)
        assert torch.equal(got["sd"]["w"], torch.arange(4.0))
    finally:
        for t in (source, peer):
            t.shutdown()


def test_sampler_follows_the_quorum_and_redoes_a_discarded_step():
    """Steps at 2, 1, 1 (redo), 3 replica groups: each step's ranks together draw exactly its global slice."""
    position = {"sample": 0}
    plan = [(2, 2 * G), (1, G), (3, 0)]  # (groups, samples the step commits) per step; 0: discarded
    drawn_per_step = []
    for groups, advance in plan:
        ids = []
        for rank in range(groups):
            s = GlobalBatchSampler(SAMPLES, G, MICRO, 1, 0, membership=lambda r=rank, w=groups: (w, r, position["sample"]))
            it = iter(s)
            ids += [i for _ in range(s.accumulation_steps) for i in next(it)]
        drawn_per_step.append(ids)
        position["sample"] += G if advance else 0
    full = GlobalBatchSampler(SAMPLES, G, G, 1, 0)
    it = iter(full)
    first, second = next(it), next(it)
    assert sorted(drawn_per_step[0]) == sorted(first)
    assert sorted(drawn_per_step[1]) == sorted(second)
    assert sorted(drawn_per_step[2]) == sorted(next(it))  # the third step: the next slice, at any quorum size


def test_per_step_config_errors_name_key_value_and_fix(tmp_path, capsys):
    done = orch_here(capsys, "launch", "conf=cpu_elastic", "fault_tolerance.mode=per_step", "data.num_workers=2",
                     f"run.dir={tmp_path / 'r'}")
    if torchft_problem() is None:
        assert done.returncode == 2 and "data.num_workers=2" in done.stderr and "Fix:" in done.stderr
    else:
        assert done.returncode == 2 and "fault_tolerance.mode" in done.stderr and "orch[ft]" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
    bad = orch_here(capsys, "launch", "conf=cpu_elastic", "fault_tolerance.mode=sometimes", f"run.dir={tmp_path / 'r'}")
    assert bad.returncode == 2 and "fault_tolerance.mode='sometimes'" in bad.stderr and "per_step" in bad.stderr


@needs_torchft
def test_per_step_plan_gives_each_node_its_own_group_and_no_secret():
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.plan import build_plan

    cfg = compose_config("cpu_elastic", ["fault_tolerance.mode=per_step", "launcher=local"])
    plan = build_plan(cfg, "/tmp/x", "run1", store_port=1234)
    for node in plan.nodes:  # the quorum service is behind the run's gate, where the store is
        assert "--nnodes=1" in node.argv and node.env["ORCH_FT_QUORUM"] == plan.rendezvous_endpoint
    assert "ORCH_RUN_SECRET" not in plan.to_json()  # added by the controller when an agent starts
    assert "note:" not in plan.format_text()  # an elastic range: survivors go on alone


@needs_torchft
def test_per_step_dry_run_says_when_survivors_would_wait_for_a_replacement(tmp_path, capsys):
    fixed = orch_here(capsys, "launch", "conf=cpu_elastic", "cluster.nnodes=2", "fault_tolerance.mode=per_step",
                      "--dry-run", f"run.dir={tmp_path / 'r'}")
    assert fixed.returncode == 0, fixed.stderr
    assert "MIN = MAX = 2 nodes" in fixed.stdout and "cluster.nnodes=1:2" in fixed.stdout
    restart = orch_here(capsys, "launch", "conf=cpu_elastic", "cluster.nnodes=2", "--dry-run", f"run.dir={tmp_path / 'r'}")
    assert restart.returncode == 0 and "note:" not in restart.stdout


@needs_torchft
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_script_on_the_elastic_api_runs_per_step_unchanged(tmp_path):
    """examples/elastic_train.py (its own model, optimizer, DDP, LR schedule) as the entrypoint: two replica
    groups form one quorum, and the run's records come from one leader."""
    run_dir = tmp_path / "run"
    done = run_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=2", "fault_tolerance.mode=per_step",
                    "entrypoint.script=examples/elastic_train.py", "trainer.max_steps=60", "trainer.log_every=10",
                    f"run.dir={run_dir}", timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 60
    evs = read_jsonl(run_dir / "events.jsonl")
    assert max(e["replicas"] for e in evs if e["event"] == "quorum_changed") == 2
    assert len([e for e in evs if e["event"] == "training_finished"]) == 1
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 60, "one writer of metrics"
    # The records are the job's, as in restart mode: each logged loss is the global batch's (averaged across
    # the quorum's groups), so the same job in restart mode logs the same losses at the same steps.
    restart_dir = tmp_path / "restart"
    done = run_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=2",
                    "entrypoint.script=examples/elastic_train.py", "trainer.max_steps=60", "trainer.log_every=10",
                    f"run.dir={restart_dir}", timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    per_step = {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}
    restart = {m["step"]: m["loss"] for m in read_jsonl(restart_dir / "metrics.jsonl")}
    assert sorted(per_step) == sorted(restart) == list(range(10, 61, 10))
    assert per_step == pytest.approx(restart, rel=1e-4), (per_step, restart)
    assert s["final_loss"] == pytest.approx(summary(restart_dir)["final_loss"], rel=1e-4)
