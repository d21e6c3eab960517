"""Entering a run: find the run dir and its config, join the process group, record the rendezvous."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from orchestrator.config.compose import load_run_config
from orchestrator.config.schema import BackendConfig, OrchConfig
from orchestrator.elastic import collectives
from orchestrator.elastic.session import Session, report_failure
from orchestrator.elastic.worker_events import WorkerEvents
from orchestrator.rundir import CONFIG_FILE
from orchestrator.runtime.distributed import DistContext, init_process_group
from orchestrator.runtime.timing import StartupTimes

RUN_DIR_ENV = "ORCH_RUN_DIR"


def init(config: Union[str, os.PathLike, OrchConfig, None] = None, *, run_dir: Optional[str] = None,
         process_group: Optional[bool] = None, startup: Optional[StartupTimes] = None, **options: Any) -> Session:
    """Start this worker's :class:`Session`; every rank calls it once, before building the model.

    ``run_dir``: default ``$ORCH_RUN_DIR`` (orch sets it on every worker); None outside orch: nothing is
    written (pass a directory to have events and metrics anyway). ``config``: a ``config.yaml`` path or an
    ``OrchConfig``; default ``<run_dir>/config.yaml`` when there is one, else the schema's defaults.
    ``process_group``: None joins the job's process group when torchrun started this process (``MASTER_ADDR``
    set) and none exists yet; True always joins one (a lone process gets a private world of one, as DDP
    needs); False never does. ``options``: :class:`Session`'s keyword options (``max_steps``, ``checkpoint_url``,
    ``every_n_steps``, ...), which override the config.

    Rank 0 records ``rendezvous_complete`` (and ``restart`` when torchrun restarted the workers; the
    fault-tolerance mode says what, :meth:`~orchestrator.ft.steps.StepProtocol.record_start`). A failure
    here is recorded as ``worker_failed`` like one in the training loop. Use the session as a context manager
    (``with elastic.init() as session:``), which finishes it, or reports the failure, on the way out.
    """
    run_dir = run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV)
    run_dir = str(run_dir) if run_dir is not None else None
    ctx = DistContext.from_env()
    startup = startup or StartupTimes()
    if "imports_t" not in startup.fields():
        startup.mark("imports")
    events = WorkerEvents(run_dir, ctx)  # writes nothing without a run dir
    try:
        cfg = _load_config(config, run_dir)
        startup.mark("config")
        session = Session(cfg, ctx, run_dir, startup=startup, **options)
        owns = _join(process_group, session, cfg)
        session.owns_process_group = owns
        startup.mark("process_group")
        session.ft.record_start(events.emit, ctx)  # the round this worker joined
        return session
    except BaseException as exc:
        if not isinstance(exc, SystemExit) or exc.code:
            report_failure(events, ctx, type(exc), exc, exc.__traceback__)
        raise


def _load_config(config: Union[str, os.PathLike, OrchConfig, None], run_dir: Optional[str]) -> Optional[OrchConfig]:
    if isinstance(config, OrchConfig):
        return config
    if config is None and run_dir is not None and (Path(run_dir) / CONFIG_FILE).exists():
        config = Path(run_dir) / CONFIG_FILE
    return load_run_config(str(config)) if config is not None else None


def _join(process_group: Optional[bool], session: Session, cfg: Optional[OrchConfig]) -> bool:
    """Join the process group as ``process_group`` says; returns whether this call created it."""
    if collectives.grouped() or process_group is False:
        return False
    if process_group is None and "MASTER_ADDR" not in os.environ:
        return False
    backend = backend_for(cfg, session.device)
    init_process_group(session.ctx, backend.name, backend.timeout_s)
    return True


def backend_for(cfg: Optional[OrchConfig], device: torch.device) -> BackendConfig:
    """The run's process-group backend; without a config, NCCL on CUDA and gloo on CPU."""
    if cfg is not None:
        return cfg.backend
    return BackendConfig(name="nccl" if device.type == "cuda" else "gloo")
