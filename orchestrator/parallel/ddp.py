"""``parallelism.strategy=ddp``: every rank holds the whole model; DistributedDataParallel all-reduces the
gradients during the backward pass, with the ``ddp`` group's flags."""

from __future__ import annotations

import inspect
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from orchestrator.config.schema import DDPConfig
from orchestrator.parallel.base import Strategy
from orchestrator.runtime.distributed import DistContext

DDP_PARAMS = inspect.signature(DDP.__init__).parameters


def ddp_kwargs(d: DDPConfig) -> dict[str, Any]:
    """The ``ddp`` group as DDP's keyword arguments (newer torch renamed broadcast_buffers, the per-forward
    buffer sync, to forward_sync_buffers)."""
    buffers_flag = "forward_sync_buffers" if "forward_sync_buffers" in DDP_PARAMS else "broadcast_buffers"
    return {"static_graph": d.static_graph, "find_unused_parameters": d.find_unused_parameters,
            "gradient_as_bucket_view": d.gradient_as_bucket_view, "bucket_cap_mb": d.bucket_cap_mb,
            buffers_flag: d.broadcast_buffers}


class DDPStrategy(Strategy):
    """DDP around the model, then ``torch.compile`` around DDP (``trainer.compile``), as torch documents for DDP:
    compiling the DDP module lets its DDPOptimizer split the graph at bucket boundaries, so gradient all-reduces
    overlap the backward pass; compiling inside DDP would make the whole backward one graph."""

    name = "ddp"

    def wrap(self, model: nn.Module, ctx: DistContext, device: torch.device, *, timer: Any = None) -> nn.Module:
        d = self.cfg.ddp if self.cfg is not None else DDPConfig()
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs(d))
        if timer is not None:
            timer.register(ddp)
        if self.cfg is not None and self.cfg.trainer.compile:
            return torch.compile(ddp, mode=self.cfg.trainer.compile_mode)
        return ddp

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()
