"""From ``orch simulate``'s flags (and run dirs) to a :class:`~orchestrator.simulate.model.Scenario`, checked once.

A flag left out keeps the calibrated value when ``--calibrate`` gave one, else its default. Without a failure
source (``--mtbf-h``, ``--preempt-per-day``, ``--interruptions``, ``--trace``), a calibrated simulation replays
the first run dir's own interruptions, length and interval: a prediction of that run to hold against it.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Optional

from orchestrator.errors import ConfigError
from orchestrator.simulate.calibrate import RunMeasure, calibrate
from orchestrator.simulate.model import MODES, JobCosts, Scenario
from orchestrator.simulate.trace import read_trace

# flag (argparse dest) -> the badput category it sets, in the launch and in every recovery
CATEGORY_FLAGS = {"launch_s": "launch_s", "waiting_for_nodes_s": "waiting_for_nodes_s", "rendezvous_s": "rendezvous_s",
                  "worker_start_s": "worker_start_s", "restore_s": "restore_s"}


def _check(flag: str, value: Any, ok: bool, fix: str, problem: str = "is invalid") -> None:
    if not ok:
        raise ConfigError(flag, value, fix, problem)


def parse_every(value: Optional[str]) -> Any:
    """``--every-n-steps``: a number of steps (0: never) or ``auto``."""
    if value is None or value == "auto":
        return value
    _check("--every-n-steps", value, value.isdigit(), "use a number of steps (0: only the final save) or auto")
    return int(value)


def per_step_costs(costs: JobCosts, heartbeat_timeout_s: float, quorum_s: float) -> JobCosts:
    """``--mode per_step``: no restart and no restore; a failure costs the heartbeat timeout that drops the lost
    replica group from the quorum, a noticed leave one quorum change; only the step in flight is lost."""
    return replace(costs, mode="per_step", emergency_save_s=0.0,
                   recovery={"failure": {"rendezvous_s": heartbeat_timeout_s}, "preemption": {"rendezvous_s": quorum_s}})


def _costs(args: argparse.Namespace, base: Optional[JobCosts]) -> JobCosts:
    costs = base or JobCosts()
    given = {cat: getattr(args, dest) for dest, cat in CATEGORY_FLAGS.items() if getattr(args, dest) is not None}
    for flag, value in [("--step-s", args.step_s), ("--ckpt-stall-s", args.ckpt_stall_s),
                        ("--emergency-save-s", args.emergency_save_s), ("--shutdown-s", args.shutdown_s),
                        *((f"--{c[:-2].replace('_', '-')}-s", v) for c, v in given.items())]:
        if value is not None:
            _check(flag, value, value >= 0 and (flag != "--step-s" or value > 0), "use a positive number of seconds")
    launch = {**costs.launch, **{c: v for c, v in given.items() if c != "waiting_for_nodes_s"}}
    recovery = {kind: {**split, **{c: v for c, v in given.items() if c != "launch_s"}}
                for kind, split in costs.recovery.items()}
    stall = args.ckpt_stall_s if args.ckpt_stall_s is not None else costs.stall_s
    emergency = args.emergency_save_s if args.emergency_save_s is not None else (
        costs.emergency_save_s if base is not None else stall)
    costs = replace(costs, step_s=args.step_s or costs.step_s, stall_s=stall, emergency_save_s=emergency,
                    launch=launch, recovery=recovery,
                    shutdown_s=args.shutdown_s if args.shutdown_s is not None else costs.shutdown_s)
    _check("--mode", args.mode, args.mode in MODES, "use restart or per_step")
    if args.mode == "per_step":
        for flag, value in (("--heartbeat-timeout-s", args.heartbeat_timeout_s), ("--quorum-s", args.quorum_s)):
            _check(flag, value, value >= 0, "use 0 or more seconds")
        costs = per_step_costs(costs, args.heartbeat_timeout_s, args.quorum_s)
    return costs


def build_scenario(args: argparse.Namespace) -> tuple[Scenario, list[RunMeasure], bool]:
    """The scenario the flags describe, the calibration runs, and whether it replays the first run (a
    prediction of it)."""
    runs: list[RunMeasure] = []
    base = None
    if args.calibrate:
        base, runs = calibrate(args.calibrate)
    first = runs[0] if runs else None
    rates_given = args.mtbf_h is not None or args.preempt_per_day is not None
    _check("--days", args.days, args.days is None or args.days > 0, "use a positive number of days")
    _check("--steps", args.steps, args.steps is None or args.steps >= 1, "use 1 or more steps")
    _check("--days", args.days, args.days is None or args.steps is None, "give --days or --steps, not both",
           "is given with --steps")
    _check("--interruptions", args.interruptions, args.interruptions is None or (args.days is not None and args.interruptions >= 0),
           "give 0 or more interruptions with --days (the period they happen in)")
    _check("--interruptions", args.interruptions, args.interruptions is None or not rates_given,
           "give either --interruptions or the per-node rates --mtbf-h / --preempt-per-day", "is given with per-node rates")
    _check("--trace", args.trace, args.trace is None or (args.interruptions is None and not rates_given),
           "give either --trace or rates (--mtbf-h, --preempt-per-day, --interruptions)", "is given with rates")
    _check("--nodes", args.nodes, args.nodes is None or args.nodes >= 1, "use 1 or more nodes")
    _check("--mtbf-h", args.mtbf_h, args.mtbf_h is None or args.mtbf_h > 0, "use a positive number of hours")
    _check("--preempt-per-day", args.preempt_per_day, args.preempt_per_day is None or args.preempt_per_day >= 0,
           "use 0 or more preemptions per node per day")
    _check("--notice-fraction", args.notice_fraction, 0 <= args.notice_fraction <= 1, "use a share between 0 and 1")
    _check("--notice-s", args.notice_s, args.notice_s is None or args.notice_s >= 0, "use 0 or more seconds")
    _check("--seeds", args.seeds, 1 <= args.seeds <= 1000, "use 1 to 1000 seeds")
    _check("--prior-mtbf-h", args.prior_mtbf_h, args.prior_mtbf_h is None or args.prior_mtbf_h > 0,
           "use a positive number of hours")
    _check("--prior-weight", args.prior_weight, args.prior_weight is None or args.prior_weight > 0, "use a positive weight")
    replay = first is not None and args.trace is None and args.interruptions is None and not rates_given
    nodes = args.nodes or (first.nodes if first else 1)
    every = parse_every(args.every_n_steps)
    scenario = Scenario(
        costs=_costs(args, base),
        every_n_steps=every if every is not None else (first.every_n_steps if first else "auto"),
        prior_mtbf_s=args.prior_mtbf_h * 3600 if args.prior_mtbf_h else (first.prior_mtbf_s if first else 14400.0),
        prior_weight=args.prior_weight or (first.prior_weight if first else 0.25),
        days=args.days, steps=args.steps,
        notice_s=args.notice_s if args.notice_s is not None else (first.notice_s if first else 30.0))
    if replay:
        scenario = replace(scenario, trace=first.trace, steps=args.steps or (None if args.days else first.steps))
    elif args.trace is not None:
        scenario = replace(scenario, trace=read_trace(args.trace, nodes))
    elif args.interruptions is not None:
        rate = args.interruptions / (args.days * 86400.0)
        scenario = replace(scenario, failure_rate=rate * (1 - args.notice_fraction),
                           preemption_rate=rate * args.notice_fraction)
    else:
        scenario = replace(scenario, failure_rate=nodes / (args.mtbf_h * 3600.0) if args.mtbf_h else 0.0,
                           preemption_rate=nodes * (args.preempt_per_day or 0.0) / 86400.0)
    if scenario.days is None and scenario.steps is None:
        scenario = replace(scenario, days=1.0)
    return scenario, runs, replay
