"""``orch bench ckpt-interval``: ``checkpoint.every_n_steps=auto`` against the best fixed interval found in
hindsight, in the simulator, for failure intervals from 30 s to 24 h.

Per row (a job-level mean time between failures without notice), every fixed interval of a geometric grid
around Young/Daly (1/8x to 8x) and auto run on the same interruption traces (common random numbers, about
2,000 failures per seed), so the comparison is paired. Auto starts from the config's default prior (a new
run knows nothing of the rate) and learns the rate from the failures it sees, as a real run does.
The job's costs default to orch's measured ones (docs/benchmarks.md): 50 ms steps, a 0.4 s synchronous save of
100 MB, 8 s to recover.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from orchestrator.checkpoint.interval import interval_steps
from orchestrator.config.schema import CheckpointConfig
from orchestrator.simulate.model import JobCosts, Scenario, auto_intervals, evaluate, traces

MTBFS_S = (30.0, 120.0, 600.0, 1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0)
FAILURES_PER_SEED = 2000
GRID = 2.0 ** (np.arange(-12, 13) / 4)  # 1/8x .. 8x Young/Daly, 25 intervals
MEASURED = JobCosts(step_s=0.05, stall_s=0.4, emergency_save_s=0.4,
                    launch={"launch_s": 0.2, "rendezvous_s": 3.2, "worker_start_s": 3.9},
                    recovery={kind: {"rendezvous_s": 3.0, "worker_start_s": 4.9, "restore_s": 0.1}
                              for kind in ("failure", "preemption")},
                    shutdown_s=1.8)


def sweep_row(costs: JobCosts, mtbf_s: float, seeds: int) -> dict[str, Any]:
    """Auto and every grid interval on the same ``seeds`` traces at one failure rate."""
    prior = CheckpointConfig()
    scenario = Scenario(costs, days=FAILURES_PER_SEED * mtbf_s / 86400.0, failure_rate=1.0 / mtbf_s,
                        prior_mtbf_s=prior.auto_prior_mtbf_s, prior_weight=prior.auto_prior_weight)
    grid = np.unique(np.maximum(1, np.rint(interval_steps(costs.step_s, costs.stall_s, mtbf_s) * GRID))).astype(int)
    fixed, auto = np.zeros((seeds, len(grid))), np.zeros(seeds)
    for s in range(seeds):
        windows, _ = traces(scenario, s)
        fixed[s] = [evaluate(scenario, windows, k)["goodput"] for k in grid]
        auto[s] = evaluate(scenario, windows, auto_intervals(scenario, windows))["goodput"]
    best = int(np.argmax(fixed.mean(axis=0)))
    return {"mtbf_s": mtbf_s, "best_fixed_interval": int(grid[best]), "best_fixed_goodput": float(fixed.mean(axis=0)[best]),
            "auto_goodput": float(auto.mean()), "auto_ratio": float(auto.mean() / fixed.mean(axis=0)[best]),
            "young_daly_interval": int(interval_steps(costs.step_s, costs.stall_s, mtbf_s))}


def run_ckpt_interval_bench(seeds: int = 4, costs: JobCosts = MEASURED) -> dict[str, Any]:
    rows = [sweep_row(costs, m, seeds) for m in MTBFS_S]
    return {"rows": rows, "seeds": seeds, "failures_per_seed": FAILURES_PER_SEED,
            "step_s": costs.step_s, "stall_s": costs.stall_s, "recovery_s": costs.recovery_s("failure"),
            "auto_within_1pct": all(r["auto_ratio"] >= 0.99 for r in rows)}


def main_ckpt_interval_bench(out: Optional[str], seeds: int = 4) -> dict[str, Any]:
    result = run_ckpt_interval_bench(seeds=seeds)
    print(f"every_n_steps=auto vs the best fixed interval in hindsight (simulated; step {result['step_s']} s, "
          f"save stall {result['stall_s']} s, recovery {result['recovery_s']:.1f} s; {seeds} seeds x "
          f"{FAILURES_PER_SEED} failures)")
    print(f"  {'MTBF':>9} {'Young/Daly':>11} {'best fixed':>11} {'its goodput':>12} {'auto goodput':>13} {'auto/best':>10}")
    for r in result["rows"]:
        print(f"  {r['mtbf_s']:>8.0f}s {r['young_daly_interval']:>11} {r['best_fixed_interval']:>11} "
              f"{r['best_fixed_goodput']:>12.4f} {r['auto_goodput']:>13.4f} {r['auto_ratio']:>10.4f}")
    print(f"  auto within 1% of the best fixed interval at every failure rate: {result['auto_within_1pct']}")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
