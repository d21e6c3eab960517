"""Which fault-tolerance mode a worker runs (the driver's choice is orchestrator/ft/driver.py's)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from orchestrator.config.schema import OrchConfig
from orchestrator.ft import QUORUM_ENV
from orchestrator.ft.steps import RestartSteps, StepProtocol
from orchestrator.runtime.distributed import DistContext


def step_protocol(cfg: Optional[OrchConfig], ctx: DistContext, device: torch.device,
                  max_steps: Optional[int] = None) -> StepProtocol:
    """This worker's mode: per_step under orch's launcher (it hosts the quorum service and says where:
    ``ORCH_FT_QUORUM``), restart otherwise (no config, a bare torchrun, or ``fault_tolerance.mode=restart``).
    ``max_steps``: the last step the loop trains (default ``trainer.max_steps``): per_step forms no quorum
    ahead of a step that will not come."""
    if cfg is not None and cfg.fault_tolerance.mode == "per_step" and os.environ.get(QUORUM_ENV):
        from orchestrator.ft.replica import PerStepSteps  # torchft: an optional extra

        return PerStepSteps(cfg, ctx, device, cfg.trainer.max_steps if max_steps is None else max_steps)
    return RestartSteps()
