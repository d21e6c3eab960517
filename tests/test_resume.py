"""Checkpoint and resume through real launches (slow): exact resume, resume at another world size, S3; and bad
checkpoint URLs, refused before a launch starts anything (the CLI's main in this process)."""

from __future__ import annotations

import signal
from collections import defaultdict

import pytest
import torch

from orchestrator.processes import kill_tree
from orchestrator.checkpoint import CheckpointManager
from orchproc import orch_here, read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for

pytestmark = pytest.mark.timeout(300)

EXACT = ["conf=cpu_elastic", "launcher=local", "cluster.nnodes=2", "trainer.max_steps=150", "trainer.log_every=10"]


def saved_steps(run_dir):
    return [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint_saved"]


def kill_launch_after_checkpoint(tmp_path, args, run_dir, min_step):
    """Start a launch, wait for a committed checkpoint at >= min_step, then SIGKILL the whole launch tree.
    Returns the newest checkpoint committed when it died, read from storage: a save can commit its manifest in
    the instant before the kill and never get to write its checkpoint_saved event."""
    proc = start_orch("launch", *args, log=tmp_path / "killed.log")
    try:
        wait_for(lambda: any(s >= min_step for s in saved_steps(run_dir)), 120, f"checkpoint at step {min_step}")
        kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop_tree(proc.pid)
    url = next((a.split("=", 1)[1] for a in args if a.startswith("checkpoint.url=")), str(run_dir / "checkpoints"))
    return CheckpointManager(url).latest_valid_step()


def launch_losing_node_1(tmp_path, args, run_dir, min_step, wait_s=120, finish_s=200):
    """Launch ARGS, SIGKILL node 1 (agent and workers: ``orch chaos kill-node``) once a checkpoint at >= min_step
    is committed, and wait for the launch to succeed without it."""
    proc = start_orch("launch", *args, log=tmp_path / "elastic.log")
    try:
        wait_for(lambda: any(s >= min_step for s in saved_steps(run_dir)), wait_s, f"checkpoint at step {min_step}")
        kill = run_orch("chaos", "kill-node", str(run_dir), "--node", "1", timeout=30)
        assert kill.returncode == 0 and "killed node 1" in kill.stdout
        assert proc.wait(timeout=finish_s) == 0, (tmp_path / "elastic.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run dir of one uninterrupted launch of EXACT (checkpoints on local disk, torch's format): the weights
    every killed-and-resumed launch of EXACT must end with, wherever and however it checkpoints (a checkpoint's
    storage and format change what is written, not what is trained)."""
    reference = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = run_orch("launch", *EXACT, f"run.dir={reference}")
    assert done.returncode == 0, done.stderr[-3000:]
    return reference


def assert_resumes_exactly(tmp_path, reference, extra):
    resumed = tmp_path / "resumed"
    args = [*EXACT, *extra(resumed), f"run.dir={resumed}"]
    last_committed = kill_launch_after_checkpoint(tmp_path, args, resumed, min_step=10)
    assert summary(resumed)["status"] == "incomplete" if (resumed / "summary.json").exists() else True

    again = run_orch("launch", *args)  # the same command, launched again
    assert again.returncode == 0, again.stderr[-3000:]
    loaded = [e for e in read_jsonl(resumed / "events.jsonl") if e["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["step"] >= 10 and loaded[0]["step"] % 5 == 0
    assert loaded[0]["step"] == last_committed
    assert summary(resumed)["params_sha256"] == summary(reference)["params_sha256"]
    assert summary(resumed)["steps_completed"] == 150

@pytest.mark.slow
def test_killed_launch_resumes_bit_identical(tmp_path, uninterrupted):
    assert_resumes_exactly(tmp_path, uninterrupted, lambda run_dir: [])

@pytest.mark.slow
def test_killed_launch_resumes_bit_identical_from_s3_in_safetensors(tmp_path, s3_bucket, uninterrupted):
    """Object storage and the pickle-free format in one drill (each alone is covered by the fast tier), against
    the same uninterrupted local run as the test above."""
    assert_resumes_exactly(tmp_path, uninterrupted, lambda run_dir: [
        f"checkpoint.url=s3://{s3_bucket}/{run_dir.name}/ckpt", "checkpoint.format=safetensors"])
    manager = CheckpointManager(f"s3://{s3_bucket}/resumed/ckpt")
    steps = manager.list()
    assert steps and all(info.valid for info in steps) and steps[-1].step == 150
    assert {"model.safetensors", "model.json"} <= set(manager.storage.list_files("step_000000150"))

@pytest.mark.slow
def test_node_kill_resumes_at_smaller_world_with_every_sample_once(tmp_path):
    common = ["conf=cpu_elastic", "launcher=local", "trainer.max_steps=100", "trainer.log_every=5", "trainer.record_sample_ids=true",
              "data.dataset.num_samples=480"]  # 20 steps of 24 samples per epoch: 5 epochs
    reference = tmp_path / "reference"
    done = run_orch("launch", *common, "cluster.nnodes=2", f"run.dir={reference}")
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "elastic"
    launch_losing_node_1(tmp_path, [*common, "cluster.nnodes=1:2", f"run.dir={run_dir}"], run_dir, min_step=10)

    s = summary(run_dir)
    # Shrunk to 1 after the kill; the controller then fills node 1's slot again and the job grows back.
    assert s["status"] == "succeeded" and s["steps_completed"] == 100 and s["world_size_history"][:2] == [2, 1]
    events = read_jsonl(run_dir / "events.jsonl")
    kill_t = next(e["t"] for e in events if e["event"] == "chaos_kill")
    loaded = [e for e in events if e["event"] == "checkpoint_loaded" and e["t"] > kill_t]
    assert loaded and loaded[0]["world_size"] == 1 and loaded[0]["saved_world_size"] == 2
    assert loaded[0]["step"] >= max(e["step"] for e in events if e["event"] == "checkpoint_saved" and e["t"] < kill_t)

    # The lineage that produced the final model: for each step, the records of its latest attempt. An attempt
    # is a rendezvous round (restart counts differ between a survivor and a node that joined later).
    rounds = sorted(e["t"] for e in events if e["event"] == "rendezvous_complete")
    records = [r for rank in (0, 1) for r in read_jsonl(run_dir / "samples" / f"rank{rank}.jsonl")]
    for r in records:
        r["attempt"] = sum(1 for t in rounds if t <= r["t"])
    latest = defaultdict(int)
    for r in records:
        latest[r["step"]] = max(latest[r["step"]], r["attempt"])
    ids_by_step = defaultdict(list)
    for r in records:
        if r["attempt"] == latest[r["step"]]:
            ids_by_step[r["step"]] += r["ids"]
    assert sorted(ids_by_step) == list(range(1, 101))
    assert all(len(ids) == 24 for ids in ids_by_step.values()), "the global batch stays 24 at every world size"
    for epoch in range(5):
        seen = sorted(i for step in range(epoch * 20 + 1, epoch * 20 + 21) for i in ids_by_step[step])
        assert seen == list(range(480)), f"epoch {epoch}: every sample exactly once"
    assert abs(s["final_loss"] - summary(reference)["final_loss"]) < 0.1 * summary(reference)["final_loss"]

@pytest.mark.slow
def test_accumulation_equivalence_across_world_sizes(tmp_path):
    """world 1 x accumulation 2 and world 2 x accumulation 1 train on the same samples to the same weights."""
    models = []
    for nodes in (1, 2):
        run_dir = tmp_path / f"w{nodes}"
        result = run_orch("launch", "conf=cpu_gloo", "launcher=local", "trainer.max_steps=10", f"cluster.nnodes={nodes}",
                          f"run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        models.append(CheckpointManager(str(run_dir / "checkpoints")).load().state["model"])
    assert models[0].keys() == models[1].keys()
    for key in models[0]:
        torch.testing.assert_close(models[0][key], models[1][key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("url, words", [
    ("foo://bucket/x", "unknown filesystem scheme"),
    ("s3://no-such-bucket-orch/x", "bucket"),
])
def test_bad_checkpoint_url_exits_2_before_training(tmp_path, s3_env, capsys, url, words):
    run_dir = tmp_path / "run"
    result = orch_here(capsys, "launch", "conf=cpu_gloo", "launcher=local", f"checkpoint.url={url}", f"run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert "checkpoint.url" in result.stderr and words in result.stderr and "Fix:" in result.stderr
    assert not run_dir.exists()

@pytest.mark.slow
def test_model_that_does_not_fit_the_checkpoint_is_refused_with_its_keys(tmp_path):
    """One node: loading a checkpoint into a model of another shape fails the same on every rank."""
    run_dir = tmp_path / "run"
    first = run_orch("launch", "conf=cpu_gloo", "launcher=local", "cluster.nnodes=1", "trainer.max_steps=4",
                     f"run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_orch("launch", "conf=cpu_gloo", "launcher=local", "cluster.nnodes=1", "trainer.max_steps=8",
                     "model.hidden_size=32", "cluster.max_restarts=0", f"run.dir={run_dir}")
    assert again.returncode == 1
    assert "does not fit the model" in again.stderr and "shape changed (" in again.stderr and "embedding_norm.weight (64,)->(32,)" in again.stderr
