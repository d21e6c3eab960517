"""``orch bench goodput``: the same CPU job with and without a preempted node every T seconds, side by side.

Both runs are real launches (local launcher, two simulated nodes, preemption notices with a grace period,
replacement nodes); goodput and lost steps come from each run's summary, i.e. from its events and metrics.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from orchestrator.rundir import EVENTS_FILE, METRICS_FILE, EventName, read_jsonl

# The local launcher: it replaces preempted simulated nodes (spot capacity coming back).
JOB = ["conf=cpu_elastic", "launcher=local", "trainer.log_every=5", "checkpoint.every_n_steps=100"]
NODES = "cluster.nnodes=2"
# ``--mode per_step`` compares the modes on the elastic job (1..2 nodes) a per_step user runs: with MIN=2 the
# survivor of a preemption may not train alone in either mode (MIN is the fewest nodes that train), so it
# waits for the replacement, and surviving without a restart would gain nothing.
ELASTIC = "cluster.nnodes=1:2"


def run_job(run_dir: Path, max_steps: int, overrides: list[str]) -> dict:
    """One launch through the CLI; returns its summary.json, with the survivors' pauses at quorum changes
    (per_step: :func:`survivor_pauses`) under ``_survivor_pauses``."""
    cmd = [sys.executable, "-m", "orchestrator.cli", "launch", *JOB, f"trainer.max_steps={max_steps}",
           *overrides, f"run.dir={run_dir}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark launch failed ({result.returncode}): {result.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["_survivor_pauses"] = survivor_pauses(read_jsonl(run_dir / EVENTS_FILE), read_jsonl(run_dir / METRICS_FILE))
    return summary


def survivor_pauses(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> list[float]:
    """per_step: the seconds the survivors did not train at each change of the quorum (a group leaving, one
    joining and healing from them), from the run's logged records. A metrics window (between two records) that
    holds a ``quorum_changed`` took this much longer than its steps take in windows with no change, at the
    world size of each step (the steps before the change at the old quorum's, the rest at the new one's); a
    discarded step and a quorum that waited are in that excess. A replacement starting up is not: the
    survivors train while it starts (in windows with no change, a little slower on a shared machine)."""
    changes = [e for e in events if e["event"] == EventName.QUORUM_CHANGED and e.get("previous") is not None]
    records = sorted((m for m in metrics if "step" in m and "t" in m), key=lambda m: m["t"])
    windows = [(a, b) for a, b in zip(records, records[1:]) if b["step"] > a["step"]]

    def changed_in(a: dict, b: dict) -> list[dict]:
        return [e for e in changes if a["t"] < e["t"] <= b["t"]]

    per_world: dict[int, list[float]] = {}
    for a, b in windows:
        if not changed_in(a, b) and a["world_size"] == b["world_size"]:
            per_world.setdefault(b["world_size"], []).append((b["t"] - a["t"]) / (b["step"] - a["step"]))
    step_s = {w: statistics.median(v) for w, v in per_world.items()}
    pauses = []
    for a, b in windows:
        for change in changed_in(a, b):
            old_world = change["world_size"] // change["replicas"] * change["previous"]
            before = max(0, min(change["step"] - 1, b["step"]) - a["step"])
            if old_world not in step_s or change["world_size"] not in step_s:
                continue  # no undisturbed window at one of the world sizes to compare with
            expected = before * step_s[old_world] + (b["step"] - a["step"] - before) * step_s[change["world_size"]]
            pauses.append(max(0.0, b["t"] - a["t"] - expected))
            break  # one excess per window, however many changes it holds
    return pauses


def run_goodput_bench(every_s: float = 60.0, max_steps: int = 6000, grace_s: float = 30.0,
                      extra: tuple[str, ...] = (NODES,)) -> dict:
    """Goodput of the job (``JOB`` + ``extra``) with a preempted node every ``every_s`` seconds, and without."""
    with tempfile.TemporaryDirectory(prefix="orch-bench-goodput-") as tmp:
        quiet = run_job(Path(tmp) / "no-preemption", max_steps, [*extra])
        drill = run_job(Path(tmp) / "preempted", max_steps,
                        [*extra, f"preemption.schedule.every_s={every_s}", f"preemption.schedule.grace_s={grace_s}"])
    result = {
        "goodput": drill["goodput"]["goodput"],
        "goodput_no_preemption": quiet["goodput"]["goodput"],
        "lost_steps": drill["goodput"]["lost_steps"],
        "preemptions": drill["preemptions"],
        "wall_s": drill["wall_s"], "wall_s_no_preemption": quiet["wall_s"],
        "badput": drill["goodput"]["badput"], "badput_no_preemption": quiet["goodput"]["badput"],
        "every_s": every_s, "max_steps": max_steps, "overrides": [*JOB, *extra],
    }
    result["ratio"] = result["goodput"] / result["goodput_no_preemption"]
    if "fault_tolerance.mode=per_step" in extra:
        pauses = drill.get("_survivor_pauses", [])
        result["survivor_pauses_s"] = [round(p, 3) for p in pauses]
        result["survivor_pause_per_preemption_s"] = (round(sum(pauses) / drill["preemptions"], 3)
                                                     if drill["preemptions"] else None)
    # Goodput counts time on steps that commit, at whatever node count: an elastic job's survivor training
    # alone is productive but slower. How much longer the same steps took says what the capacity loss cost.
    result["time_to_train_ratio"] = result["wall_s_no_preemption"] / result["wall_s"]
    return result


def main_goodput_bench(out: Optional[str], every_s: float, max_steps: int, mode: str = "restart") -> dict:
    if mode == "per_step":
        both = {m: run_goodput_bench(every_s=every_s, max_steps=max_steps, extra=(ELASTIC, f"fault_tolerance.mode={m}"))
                for m in ("restart", "per_step")}
        print(f"goodput with a preempted node every {every_s:g} s vs none ({max_steps} steps, 1..2 simulated nodes)")
        print(f"  {'mode':<10}{'goodput':>9}{'no preemption':>15}{'ratio':>8}{'lost steps':>12}{'preemptions':>13}"
              f"{'time-to-train ratio':>21}")
        for m, r in both.items():
            print(f"  {m:<10}{r['goodput']:>9.3f}{r['goodput_no_preemption']:>15.3f}{r['ratio']:>8.3f}"
                  f"{r['lost_steps']:>12}{r['preemptions']:>13}{r['time_to_train_ratio']:>21.3f}")
        for m, r in both.items():
            print(f"  badput (s) {m}, preempted: " + ", ".join(f"{k} {v:.1f}" for k, v in r["badput"].items() if v))
        pause = both["per_step"].get("survivor_pause_per_preemption_s")
        print(f"  per_step survivors' pause per preemption: {pause if pause is not None else '-'} s (quorum changes: "
              f"{', '.join(f'{p:.3f}' for p in both['per_step'].get('survivor_pauses_s', [])) or 'none'})")
        print("  target per_step: ratio >= 0.97, 0 lost steps, survivor_pause_per_preemption_s <= 0.2")
        if out:
            Path(out).write_text(json.dumps(both, indent=2) + "\n")
        return both
    result = run_goodput_bench(every_s=every_s, max_steps=max_steps)
    print(f"goodput with a preempted node every {every_s:g} s vs none ({max_steps} steps, 2 simulated nodes)")
    print(f"  {'':<16}{'goodput':>9}{'wall s':>9}{'lost steps':>12}{'preemptions':>13}")
    print(f"  {'no preemption':<16}{result['goodput_no_preemption']:>9.3f}{result['wall_s_no_preemption']:>9.1f}"
          f"{0:>12}{0:>13}")
    print(f"  {'preempted':<16}{result['goodput']:>9.3f}{result['wall_s']:>9.1f}{result['lost_steps']:>12}"
          f"{result['preemptions']:>13}")
    print(f"  ratio {result['ratio']:.3f} (target >= 0.9), lost steps {result['lost_steps']} (target 0)")
    print("  badput (s) preempted:     " + ", ".join(f"{k} {v:.1f}" for k, v in result["badput"].items()))
    print("  badput (s) no preemption: " + ", ".join(f"{k} {v:.1f}" for k, v in result["badput_no_preemption"].items()))
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
