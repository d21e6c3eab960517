"""``orch simulate`` and ``orch advise checkpoint``: their arguments, their printout, their JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Optional


def add_simulate_parsers(sub: Any) -> None:
    """Register ``simulate`` and ``advise`` on the ``orch`` subcommand parser."""
    p = sub.add_parser("simulate", help="goodput of one training job under failures and preemptions (simulated)",
                       description="A job-level discrete-event simulation: goodput, badput by cause, lost steps "
                                   "and effective training time, with 95% intervals over seeds. See docs/simulate.md.")
    g = p.add_argument_group("the job")
    g.add_argument("--nodes", type=int, help="nodes in the job (default 1, or the calibration run's)")
    g.add_argument("--days", type=float, help="wall-clock days to simulate (default 1)")
    g.add_argument("--steps", type=int, help="or: run until this many steps are trained")
    g.add_argument("--mode", default="restart", help="restart (default) or per_step (torchft-style, no restart)")
    g = p.add_argument_group("interruptions (none: an uninterrupted job; with --calibrate, that run's own)")
    g.add_argument("--mtbf-h", type=float, help="per-node mean time between failures (no notice), hours")
    g.add_argument("--preempt-per-day", type=float, help="per-node preemptions a day (with --notice-s of notice)")
    g.add_argument("--interruptions", type=int, help="interruptions of the whole job over --days (instead of rates)")
    g.add_argument("--notice-fraction", type=float, default=0.0,
                   help="share of --interruptions that come with a notice (default 0: all are failures)")
    g.add_argument("--notice-s", type=float, help="seconds of notice a preemption gives (default 30)")
    g.add_argument("--trace", help="replay a CSV of interruptions: time,node,kind (see docs/simulate.md)")
    g = p.add_argument_group("costs in seconds (default 0; with --calibrate, as measured)")
    g.add_argument("--calibrate", nargs="+", metavar="RUN_DIR", help="take the costs from these run dirs")
    g.add_argument("--step-s", type=float, help="seconds per training step (default 1)")
    g.add_argument("--every-n-steps", help="checkpoint interval in steps, 0 (final save only) or auto (default)")
    g.add_argument("--ckpt-stall-s", type=float, help="the loop blocked per periodic save")
    g.add_argument("--emergency-save-s", type=float, help="the save on a notice (default: --ckpt-stall-s)")
    for name, what in (("launch", "getting the nodes at launch"), ("waiting-for-nodes", "a replacement node"),
                       ("rendezvous", "detection and rendezvous"), ("worker-start", "worker start-up"),
                       ("restore", "loading the checkpoint")):
        g.add_argument(f"--{name}-s", type=float, help=what)
    g.add_argument("--shutdown-s", type=float, help="after the last step")
    g.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="per_step: seconds until a failed replica group is dropped (default 10)")
    g.add_argument("--quorum-s", type=float, default=1.0, help="per_step: a noticed leave's quorum change (default 1)")
    g = p.add_argument_group("every_n_steps=auto's prior (default: checkpoint.auto_prior_*)")
    g.add_argument("--prior-mtbf-h", type=float, help="assumed hours between interruptions that lose work (4)")
    g.add_argument("--prior-weight", type=float, help="interruptions the prior counts as (0.25)")
    p.add_argument("--seeds", type=int, default=20, help="independent runs for the 95%% intervals (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--out", help="write the result as JSON to this file")
    p.set_defaults(func=cmd_simulate)

    advise = sub.add_parser("advise", help="advice from a run dir's measurements").add_subparsers(
        dest="advise_command", required=True)
    p = advise.add_parser("checkpoint", help="the Young/Daly checkpoint interval and its simulated goodput")
    p.add_argument("run_dir", help="a finished run dir (its step time, save stall and restart costs)")
    p.add_argument("--mtbf-h", type=float, required=True,
                   help="expected hours between interruptions of the job that lose work (failures without notice)")
    p.add_argument("--days", type=float, default=30.0, help="simulated days per seed (default 30)")
    p.add_argument("--seeds", type=int, default=20, help="seeds (default 20)")
    p.add_argument("--out", help="write the advice as JSON to this file")
    p.set_defaults(func=cmd_advise_checkpoint)


def _fmt_s(seconds: float, wall_s: float) -> str:
    return f"{seconds / 3600:.1f} h" if wall_s > 2 * 86400 else f"{seconds:.1f} s"


def format_result(result: dict[str, Any]) -> str:
    lo, hi = result["goodput_ci95"]
    elo, ehi = result["effective_training_time_ci95"]
    wall = result["wall_s"]
    inputs = result["inputs"]
    lines = [f"simulated {result['seeds']} seed(s) in {result['elapsed_s']:.1f} s: {inputs['nodes']} node(s), "
             f"{inputs['mode']} mode, checkpoint every {inputs['every_n_steps']} steps, "
             f"{result['interruptions']:.1f} interruptions, wall {_fmt_s(wall, wall)}",
             f"  goodput                 {result['goodput']:.4f} [{lo:.4f}, {hi:.4f}]",
             f"  effective training time {result['effective_training_time']:.4f} [{elo:.4f}, {ehi:.4f}]",
             f"  lost steps              {result['lost_steps']:.1f}",
             "  badput: " + ", ".join(f"{k[:-2]} {_fmt_s(v, wall)}" for k, v in result["badput"].items() if v > 0)]
    if "calibration" in result and result["calibration"].get("measured_goodput") is not None:
        c = result["calibration"]
        lines.append(f"  measured goodput of {c['run_dirs'][0]}: {c['measured_goodput']:.4f} "
                     f"(prediction off by {c['prediction_error'] * 100:+.1f}%)")
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> dict[str, Any]:
    """The simulation the flags describe, with its inputs, as ``--out`` writes it."""
    from dataclasses import asdict

    from orchestrator.simulate.model import simulate
    from orchestrator.simulate.scenario import build_scenario

    started = time.perf_counter()
    scenario, runs, replay = build_scenario(args)
    result = simulate(scenario, seeds=args.seeds, seed=args.seed)
    inputs = {k: v for k, v in asdict(scenario).items() if k != "trace"}
    inputs.update(nodes=args.nodes or (runs[0].nodes if runs else 1),
                  mode=scenario.costs.mode, trace_interruptions=len(scenario.trace) if scenario.trace else None)
    result.update(inputs=inputs, elapsed_s=time.perf_counter() - started)
    if runs:
        result["calibration"] = {"run_dirs": [r.run_dir for r in runs], "measured_goodput": None}
        if replay:
            measured = runs[0].goodput
            result["calibration"].update(measured_goodput=measured,
                                         prediction_error=(result["goodput"] - measured) / measured)
    return result


def cmd_simulate(args: argparse.Namespace) -> int:
    result = run_simulate(args)
    print(format_result(result))
    _write(args.out, result)
    return 0


def cmd_advise_checkpoint(args: argparse.Namespace) -> int:
    from orchestrator.simulate.advise import advise_checkpoint, format_advice

    advice = advise_checkpoint(args.run_dir, args.mtbf_h, days=args.days, seeds=args.seeds)
    print(format_advice(advice))
    _write(args.out, advice)
    return 0


def _write(out: Optional[str], data: dict[str, Any]) -> None:
    if out:
        Path(out).write_text(json.dumps(data, indent=2, default=float) + "\n")
