"""The training job ``orch bench replay`` runs outside orch: a plain DDP loop shared by its bare torchrun leg and
its Ray Train leg, so that both train what the orch legs train.

    torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --max-restarts=10 \\
        -m orchestrator.bench.replay_job --job JOB.json --snapshot snapshot.pt --steps-file steps.jsonl

The job is ``conf=cpu_elastic``'s (``job_from_config``): its BertMLM model, its SyntheticTokens data, its global
batch (kept at every world size by gradient accumulation), AdamW with linear warmup and cosine decay, gradient
clipping, one intra-op thread per worker. Step ``s`` trains the global batch of samples ``(s-1)*G .. s*G - 1`` of
one seeded permutation (rank ``r`` of ``w`` takes the ``r``-th ``G/w`` of them), so a run resumed at any world size
trains the same samples in the same order as an uninterrupted one.

Under torchrun (``main``) it follows PyTorch's elastic DDP tutorial: rank 0 saves a snapshot (model, optimizer,
schedule, step) every ``save_every`` steps, and whatever workers torchrun (re)starts load it and go on from there.
The snapshot is written to a temporary file and renamed, so a kill during a save leaves the previous one.
Rank 0 appends ``{"t", "step", "world"}`` to ``--steps-file`` after every step: the timeline the bench reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class Job:
    """One job, every leg alike. ``model``/``data``: BertMLM / SyntheticTokens keyword arguments."""

    model: dict
    data: dict
    global_batch: int
    micro_batch: int
    optim: dict  # AdamW keyword arguments (lr, betas, weight_decay, eps)
    warmup_steps: int
    min_lr_ratio: float
    grad_clip: Optional[float]
    max_steps: int
    save_every: int
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Job":
        return cls(**json.loads(text))


def job_from_config(cfg) -> Job:
    """The plain job equal to an orch config's (a composed ``OrchConfig``)."""
    def kwargs(node: Any) -> dict:
        return {k: v for k, v in dict(node).items() if k != "_target_"}

    optim = kwargs(cfg.optim)
    optim["betas"] = list(optim.get("betas", (0.9, 0.999)))
    return Job(model=kwargs(cfg.model), data=kwargs(cfg.data.dataset), global_batch=cfg.trainer.global_batch_size,
               micro_batch=cfg.trainer.micro_batch_size, optim=optim,
               warmup_steps=int(cfg.scheduler["warmup_steps"]), min_lr_ratio=float(cfg.scheduler["min_lr_ratio"]),
               grad_clip=cfg.trainer.grad_clip_norm, max_steps=cfg.trainer.max_steps,
               save_every=cfg.checkpoint.every_n_steps, seed=cfg.trainer.seed)


class PlainTrainer:
    """DDP over the default process group (already initialized); ``train_step(s)`` trains global step ``s``."""

    def __init__(self, job: Job):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from orchestrator.runtime.data import SyntheticTokens
        from orchestrator.runtime.models import BertMLM
        from orchestrator.runtime.schedule import warmup_cosine

        torch.set_num_threads(1)  # as orch's CPU workers: the simulated nodes share this machine's cores
        self.job, self.rank, self.world = job, dist.get_rank(), dist.get_world_size()
        if job.global_batch % (job.micro_batch * self.world):
            raise ValueError(f"global batch {job.global_batch} does not split into micro-batches of "
                             f"{job.micro_batch} over {self.world} ranks")
        torch.manual_seed(job.seed)
        self.model = DDP(BertMLM(**job.model))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **job.optim)
        self.scheduler = warmup_cosine(self.optimizer, job.warmup_steps, job.max_steps, job.min_lr_ratio)
        self.dataset = SyntheticTokens(**job.data)
        self.order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(job.seed))

    def state_dict(self, step: int) -> dict:
        return {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": step}

    def load_state_dict(self, state: dict) -> int:
        """Load a snapshot; returns the step it was taken after."""
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return int(state["step"])

    def _micro_batches(self, step: int):
        import torch

        g, n = self.job.global_batch, len(self.order)
        share = g // self.world
        start = ((step - 1) * g + self.rank * share) % n
        ids = [int(self.order[(start + i) % n]) for i in range(share)]
        for i in range(0, share, self.job.micro_batch):
            items = [self.dataset[j] for j in ids[i:i + self.job.micro_batch]]
            yield {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "labels")}

    def train_step(self, step: int) -> float:
        import torch

        batches = list(self._micro_batches(step))
        total = 0.0
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.model(batch["input_ids"], batch["labels"]) / len(batches)
                loss.backward()
            total += float(loss.detach())
        if self.job.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


class StepLog:
    """Rank 0's timeline: one ``{"t", "step", "world"}`` line per completed step, appended (a restarted
    worker appends to the same file)."""

    def __init__(self, path: str, rank: int, world: int):
        self.world = world
        self._f = open(path, "a", buffering=1) if rank == 0 else None

    def step_done(self, step: int) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"t": time.time(), "step": step, "world": self.world}) + "\n")


def main() -> None:
    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="a file holding Job as JSON")
    p.add_argument("--snapshot", required=True, help="the snapshot file (read if it exists, written by rank 0)")
    p.add_argument("--steps-file", required=True, help="rank 0 appends one JSON line per completed step")
    args = p.parse_args()

    job = Job.from_json(Path(args.job).read_text())
    dist.init_process_group("gloo")
    trainer = PlainTrainer(job)
    snapshot = Path(args.snapshot)
    start = 1
    if snapshot.exists():  # the tutorial's _load_snapshot: every (re)started worker resumes from the last save
        start = trainer.load_state_dict(torch.load(snapshot, map_location="cpu", weights_only=True)) + 1
    log = StepLog(args.steps_file, trainer.rank, trainer.world)
    for step in range(start, job.max_steps + 1):
        trainer.train_step(step)
        log.step_done(step)
        if trainer.rank == 0 and (step % job.save_every == 0 or step == job.max_steps):
            tmp = snapshot.with_suffix(".tmp")
            torch.save(trainer.state_dict(step), tmp)
            os.replace(tmp, snapshot)
    dist.barrier()  # nobody leaves (and so fails a peer's last all-reduce) before every rank is done


if __name__ == "__main__":
    main()
    # As orchestrator/bench/plain_ddp.py: leave without the interpreter's teardown, which can abort after DDP
    # over gloo (SIGABRT from a gloo thread that needs the GIL while the interpreter finalizes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
