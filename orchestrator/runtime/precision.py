"""Automatic mixed precision: the autocast context and, for fp16, a GradScaler."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """``autocast()`` for the forward pass; ``scaler`` is enabled only for fp16, whose small gradients would
    underflow. The step order with a scaler is scale -> backward -> unscale_ -> clip -> step -> update."""

    def __init__(self, enabled: bool, dtype: str, device: torch.device):
        self.enabled, self.dtype, self.device_type = enabled, DTYPES[dtype], device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=enabled and dtype == "fp16")

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
