"""The command line of a run's life: ``orch launch``'s modes (foreground, ``--detach``, a Ray job, ``-m``
sweeps, ``--cfg job``) and ``orch status``, ``orch logs``, ``orch stop``, ``orch resume``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

LAUNCH_FLAGS = ("--dry-run", "--detach", "-m", "--multirun")  # may stand anywhere among the overrides


def add_launch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the launch plan and start nothing")
    p.add_argument("--detach", action="store_true",
                   help="run in the background (a Ray job on a remote cluster); print the run dir and run id and return")
    p.add_argument("-m", "--multirun", action="store_true",
                   help="sweep: key=a,b (or range(A,B)) launches every combination, one after another")
    p.add_argument("--cfg", choices=["job"], help="print the composed config as YAML and start nothing")


def start_agent_ahead(tokens: Sequence[str]) -> None:
    """Start a node agent's interpreter now if this launch most likely runs its nodes as local processes
    (``launcher=local``, the last such override, else the preset file's own ``launcher:`` line): it imports
    torch's elastic agent (~1 s) while the driver composes, checks and plans (~0.5 s), and the local launcher's
    first node becomes it (:func:`orchestrator.processes.take_ahead`). A wrong guess costs an interpreter that
    is ended unused, never a different launch: composing is what decides."""
    import re
    from pathlib import Path

    launcher = next((t.split("=", 1)[1] for t in reversed(tokens) if t.startswith("launcher=")), None)
    preset = next((t.split("=", 1)[1] for t in tokens if t.startswith("conf=")), "")
    if launcher is None and re.fullmatch(r"[\w-]+", preset):
        path = Path(__file__).resolve().parents[1] / "conf" / f"{preset}.yaml"
        try:
            found = re.search(r"^launcher:\s*(\w+)", path.read_text(), re.MULTILINE)
        except OSError:
            found = None
        launcher = found.group(1) if found else None
    if launcher == "local":
        from orchestrator.processes import start_ahead
        from orchestrator.rendezvous.warm import AGENT_MODULE, WARM_MODULE

        start_ahead(WARM_MODULE, AGENT_MODULE)


def run_launch(preset: str, overrides: Sequence[str], *, detach: bool = False, dry_run: bool = False,
               multirun: bool = False, cfg: str | None = None, command_t: float | None = None) -> int:
    """``orch launch`` (and ``orch resume``, with the recorded overrides): pick the mode and run it.
    ``command_t``: when the command started (a foreground launch's wall_s and goodput count from it)."""
    import orchestrator
    from orchestrator.errors import UserError
    from orchestrator.lifecycle import rayjobs
    from orchestrator.report.summary import format_summary

    if cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(orchestrator.compose(preset, overrides))), end="")
        return 0
    if multirun:
        from orchestrator.sweep import format_table, run_sweep

        if detach or dry_run:
            raise UserError("-m with --detach/--dry-run: a sweep runs its launches one after another in the "
                            "foreground. Fix: drop --detach/--dry-run, or launch each combination on its own")
        jobs = run_sweep(preset, overrides, echo=sys.stdout)
        print(format_table(jobs))
        return 0 if all(j.status == "succeeded" for j in jobs) else 1
    from orchestrator.launch import compose_for_launch, launch_config

    composed = compose_for_launch(preset, overrides)  # once: composing and validating take ~0.3 s of the start
    if not dry_run and rayjobs.submits_job(composed.cluster.address, detach):
        return _ray_job(preset, overrides, detach)
    if detach and not dry_run:
        from orchestrator.lifecycle.detach import launch_detached

        run_dir, run_id = launch_detached(preset, overrides)
        print(f"detached: the run goes on in the background (its output: {run_dir}/orch.log)")
        _print_handles(run_dir, run_id)
        return 0
    result = launch_config(composed, dry_run=dry_run, echo=sys.stdout, overrides=list(overrides),
                           command_t=command_t or time.time())
    if not dry_run:
        print(format_summary(result.summary, result.run_dir))
        if result.status == "stopped":
            print(f"stopped by `orch stop`: `orch resume {result.run_id}` goes on from its emergency checkpoint")
    return 0


def _ray_job(preset: str, overrides: Sequence[str], detach: bool) -> int:
    from orchestrator.lifecycle import rayjobs
    from orchestrator.launch_record import read_record

    run_dir, run_id, url = rayjobs.submit(preset, overrides)
    print(f"submitted Ray job {run_id} to {url}")
    _print_handles(run_dir, run_id)
    if detach:
        return 0
    print("following its log until it ends (Ctrl-C stops following; the job goes on)", flush=True)
    record = read_record(run_dir)
    rayjobs.follow_job_logs(record, _write)
    state = rayjobs.job_state(record)
    print(f"Ray job {run_id} {state}")
    return 0 if state in ("succeeded", "stopped") else 1


def _print_handles(run_dir: str, run_id: str) -> None:
    # The run id works from any directory (the user's index of runs), wherever the run dir is.
    print(f"run dir: {run_dir}\nrun id: {run_id}\n  orch status {run_id}  |  orch logs {run_id} --follow  |  "
          f"orch stop {run_id}  |  orch resume {run_id}", flush=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.lifecycle.runs import run_status, status_table

    print(run_status(args.run).lines() if args.run else status_table())
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.lifecycle.control import show_logs

    show_logs(args.run, args.follow, args.node, _write)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from orchestrator.lifecycle.control import stop_run

    print(f"stopping {args.run}: every node saves an emergency checkpoint and leaves ...", flush=True)
    stopped = stop_run(args.run, timeout_s=args.timeout)
    saved = stopped["emergency_checkpoint"]
    # The checkpoint's step is the step the run goes on from (the step in hand when the notice came).
    step = saved.get("step") if saved else stopped["step"]
    where = f"emergency checkpoint at step {step}" if saved else "no emergency checkpoint was needed"
    print(f"run {stopped['run_id']} {stopped['state']} at step {step} ({where}); "
          f"`orch resume {stopped['run_id']}` goes on\nrun dir: {stopped['run_dir']}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    import os

    from orchestrator.config.compose import CONF_PATH_ENV
    from orchestrator.lifecycle.control import resume_args

    preset, overrides, conf = resume_args(args.run, args.overrides)
    where = f" (conf={preset} is the run's own config.yaml: {conf})" if conf else ""
    print(f"resuming: orch launch conf={preset} {' '.join(overrides)}{where}", flush=True)
    before = os.environ.get(CONF_PATH_ENV)
    if conf is not None:  # for this launch (and a detached one's process) only
        os.environ[CONF_PATH_ENV] = os.pathsep.join(p for p in (str(conf), before) if p)
    try:
        return run_launch(preset, overrides, detach=args.detach, command_t=getattr(args, "command_t", None))
    finally:
        if before is None:
            os.environ.pop(CONF_PATH_ENV, None)
        else:
            os.environ[CONF_PATH_ENV] = before


def add_lifecycle_parsers(sub) -> None:
    """``orch status``, ``orch logs``, ``orch stop`` and ``orch resume``."""
    run_help = "a run id (from any directory), a run dir, or PRESET/NAME under runs/"
    p = sub.add_parser("status", help="where a run stands (state, world size, step, goodput, last event); "
                                      "without RUN, a table of every run you launched, newest first")
    p.add_argument("run", nargs="?", metavar="RUN", help=run_help)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="print a run's log (what `orch launch` prints), or one node's")
    p.add_argument("run", metavar="RUN", help=run_help)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    p.add_argument("--node", type=int, help="that node's log (logs/node<N>.log) instead")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("stop", help="stop a run gracefully: an emergency checkpoint first, then status stopped")
    p.add_argument("run", metavar="RUN", help=run_help)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it to end (default 300)")
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("resume", help="launch a run again under its run id with its recorded preset and overrides "
                                      "(plus new ones): the same run dir, tracker runs and checkpoints",
                       usage="orch resume RUN [key=value ...] [--detach]")
    p.add_argument("run", metavar="RUN", help=run_help)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides, recorded with the others")
    p.add_argument("--detach", action="store_true", help="run in the background, as orch launch --detach")
    p.set_defaults(func=cmd_resume)
