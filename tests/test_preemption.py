"""Spot preemption: notices from every source lead to a coordinated emergency checkpoint and zero lost steps;
torchrun restarting the workers (a scale-up) is no notice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from metadata_servers import FakeMetadata
from orchestrator.preemption import deliver_notice
from orchestrator.preemption.sources import (AWSSpotSource, AzureScheduledEventsSource, ChaosFileSource,
                                             GCPPreemptedSource)
from orchestrator.preemption.watcher import RESTART_MESSAGE
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, NODES_FILE, EventName
from orchproc import orch_env, preempt_midrun, read_jsonl, run_orch, summary, wait_for

JOB = ["conf=cpu_elastic", "launcher=local", "cluster.nnodes=2", "trainer.max_steps=160", "trainer.log_every=1",
       "checkpoint.every_n_steps=50"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind, source", [("aws", AWSSpotSource), ("gcp", None), ("azure", AzureScheduledEventsSource)])
def test_sources_speak_each_clouds_protocol(kind, source):
    with FakeMetadata(kind) as fake:
        url = fake.url.replace("{node}", "3")
        poller = GCPPreemptedSource(url, wait_s=1) if kind == "gcp" else source(url)
        assert poller.poll() is None
        fake.arm(3)
        notice = poller.poll()
        assert notice is not None and notice.source == kind
        assert poller.poll() is None  # announced once


@pytest.mark.timeout(30)
def test_chaos_source_reads_only_its_own_agents_notice(tmp_path):
    (tmp_path / "notices").mkdir()
    source = ChaosFileSource(str(tmp_path), node=1)
    (tmp_path / "notices" / "node1-999999.json").write_text(json.dumps({"t": 1.0, "grace_s": 5}))
    assert source.poll() is None  # another agent's notice (a node this one replaced)
    (tmp_path / "notices" / f"node1-{os.getppid()}.json").write_text(json.dumps({"t": 1.0, "grace_s": 5}))
    assert source.poll().source == "chaos"


def steps_trained(run_dir):
    return Counter(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl"))


def assert_zero_lost_steps(run_dir, max_steps):
    counts = steps_trained(run_dir)
    assert sorted(counts) == list(range(1, max_steps + 1)) and set(counts.values()) == {1}, "no step trained twice"
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["goodput"]["lost_steps"] == 0
    events = read_jsonl(run_dir / "events.jsonl")
    emergency = [e["step"] for e in events if e["event"] == "emergency_checkpoint"]
    loaded = [e["step"] for e in events if e["event"] == "checkpoint_loaded"]
    assert emergency and loaded[-len(emergency):] == emergency, "each resume starts at the emergency checkpoint"
    return s, events


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_notice_to_an_agent_checkpoints_and_resumes_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    done = run_orch("launch", *JOB, f"run.dir={reference}")
    assert done.returncode == 0, done.stderr[-2000:]

    def sigterm_node1(run_dir):
        # What orch does when it is evicted, for one node: announce the SIGTERM in the notice file, then send it.
        agent = json.loads((run_dir / NODES_FILE).read_text())["1"]
        deliver_notice(run_dir, 1, agent, 30.0, source="sigterm", detail="test")
        os.kill(agent, signal.SIGTERM)

    run_dir = preempt_midrun(tmp_path, JOB, sigterm_node1)
    s, events = assert_zero_lost_steps(run_dir, 160)
    notice = next(e for e in events if e["event"] == "preemption_notice")
    assert (notice["node"], notice["source"]) == (1, "sigterm")
    emergency = next(e for e in events if e["event"] == "emergency_checkpoint")
    assert emergency["step"] % 50 != 0 or emergency["step"] == notice["step"], "saved at the step the notice came"
    assert [e["node"] for e in events if e["event"] == "node_preempted"] == [1]
    # The launcher takes the departed agent out of the rendezvous at once, not after its keep-alive expired,
    # unless the agent's own orderly exit took it out first (seen on a loaded machine): never another node.
    assert [e["node"] for e in events if e["event"] == "rendezvous_evicted"] in ([], [1])
    assert not [e for e in events if e["event"] in ("node_failed", "node_lost")]
    assert s["world_size_history"] == [2] and s["preemptions"] == 1
    assert s["params_sha256"] == summary(reference)["params_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cloud_metadata_notice_triggers_the_same_path(tmp_path, kind="aws"):
    """A cloud's notice (AWS's IMDSv2 here) leads to the same drain as a SIGTERM. One provider end to end: each
    provider's poller reads its own fake metadata server above, and every source hands over the same notice."""
    with FakeMetadata(kind) as fake:
        args = [*JOB, f"preemption.sources=[sigterm,{kind}]", f"preemption.{kind}_endpoint='{fake.url}'",
                "preemption.poll_interval_s=0.5"]
        run_dir = preempt_midrun(tmp_path, args, lambda run_dir: fake.arm(0))
        assert fake.served == ["node0"]
    s, events = assert_zero_lost_steps(run_dir, 160)
    notice = next(e for e in events if e["event"] == "preemption_notice")
    assert (notice["node"], notice["source"]) == (0, kind)
    assert [e["node"] for e in events if e["event"] == "node_preempted"] == [0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_scheduled_preemptions_complete(tmp_path):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=2", "trainer.max_steps=600", "trainer.log_every=1",
                      "preemption.schedule.every_s=8", "preemption.schedule.max_count=3",
                      "preemption.schedule.grace_s=20", f"run.dir={run_dir}", timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    s, events = assert_zero_lost_steps(run_dir, 600)
    assert s["preemptions"] == 3 and sum(e["event"] == "chaos_preempt" for e in events) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hard_kill_without_notice_loses_at_most_every_n_steps(tmp_path):
    every = 5
    run_dir = tmp_path / "run"
    args = ["conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2", "trainer.max_steps=200", "trainer.log_every=1",
            f"checkpoint.every_n_steps={every}"]
    run_dir = preempt_midrun(tmp_path, args, lambda rd: run_orch("chaos", "kill-node", str(rd), "--node", "1"))
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 200
    # Each restart resumes from the newest periodic save: the kill, and the growth back to two nodes once the
    # controller refilled node 1's slot (torchrun restarts the survivors' workers for it), lose at most
    # every_n_steps each.
    restarts = sum(1 for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint_loaded")
    assert 1 <= restarts <= 2 and 0 <= s["goodput"]["lost_steps"] <= every * restarts
    counts = steps_trained(run_dir)
    assert sum(c - 1 for c in counts.values()) == s["goodput"]["lost_steps"]


SECRET = "scale-up-test-secret"


def start_agent(node, log: Path) -> subprocess.Popen:
    """One node's torchrun agent as the controller starts it (the plan's argv and env, torchrun behind orch's
    agent module with the run's secret), outside any launcher."""
    return subprocess.Popen(list(node.argv), env=orch_env({**node.env, "ORCH_RUN_SECRET": SECRET}), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_scale_up_restart_is_no_notice(tmp_path):
    """torchrun SIGTERMs the workers it restarts when a third node joins: under the plan's env they leave at once,
    with no preemption_notice and no emergency checkpoint, and the bigger round resumes from a periodic save.
    Runs the plan's torchrun agents against a RendezvousStore directly, so no launcher decides anything."""
    from orchestrator.config.compose import compose_config
    from orchestrator.launch import write_config
    from orchestrator.plan.plan import build_plan
    from orchestrator.preflight import run_leases
    from orchestrator.processes import terminate_tree
    from orchestrator.rendezvous import RendezvousStore

    run_dir = tmp_path / "run"
    cfg = compose_config("cpu_elastic", ["launcher=local", "cluster.nnodes=2:3", "trainer.max_steps=100000",
                                         "checkpoint.every_n_steps=5", f"run.dir={run_dir}"])
    write_config(cfg, str(run_dir))
    leases = run_leases(cfg, "scale-up", SECRET).acquire()  # as a launcher holds them: the workers' saves check
    store = RendezvousStore("127.0.0.1", 0, secret=SECRET)
    plan = build_plan(cfg, str(run_dir), "scale-up", store_port=store.port)
    agents: dict[int, subprocess.Popen] = {}

    def events() -> list[dict]:
        return read_jsonl(run_dir / EVENTS_FILE)

    def alive() -> None:
        for node, proc in agents.items():
            assert proc.poll() is None, (tmp_path / f"node{node}.log").read_text()[-3000:]

    try:
        for node in (0, 1):
            agents[node] = start_agent(plan.nodes[node], tmp_path / f"node{node}.log")
        # Past a periodic checkpoint at world size 2, so the bigger round has one to resume from.
        wait_for(lambda: alive() or any(m["step"] >= 7 and m["world_size"] == 2
                                        for m in read_jsonl(run_dir / METRICS_FILE)), 240, "training on 2 nodes")
        joined_t = events()[-1]["t"]
        agents[2] = start_agent(plan.nodes[2], tmp_path / "node2.log")
        wait_for(lambda: alive() or any(e["event"] == EventName.FIRST_STEP and e["world_size"] == 3
                                        for e in events()), 240, "the first step at world size 3")
        seen = events()
        assert not [e for e in seen if e["event"] in (EventName.PREEMPTION_NOTICE, EventName.EMERGENCY_CHECKPOINT,
                                                      EventName.WORKER_FAILED)], seen
        loaded = [e for e in seen if e["event"] == EventName.CHECKPOINT_LOADED and e["t"] > joined_t]
        assert loaded and loaded[-1]["step"] % 5 == 0, "the bigger round resumed from a periodic checkpoint"
        for node in (0, 1):  # the first round's workers said why they left (torchrun's --tee echoes their stderr)
            log = (tmp_path / f"node{node}.log").read_text()
            assert RESTART_MESSAGE.decode().strip() in log, log[-3000:]
        assert not (run_dir / "notices").exists()
    finally:
        for proc in agents.values():
            terminate_tree(proc.pid, grace_s=10)
        store.close()
        leases.release()
