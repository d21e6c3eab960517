"""``summary.json``: the outcome of a run, rebuilt from its events.jsonl and metrics.jsonl alone.

Because it is derived, a summary can be rebuilt after the launcher itself crashed (``orch report``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from orchestrator.report.goodput import compute_goodput, launch_start
from orchestrator.report.efficiency import run_efficiency
from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, EventName, latest_launch, read_jsonl



def root_cause(events: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The earliest failure: a lost node before any worker error (the survivors' errors are its echo), else
    the first worker exception (duplicates grouped), else the first agent that failed."""
    failures = [e for e in events if e["event"] == EventName.WORKER_FAILED]
    lost = [e for e in events if e["event"] == EventName.NODE_LOST]
    if lost and (not failures or min(e["t"] for e in lost) < min(e["t"] for e in failures)):
        first = min(lost, key=lambda e: e["t"])
        return {"rank": None, "node": first.get("node"), "error": f"node {first.get('node')} lost: {first.get('reason')}"}
    if failures:
        first = min(failures, key=lambda e: e["t"])
        same = [e["rank"] for e in failures if e.get("error") == first.get("error")]
        return {"rank": first["rank"], "node": first.get("node"), "error": first.get("error"),
                "also_failed_ranks": sorted(set(same) - {first["rank"]})}
    exits = [e for e in events if e["event"] in (EventName.NODE_FAILED, EventName.NODE_LOST)]
    if exits:
        first = min(exits, key=lambda e: e["t"])
        return {"rank": None, "node": first.get("node"), "error": first.get("reason")}
    return None


WORLD_EVENTS = (EventName.RENDEZVOUS_COMPLETE, EventName.QUORUM_CHANGED)  # a round's world, or a quorum's


def world_size_history(events: list[dict[str, Any]]) -> list[int]:
    """World sizes of successive rendezvous rounds (or quorums), consecutive repeats collapsed:
    [2, 1, 2] = shrink, grow."""
    history: list[int] = []
    for e in events:
        if e["event"] in WORLD_EVENTS and (not history or history[-1] != e["world_size"]):
            history.append(e["world_size"])
    return history


# partition: orch testcluster; hang: its node ended; node_preempted: a node left on a notice (every script style)
LOSS_EVENTS = (EventName.CHAOS_KILL, EventName.NODE_LOST, EventName.CHAOS_PARTITION, EventName.HANG_DETECTED,
               EventName.NODE_PREEMPTED)
STEP_EVENTS = (EventName.RECOVERED, EventName.FIRST_STEP, EventName.QUORUM_CHANGED)  # quorum_changed: survivors without a restart


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each loss (a chaos kill, a lost node, a node preempted) paired with the first completed training step after
    it (``first_step``: the built-in trainer, the elastic API and the HF callback write it).

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


def final_training(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The last ``training_finished`` that knows its loss, else the last one ({} if none). Several groups
    finish a run with replica groups, and one that never logged a step (a late joiner) has ``final_loss`` null."""
    finished = [e for e in events if e["event"] == EventName.TRAINING_FINISHED]
    with_loss = [e for e in finished if e.get("final_loss") is not None]
    return (with_loss or finished or [{}])[-1]


def build_summary(run_dir: str | Path) -> dict[str, Any]:
    """Summarize the latest launch in ``run_dir`` from its append-only files."""
    run_dir = Path(run_dir)
    events = latest_launch(read_jsonl(run_dir / EVENTS_FILE))
    start = events[0]["t"] if events else None
    metrics = [m for m in read_jsonl(run_dir / METRICS_FILE) if start is None or m["t"] >= start]
    finished = final_training(events)
    run_finished = next((e for e in reversed(events) if e["event"] == EventName.RUN_FINISHED), None)
    status = run_finished["status"] if run_finished else "incomplete"
    summary = {
        "status": status,
        "preset": events[0].get("preset") if events else None,
        "steps_completed": finished.get("steps_completed", metrics[-1]["step"] if metrics else 0),
        "final_loss": finished.get("final_loss", metrics[-1]["loss"] if metrics else None),
        "first_loss": metrics[0]["loss"] if metrics else None,
        "world_size_history": world_size_history(events),
        "recoveries": recoveries(events),
        "wall_s": (run_finished["t"] - launch_start(events)) if run_finished and launch_start(events) else None,
        "params_sha256": finished.get("params_sha256"),
        "restarts": sum(1 for e in events if e["event"] == EventName.RESTART),
        "preemptions": preemptions(events),
        "goodput": compute_goodput(events, metrics),
        "nodes_lost": sum(1 for e in events if e["event"] == EventName.NODE_LOST),
        "samples_per_s": _mean(m.get("samples_per_s") for m in metrics),  # None: the script reported no samples
        **run_efficiency(metrics),  # throughput_by_world_size, scaling_efficiency, step_time
    }
    if status != "succeeded":
        summary["root_cause"] = root_cause(events)
        if run_finished and run_finished.get("reason"):
            summary["failure_reason"] = run_finished["reason"]  # the controller's own account (budgets, MIN)
    return summary


def _mean(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def write_summary(run_dir: str | Path) -> dict[str, Any]:
    summary = build_summary(run_dir)
    (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def preemptions(events: list[dict[str, Any]]) -> int:
    """Nodes that left on a preemption notice; not those that left on ``orch stop``'s (it sends every node one)."""
    stopped = min((e["t"] for e in events if e["event"] == EventName.STOP_REQUESTED), default=float("inf"))
    return sum(1 for e in events if e["event"] == EventName.NODE_PREEMPTED and e["t"] < stopped)


def format_summary(summary: dict, run_dir: str) -> str:
    """The summary as ``orch launch`` prints it: one outcome line, indented details, then the run dir."""
    if not summary["world_size_history"] and not summary["steps_completed"]:  # a user entrypoint: no training events
        wall = f" in {summary['wall_s']:.1f} s" if summary.get("wall_s") else ""
        return f"run {summary['status']}{wall} (user entrypoint: its own output is in the logs)\nrun dir: {run_dir}"
    loss = summary.get("final_loss")
    first = summary.get("first_loss")
    parts = [f"run {summary['status']}: {summary['steps_completed']} steps",
             f"loss {first:.4f} -> {loss:.4f}" if loss is not None and first is not None else "",
             f"world size {'->'.join(map(str, summary['world_size_history']))}" if summary["world_size_history"] else "",
             f"{summary['samples_per_s']:.1f} samples/s" if summary.get("samples_per_s") else "",
             f"{summary['wall_s']:.1f} s" if summary.get("wall_s") else ""]
    details = "".join(f"\n  {line}" for line in summary_details(summary))
    return ", ".join(p for p in parts if p) + details + f"\nrun dir: {run_dir}"


def summary_details(summary: dict) -> list[str]:
    """Step-time breakdown, scaling efficiency, recoveries and goodput, where the summary has them."""
    lines = []
    step = summary.get("step_time")
    if step and step.get("step_time_s"):
        shares = sorted(((k.removesuffix("_s"), v / step["step_time_s"]) for k, v in step.items()
                         if k in ("data_s", "compute_s", "comm_s", "optimizer_s", "checkpoint_s", "other_s")),
                        key=lambda kv: -kv[1])
        lines.append(f"step time {1e3 * step['step_time_s']:.1f} ms: " + ", ".join(f"{k} {v:.0%}" for k, v in shares))
    scaling = summary.get("scaling_efficiency")
    if scaling:
        effs = ", ".join(f"{v:.2f} at world size {k}" for k, v in scaling["by_world_size"].items()
                         if int(k) != scaling["baseline_world_size"])
        lines.append(f"scaling efficiency {effs} (against world size {scaling['baseline_world_size']} in this run)")
    if summary.get("preemptions"):
        lines.append(f"preemptions {summary['preemptions']}: node(s) left on a notice after an emergency checkpoint")
    if summary.get("recoveries"):
        mttrs = ", ".join(f"{r['mttr_s']:.1f} s" for r in summary["recoveries"])
        lines.append(f"recoveries {len(summary['recoveries'])}: MTTR {mttrs}")
    goodput = summary.get("goodput")
    if goodput:
        badput = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in (goodput.get("badput") or {}).items() if v >= 0.05)
        lines.append(f"goodput {goodput['goodput']:.1%}" + (f" (badput: {badput})" if badput else ""))
    return lines
