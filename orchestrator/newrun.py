"""A new run's run dir, created once every check has passed: the directory, its leases (taken first: a live
run on the same run dir or checkpoint URL refuses the launch, and a directory created for a refused launch is
removed again), its resolved config and its launch record. Nothing of the run is written before this."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from orchestrator.config.schema import OrchConfig
from orchestrator.events import LeaseLost
from orchestrator.launch_record import record_launch
from orchestrator.preflight import make_run_dir, run_leases
from orchestrator.rundir import CONFIG_FILE, EventLog


def write_config(cfg: OrchConfig, run_dir: str) -> None:
    """The resolved config every worker loads; the run dir's record of exactly what ran."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def open_run_dir(cfg: OrchConfig, run_id: str, overrides: Optional[Sequence[str]], secret: Optional[str]):
    """Create the run dir with its leases, config and launch record; returns the held leases (release them at
    the end). Raises ConfigError naming the live run that holds a lease, leaving nothing behind."""
    created = make_run_dir(cfg.run.dir)
    keeper = run_leases(cfg, run_id, secret)
    keeper.on_lost = lease_lost_recorder(EventLog(cfg.run.dir))
    try:
        leases = keeper.acquire()
    except BaseException:
        if created:
            shutil.rmtree(cfg.run.dir, ignore_errors=True)
        raise
    try:
        write_config(cfg, cfg.run.dir)
        record_launch(cfg.run.dir, run_id, cfg.preset, overrides)
    except BaseException:
        leases.release()
        raise
    return leases


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
        events.write(LeaseLost(url=lease.url, setting=lease.setting,
                               holder=holder.run_id if holder is not None else None, by="launcher",
                               reason=f"lease on {lease.setting}={lease.url} lost to {whom}"))
    return record
