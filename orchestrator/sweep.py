"""``orch launch -m``: Hydra's multirun convention. ``key=a,b`` (also ``range(1,4)``) sweeps a key; every
combination is one launch, run one after another, each in its own run dir, and a table sums them up.

Hydra itself would refuse ``key=a,b`` outside multirun ("Ambiguous value"); here the sweep is expanded with
Hydra's own override parser, so the syntax is Hydra's, and each launch gets plain ``key=value`` overrides.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, TextIO

from orchestrator.checkpoint.inspect import _table  # the CLI's plain text tables
from orchestrator.errors import OrchError, UserError


@dataclass
class SweepJob:
    """One launch of a sweep and how it ended."""

    overrides: list[str]
    swept: list[str]  # the overrides that vary across the sweep, for the table
    status: str = "not run"
    run_dir: str = "-"
    steps: Optional[int] = None
    final_loss: Optional[float] = None
    exit_code: int = 0


def expand(overrides: Sequence[str]) -> list[SweepJob]:
    """Every combination of the sweep overrides (the first one varies slowest, as in Hydra's basic sweeper)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise UserError(f"sweep {' '.join(overrides)!r} cannot be parsed ({str(exc).splitlines()[0]}). Fix: sweep a "
                        "key with key=a,b or key=range(START,STOP)") from None
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [o.input_line] for o in parsed]
    return [SweepJob(list(combo), [c for c, options in zip(combo, choices) if len(options) > 1])
            for combo in itertools.product(*choices)]


def run_sweep(preset: str, overrides: Sequence[str], echo: Optional[TextIO]) -> list[SweepJob]:
    """Launch every combination in turn; a failed launch is recorded and the sweep goes on."""
    from orchestrator.launch import launch_preset

    if any(o.split("=", 1)[0] == "run.dir" for o in overrides):
        raise UserError("run.dir: a sweep gives every launch its own run dir under runs/<preset>/. Fix: leave run.dir "
                        "out with -m")
    jobs = expand(overrides)
    for i, job in enumerate(jobs):
        if echo is not None:
            print(f"[sweep] launch {i + 1}/{len(jobs)}: {' '.join(job.swept) or '(no swept key)'}", file=echo, flush=True)
        try:
            result = launch_preset(preset, job.overrides, echo=echo)
            job.status, job.run_dir, summary = result.status, result.run_dir, result.summary
        except OrchError as exc:
            job.status, job.exit_code = f"error (exit {exc.exit_code})", exc.exit_code
            result = getattr(exc, "result", None)
            summary = result.summary if result is not None else {}
            job.run_dir = result.run_dir if result is not None else "-"
            if result is not None:
                job.status = result.status
            if echo is not None:
                print(f"orch: error: {exc}", file=echo, flush=True)
        job.steps, job.final_loss = summary.get("steps_completed"), summary.get("final_loss")
    return jobs


def format_table(jobs: Sequence[SweepJob]) -> str:
    header = ("#", "OVERRIDES", "STATUS", "STEPS", "FINAL LOSS", "RUN DIR")
    rows = [(str(i), " ".join(j.swept) or "-", j.status, "-" if j.steps is None else str(j.steps),
             "-" if j.final_loss is None else f"{j.final_loss:.4f}", j.run_dir) for i, j in enumerate(jobs)]
    ok = sum(1 for j in jobs if j.status == "succeeded")
    return f"sweep: {ok}/{len(jobs)} succeeded\n" + _table([header, *rows])
