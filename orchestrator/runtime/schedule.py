"""Learning-rate schedules: ``LambdaLR`` factories, instantiated from ``conf/scheduler/`` with the optimizer."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup_then(decay, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay(progress)

    return factor


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x lr at ``total_steps``."""
    return LambdaLR(optimizer, _warmup_then(lambda p: 0.5 * (1 + math.cos(math.pi * p)), warmup_steps, total_steps,
                                            min_lr_ratio))


def warmup_linear(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup over ``warmup_steps``, then linear decay to ``min_lr_ratio`` x lr at ``total_steps``."""
    return LambdaLR(optimizer, _warmup_then(lambda p: 1.0 - p, warmup_steps, total_steps, min_lr_ratio))


def constant(optimizer: Optimizer) -> LambdaLR:
    """The optimizer's learning rate, unchanged."""
    return LambdaLR(optimizer, lambda step: 1.0)
