"""`orch bench overhead --mode per_step`: both modes alternate on each job, the ratio is per_step's median over
restart's, and the JSON and the printout carry per_step_over_restart_throughput (runs stubbed here: the real
ones are launches, measured in docs/benchmarks.md)."""

from __future__ import annotations

import json

from orchestrator.bench import overhead_modes
from orchestrator.cli import build_parser


def test_modes_alternate_and_the_ratio_is_per_steps_median_over_restarts(tmp_path, monkeypatch, capsys):
    order: list[tuple[str, str]] = []
    speed = {"restart": iter([100.0, 110.0, 90.0]), "per_step": iter([99.0, 97.0, 100.0])}

    def run(job, mode, run_dir, log):
        order.append((job.name, mode))
        return {"samples_per_s": next(speed[mode]) if job.name == "cpu_elastic" else (2.0 if mode == "restart" else 1.9),
                "step_time_s": 0.1, "timing_s": {}, "quorum_wait_s_per_step": 0.001 if mode == "per_step" else None,
                "loadavg_1m": 1.0, "wall_s": 1.0, "final_loss": 3.5}

    monkeypatch.setattr(overhead_modes, "run_mode", run)
    out = tmp_path / "modes.json"
    result = overhead_modes.main_modes_overhead(str(out), repeats=3, steps=30, large_steps=6, large_repeats=2)
    assert order[:6] == [("cpu_elastic", "restart"), ("cpu_elastic", "per_step"), ("cpu_elastic", "per_step"),
                         ("cpu_elastic", "restart"), ("cpu_elastic", "restart"), ("cpu_elastic", "per_step")]
    assert order[6:] == [("large", "restart"), ("large", "per_step"), ("large", "per_step"), ("large", "restart")]
    # Pairs (run i of each mode, back to back): 99/100, 97/110, 100/90; their median is 0.99.
    assert result["cpu_elastic"]["paired_ratios"] == [0.99, 97 / 110, 100 / 90]
    assert result["per_step_over_restart_throughput"] == 0.99
    assert result["cpu_elastic"]["ratio_of_medians"] == 99.0 / 100.0  # medians: 99 of (99, 97, 100), 100
    assert result["per_step_over_restart_throughput_large"] == 1.9 / 2.0
    assert result["model_params"]["large"] > 50_000_000 > result["model_params"]["cpu_elastic"]
    data = json.loads(out.read_text())
    assert data["per_step_over_restart_throughput"] == result["per_step_over_restart_throughput"]
    assert len(data["cpu_elastic"]["runs"]["per_step"]) == 3 and "loadavg_before" in data
    printed = capsys.readouterr().out
    assert "per_step_over_restart_throughput         0.990" in printed and "load average" in printed


def test_the_command_takes_mode_per_step():
    args = build_parser().parse_args(["bench", "overhead", "--mode", "per_step", "--out", "f.json"])
    assert args.mode == "per_step" and args.out == "f.json" and args.large_steps == 24
    assert build_parser().parse_args(["bench", "overhead"]).mode == "restart"
