"""Efficiency from metrics, `orch report` on a real run with a recovery, the launch summary's extra lines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.report.summary import format_summary
from orchestrator.report import efficiency as eff
from orchproc import orch_here, read_jsonl, run_orch, start_orch, stop_tree, summary, wait_for


def _record(t: float, step: int, step_time_s: float, world_size: int, restart_count: int = 0, **timing) -> dict:
    """A metrics.jsonl record as the trainer writes it for global batch 16."""
    record = {"t": t, "step": step, "loss": 5.0, "world_size": world_size, "restart_count": restart_count,
              "step_time_s": step_time_s, "samples_per_s": 16 / step_time_s}
    if timing:
        record["timing"] = timing
    return record


# An elastic run: world size 2, then (after a restart) world size 1; logged every 5 steps.
ELASTIC = [
    _record(1.0, 5, 0.100, 2),   # first window of the attempt: start-up, never counted
    _record(2.0, 10, 0.050, 2),  # 5 steps x 0.05 s = 0.25 s, 80 samples
    _record(3.0, 15, 0.040, 2),  # 0.20 s, 80 samples
    _record(4.0, 20, 0.020, 2),  # 0.10 s, 80 samples
    _record(9.0, 25, 0.500, 1, restart_count=1),  # first window after the restart: not counted
    _record(10.0, 30, 0.050, 1, restart_count=1),  # 0.25 s, 80 samples
    _record(11.0, 35, 0.050, 1, restart_count=1),  # 0.25 s, 80 samples
]


@pytest.mark.timeout(30)
def test_throughput_and_efficiency_equal_the_hand_computation():
    by_size = eff.throughput_by_world_size(ELASTIC)
    assert by_size[2] == pytest.approx(240 / 0.55)  # 436.36 samples/s
    assert by_size[1] == pytest.approx(160 / 0.50)  # 320 samples/s
    efficiency = eff.efficiency_by_world_size(by_size)
    assert efficiency[2] == pytest.approx((240 / 0.55) / (2 * 320))  # 0.6818
    assert efficiency[1] == pytest.approx(1.0)
    # warm-up: windows starting within 5 steps after the first logged step (5, resp. 25) are left out too
    assert eff.throughput_by_world_size(ELASTIC, warmup_steps=5) == pytest.approx({2: 160 / 0.30, 1: 80 / 0.25})
    assert eff.scaling_efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert eff.scaling_efficiency(300.0, 4, 200.0, baseline_world_size=2) == pytest.approx(0.75)
    run = eff.run_efficiency(ELASTIC)
    assert run["scaling_efficiency"] == {"baseline_world_size": 1, "by_world_size": pytest.approx({"1": 1.0, "2": 0.681818})}


@pytest.mark.timeout(30)
def test_summary_keeps_the_final_loss_when_a_later_group_finishes_without_one(tmp_path):
    """per_step: every finishing group records training_finished; one that never logged a step has no loss."""
    from orchestrator.report.summary import build_summary
    t = time.time()
    events = [{"t": t, "event": "launch_started"},
              {"t": t + 1, "event": "training_finished", "steps_completed": 400, "final_loss": 3.6116},
              {"t": t + 2, "event": "training_finished", "steps_completed": 400, "final_loss": None},
              {"t": t + 3, "event": "run_finished", "status": "succeeded"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    s = build_summary(tmp_path)
    assert s["final_loss"] == 3.6116 and s["steps_completed"] == 400


@pytest.mark.timeout(30)
def test_nodes_that_leave_on_orch_stops_notice_are_no_preemptions(tmp_path):
    from orchestrator.report.summary import build_summary
    t = time.time()
    events = [{"t": t, "event": "launch_started"},
              {"t": t + 1, "event": "node_preempted", "node": 1, "exit_code": 75, "reason": "a notice"},
              {"t": t + 2, "event": "stop_requested"},
              {"t": t + 3, "event": "node_preempted", "node": 0, "exit_code": 75, "reason": "orch stop"},
              {"t": t + 3, "event": "node_preempted", "node": 1, "exit_code": 75, "reason": "orch stop"},
              {"t": t + 4, "event": "run_finished", "status": "stopped"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert build_summary(tmp_path)["preemptions"] == 1


@pytest.mark.timeout(30)
def test_step_time_breakdown_is_the_step_weighted_mean():
    metrics = [
        _record(1.0, 2, 0.1, 2, data_s=0.1, compute_s=0.0, comm_s=0.0, optimizer_s=0.0, checkpoint_s=0.0, other_s=0.0),
        _record(2.0, 4, 0.010, 2, data_s=0.001, compute_s=0.005, comm_s=0.002, optimizer_s=0.001, checkpoint_s=0.0,
                other_s=0.001),  # 2 steps
        _record(3.0, 10, 0.020, 2, data_s=0.001, compute_s=0.011, comm_s=0.006, optimizer_s=0.001, checkpoint_s=0.0,
                other_s=0.001),  # 6 steps
    ]
    b = eff.step_time_breakdown(metrics)
    assert b["step_time_s"] == pytest.approx((2 * 0.010 + 6 * 0.020) / 8)
    assert b["comm_s"] == pytest.approx((2 * 0.002 + 6 * 0.006) / 8)
    assert b["comm_fraction"] == pytest.approx(0.005 / 0.0175)
    assert eff.step_time_breakdown([_record(1.0, 5, 0.1, 1), _record(2.0, 10, 0.1, 1)]) is None, "no timing records"


@pytest.mark.timeout(30)
def test_launch_summary_prints_step_time_efficiency_recoveries_and_goodput():
    s = {"status": "succeeded", "steps_completed": 80, "first_loss": 6.0, "final_loss": 4.5, "world_size_history": [2, 1],
         "samples_per_s": 150.0, "wall_s": 50.0, "recoveries": [{"mttr_s": 12.5}],
         "goodput": {"goodput": 0.42, "badput": {"launch_s": 8.0, "lost_s": 0.0}},
         "scaling_efficiency": {"baseline_world_size": 1, "by_world_size": {"1": 1.0, "2": 0.68}},
         "step_time": {"step_time_s": 0.040, "data_s": 0.002, "compute_s": 0.030, "comm_s": 0.004, "optimizer_s": 0.002,
                       "checkpoint_s": 0.0, "other_s": 0.002, "comm_inflight_s": 0.004, "comm_fraction": 0.1}}
    text = format_summary(s, "/runs/x")
    lines = text.splitlines()
    assert lines[0].startswith("run succeeded: 80 steps") and lines[-1] == "run dir: /runs/x"
    assert "step time 40.0 ms: compute 75%, comm 10%" in text
    assert "scaling efficiency 0.68 at world size 2 (against world size 1 in this run)" in text
    assert "recoveries 1: MTTR 12.5 s" in text
    assert "goodput 42.0% (badput: launch 8.0 s)" in text


def _assert_png_with_content(path: Path) -> None:
    from PIL import Image

    assert path.exists(), path
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width >= 400 and img.height >= 150, (path, img.size)
        pixels = img.convert("L")
        low, high = pixels.getextrema()
        assert high - low > 100, f"{path.name}: nearly uniform image"
        colors = img.convert("RGB").getcolors(maxcolors=100_000)
        assert colors is None or len(colors) > 20, f"{path.name}: only {len(colors)} colours: no real content"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_of_a_real_run_with_a_lost_node(tmp_path):
    """nnodes=1:2, node 1 killed at step 10: report.md, report.json and real plots, recovery and markers in them."""
    run_dir = tmp_path / "run"
    proc = start_orch("launch", "conf=cpu_elastic", "launcher=local", "cluster.nnodes=1:2", "trainer.max_steps=40", "trainer.log_every=2",
                      f"run.dir={run_dir}", log=tmp_path / "orch.log")
    try:
        wait_for(lambda: any(m["step"] >= 10 for m in read_jsonl(run_dir / "metrics.jsonl")), 120, "step 10")
        result = run_orch("chaos", "kill-node", str(run_dir), "--node", "1")
        assert result.returncode == 0, result.stderr
        assert proc.wait(timeout=200) == 0, (tmp_path / "orch.log").read_text()[-3000:]
    finally:
        stop_tree(proc.pid)
    launch_out = (tmp_path / "orch.log").read_text()
    assert "step time" in launch_out and "scaling efficiency" in launch_out
    s = summary(run_dir)
    assert s["world_size_history"] == [2, 1]
    has_recoveries = "recoveries" in s  # summary.json's recoveries come with the Ray controller's work
    assert not has_recoveries or "recoveries 1: MTTR" in launch_out

    result = run_orch("report", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert set(report["throughput"]["by_world_size"]) == {"1", "2"}
    assert report["efficiency"]["baseline"]["world_size"] == 1 and report["efficiency"]["by_world_size"]["2"] > 0
    assert [c["world_size"] for c in report["world_size_changes"]] == [2, 1]
    if has_recoveries:
        assert len(report["recoveries"]) == 1 and report["recoveries"][0]["mttr_s"] > 0
    kinds = {m["kind"] for m in report["markers"]}
    assert {"checkpoint", "node lost"} <= kinds
    assert report["step_time_by_world_size"]["2"]["comm_s"] > 0
    md = (run_dir / "report.md").read_text()
    for text in ("# Run report: cpu_elastic", "## Step time", "## World size changes", "| 2 |", "chaos_kill node 1",
                 "node_lost node 1", "![loss and throughput over time](loss_throughput.png)",
                 *(["## Recoveries"] if has_recoveries else [])):
        assert text in md, text
    assert {"loss_throughput.png", "step_time.png", "throughput_vs_world_size.png"} <= set(report["plots"])
    for name in report["plots"]:
        _assert_png_with_content(run_dir / name)

    # --baseline: efficiency against another run's smallest world size (here the same run's world size 1)
    result = run_orch("report", str(run_dir), "--baseline", str(run_dir))
    assert result.returncode == 0 and "(against world size 1 of" in result.stdout, result.stderr[-2000:]


@pytest.mark.timeout(60)
def test_report_of_a_bench_scaling_dir_plots_throughput_against_world_size(tmp_path, capsys):
    rows = [{"world_size": 1, "samples_per_s": 500.0, "efficiency": 1.0, "comm_fraction": 0.02},
            {"world_size": 2, "samples_per_s": 800.0, "efficiency": 0.8, "comm_fraction": 0.2}]
    (tmp_path / "scaling.json").write_text(json.dumps({"preset": "cpu_gloo", "rows": rows, "warning": None}))
    result = orch_here(capsys, "report", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| 2 | 800.0 | 0.80 | 0.200 |" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["kind"] == "scaling"
    _assert_png_with_content(tmp_path / "throughput_vs_world_size.png")


@pytest.mark.timeout(60)
def test_report_names_the_plots_it_could_not_draw_and_why(tmp_path, capsys, monkeypatch):
    from orchestrator.events import LaunchStarted, RunFinished
    from orchestrator.report import report
    from orchestrator.rundir import EventLog, append_jsonl

    events = EventLog(str(tmp_path))
    events.write(LaunchStarted(preset="cpu_gloo", run_id="r", launcher="local", nodes=1, rendezvous_endpoint=None))
    for step in (2, 4):
        append_jsonl(tmp_path / "metrics.jsonl", {"t": time.time(), "step": step, "loss": 5.0 - step, "lr": 1e-3,
                                                   "world_size": 1, "samples_per_s": 10.0, "step_time_s": 0.1})
    events.write(RunFinished(status="succeeded", attempts=1, node_exit_codes={"0": 0}))
    done = orch_here(capsys, "report", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "not drawn: throughput_vs_world_size.png: the run trained at one world size only" in done.stdout
    assert "not drawn: loss_throughput.png" not in done.stdout
    _assert_png_with_content(tmp_path / "loss_by_step.png")
    assert "![loss by step](loss_by_step.png)" in (tmp_path / "report.md").read_text()
    assert "throughput_vs_world_size.png not drawn: the run trained at one world size only" in (
        tmp_path / "report.md").read_text()
    monkeypatch.setattr(report, "plots_available", lambda: False)
    done = orch_here(capsys, "report", str(tmp_path))
    assert "written: " in done.stdout and "not drawn: loss_throughput.png: matplotlib is not installed" in done.stdout


@pytest.mark.timeout(60)
def test_report_refuses_a_directory_that_is_not_a_run_dir(tmp_path, capsys):
    result = orch_here(capsys, "report", str(tmp_path))
    assert result.returncode == 2 and "no events.jsonl" in result.stderr
