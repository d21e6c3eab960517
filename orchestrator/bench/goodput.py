"""``orch bench goodput``: the same CPU job with and without a preempted node every T seconds, side by side.

Both runs are real launches (local launcher, two simulated nodes, preemption notices with a grace period,
replacement nodes); goodput and lost steps come from each run's summary, i.e. from its events and metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

# The local launcher: it replaces preempted simulated nodes (spot capacity coming back).
JOB = ["conf=cpu_elastic", "launcher=local", "trainer.log_every=5", "checkpoint.every_n_steps=100"]
NODES = "cluster.nnodes=2"
# ``--mode per_step`` compares the modes on the elastic job (1..2 nodes) a per_step user runs: with MIN=2 the
# survivor of a preemption may not train alone in either mode (MIN is the fewest nodes that train), so it
# waits for the replacement, and surviving without a restart would gain nothing.
ELASTIC = "cluster.nnodes=1:2"


def run_job(run_dir: Path, max_steps: int, overrides: list[str]) -> dict:
    """One launch through the CLI; returns its summary.json."""
    cmd = [sys.executable, "-m", "orchestrator.cli", "launch", *JOB, f"trainer.max_steps={max_steps}",
           *overrides, f"run.dir={run_dir}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark launch failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


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
        print("  target per_step: ratio >= 0.97, 0 lost steps")
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
