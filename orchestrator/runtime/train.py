"""Entry point of every built-in worker: ``python -m orchestrator.runtime.train --config RUN_DIR/config.yaml``.

torchrun starts it once per rank. It reads the run's resolved config, joins the process group, trains,
and reports: rank 0 writes ``rendezvous_complete``/``restart``/``worker_started``/``training_finished`` events,
and any rank that fails writes ``worker_failed`` with its traceback so the launcher can name the root-cause rank.
"""

from __future__ import annotations

import time

ENTRY_T = time.time()  # before the heavy imports below: start-up timing tells interpreter start from imports

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from orchestrator.config.compose import load_run_config
from orchestrator.rundir import EventLog, EventName
from orchestrator.runtime.distributed import DistContext, init_process_group
from orchestrator.runtime.preemption import PreemptedExit
from orchestrator.runtime.timing import StartupTimes
from orchestrator.runtime.trainer import Trainer


@record  # writes torchrun's error file, so torchrun's own summary names this rank too
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrator.runtime.train")
    parser.add_argument("--config", required=True, help="a run dir's resolved config.yaml")
    args = parser.parse_args(argv)
    run_dir = os.environ.get("ORCH_RUN_DIR") or str(Path(args.config).parent)
    events, ctx = EventLog(run_dir), DistContext.from_env()
    startup = StartupTimes(entry_t=ENTRY_T)  # rank 0 reports it as worker_started, just before the first step
    startup.mark("imports")
    try:
        cfg = load_run_config(args.config)
        startup.mark("config")
        init_process_group(ctx, cfg.backend.name, cfg.backend.timeout_s)
        startup.mark("process_group")
        if ctx.is_main:
            events.emit(EventName.RENDEZVOUS_COMPLETE, world_size=ctx.world_size, restart_count=ctx.restart_count,
                        nnodes=ctx.world_size // ctx.local_world_size)
            if ctx.restart_count:
                events.emit(EventName.RESTART, restart_count=ctx.restart_count, world_size=ctx.world_size,
                            reason="workers restarted by the torchrun agent")
        Trainer(cfg, ctx, run_dir, events, startup=startup).fit()
    except PreemptedExit as exc:
        # Not a failure: the launcher reads the exit code as "preempted". The emergency checkpoint is committed
        # and every rank passed the barrier after it; events and samples are appended line by line. Leave now:
        # a torch interpreter's teardown (process group, modules) takes 1-2 s on a busy node, and the
        # survivors' restart waits for this exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.code)
    except BaseException as exc:
        if not isinstance(exc, SystemExit) or exc.code:
            events.emit(EventName.WORKER_FAILED, rank=ctx.rank, node=ctx.node, restart_count=ctx.restart_count,
                        error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
