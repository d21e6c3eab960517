"""Elastic sharded training through real launches (slow; issue 25's Done-when): ``conf=cpu_fsdp`` (FSDP2 over
gloo, DCP checkpoints) loses a node after its step-20 checkpoint, shrinks to one node and resumes from the DCP
shards; the same checkpoint resumes at three nodes; a killed launch resumes bit-exact at the same world size; a
preemption notice leads to an emergency DCP save that every rank commits.
The preset's model is shrunk (same architecture, fewer and narrower layers) so a step takes milliseconds."""

from __future__ import annotations

import json
import os

import pytest

from orchproc import preempt_midrun, read_jsonl, run_orch, summary
from test_resume import kill_launch_after_checkpoint, launch_losing_node_1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHARDED = ["conf=cpu_fsdp", "launcher=local", "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
           "model.num_heads=4", "model.ffn_size=256", "trainer.log_every=5"]


def events(run_dir, name):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def test_lost_node_shrinks_and_resumes_from_dcp_shards_then_the_checkpoint_resumes_at_three(tmp_path):
    url, run_dir = tmp_path / "ckpt", tmp_path / "elastic"
    # 40 steps after the step-20 checkpoint: the kill lands while the job still trains; step 20 is kept.
    args = [*SHARDED, "cluster.nnodes=1:2", "trainer.max_steps=60", "checkpoint.keep_last=10", f"checkpoint.url={url}",
            f"run.dir={run_dir}"]
    launch_losing_node_1(tmp_path, args, run_dir, min_step=20, wait_s=240, finish_s=300)
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 60 and s["world_size_history"][:2] == [2, 1]
    kill_t = events(run_dir, "chaos_kill")[0]["t"]
    loaded = [e for e in events(run_dir, "checkpoint_loaded") if e["t"] > kill_t]
    assert loaded and loaded[0]["world_size"] == 1 and loaded[0]["saved_world_size"] == 2
    assert loaded[0]["step"] >= 20
    step20 = os.listdir(url / "step_000000020")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"} <= set(step20)

    # The same step-20 checkpoint (saved by two FSDP2 ranks), resumed by three.
    again = tmp_path / "three"
    done = run_orch("launch", *SHARDED, "cluster.nnodes=3", "trainer.max_steps=22", f"checkpoint.url={url}",
                    "checkpoint.resume=20", f"run.dir={again}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = events(again, "checkpoint_loaded")
    assert [(e["step"], e["world_size"], e["saved_world_size"]) for e in loaded] == [(20, 3, 2)]
    assert summary(again)["steps_completed"] == 22


def test_killed_fsdp2_launch_resumes_bit_exact(tmp_path):
    common = [*SHARDED, "cluster.nnodes=2", "trainer.max_steps=20", "checkpoint.every_n_steps=5"]
    reference = tmp_path / "reference"
    done = run_orch("launch", *common, f"run.dir={reference}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed"
    last_committed = kill_launch_after_checkpoint(tmp_path, [*common, f"run.dir={resumed}"], resumed, min_step=10)
    again = run_orch("launch", *common, f"run.dir={resumed}", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    loaded = events(resumed, "checkpoint_loaded")
    assert len(loaded) == 1 and 10 <= loaded[0]["step"] == last_committed and loaded[0]["world_size"] == 2
    assert summary(resumed)["params_sha256"] == summary(reference)["params_sha256"]
    assert summary(resumed)["steps_completed"] == 20


def test_preemption_notice_leads_to_an_emergency_dcp_save_every_rank_commits(tmp_path):
    """A notice for node 1 of a 2-node FSDP2 job: every rank writes its shards of the emergency checkpoint
    (synchronous, committed before anyone leaves), and the next round resumes from exactly that step."""
    url = tmp_path / "ckpt"
    args = [*SHARDED, "cluster.nnodes=2", "trainer.max_steps=60", "checkpoint.every_n_steps=50",
            "checkpoint.keep_last=10", f"checkpoint.url={url}"]
    run_dir = preempt_midrun(tmp_path, args, lambda rd: run_orch("chaos", "preempt", str(rd), "--node", "1",
                                                                 timeout=60), min_step=15)
    emergency = events(run_dir, "emergency_checkpoint")
    assert len(emergency) == 1 and summary(run_dir)["steps_completed"] == 60
    step = emergency[0]["step"]
    stepdir = url / f"step_{step:09d}"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(stepdir))
    assert json.loads((stepdir / "manifest.json").read_text())["metadata"]["reason"] == "preemption"
    assert [e["step"] for e in events(run_dir, "checkpoint_loaded")][-1:] == [step]
