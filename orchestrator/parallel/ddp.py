"""``parallelism.strategy=ddp``: every rank holds the whole model; DistributedDataParallel all-reduces the
gradients during the backward pass, with the ``ddp`` group's flags.

With a gradient handoff (per_step), DDP's comm hook hands each bucket over, in place, as soon as the group's own
all-reduce of it is done, and DDP waits for the handoff's average before it writes ``.grad``. DDP then runs with
``find_unused_parameters=True``, as torchft's DDP does: that is what keeps DDP from rebuilding its buckets in
the order the first backward pass produced gradients, so bucket *i* holds the same parameters in every replica
group, one that joins late included (torch warns once that none was unused)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from orchestrator.config.schema import DDPConfig
from orchestrator.parallel.base import GradientHandoff, Strategy
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

    def wrap(self, model: nn.Module, ctx: DistContext, device: torch.device, *, timer: Any = None,
             handoff: Optional[GradientHandoff] = None) -> nn.Module:
        d = self.cfg.ddp if self.cfg is not None else DDPConfig()
        kwargs = ddp_kwargs(d)
        if handoff is not None:
            kwargs["find_unused_parameters"] = True  # the same buckets in every group, at every step
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
        hook = handing_hook(handoff) if handoff is not None else None
        if timer is not None:
            timer.register(ddp, hook)
        elif hook is not None:
            ddp.register_comm_hook(None, hook)
        if self.cfg is not None and self.cfg.trainer.compile:
            return torch.compile(ddp, mode=self.cfg.trainer.compile_mode)
        return ddp

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()


def handing_hook(handoff: GradientHandoff) -> Callable:
    """A DDP comm hook: torch's default all-reduce of the bucket over the group (skipped in a group of one rank:
    averaging over one rank changes nothing), then the bucket handed over in place; DDP copies it into ``.grad``
    once the handoff's future completes. DDP calls a comm hook in bucket order, and only in backward passes
    that synchronize (not inside ``no_sync``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):  # no annotations: DDP rejects the string ones of this module
        grouped = allreduce_hook(process_group, bucket) if dist.get_world_size(process_group) > 1 else None
        return handoff.reduce(bucket.buffer(), bucket.parameters(), after=grouped)

    return hook
