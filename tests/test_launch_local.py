"""Real launches through the CLI: torchrun agents over gloo on this machine, as a user runs them."""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import time

import pytest

from orchproc import ORCH, REPO, orch_env, read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAST = ["trainer.max_steps=12", "trainer.log_every=2"]
LOCAL = "launcher=local"  # what this file tests; the presets default to the Ray launcher


def test_cpu_gloo_trains_two_nodes_and_writes_the_run_dir(tmp_path):
    """A foreground launch as a user runs it, through a pipe: its first line within 1 s of the command, and
    summary.json's wall_s (and goodput) covering the command's own wall time, start-up included."""
    run_dir = tmp_path / "run"
    began = time.monotonic()
    proc = subprocess.Popen([*ORCH, "launch", "conf=cpu_gloo", LOCAL, f"run.dir={run_dir}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=orch_env(), cwd=REPO)
    try:
        spoke = select.select([proc.stdout], [], [], 1.0)[0]
        first_s = time.monotonic() - began
        stdout, stderr = proc.communicate(timeout=200)
        command_s = time.monotonic() - began
    finally:
        stop_tree(proc.pid)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert spoke and stdout.startswith("[orch] launch conf=cpu_gloo: "), (first_s, stdout[:200])
    s = summary(run_dir)
    assert s["wall_s"] >= 0.9 * command_s, (s["wall_s"], command_s)
    assert s["goodput"]["wall_s"] == pytest.approx(s["wall_s"]) and s["goodput"]["badput"]["launch_s"] > 0
    assert s["status"] == "succeeded" and s["steps_completed"] == 40
    assert s["world_size_history"] == [2]
    assert s["final_loss"] < s["first_loss"] - 0.5, "the loss should fall visibly"
    assert re.fullmatch(r"[0-9a-f]{64}", s["params_sha256"]) and s["wall_s"] > 0
    for name in ("config.yaml", "plan.json", "events.jsonl", "metrics.jsonl", "logs/node0.log", "logs/node1.log"):
        assert (run_dir / name).exists(), name
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert events[0] == "launch_started" and events[-1] == "run_finished"
    assert "rendezvous_complete" in events
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert {"step", "loss", "lr", "world_size", "samples_per_s", "step_time_s"} <= set(metrics[0])
    assert metrics[-1]["step"] == 40 and all(m["world_size"] == 2 for m in metrics)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert len(plan["nodes"]) == 2 and "is_host=false" in plan["rendezvous_conf"]
    assert "[node0-local0]:[rank0] step 40/40" in (run_dir / "logs/node0.log").read_text()
    # streamed live with one short prefix: node and rank (the node log keeps torchrun's own)
    assert re.search(r"^\[node[01] rank0\] step 40/40 loss ", result.stdout, re.M), result.stdout[-2000:]
    assert "[node1-local0]:" not in result.stdout and "[node0] [node0-local0]" not in result.stdout
    assert "run succeeded" in result.stdout


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_flags_reach_ddp_unused_branch(tmp_path, find_unused):
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", LOCAL, *FAST, "cluster.nnodes=1", "cluster.nproc_per_node=2",
                      "cluster.max_restarts=0", "model._target_=testmodels.UnusedBranchMLM",
                      f"ddp.find_unused_parameters={str(find_unused).lower()}", f"run.dir={run_dir}")
    if find_unused:
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(run_dir)["steps_completed"] == 12
    else:
        assert result.returncode == 1
        assert re.search(r"root cause rank \d \(node 0\): RuntimeError: Expected to have finished reduction",
                         result.stderr), result.stderr[-2000:]
        assert summary(run_dir)["status"] == "failed"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_runs_on_cpu(tmp_path, dtype):
    """One node: autocast and the GradScaler are each rank's own (DDP over two nodes is the first test's)."""
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", LOCAL, *FAST, "cluster.nnodes=1", "amp.enabled=true",
                      f"amp.dtype={dtype}", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["step"] == 12
    # fp16 runs through a GradScaler (its scale is logged); bf16 needs none.
    assert ("grad_scale" in metrics[-1]) == (dtype == "fp16")


def test_user_script_entrypoint_runs_under_the_plans_torchrun(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_orch("launch", "conf=cpu_gloo", LOCAL, "entrypoint.script=tests/scripts/user_train.py",
                      f"entrypoint.args=[{out}]", f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(s["env"]["WORLD_SIZE"] == "2" and s["rank_sum"] == 1.0 for s in seen)
    assert {s["env"]["RANK"] for s in seen} == {"0", "1"}
    assert seen[0]["env"]["TORCHELASTIC_RUN_ID"].startswith("cpu-gloo-")


def test_user_code_failure_exhausts_max_failures_and_names_the_root_cause_rank(tmp_path):
    """The same budget as under launcher=ray (test_ray_launch.py): one restart of every node, then exit 1
    naming the budget and the root-cause rank."""
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", LOCAL, *FAST, "cluster.max_restarts=0", "model._target_=testmodels.FailingMLM",
                      "+model.fail_rank=1", "failure.max_failures=1", f"run.dir={run_dir}")
    assert result.returncode == 1
    error = result.stderr.strip().splitlines()[-1]
    assert "failure.max_failures=1" in error and "root cause rank 1" in error
    assert "ValueError: deliberate bug in user code" in error
    s = summary(run_dir)
    assert s["status"] == "failed" and s["root_cause"]["rank"] == 1
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["scope"] for e in events if e["event"] == "restart" and "scope" in e] == ["every node"]
    assert len({e["rdzv_id"] for e in events if e["event"] == "node_joined"}) == 2, "the restart used a fresh rendezvous"
    # The root cause names orch's node (whose log holds the traceback), not torchrun's group rank.
    assert "deliberate bug in user code" in (run_dir / "logs" / f"node{s['root_cause']['node']}.log").read_text()


def test_killing_a_simulated_node_leaves_store_and_survivor_alive(tmp_path):
    """nnodes=1:2: kill node 1's whole process tree mid-run; node 0 re-rendezvouses at world size 1 and goes on,
    then the controller fills node 1's slot again (as the Ray launcher grows back onto a machine) and the job
    grows back to 2."""
    run_dir = tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", LOCAL, "cluster.nnodes=1:2", "trainer.max_steps=400",
                      "trainer.log_every=5", f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        wait_for(lambda: any(m["step"] >= 10 for m in read_jsonl(run_dir / "metrics.jsonl")), 90, "step 10")
        nodes = json.loads((run_dir / "nodes.json").read_text())
        from orchestrator.processes import kill_tree

        killed = kill_tree(nodes["1"])
        assert len(killed) >= 2, "the agent and its worker"
        assert proc.wait(timeout=180) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    s = summary(run_dir)
    assert s["status"] == "succeeded" and s["steps_completed"] == 400
    assert s["world_size_history"] == [2, 1, 2]
    events = read_jsonl(run_dir / "events.jsonl")
    lost = next(e for e in events if e["event"] == "node_lost")
    assert lost["node"] == 1
    after = [e for e in events if e["t"] > lost["t"]]
    assert any(e["event"] == "rendezvous_complete" and e["world_size"] == 1 for e in after)
    recovered = next(e for e in after if e["event"] == "recovered")
    replaced = next(e for e in after if e["event"] == "node_started" and e["node"] == 1)
    assert replaced["replacement"] and replaced["t"] > recovered["t"], "growth waits until the survivors step again"
    assert {e["node"] for e in after if e["event"] == "node_finished"} == {0, 1}


def test_a_script_that_fails_the_same_way_every_time_stops_after_the_second_failure(tmp_path):
    """failure.max_failures=5 would allow five restarts; the second identical failure ends the run, naming it."""
    script = tmp_path / "broken.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise KeyError('no column \"label\" in batch')\n")
    run_dir = tmp_path / "run"
    result = run_orch("launch", "conf=cpu_gloo", LOCAL, f"entrypoint.script={script}", "cluster.max_restarts=0",
                      "failure.max_failures=5", f"run.dir={run_dir}")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "the same failure on two attempts in a row" in error and "KeyError: 'no column \"label\" in batch'" in error
    events = read_jsonl(run_dir / "events.jsonl")
    assert len([e for e in events if e["event"] == "restart"]) == 1
    [stopped] = [e for e in events if e["event"] == "deterministic_failure"]
    assert stopped["node"] == 1 and stopped["attempts"] == 2
