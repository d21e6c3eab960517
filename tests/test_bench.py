"""`orch bench scaling` and `orch bench overhead`: they run and write what they promise (numbers: docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from orchestrator.bench import overhead, scaling
from orchestrator.errors import UserError
from orchproc import run_orch


@pytest.mark.timeout(30)
def test_world_sizes_and_overrides_are_parsed():
    assert scaling.split_bench_args(["conf=cpu_gloo", "world_sizes=[2,1,2]", "trainer.max_steps=9"]) == (
        "cpu_gloo", [1, 2], ["trainer.max_steps=9"])
    assert scaling.parse_world_sizes("1,4") == [1, 4]
    for bad in ("[0,1]", "[a]", "[]"):
        with pytest.raises(UserError, match="world_sizes="):
            scaling.parse_world_sizes(bad)
    with pytest.raises(UserError, match="world_sizes"):
        scaling.split_bench_args(["conf=cpu_gloo"])
    assert scaling.shape_overrides(4, 2) == ["cluster.nnodes=2", "cluster.nproc_per_node=2"]
    assert scaling.shape_overrides(3, 2) == ["cluster.nnodes=3", "cluster.nproc_per_node=1"]


@pytest.mark.timeout(30)
def test_warning_when_the_machine_has_fewer_cores_than_workers():
    assert scaling.core_warning([1, 2], "cpu", cores=2) is None
    assert "2 CPU core(s) but world size 4 runs 4 worker processes" in scaling.core_warning([1, 4], "cpu", cores=2)
    assert scaling.core_warning([1, 16], "cuda", cores=2) is None


@pytest.mark.timeout(30)
def test_overhead_throughput_is_per_window_after_warmup():
    marks = {5: 0.0, 10: 0.5, 20: 1.0, 25: 2.0, 30: 2.25}
    assert overhead.window_throughputs(marks, 16, warmup_steps=10) == pytest.approx([320.0, 80.0, 320.0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_scaling_runs_and_comm_fraction_tracks_world_size(tmp_path):
    out = tmp_path / "scaling.json"
    result = run_orch("bench", "scaling", "conf=cpu_gloo", "world_sizes=[2]", "trainer.max_steps=30",
                      f"--run-root={tmp_path / 'runs'}", f"--out={out}", timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "world_size  samples_per_s efficiency comm_fraction" in result.stdout
    rows = {r["world_size"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {1, 2} and not rows[1]["requested"], "world size 1 always runs, as the baseline"
    assert rows[1]["efficiency"] == 1.0 and rows[2]["efficiency"] > 0
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["samples_per_s"] / (2 * rows[1]["samples_per_s"]))
    assert all(r["steps_measured"] == 20 for r in rows.values()), "steps 1-10 are warm-up"
    # World size 1 has nothing to exchange (DDP still all-reduces with itself: a copy); world size 2 does.
    assert rows[1]["comm_fraction"] < 0.1, rows[1]
    assert rows[2]["comm_fraction"] > 0.03 and rows[2]["comm_fraction"] > rows[1]["comm_fraction"], rows
    assert (tmp_path / "runs" / "scaling.json").exists() and rows[2]["run_dirs"] == [str(tmp_path / "runs" / "ws2")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_overhead_runs_plain_torchrun_and_orch(tmp_path):
    out = tmp_path / "overhead.json"
    result = run_orch("bench", "overhead", "--repeats=1", "--steps=30", "--timing-steps=40", f"--out={out}", timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["throughput_ratio"] > 0 and data["first_step_ratio"] > 0
    assert data["plain"]["samples_per_s"] > 0 and data["orch"]["samples_per_s"] > 0
    assert 0 < data["timing_overhead"] < 0.05 and data["buckets"] >= 1
    assert "throughput_ratio (orch / plain)" in result.stdout


@pytest.mark.timeout(30)
def test_goodput_per_step_runs_both_modes_on_the_elastic_job_and_reports_time_to_train(monkeypatch, tmp_path, capsys):
    """A scripted ``run_job``: which launches the comparison asks for, and the ratios it derives from them."""
    from orchestrator.bench import goodput

    launches = []

    def fake_run_job(run_dir, max_steps, overrides):
        launches.append((run_dir.name, overrides))
        preempted = run_dir.name == "preempted"
        return {"goodput": {"goodput": 0.9 if preempted else 0.95, "lost_steps": 0, "badput": {"quorum_wait_s": 1.0}},
                "preemptions": 3 if preempted else 0, "wall_s": 200.0 if preempted else 180.0,
                "_survivor_pauses": [0.1, 0.2, 0.05, 0.25] if preempted else []}

    monkeypatch.setattr(goodput, "run_job", fake_run_job)
    out = tmp_path / "goodput.json"
    both = goodput.main_goodput_bench(str(out), every_s=60, max_steps=100, mode="per_step")
    assert [name for name, _ in launches] == ["no-preemption", "preempted"] * 2
    for (_, overrides), mode in zip(launches, ["restart", "restart", "per_step", "per_step"]):
        assert overrides[:2] == ["cluster.nnodes=1:2", f"fault_tolerance.mode={mode}"]
    assert json.loads(out.read_text()) == both and set(both) == {"restart", "per_step"}
    r = both["per_step"]
    assert r["ratio"] == pytest.approx(0.9 / 0.95) and r["time_to_train_ratio"] == pytest.approx(180 / 200)
    assert r["overrides"] == [*goodput.JOB, "cluster.nnodes=1:2", "fault_tolerance.mode=per_step"]
    assert r["survivor_pause_per_preemption_s"] == pytest.approx(0.6 / 3) and "survivor_pause_per_preemption_s" not in both["restart"]
    printed = capsys.readouterr().out
    assert "time-to-train ratio" in printed and "pause per preemption: 0.2 s" in printed


def test_survivor_pauses_are_the_excess_of_the_windows_where_the_quorum_changed():
    """Records every 5 steps; a step takes 0.1 s at world 2, 0.2 s at world 1. A group leaves: step 17 is the
    first of the quorum of one (window 15..20: 1 step at world 2 and 4 at world 1, 0.3 s more than that); it
    joins again: step 32 is the first of the quorum of two (window 30..35: 0.5 s more)."""
    from orchestrator.bench.goodput import survivor_pauses

    at = [(5, 0.5, 2), (10, 1.0, 2), (15, 1.5, 2), (20, 2.7, 1), (25, 3.7, 1), (30, 4.7, 1), (35, 5.8, 2),
          (40, 6.3, 2), (45, 6.8, 2), (50, 7.3, 2)]
    metrics = [{"t": t, "step": step, "world_size": world} for step, t, world in at]
    events = [{"event": "quorum_changed", "t": 0.1, "step": 1, "replicas": 2, "previous": None, "world_size": 2},
              {"event": "quorum_changed", "t": 2.2, "step": 17, "replicas": 1, "previous": 2, "world_size": 1},
              {"event": "quorum_changed", "t": 5.2, "step": 32, "replicas": 2, "previous": 1, "world_size": 2}]
    assert survivor_pauses(events, metrics) == pytest.approx([0.3, 0.5])



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_memory_halves_the_state_per_rank_at_world_2(tmp_path):
    """ddp and fsdp2 side by side on conf=cpu_gloo's tiny model, at world size 2 only (each run is a spawn)."""
    out = tmp_path / "memory.json"
    result = run_orch("bench", "memory", "--preset=cpu_gloo", "--world-sizes=2", "--steps=2", f"--out={out}",
                      timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {(r["world_size"], r["strategy"]) for r in data["rows"]} == {(2, "ddp"), (2, "fsdp2")}
    for row in data["rows"]:
        assert row["state_bytes"] > 0 and row["peak_rss_bytes"] > row["state_bytes"] and row["samples_per_s"] > 0
    ddp = next(r for r in data["rows"] if r["strategy"] == "ddp")
    assert ddp["state_bytes"] >= 16 * ddp["params"]  # fp32 parameters, gradients and AdamW's two moments
    assert data["fsdp2_over_ddp_state_bytes_per_rank"]["2"] <= 0.6 and data["targets_met"] == {"2": True}
    assert data["fsdp2_over_ddp_peak_rss_per_rank"]["2"] > 0  # recorded (a tiny model's is ~1)
    assert "fsdp2/ddp state per rank at world 2" in result.stdout and "met" in result.stdout
