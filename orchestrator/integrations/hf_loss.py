"""Which models ``transformers.Trainer`` takes for ones that sum their loss, when they average it themselves:
the check behind :func:`orchestrator.integrations.hf.averages_its_own_loss`'s warning, shared by the Trainer's
loop (:mod:`orchestrator.integrations.hf`) and the per_step loop (:mod:`orchestrator.integrations.hf_per_step`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _loss_scaled_by_trainer(model: torch.nn.Module) -> bool:
    """Whether the Trainer will take ``model``'s loss for a token sum it is not (see :func:`averages_its_own_loss`):
    a ``forward(**kwargs)``, no ``accepts_loss_kwargs`` and no use of ``num_items_in_batch`` in its source."""
    import inspect

    model = getattr(model, "module", model)  # DDP's wrapper
    if getattr(model, "accepts_loss_kwargs", None) is not None:
        return False
    try:
        forward = inspect.unwrap(type(model).forward)
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
        source = inspect.getsource(forward)
    except (TypeError, OSError, ValueError):
        return False
    return takes_kwargs and "num_items_in_batch" not in source and "loss_function" not in source


def warn_if_loss_scaled(model: Any, scale: int, is_main: bool) -> None:
    """On rank 0, one line naming the fix when the Trainer will scale ``model``'s mean loss by ``scale`` (world
    size x accumulation; see :func:`averages_its_own_loss`)."""
    if is_main and scale > 1 and isinstance(model, torch.nn.Module) and _loss_scaled_by_trainer(model):
        print(f"[orch] warning: {type(getattr(model, 'module', model)).__name__} averages its own loss, so "
              f"transformers.Trainer scales its loss and gradients by {scale} (world size x accumulation). Fix: "
              "build the Trainer with orchestrator.integrations.hf.averages_its_own_loss(model)",
              file=sys.stderr, flush=True)
