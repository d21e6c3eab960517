"""``orch report RUN_DIR [--baseline RUN_DIR]``: report.md, report.json and PNG plots, in the run dir.

Everything is rebuilt from the run dir's events.jsonl and metrics.jsonl (the latest launch), so a report
can be made after a crash, or again later. A run dir of ``orch bench scaling`` (one holding
``scaling.json``) gets the throughput-against-world-size report instead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import UserError
from orchestrator.report import efficiency as eff
from orchestrator.rundir import EVENTS_FILE, EventName, METRICS_FILE, check_events, read_jsonl
from orchestrator.report.goodput import launch_start
from orchestrator.report.summary import build_summary
from orchestrator.rundir import latest_launch

REPORT_MD, REPORT_JSON, SCALING_FILE = "report.md", "report.json", "scaling.json"
# Events drawn as vertical lines on the timeline, by marker kind.
MARKER_EVENTS = {
    EventName.CHECKPOINT_SAVED: "checkpoint",
    EventName.PREEMPTION_NOTICE: "preemption", EventName.NODE_PREEMPTED: "preemption", EventName.CHAOS_PREEMPT: "preemption",
    EventName.NODE_LOST: "node lost", EventName.CHAOS_KILL: "node lost",
    EventName.RESTART: "restart",
}


def launch_records(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The latest launch's events and metrics (what summary.json describes)."""
    events = latest_launch(read_jsonl(run_dir / EVENTS_FILE))
    start = events[0]["t"] if events else None
    return events, [m for m in read_jsonl(run_dir / METRICS_FILE) if start is None or m["t"] >= start]


def markers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"t", "kind", "label"}`` for every event worth a line on the timeline."""
    out = []
    for e in events:
        kind = MARKER_EVENTS.get(e["event"])
        if kind:
            detail = f"step {e['step']}" if "step" in e else f"node {e['node']}" if "node" in e else ""
            out.append({"t": e["t"], "kind": kind, "event": e["event"], "label": f"{e['event']} {detail}".strip()})
    return out


def world_size_changes(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """``(t, world_size)`` of every rendezvous that changed the world size (the first one included)."""
    changes: list[tuple[float, int]] = []
    for e in events:
        if e["event"] == EventName.RENDEZVOUS_COMPLETE and (not changes or changes[-1][1] != e["world_size"]):
            changes.append((e["t"], e["world_size"]))
    return changes


def baseline_throughput(baseline_dir: Path, warmup_steps: int) -> dict[str, Any]:
    """The baseline run's smallest world size and its steady samples/s."""
    _, metrics = launch_records(baseline_dir)
    by_size = eff.throughput_by_world_size(metrics, warmup_steps)
    if not by_size:
        raise UserError(f"--baseline {baseline_dir}: no steady-state throughput in its metrics.jsonl (no metrics, or "
                        f"too few logged steps after warm-up). Fix: give the run dir of a finished built-in-trainer run")
    size = min(by_size)
    return {"run_dir": str(baseline_dir), "world_size": size, "samples_per_s": by_size[size]}


def build_report(run_dir: str | Path, baseline: Optional[str | Path] = None, warmup_steps: int = 0) -> dict[str, Any]:
    """The report of a launch's run dir as a dict (what report.json holds, less the plot list)."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / EVENTS_FILE).exists():
        raise UserError(f"{run_dir}: no {EVENTS_FILE}, so not a run dir of orch launch. Fix: give the directory "
                        "`orch launch` printed as `run dir: ...` (or an `orch bench scaling` directory)")
    check_events(run_dir / EVENTS_FILE)
    events, metrics = launch_records(run_dir)
    summary = build_summary(run_dir)
    by_size = eff.throughput_by_world_size(metrics, warmup_steps)
    report: dict[str, Any] = {
        "kind": "run", "run_dir": str(run_dir), "generated_t": time.time(), "warmup_steps": warmup_steps,
        "summary": summary,
        "throughput": {"samples_per_s": eff.throughput(eff.steady_windows(metrics, warmup_steps)),
                       "by_world_size": {str(k): v for k, v in by_size.items()}},
        "step_time": eff.step_time_breakdown(metrics, warmup_steps),
        "step_time_by_world_size": {str(s): b for s in by_size
                                    if (b := eff.step_time_breakdown([m for m in metrics if m["world_size"] == s],
                                                                     warmup_steps))},
        "world_size_changes": [{"t": t, "world_size": w} for t, w in world_size_changes(events)],
        "markers": markers(events),
        "recoveries": summary.get("recoveries") or [],
        "goodput": summary.get("goodput"),
        "efficiency": None,
    }
    if baseline is not None:
        base = baseline_throughput(Path(baseline).resolve(), warmup_steps)
        report["efficiency"] = {
            "baseline": base,
            "by_world_size": {str(s): eff.scaling_efficiency(v, s, base["samples_per_s"], base["world_size"])
                              for s, v in by_size.items()}}
    elif summary.get("scaling_efficiency"):
        se = summary["scaling_efficiency"]
        report["efficiency"] = {"baseline": {"run_dir": str(run_dir), "world_size": se["baseline_world_size"],
                                             "samples_per_s": by_size.get(se["baseline_world_size"])},
                                "by_world_size": se["by_world_size"]}
    return report


def plots_available() -> bool:
    """matplotlib is a dev dependency of orch: without it the report is written without plots."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib)"
RUN_PLOTS = ("loss_by_step.png", "loss_throughput.png", "step_time.png", "throughput_vs_world_size.png", "goodput.png")


def attempt_gaps(report: dict[str, Any]) -> list[tuple[float, float, str]]:
    """Goodput's gaps between attempts (a restart's, a preemption's, a failure's), as ``(start_t, end_t, cause)``
    in unix seconds; the first attempt's start-up (cause ``launch``) too."""
    goodput = report.get("goodput") or {}
    start = report.get("launch_t")
    if not goodput.get("attempts") or start is None:
        return []
    return [(start + a["at_s"], start + a["at_s"] + a["gap_s"], a["cause"]) for a in goodput["attempts"]
            if a.get("gap_s", 0) > 0]


def write_plots(report: dict[str, Any], run_dir: Path, metrics: list[dict[str, Any]], t0: float) -> list[str]:
    """Draw every plot the report has data for; returns the file names written. The others are named in
    ``report["plots_skipped"]`` (``{file: why}``)."""
    from orchestrator.report import plots

    if not plots_available():
        report["plots_skipped"] = {name: NO_MATPLOTLIB for name in RUN_PLOTS}
        return []
    written = []
    report["plots_skipped"] = skipped = {}
    if not metrics:
        skipped["loss_throughput.png"] = "no metrics records in metrics.jsonl"
    if not any(m.get("loss") is not None for m in metrics):
        skipped["loss_by_step.png"] = "no loss in metrics.jsonl"
    else:
        plots.plot_loss_by_step(metrics, run_dir / "loss_by_step.png")
        written.append("loss_by_step.png")
    if not report["step_time_by_world_size"]:
        skipped["step_time.png"] = "no step-time breakdown recorded (the built-in trainer and the elastic API record it)"
    if len(report["throughput"]["by_world_size"]) <= 1:
        skipped["throughput_vs_world_size.png"] = "the run trained at one world size only"
    if not report.get("goodput"):
        skipped["goodput.png"] = "no goodput (the run has no run_finished event)"
    if metrics:
        changes = [(c["t"], c["world_size"]) for c in report["world_size_changes"]]
        plots.plot_timeline(metrics, report["markers"], changes, t0, run_dir / "loss_throughput.png",
                            report["recoveries"], attempt_gaps(report))
        written.append("loss_throughput.png")
    if report["step_time_by_world_size"]:
        plots.plot_step_breakdown({int(k): v for k, v in report["step_time_by_world_size"].items()},
                                  run_dir / "step_time.png")
        written.append("step_time.png")
    if len(report["throughput"]["by_world_size"]) > 1:
        eff_by = (report["efficiency"] or {}).get("by_world_size", {})
        rows = [{"world_size": int(k), "samples_per_s": v, "efficiency": eff_by.get(k)}
                for k, v in report["throughput"]["by_world_size"].items()]
        plots.plot_scaling(rows, run_dir / "throughput_vs_world_size.png")
        written.append("throughput_vs_world_size.png")
    if report.get("goodput"):
        plots.plot_goodput(report["goodput"], run_dir / "goodput.png")
        written.append("goodput.png")
    return written


def write_report(run_dir: str | Path, baseline: Optional[str | Path] = None, warmup_steps: int = 0) -> dict[str, Any]:
    """Write report.md, report.json and the plots into ``run_dir``; returns the report (with ``files``)."""
    run_dir = Path(run_dir).resolve()
    if (run_dir / SCALING_FILE).exists() and not (run_dir / EVENTS_FILE).exists():
        return write_scaling_report(run_dir)
    report = build_report(run_dir, baseline, warmup_steps)
    events, metrics = launch_records(run_dir)
    report["launch_t"] = launch_start(events)  # the command's start: goodput's attempts count from it, plots too
    t0 = report["launch_t"] or (events[0]["t"] if events else (metrics[0]["t"] if metrics else 0.0))
    report["plots"] = write_plots(report, run_dir, metrics, t0)
    return _write(run_dir, report, format_markdown(report, t0))


def write_scaling_report(bench_dir: Path) -> dict[str, Any]:
    """The report of an ``orch bench scaling`` directory: its rows as a table and a plot."""
    from orchestrator.report import plots

    scaling = json.loads((bench_dir / SCALING_FILE).read_text())
    report = {"kind": "scaling", "run_dir": str(bench_dir), "generated_t": time.time(), **scaling, "plots": []}
    if not plots_available():
        report["plots_skipped"] = {"throughput_vs_world_size.png": NO_MATPLOTLIB}
    elif scaling.get("rows"):
        plots.plot_scaling(scaling["rows"], bench_dir / "throughput_vs_world_size.png")
        report["plots"] = ["throughput_vs_world_size.png"]
    return _write(bench_dir, report, format_scaling_markdown(report))


def _write(run_dir: Path, report: dict[str, Any], markdown: str) -> dict[str, Any]:
    if report.get("plots_skipped"):
        markdown += "\n" + "".join(f"_{name} not drawn: {why}_  \n" for name, why in report["plots_skipped"].items())
    (run_dir / REPORT_JSON).write_text(json.dumps(report, indent=2, default=str) + "\n")
    (run_dir / REPORT_MD).write_text(markdown)
    report["files"] = [str(run_dir / name) for name in (REPORT_MD, REPORT_JSON, *report["plots"])]
    return report


# -- markdown ---------------------------------------------------------------------------------------------
def _num(value: Optional[float], fmt: str = ".1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def format_markdown(report: dict[str, Any], t0: float) -> str:
    s = report["summary"]
    lines = [f"# Run report: {s.get('preset') or 'run'}", "", f"Run dir: `{report['run_dir']}`", "",
             "| | |", "|---|---|",
             f"| status | {s['status']} |",
             f"| steps | {s['steps_completed']} |",
             f"| loss | {_num(s.get('first_loss'), '.4f')} -> {_num(s.get('final_loss'), '.4f')} |",
             f"| wall time | {_num(s.get('wall_s'), '.1f', ' s')} |",
             f"| world size | {' -> '.join(map(str, s['world_size_history'])) or 'n/a'} |",
             f"| throughput (steady) | {_num(report['throughput']['samples_per_s'], '.1f', ' samples/s')} |"]
    if s.get("goodput"):
        lines.append(f"| goodput | {s['goodput']['goodput']:.1%} |")
    if report["recoveries"]:
        mttrs = ", ".join(f"{r['mttr_s']:.1f} s" for r in report["recoveries"])
        lines.append(f"| recoveries | {len(report['recoveries'])}, MTTR {mttrs} |")
    plots = set(report["plots"])
    if "loss_by_step.png" in plots:
        lines += ["", "## Loss by step", "", "![loss by step](loss_by_step.png)", "",
                  "Raw (light) and smoothed loss against the optimizer step; vertical lines where a restart or a "
                  "world size change began."]
    if "loss_throughput.png" in plots:
        lines += ["", "## Loss and throughput", "", "![loss and throughput over time](loss_throughput.png)", "",
                  "Seconds since the launch command started. Shaded grey and named: the gaps between attempts "
                  "(launch, failure, preemption, restart); orange: recoveries (loss to first step after it). "
                  "Vertical lines: preemptions (red, dashed), lost nodes (orange), worker restarts (purple); "
                  "green ticks: checkpoints; the grey step line is the world size."]
    lines += _throughput_section(report)
    lines += _step_time_section(report)
    lines += _events_section(report, t0)
    if report.get("goodput"):
        g = report["goodput"]
        lines += ["", "## Goodput", "", f"Goodput {g['goodput']:.1%}: {g['productive_s']:.1f} s of productive steps in "
                  f"{g['wall_s']:.1f} s of wall time; {g.get('lost_steps', 0)} step(s) trained twice.", "",
                  "| badput | seconds |", "|---|---:|"]
        lines += [f"| {k.removesuffix('_s')} | {v:.2f} |" for k, v in (g.get("badput") or {}).items()]
        if "goodput.png" in plots:
            lines += ["", "![goodput breakdown](goodput.png)"]
    return "\n".join(lines) + "\n"


def _throughput_section(report: dict[str, Any]) -> list[str]:
    by_size = report["throughput"]["by_world_size"]
    if not by_size:
        return []
    effs = (report["efficiency"] or {}).get("by_world_size", {})
    warmup = f" and the {report['warmup_steps']} steps after it" if report["warmup_steps"] else ""
    lines = ["", "## Throughput", "", f"Steady state: each attempt's first logged window{warmup} left out.", "",
             "| world size | samples/s | scaling efficiency |", "|---:|---:|---:|"]
    lines += [f"| {k} | {v:.1f} | {_num(effs.get(k), '.2f')} |" for k, v in by_size.items()]
    if report["efficiency"]:
        base = report["efficiency"]["baseline"]
        lines += ["", f"Efficiency = throughput(N) / (N / B x throughput(B)), baseline B = world size {base['world_size']} "
                  f"at {_num(base['samples_per_s'])} samples/s from `{base['run_dir']}`."]
    if "throughput_vs_world_size.png" in report["plots"]:
        lines += ["", "![throughput against world size](throughput_vs_world_size.png)"]
    return lines


def _step_time_section(report: dict[str, Any]) -> list[str]:
    by_size = report["step_time_by_world_size"]
    if not by_size:
        return []
    sizes = list(by_size)
    lines = ["", "## Step time", "", "Mean milliseconds per step (share of the step); comm is all-reduce time not "
             "hidden behind backward compute (see docs/reports.md).", "",
             "| phase | " + " | ".join(f"world {s}" for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for phase in (*eff.BREAKDOWN, "comm_inflight"):
        key = f"{phase}_s"
        if any(key in b for b in by_size.values()):
            cells = [f"{1e3 * b[key]:.2f} ({b[key] / b['step_time_s']:.0%})" if key in b else "n/a"
                     for b in by_size.values()]
            lines.append(f"| {phase.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{1e3 * b['step_time_s']:.2f}**" for b in by_size.values()) + " |")
    if "step_time.png" in report["plots"]:
        lines += ["", "![step time breakdown](step_time.png)"]
    return lines


def _events_section(report: dict[str, Any], t0: float) -> list[str]:
    lines = []
    if len(report["world_size_changes"]) > 1:
        lines += ["", "## World size changes", "", "| at (s) | world size |", "|---:|---:|"]
        lines += [f"| {c['t'] - t0:.1f} | {c['world_size']} |" for c in report["world_size_changes"]]
    if report["recoveries"]:
        lines += ["", "## Recoveries", "", "| cause | node | at (s) | MTTR (s) | resumed at step | world size |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.get('cause')} | {r.get('node')} | {r['lost_t'] - t0:.1f} | {r['mttr_s']:.2f} | {r.get('step')} "
                  f"| {r.get('world_size')} |" for r in report["recoveries"]]
    notable = [m for m in report["markers"] if m["kind"] != "checkpoint"]
    checkpoints = [m for m in report["markers"] if m["kind"] == "checkpoint"]
    if notable or checkpoints:
        lines += ["", "## Events", ""]
        if checkpoints:
            steps = [m["label"].split(" ", 1)[-1] for m in checkpoints]
            shown = ", ".join(steps if len(steps) <= 6 else [*steps[:3], "...", *steps[-2:]])
            lines.append(f"- {len(checkpoints)} checkpoint(s) saved: {shown}")
        lines += [f"- {m['t'] - t0:.1f} s: {m['label']}" for m in notable]
    return lines


def format_scaling_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Scaling: {report.get('preset', '')}", "", f"Directory: `{report['run_dir']}`", ""]
    if report.get("warning"):
        lines += [f"> **Warning:** {report['warning']}", ""]
    lines += ["| world size | samples/s | efficiency | comm fraction |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['world_size']} | {_num(r['samples_per_s'])} | {_num(r.get('efficiency'), '.2f')} | "
              f"{_num(r.get('comm_fraction'), '.3f')} |" for r in report.get("rows", [])]
    if report["plots"]:
        lines += ["", "![throughput against world size](throughput_vs_world_size.png)"]
    return "\n".join(lines) + "\n"
