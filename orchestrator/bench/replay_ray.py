"""The Ray Train leg of ``orch bench replay``: the driver, run as its own process against the bench's Ray cluster.

    python -m orchestrator.bench.replay_ray --address HOST:PORT --job JOB.json --storage DIR --steps-file F \\
        --max-workers 2

Ray Train v2 (``RAY_TRAIN_V2_ENABLED=1``, the default since Ray 2.5x; checked at start): a ``TorchTrainer`` with
an elastic ``ScalingConfig(num_workers=(1, max))`` (one worker per 1-CPU Ray node: the bench's simulated nodes)
and a ``FailureConfig`` that retries any number of worker failures and preemptions, training the same plain
DDP loop as the bare torchrun leg (``orchestrator/bench/replay_job.py``). Checkpoints go through
``ray.train.report`` every ``save_every`` steps (rank 0's state, the other ranks report without one) and are read
back with ``ray.train.get_checkpoint`` whenever Ray Train (re)starts the workers. After every step the loop asks
``ray.train.get_preemption_info()``, as Ray's docs recommend: the first time a node of the group is being
drained for preemption it reports a just-in-time checkpoint, then trains on until Ray Train tears the group down
at the deadline and restarts it from that checkpoint. Everything else is Ray's defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

V2_ENV = "RAY_TRAIN_V2_ENABLED"


def train_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``: the plain job, resumed from Ray's latest checkpoint if any."""
    import ray.train
    import torch
    import torch.distributed as dist

    from orchestrator.bench.replay_job import Job, PlainTrainer, StepLog

    job = Job.from_json(config["job"])
    trainer = PlainTrainer(job)
    start = 1
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = trainer.load_state_dict(torch.load(Path(d) / "state.pt", map_location="cpu",
                                                       weights_only=True)) + 1
    log = StepLog(config["steps_file"], trainer.rank, trainer.world)
    saved_on_notice = False
    for step in range(start, job.max_steps + 1):
        trainer.train_step(step)
        log.step_done(step)
        noticed = ray.train.get_preemption_info() is not None and not saved_on_notice
        if noticed or step % job.save_every == 0 or step == job.max_steps:
            saved_on_notice |= noticed
            _report(trainer, step)
    dist.barrier()


def _report(trainer, step: int) -> None:
    import ray.train
    import torch
    from ray.train import Checkpoint

    if trainer.rank != 0:
        ray.train.report({"step": step}, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="replay-ckpt-") as d:
        torch.save(trainer.state_dict(step), Path(d) / "state.pt")
        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the Ray cluster's GCS address")
    p.add_argument("--job", required=True, help="a file holding replay_job.Job as JSON")
    p.add_argument("--storage", required=True, help="Ray Train's storage_path (checkpoints)")
    p.add_argument("--steps-file", required=True)
    p.add_argument("--max-workers", type=int, required=True)
    args = p.parse_args()

    os.environ[V2_ENV] = "1"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled

    if not is_v2_enabled():
        raise SystemExit(f"replay: Ray Train v2 is not enabled ({V2_ENV})")
    ray.init(address=args.address, log_to_driver=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"job": Path(args.job).read_text(), "steps_file": args.steps_file},
        scaling_config=ScalingConfig(num_workers=(1, args.max_workers), use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="replay", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=-1, max_preemption_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
