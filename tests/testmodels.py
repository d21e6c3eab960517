"""Models and scripts that exist only for tests (importable by workers: tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import torch
from torch import nn


class UnusedBranchMLM(nn.Module):
    """A masked-LM whose ``unused`` branch never contributes to the loss: DDP must be told
    (``find_unused_parameters=true``) or it fails at the next step, as torch documents."""

    def __init__(self, vocab_size: int, hidden_size: int, **_ignored):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.used = nn.Linear(hidden_size, vocab_size)
        self.unused = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.used(self.embedding(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class FailingMLM(UnusedBranchMLM):
    """Raises in forward on one rank once ``fail_at_call`` forwards have run there: a deterministic user bug."""

    def __init__(self, vocab_size: int, hidden_size: int, fail_rank: int = 1, fail_at_call: int = 3, **_ignored):
        super().__init__(vocab_size, hidden_size)
        del self.unused  # only the failure under test, no DDP complaint
        self.fail_rank, self.fail_at_call, self.calls = fail_rank, fail_at_call, 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import os

        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.fail_rank and self.calls >= self.fail_at_call:
            raise ValueError(f"deliberate bug in user code at forward {self.calls}")
        return nn.functional.cross_entropy(self.used(self.embedding(input_ids)).flatten(0, 1), labels.flatten(),
                                           ignore_index=-100)


class SlowMLM(UnusedBranchMLM):
    """Sleeps ``delay_s`` in every forward: a run long enough to be watched, stopped and resumed by a test."""

    def __init__(self, vocab_size: int, hidden_size: int, delay_s: float = 0.03, **_ignored):
        super().__init__(vocab_size, hidden_size)
        del self.unused
        self.delay_s = delay_s

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.delay_s)
        return nn.functional.cross_entropy(self.used(self.embedding(input_ids)).flatten(0, 1), labels.flatten(),
                                           ignore_index=-100)
