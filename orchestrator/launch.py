"""``orch launch`` and ``orchestrator.launch``: composed config -> site -> (plan, checks, run dir, controller:
the site's runner, launchers/runner.py) -> summary.

The site is found by ``launcher`` name (orchestrator/site.py); nothing here knows which. Nothing is written
before every check has passed: a bad config or a machine that cannot run the plan exits 2 with no run dir left
behind. Nothing is printed unless ``echo`` asks for it (the CLI passes stdout).
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from orchestrator.config.schema import OrchConfig
from orchestrator.config.values import run_id_slug
from orchestrator.errors import ConfigError, Interrupted, OrchError, Preempted, RunFailed
from orchestrator.newrun import write_config  # noqa: F401 (re-exported: tools write a run's config.yaml)
from orchestrator.plan.plan import LaunchPlan
from orchestrator.preflight import check
from orchestrator.report.progress import RunProgress
from orchestrator.report.summary import write_summary
from orchestrator.site import make_site
from orchestrator.trust.secret import RUN_SECRET_ENV


def resolve_run_dir(cfg: Any) -> str:
    """``run.dir`` if set, else ``runs/<preset>/<timestamp>``; returned absolute, as workers need it.
    ``cfg``: an OrchConfig, or the composed DictConfig before validation (see compose_for_launch)."""
    if cfg.run.dir is not None and not str(cfg.run.dir).strip():
        raise ConfigError("run.dir", cfg.run.dir, "give a path, or drop run.dir (null) for a new one under runs/",
                          "is empty")
    path = cfg.run.dir or f"runs/{cfg.preset}/{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    return str(Path(path).resolve())


def new_run_id(cfg: OrchConfig) -> str:
    """``run.id`` if set (the pods of one Kubernetes job share it), else a new unique id that passes run.id's
    own check (``cpu_elastic`` -> ``cpu-elastic-<timestamp>-<hex>``: see config/values.py)."""
    if cfg.run.id:
        return cfg.run.id
    return f"{run_id_slug(cfg.preset, 40)}-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"


STDOUT = "stdout"  # echo to whatever sys.stdout is when launch() is called (not when this module was imported)


@dataclass(frozen=True)
class LaunchResult:
    """What one launch did. ``status``: ``succeeded``, or ``dry-run`` (nothing ran; ``plan`` holds the plan).
    ``summary``: the run's ``summary.json`` as a dict (empty for a dry run). A run that did not succeed raises
    instead (RunFailed, Preempted, Interrupted), with its LaunchResult as the error's ``result`` attribute."""

    status: str
    run_dir: str
    run_id: str
    summary: dict = field(default_factory=dict)
    plan: Optional[LaunchPlan] = field(default=None, repr=False, compare=False)


def compose_for_launch(preset: str, overrides: Sequence[str] = ()) -> OrchConfig:
    """Compose and validate ``preset`` with ``overrides`` for a launch: ``run.dir`` is made final (absolute,
    the default one chosen) before interpolations resolve, so ``${run.dir}`` anywhere in the config (e.g.
    ``entrypoint.args=[--out,'${run.dir}/out']``) is the run dir the run writes to."""
    from omegaconf.errors import OmegaConfBaseException

    from orchestrator.config.compose import compose_dictconfig, to_validated

    composed = compose_dictconfig(preset, overrides)
    try:
        composed.run.dir = resolve_run_dir(composed)
    except OmegaConfBaseException:
        pass  # a missing preset name or a bad run.dir interpolation: validation names the key and the fix
    return to_validated(composed)


def check_launchable(preset: str, overrides: Sequence[str], here: bool = True) -> tuple[OrchConfig, str]:
    """Every check a launch makes before it writes anything (config, this machine, the checkpoint URL, the
    leases), for a launch that runs elsewhere: detached (``here``: on this machine) or as a Ray job (not here:
    nothing of this machine is checked). Returns the config (run dir final) and a new run id."""
    cfg = compose_for_launch(preset, overrides)
    cfg.run.dir = resolve_run_dir(cfg)
    run_id = new_run_id(cfg)
    check(cfg, make_site(cfg, run_id), here=here)
    return cfg, run_id


def launch_preset(preset: str, overrides: Sequence[str] = (), *, echo: Optional[TextIO] = None,
                  dry_run: bool = False, command_t: Optional[float] = None) -> LaunchResult:
    """``orchestrator.launch``: compose ``preset`` with ``overrides`` and run it (see :func:`launch_config`)."""
    command_t = command_t or time.time()  # composing counts too
    return launch_config(compose_for_launch(preset, overrides), dry_run=dry_run, echo=echo, overrides=overrides,
                         command_t=command_t)


def launch_config(cfg: OrchConfig, *, dry_run: bool = False, echo: Optional[TextIO] = None,
                  overrides: Optional[Sequence[str]] = None, command_t: Optional[float] = None) -> LaunchResult:
    """Run ``cfg``, or only plan it when ``dry_run``. ``echo``: where node output, live progress and a dry
    run's plan go; None: nowhere (the run dir has everything). ``overrides``: the command line ``cfg`` was
    composed from, recorded in ``launch.json`` for ``orch resume`` (None: unknown). ``command_t``: when the
    command started (``orch launch``: its process's start), where ``wall_s`` and goodput begin (None: now).
    Returns the LaunchResult of
    a run that succeeded or was stopped (``orch stop``); raises UserError (exit 2, nothing written), RunFailed,
    Preempted or Interrupted otherwise."""
    command_t = command_t or time.time()
    cfg.run.dir = resolve_run_dir(cfg)
    run_id = new_run_id(cfg)
    site = make_site(cfg, run_id, echo)  # reads what the site needs (a test cluster's hosts); connects nothing
    site.command_t = command_t
    if dry_run:
        plan = site.make_plan(cfg.run.dir)
        if echo is not None:
            print(plan.format_text(secret_env=[RUN_SECRET_ENV]), file=echo)
        return LaunchResult("dry-run", cfg.run.dir, run_id, plan=plan)
    # Live progress (tailing the run dir) shares the terminal with node output: the site writes through it.
    progress = RunProgress(cfg.run.dir, cfg.trainer.max_steps if cfg.entrypoint.builtin else None, echo) if echo else None
    site.echo = progress.echo if progress else echo
    status = site.run(cfg, run_id, overrides, progress)
    plan = site.plan
    summary = write_summary(cfg.run.dir)
    from orchestrator.tracking.run_end import record_run_end

    record_run_end(cfg, cfg.run.dir, run_id, summary)  # final metrics and artifacts in the run's tracker runs
    result = LaunchResult(status, cfg.run.dir, run_id, summary, plan)
    if status in ("succeeded", "stopped"):
        return result
    if status == "preempted":
        error: OrchError = Preempted(f"run preempted: every node saved an emergency checkpoint and left; launch the "
                                     f"same command again to resume (run dir: {cfg.run.dir})")
    elif status == "interrupted":
        error = Interrupted(f"run interrupted; every node stopped (run dir: {cfg.run.dir})")
    else:
        cause = summary.get("root_cause") or {}
        who = f"rank {cause['rank']} (node {cause.get('node')})" if cause.get("rank") is not None else (
            f"node {cause.get('node')}" if cause else "unknown")
        reason = summary.get("failure_reason")
        blame = f"root cause {who}: {cause.get('error', 'no error recorded')}"
        # With no failing rank, the controller's own account (a lost lease, a spent budget) is the whole story.
        detail = blame if not reason else f"{reason}; {blame}" if cause else reason
        error = RunFailed(f"run {status}: {detail} (run dir: {cfg.run.dir})")
    error.result = result  # type: ignore[attr-defined]
    raise error


def launch(cfg: OrchConfig, dry_run: bool = False, echo: Optional[TextIO] | str = STDOUT) -> dict:
    """Run ``cfg`` (or print its plan when ``dry_run``); returns the summary. Raises RunFailed on failure.
    ``echo``: where node output and progress go (None: nowhere; a dry run's plan then goes to stdout).
    The older form of :func:`launch_config`, kept for callers that hold a composed config."""
    if echo == STDOUT:
        echo = sys.stdout
    if dry_run:
        result = launch_config(cfg, dry_run=True, echo=echo or sys.stdout)
        return {"status": "dry-run", "plan": result.plan}
    return launch_config(cfg, echo=echo).summary
