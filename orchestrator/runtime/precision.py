"""Automatic mixed precision: the autocast context and, for fp16, a GradScaler."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """``autocast()`` for the forward pass; ``scaler`` is enabled only for fp16, whose small gradients would
    underflow. The step order with a scaler is scale -> backward -> unscale_ -> clip -> step -> update.

    Under a sharded strategy with amp on, FSDP2's MixedPrecisionPolicy already casts the parameters; autocast
    stays on all the same, so the ops autocast keeps in fp32 (softmax, norms, the loss) still run in fp32."""

    def __init__(self, enabled: bool, dtype: str, device: torch.device,
                 scaler: Optional[torch.amp.GradScaler] = None):
        self.enabled, self.dtype, self.device_type = enabled, DTYPES[dtype], device.type
        # ``scaler``: the parallelism strategy's (a sharded one agrees on inf/NaN over every rank's shards).
        fp16 = enabled and dtype == "fp16"
        self.scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=fp16)

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
