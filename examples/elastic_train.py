"""A complete training script of your own on orch's elastic API: a small MLP regressing synthetic data.

Under orch (preemption notices, checkpoints, resume at any world size, metrics and reports in the run dir)::

    orch launch conf=cpu_elastic launcher=local entrypoint.script=examples/elastic_train.py trainer.max_steps=300

The length comes from ``trainer.max_steps`` and the checkpoint interval from ``checkpoint.every_n_steps``,
like the built-in trainer's. The same file runs without orch, where nothing is written unless asked::

    torchrun --nproc-per-node=2 examples/elastic_train.py              # a bare torchrun
    python examples/elastic_train.py --checkpoint-url /tmp/ckpt        # one process, no process group

Nothing is downloaded: the data is generated from a seed.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import orchestrator.elastic as elastic

GLOBAL_BATCH = 24  # samples per optimizer step, at every world size (24 divides by 4 x 1, 2, 3 ranks)
MICRO_BATCH = 4  # samples per forward/backward on one rank; the rest is gradient accumulation


class SyntheticRegression(Dataset):
    """``y = sin(x @ w)`` plus a little noise, from a fixed seed: every rank builds the same samples."""

    def __init__(self, num_samples: int = 4096, dim: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=g)
        self.y = torch.sin(self.x @ torch.randn(dim, 1, generator=g)) + 0.01 * torch.randn(num_samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batches, accumulation: int,
               device: torch.device) -> torch.Tensor:
    """One optimizer step over ``accumulation`` micro-batches; DDP all-reduces the gradients on the last."""
    total = torch.zeros((), device=device)
    for micro in range(accumulation):
        x, y = next(batches)
        skip_sync = isinstance(model, DDP) and micro < accumulation - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device)) / accumulation
            loss.backward()
        total += loss.detach()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, help="default: trainer.max_steps of the run's config")
    parser.add_argument("--checkpoint-url", help="default: checkpoint.url, else <run dir>/checkpoints")
    args = parser.parse_args()

    with elastic.init(max_steps=args.max_steps, checkpoint_url=args.checkpoint_url) as session:
        torch.manual_seed(0)  # the same initial weights on every rank
        net = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
        net = net.to(session.device)
        model = DDP(net) if session.distributed else net
        optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=session.max_steps)
        session.register(model=net, optim=optim, scheduler=sched)

        start = session.restore()  # the newest valid checkpoint's step; 0 at a fresh start
        data = SyntheticRegression()
        sampler = session.global_batch_sampler(len(data), GLOBAL_BATCH, MICRO_BATCH)
        batches = iter(DataLoader(data, batch_sampler=sampler))
        if session.is_main:
            print(f"world size {session.world_size}, resuming after step {start}, "
                  f"{sampler.accumulation_steps} micro-batch(es) per step", flush=True)

        for _ in session.steps():
            loss = train_step(model, optim, batches, sampler.accumulation_steps, session.device)
            sched.step()
            session.step_done(loss=loss)  # metrics; on a preemption notice: save, then exit 75


if __name__ == "__main__":
    main()
