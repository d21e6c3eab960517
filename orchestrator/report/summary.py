"""``summary.json``: the outcome of a run, rebuilt from its events.jsonl and metrics.jsonl alone.

Because it is derived, a summary can be rebuilt after the launcher itself crashed (``orch report``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from orchestrator.report.goodput import compute_goodput
from orchestrator.report.efficiency import run_efficiency
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, latest_launch, read_jsonl



def root_cause(events: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The earliest failure: a lost node before any worker error (the survivors' errors are its echo), else
    the first worker exception (duplicates grouped), else the first agent that failed."""
    failures = [e for e in events if e["event"] == "worker_failed"]
    lost = [e for e in events if e["event"] == "node_lost"]
    if lost and (not failures or min(e["t"] for e in lost) < min(e["t"] for e in failures)):
        first = min(lost, key=lambda e: e["t"])
        return {"rank": None, "node": first.get("node"), "error": f"node {first.get('node')} lost: {first.get('reason')}"}
    if failures:
        first = min(failures, key=lambda e: e["t"])
        same = [e["rank"] for e in failures if e.get("error") == first.get("error")]
        return {"rank": first["rank"], "node": first.get("node"), "error": first.get("error"),
                "also_failed_ranks": sorted(set(same) - {first["rank"]})}
    exits = [e for e in events if e["event"] in ("node_failed", "node_lost")]
    if exits:
        first = min(exits, key=lambda e: e["t"])
        return {"rank": None, "node": first.get("node"), "error": first.get("reason")}
    return None


def world_size_history(events: list[dict[str, Any]]) -> list[int]:
    """World sizes of successive rendezvous rounds, consecutive repeats collapsed: [2, 1, 2] = shrink, grow."""
    history: list[int] = []
    for e in events:
        if e["event"] == "rendezvous_complete" and (not history or history[-1] != e["world_size"]):
            history.append(e["world_size"])
    return history


LOSS_EVENTS = ("chaos_kill", "node_lost", "chaos_partition")  # chaos_partition: orch testcluster partition
STEP_EVENTS = ("recovered", "first_step")


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each loss (a chaos kill or a lost node) paired with the first completed training step after it.

    ``mttr_s`` = that step's time - the loss's time. A loss that happens before the job recovered from an
    earlier one belongs to the same recovery, timed from the earlier one.
    """
    found: list[dict[str, Any]] = []
    lost: Optional[dict[str, Any]] = None
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] in LOSS_EVENTS and lost is None:
            lost = e
        elif e["event"] in STEP_EVENTS and lost is not None:
            found.append({"cause": lost["event"], "node": lost.get("node"), "lost_t": lost["t"],
                          "recovered_t": e["t"], "mttr_s": round(e["t"] - lost["t"], 3),
                          "step": e.get("step"), "world_size": e.get("world_size")})
            lost = None
    return found


def build_summary(run_dir: str | Path) -> dict[str, Any]:
    """Summarize the latest launch in ``run_dir`` from its append-only files."""
    run_dir = Path(run_dir)
    events = latest_launch(read_jsonl(run_dir / EVENTS_FILE))
    start = events[0]["t"] if events else None
    metrics = [m for m in read_jsonl(run_dir / METRICS_FILE) if start is None or m["t"] >= start]
    finished = next((e for e in reversed(events) if e["event"] == "training_finished"), {})
    run_finished = next((e for e in reversed(events) if e["event"] == "run_finished"), None)
    status = run_finished["status"] if run_finished else "incomplete"
    summary = {
        "status": status,
        "preset": events[0].get("preset") if events else None,
        "steps_completed": finished.get("steps_completed", metrics[-1]["step"] if metrics else 0),
        "final_loss": finished.get("final_loss", metrics[-1]["loss"] if metrics else None),
        "first_loss": metrics[0]["loss"] if metrics else None,
        "world_size_history": world_size_history(events),
        "recoveries": recoveries(events),
        "wall_s": (run_finished["t"] - start) if run_finished and start else None,
        "params_sha256": finished.get("params_sha256"),
        "restarts": sum(1 for e in events if e["event"] == "restart"),
        "preemptions": sum(1 for e in events if e["event"] == "node_preempted"),
        "goodput": compute_goodput(events, metrics),
        "nodes_lost": sum(1 for e in events if e["event"] == "node_lost"),
        "samples_per_s": (sum(m["samples_per_s"] for m in metrics) / len(metrics)) if metrics else None,
        **run_efficiency(metrics),  # throughput_by_world_size, scaling_efficiency, step_time
    }
    if status != "succeeded":
        summary["root_cause"] = root_cause(events)
        if run_finished and run_finished.get("reason"):
            summary["failure_reason"] = run_finished["reason"]  # the controller's own account (budgets, MIN)
    return summary


def write_summary(run_dir: str | Path) -> dict[str, Any]:
    summary = build_summary(run_dir)
    (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
