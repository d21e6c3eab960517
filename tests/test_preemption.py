"""Spot preemption: notices from every source lead to a coordinated emergency checkpoint and zero lost steps."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest

from metadata_servers import FakeMetadata
from orchestrator.preemption.sources import (AWSSpotSource, AzureScheduledEventsSource, ChaosFileSource,
                                             GCPPreemptedSource)
from orchproc import read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for

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


def preempt_midrun(tmp_path, args, deliver, min_step=15):
    run_dir = tmp_path / "run"
    proc = start_orch("launch", *args, f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        def training() -> bool:
            assert proc.poll() is None, (tmp_path / "orch.log").read_text()[-3000:]
            return any(m["step"] >= min_step for m in read_jsonl(run_dir / "metrics.jsonl"))

        wait_for(training, 120, "training")
        deliver(run_dir)
        assert proc.wait(timeout=200) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_to_an_agent_checkpoints_and_resumes_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    done = run_orch("launch", *JOB, f"run.dir={reference}")
    assert done.returncode == 0, done.stderr[-2000:]

    def sigterm_node1(run_dir):
        os.kill(json.loads((run_dir / "nodes.json").read_text())["1"], signal.SIGTERM)

    run_dir = preempt_midrun(tmp_path, JOB, sigterm_node1)
    s, events = assert_zero_lost_steps(run_dir, 160)
    notice = next(e for e in events if e["event"] == "preemption_notice")
    assert (notice["node"], notice["source"]) == (1, "sigterm")
    emergency = next(e for e in events if e["event"] == "emergency_checkpoint")
    assert emergency["step"] % 50 != 0 or emergency["step"] == notice["step"], "saved at the step the notice came"
    assert [e["node"] for e in events if e["event"] == "node_preempted"] == [1]
    # The launcher took the departed agent out of the rendezvous at once, not after its keep-alive expired.
    assert [e["node"] for e in events if e["event"] == "rendezvous_evicted"] == [1]
    assert not [e for e in events if e["event"] in ("node_failed", "node_lost")]
    assert s["world_size_history"] == [2] and s["preemptions"] == 1
    assert s["params_sha256"] == summary(reference)["params_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["aws", "gcp"])
def test_cloud_metadata_notice_triggers_the_same_path(tmp_path, kind):
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
    assert 0 <= s["goodput"]["lost_steps"] <= every
    counts = steps_trained(run_dir)
    assert sum(c - 1 for c in counts.values()) == s["goodput"]["lost_steps"]
