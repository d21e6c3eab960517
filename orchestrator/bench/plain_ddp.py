"""A plain, hand-written DDP training script: the baseline ``orch bench overhead`` measures orch against.

    torchrun --standalone --nproc-per-node 2 orchestrator/bench/plain_ddp.py --steps 100 --out plain.json \\
        --model '{"vocab_size": 512, ...}' --data '{"num_samples": 8192, ...}' --ddp '{"gradient_as_bucket_view": true, ...}'

What a user would write without orch: DDP, a DistributedSampler, AdamW with linear warmup and cosine decay,
gradient clipping, the loss all-reduced and printed every ``--log-every`` steps. The model and dataset
classes and every setting, DDP's flags included, are those of ``conf=cpu_gloo`` (the bench passes them in),
so both sides run the same job; none of orch's runtime (trainer, checkpoints, preemption, metrics, timing) is used.

Rank 0 writes ``--out``: ``{"first_step_t": unix time after step 1, "log_t": {step: unix time}}``. Each rank
then leaves with ``os._exit`` (the end of this file says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from orchestrator.runtime.data import SyntheticTokens
from orchestrator.runtime.models import BertMLM
from orchestrator.runtime.schedule import warmup_cosine


def batches(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--model", type=json.loads, required=True, help="BertMLM keyword arguments, as JSON")
    p.add_argument("--data", type=json.loads, required=True, help="SyntheticTokens keyword arguments, as JSON")
    p.add_argument("--ddp", type=json.loads, default={}, help="DistributedDataParallel keyword arguments, as JSON")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(BertMLM(**args.model), **args.ddp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)
    scheduler = warmup_cosine(optimizer, warmup_steps=5, total_steps=args.steps, min_lr_ratio=0.1)
    dataset = SyntheticTokens(**args.data)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    data = batches(DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, drop_last=True), sampler)
    accumulation = args.global_batch // (args.micro_batch * world)
    first_step_t, log_t = None, {}
    for step in range(1, args.steps + 1):
        total = torch.zeros(())
        for micro in range(accumulation):
            batch = next(data)
            with model.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                loss = model(batch["input_ids"], batch["labels"]) / accumulation
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            first_step_t = time.time()
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(total)
            if rank == 0:
                print(f"step {step}/{args.steps} loss {total.item() / world:.4f}", flush=True)
            log_t[step] = time.time()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_t": first_step_t, "log_t": log_t}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown. DDP keeps the gloo process group, and so its worker threads, alive
    # past destroy_process_group; a worker thread that drops its hold on a Python tensor (the last all-reduce's)
    # needs the GIL, a finalizing interpreter ends that thread instead, and the unwind through torch's noexcept
    # destructor aborts the process ("terminate called without an active exception", SIGABRT) after a run that
    # completed. Everything is written; what teardown would add is only that race.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
