"""Entry point of every built-in worker: ``python -m orchestrator.trainer.train --config RUN_DIR/config.yaml``.

torchrun starts it once per rank. It enters the run through the elastic API, as a user's script would
(``elastic.init``: the resolved config, the process group, ``rendezvous_complete``/``restart``), and trains
with the built-in trainer. The session reports the rest: ``worker_started``/``training_finished``, and
``worker_failed`` with the traceback from any rank that fails, so the launcher can name the root-cause rank;
a preempted worker leaves with exit status 75 once its emergency checkpoint is committed.
"""

from __future__ import annotations

import time

ENTRY_T = time.time()  # before the heavy imports below: start-up timing tells interpreter start from imports

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

import orchestrator.elastic as elastic
from orchestrator.runtime.timing import StartupTimes
from orchestrator.trainer.trainer import Trainer


@record  # writes torchrun's error file, so torchrun's own summary names this rank too
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orchestrator.trainer.train")
    parser.add_argument("--config", required=True, help="a run dir's resolved config.yaml")
    args = parser.parse_args(argv)
    run_dir = os.environ.get("ORCH_RUN_DIR") or str(Path(args.config).parent)
    startup = StartupTimes(entry_t=ENTRY_T)  # rank 0 reports it as worker_started, just before the first step
    startup.mark("imports")
    with elastic.init(args.config, run_dir=run_dir, process_group=True, step_timer=True, startup=startup) as session:
        Trainer(session).fit()
    return 0


def leave(code: int) -> None:
    """Exit like a normal interpreter exit, minus its final teardown (module and object clean-up).

    DDP keeps the gloo process group, and so its worker threads, alive past destroy_process_group. A worker
    thread that drops its hold on a Python tensor (the last collective's) needs the GIL; once the interpreter
    is finalizing, taking the GIL ends that thread instead, and the unwind through torch's noexcept destructor
    aborts the process ("terminate called without an active exception", SIGABRT) after a run that finished:
    torchrun then restarts finished workers. What a normal exit does before that point still happens here:
    non-daemon threads are joined and atexit handlers run (trackers, logging, multiprocessing children).
    """
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())  # a failure raises out of main() as before: @record's error file, the traceback, exit 1
