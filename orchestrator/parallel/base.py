"""What a parallelism strategy is: the one seam between a training loop and how its model is spread over the
ranks (torchtitan's ``parallelize`` step). The trainer and ``session.wrap`` call these methods and never ask
which strategy they hold.

The order a loop follows: ``build`` the model from a factory (or ``wrap`` one built already), then build the
optimizer over the *wrapped* module's parameters (a sharded strategy turns them into DTensors), take the grad
scaler from ``grad_scaler``, run accumulation micro-steps inside ``no_sync``, clip with ``clip_grad_norm_``, and
register ``unwrap(model)`` for checkpoints.

A fault-tolerance mode that averages gradients over what the process group does not span (per_step's other
replica groups) passes a :class:`GradientHandoff` to ``build``/``wrap`` (``handoff=``, only then): the strategy
hands it each gradient as soon as it is final within the group, so that averaging overlaps the backward pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
from torch import nn

from orchestrator.config.schema import OrchConfig
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import unwrap


class GradientHandoff(Protocol):
    """Takes gradients once they are final within the process group (reduced over its ranks), in a backward pass
    that synchronizes gradients (never inside ``no_sync``), one way or the other. Called from the thread that
    finished them (autograd's, or a collective's)."""

    def reduce(self, buffer: torch.Tensor, params: list[torch.Tensor],
               after: Optional["torch.futures.Future"] = None) -> "torch.futures.Future":
        """``buffer``: the flat gradients of ``params`` in that order (a bucket whose parameters are the same in
        every replica of the model), final once ``after`` (the group's own all-reduce of it) completes: it is
        averaged in place; the future completes with ``buffer`` then. Buffers are handed over in the same order
        on every rank of the job."""

    def ready(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad``: ``param``'s gradient (or its local shard, or a view of either), which the strategy may reuse
        once this returns."""


class Strategy:
    """One way to spread a model over the process group. ``cfg``: the run's config (``None``: the schema's
    defaults, e.g. a script outside orch). Subclasses set ``name`` and ``sharded`` and override what differs;
    the defaults here are those of a module every rank holds whole."""

    name: str = "none"
    sharded: bool = False
    """Whether each rank holds only a shard of parameters, gradients and optimizer state (its checkpoints then
    need a sharded engine: ``checkpoint.engine=dcp``)."""

    def __init__(self, cfg: Optional[OrchConfig] = None):
        self.cfg = cfg

    def build(self, factory: Callable[[], nn.Module], ctx: DistContext, device: torch.device, *,
              timer: Any = None, handoff: Optional[GradientHandoff] = None) -> nn.Module:
        """The model ``factory()`` makes, spread over the ranks: by default :meth:`wrap` of the model built on
        every rank and moved to ``device``. A sharded strategy overrides it so that a model that does not fit one
        device is never built whole on every rank. Every rank calls it with the same factory (same seed)."""
        return self.wrap(factory().to(device), ctx, device, timer=timer, **handoff_kwargs(handoff))

    def wrap(self, model: nn.Module, ctx: DistContext, device: torch.device, *, timer: Any = None,
             handoff: Optional[GradientHandoff] = None) -> nn.Module:
        """The module to call forward on (``model`` is on ``device``, identical on every rank or made so here).
        ``timer``: a StepTimer whose communication hooks the strategy may install. ``handoff``: where to hand
        each gradient once it is final within the group (a strategy that does not is still correct: the mode
        then takes the gradients after the backward pass). Every rank calls it."""
        return model

    def no_sync(self, model: nn.Module) -> ContextManager:
        """A context for gradient-accumulation micro-steps: gradients accumulate locally, unsynchronized, until
        the last micro-step's backward (outside it) synchronizes their sum."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``model``'s parameters to a global norm of ``max_norm``; returns the norm
        before clipping (the same on every rank)."""
        return torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm)

    def grad_scaler(self, enabled: bool, device: torch.device) -> torch.amp.GradScaler:
        """The grad scaler of an fp16 run (``enabled``); a disabled one (a pass-through) otherwise."""
        return torch.amp.GradScaler(device.type, enabled=enabled)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module whose state dict is the model's (no wrapper prefixes): what checkpoints register."""
        return unwrap(model)


def handoff_kwargs(handoff: Optional[GradientHandoff]) -> dict[str, Any]:
    """``handoff=`` only when there is one: a plug-in strategy written before the handoff keeps working."""
    return {"handoff": handoff} if handoff is not None else {}
