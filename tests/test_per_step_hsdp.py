"""per_step with hsdp (issue 25 item 4): each node is a replica group sharded inside (FSDP2 over its two ranks),
the quorum is the replicate dimension; a killed group's survivors go on without restarting and the returning
group heals shard by shard from a live one, reading no checkpoint."""

from __future__ import annotations

import pytest

from orchestrator.ft import torchft_problem
from orchestrator.rundir import read_jsonl
from orchproc import orch_here, start_orch, stop_tree, summary
from test_per_step import kill_second_group

needs_torchft = pytest.mark.skipif(torchft_problem() is not None, reason=str(torchft_problem()))

HSDP = ["conf=cpu_elastic", "fault_tolerance.mode=per_step", "parallelism.strategy=hsdp", "cluster.nproc_per_node=2",
        "cluster.nnodes=1:2", "trainer.global_batch_size=16"]  # 16 = micro 4 x 2 or 4 ranks x accumulation


@needs_torchft
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_hsdp_group_leaves_its_peer_training_and_returns_healed_shard_by_shard(tmp_path):
    run_dir = tmp_path / "run"
    steps = 500  # the survivor trains alone (~4 steps/s here) while the replacement starts (~30 s)
    proc = start_orch("launch", *HSDP, "launcher=local", f"trainer.max_steps={steps}", "trainer.log_every=1",
                      "checkpoint.every_n_steps=50", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        killed = kill_second_group(run_dir, after_step=20)
        assert proc.wait(timeout=300) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)

    evs = read_jsonl(run_dir / "events.jsonl")
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == steps
    # The survivor never restarted and nothing was read from storage (periodic DCP checkpoints were there).
    assert not [e for e in evs if e["event"] in ("restart", "checkpoint_loaded")]
    assert [e for e in evs if e["event"] == "checkpoint_saved"]
    shrink = next(e for e in evs if e["event"] == "quorum_changed" and e["t"] > killed)
    assert shrink["replicas"] == 1 and shrink["world_size"] == 2 and shrink["t"] - killed < 15, shrink
    # The returning group's rank 0 got rank 0's shards of the live group: the same bytes, no checkpoint read.
    h = next(e for e in evs if e["event"] == "replica_healed" and e["t"] > killed)
    assert h["node"] == 1 and h["source_node"] == 0 and h["checkpoint_read"] is False and h["step"] > 20
    assert h["params_sha256"] == h["source_params_sha256"]
    grown = next(e for e in evs if e["event"] == "quorum_changed" and e["t"] > h["t"])
    assert grown["replicas"] == 2 and grown["world_size"] == 4 and grown["step"] == h["step"] + 1
    finished = next(e for e in evs if e["event"] == "training_finished")
    assert finished["world_size"] == 4


def test_per_step_refuses_a_strategy_whose_groups_cannot_heal_shard_by_shard(tmp_path, capsys):
    done = orch_here(capsys, "launch", *HSDP[:1], "fault_tolerance.mode=per_step", "parallelism.strategy=fsdp2",
                     "--dry-run", f"run.dir={tmp_path / 'r'}")
    if torchft_problem() is None:
        assert done.returncode == 2 and "parallelism.strategy='fsdp2'" in done.stderr
        assert "Fix: use parallelism.strategy=hsdp" in done.stderr
    else:
        assert done.returncode == 2 and "orch[ft]" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
