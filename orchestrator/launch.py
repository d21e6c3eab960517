"""``orch launch`` and ``orchestrator.launch``: composed config -> run dir -> plan -> launcher -> summary.

Nothing is written before every check has passed: a bad config or a machine that cannot run the plan
exits 2 with no run dir left behind. Nothing is printed unless ``echo`` asks for it (the CLI passes stdout).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from omegaconf import OmegaConf

from orchestrator.config.schema import OrchConfig
from orchestrator.config.values import run_id_slug
from orchestrator.errors import ConfigError, Interrupted, OrchError, Preempted, RunFailed
from orchestrator.lifecycle.record import record_launch
from orchestrator.plan.plan import CONFIG_FILE, LaunchPlan, build_plan
from orchestrator.plan.resources import check_local_resources
from orchestrator.preflight import check_entrypoint, check_resume_step, check_store_address, make_run_dir, run_leases
from orchestrator.report.progress import RunProgress
from orchestrator.report.summary import write_summary
from orchestrator.rundir import EventLog, EventName
from orchestrator.testcluster.state import state_for_launch
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


def write_config(cfg: OrchConfig, run_dir: str) -> None:
    """The resolved config every worker loads; the run dir's record of exactly what ran."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def checkpoint_url(cfg: OrchConfig) -> str:
    """Where this run's checkpoints go: ``checkpoint.url``, or ``<run.dir>/checkpoints``."""
    return cfg.checkpoint.url or f"{cfg.run.dir}/checkpoints"


def preflight_checkpoints(cfg: OrchConfig) -> None:
    """Prove the checkpoint URL is writable before anything starts (exit 2 with the fix if not).

    The default URL lives inside the run dir, which does not exist yet: probing it would create the run dir,
    so only an explicit URL is probed; the run dir itself is created right after.
    """
    if cfg.checkpoint.url is not None:  # an empty URL is refused, not taken for the default
        from orchestrator.checkpoint import preflight_storage

        preflight_storage(cfg.checkpoint.url)


def preflight_launch(cfg: OrchConfig, store: bool = True) -> None:
    """The entrypoint exists, the store port is free (``store``: the store is hosted here), a resume step
    exists: each a ConfigError (exit 2) before anything is written, instead of a failure after agents start."""
    check_entrypoint(cfg)
    if store:
        check_store_address(cfg)
    check_resume_step(cfg, checkpoint_url(cfg))


@contextlib.contextmanager
def run_secret(cfg: OrchConfig) -> Iterator[Optional[str]]:
    """The run's secret for its leases' proofs, while the launch runs: ``ORCH_RUN_SECRET`` when the
    environment has one (a Kubernetes Secret's, a secret store's); else, when this launch hosts the store, a
    fresh one put into the environment for the launch (the launcher hands that same one to every agent and
    worker, see orchestrator/trust/secret.py) and taken out again at the end. None for a launch that dials an
    external store without one: no other process of the run would share a secret made here."""
    given = os.environ.get(RUN_SECRET_ENV)
    if given or cfg.rendezvous.external:
        yield given or None
        return
    os.environ[RUN_SECRET_ENV] = secret = secrets.token_hex(32)
    try:
        yield secret
    finally:
        if os.environ.get(RUN_SECRET_ENV) == secret:
            del os.environ[RUN_SECRET_ENV]


def _take_leases(cfg: OrchConfig, run_id: str, secret: Optional[str]):
    """Create the run dir and take the run's leases (ConfigError naming the live run holding one); a run dir
    created here is removed again when refused, so a refused launch leaves nothing behind. A lease found lost
    later stops the run (:func:`lease_lost_recorder`)."""
    created = make_run_dir(cfg.run.dir)
    keeper = run_leases(cfg, run_id, secret)
    keeper.on_lost = lease_lost_recorder(EventLog(cfg.run.dir))
    try:
        return keeper.acquire()
    except BaseException:
        if created:
            shutil.rmtree(cfg.run.dir, ignore_errors=True)
        raise


def lease_lost_recorder(events: EventLog):
    """``on_lost`` for a launch's leases: a ``lease_lost`` event naming the lease and who holds it now. The
    controller reads it and stops every node at once, the run ending ``failed`` with its reason (the workers'
    commit check refuses their saves meanwhile: orchestrator/checkpoint/fence.py)."""
    def record(lease) -> None:
        try:
            holder = lease.read()
        except Exception:  # noqa: BLE001 - the store that lost us the lease may be unreachable now
            holder = None
        whom = f"run {holder.run_id}" if holder is not None else "another writer (its lease file is gone)"
        events.emit(EventName.LEASE_LOST, url=lease.url, setting=lease.setting, by="launcher",
                    holder=holder.run_id if holder is not None else None,
                    reason=f"lease on {lease.setting}={lease.url} lost to {whom}")
    return record


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


def check_launchable(preset: str, overrides: Sequence[str]) -> tuple[OrchConfig, str]:
    """Every check a launch makes before it writes anything (config, this machine, the checkpoint URL), for a
    launch that runs elsewhere (detached, a Ray job); returns the config (run dir final) and a new run id."""
    cfg = compose_for_launch(preset, overrides)
    result = launch_config(cfg, dry_run=True)
    check_local_resources(result.plan, cfg.cluster)
    preflight_checkpoints(cfg)
    preflight_launch(cfg, store=False)
    run_leases(cfg, result.run_id).check()
    return cfg, result.run_id


def launch_preset(preset: str, overrides: Sequence[str] = (), *, echo: Optional[TextIO] = None,
                  dry_run: bool = False) -> LaunchResult:
    """``orchestrator.launch``: compose ``preset`` with ``overrides`` and run it (see :func:`launch_config`)."""
    return launch_config(compose_for_launch(preset, overrides), dry_run=dry_run, echo=echo, overrides=overrides)


def launch_config(cfg: OrchConfig, *, dry_run: bool = False, echo: Optional[TextIO] = None,
                  overrides: Optional[Sequence[str]] = None) -> LaunchResult:
    """Run ``cfg``, or only plan it when ``dry_run``. ``echo``: where node output, live progress and a dry
    run's plan go; None: nowhere (the run dir has everything). ``overrides``: the command line ``cfg`` was
    composed from, recorded in ``launch.json`` for ``orch resume`` (None: unknown). Returns the LaunchResult of
    a run that succeeded or was stopped (``orch stop``); raises UserError (exit 2, nothing written), RunFailed,
    Preempted or Interrupted otherwise."""
    cfg.run.dir = resolve_run_dir(cfg)
    run_id = new_run_id(cfg)
    plan = build_plan(cfg, cfg.run.dir, run_id, testcluster=state_for_launch(cfg.cluster.testcluster, cfg.cluster.max_nodes))
    if dry_run:
        if echo is not None:
            print(plan.format_text(), file=echo)
        return LaunchResult("dry-run", cfg.run.dir, run_id, plan=plan)
    check_local_resources(plan, cfg.cluster)
    preflight_checkpoints(cfg)
    preflight_launch(cfg)
    # Live progress (tailing the run dir) shares the terminal with node output: launchers write through it.
    progress = RunProgress(cfg.run.dir, cfg.trainer.max_steps if cfg.entrypoint.builtin else None, echo) if echo else None
    echo = progress.echo if progress else echo
    launcher = _launcher(cfg, run_id, echo)  # the Ray launcher connects here: unreachable exits 2, no run dir
    with run_secret(cfg) as secret:
        leases = _take_leases(cfg, run_id, secret)  # the first write: the run dir and its leases, nothing else yet
        try:
            write_config(cfg, cfg.run.dir)
            record_launch(cfg.run.dir, run_id, cfg.preset, overrides)
            with progress or contextlib.nullcontext():
                status = launcher.run()
        finally:
            leases.release()
    summary = write_summary(cfg.run.dir)
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


def _launcher(cfg: OrchConfig, run_id: str, echo: Optional[TextIO]):
    from orchestrator.launchers.local import LocalLauncher

    if cfg.launcher == "local":
        return LocalLauncher(cfg, cfg.run.dir, run_id, echo=echo)
    from orchestrator.launchers.ray import RayLauncher  # imported lazily: Ray takes seconds to import

    return RayLauncher(cfg, cfg.run.dir, run_id, echo=echo)
