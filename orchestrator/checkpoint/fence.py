"""The workers' side of fencing: before a checkpoint is committed, the lease on its URL must still be this run's.

The launcher holds the lease (orchestrator/checkpoint/lease.py); the worker that writes checkpoints (rank 0)
knows its run by ``ORCH_RUN_ID`` and ``ORCH_RUN_SECRET``, which orch's launcher gives every worker. A
:class:`LeaseFence` reads the lease right before a save starts writing and again right before the commit (the
manifest write, or the rename that publishes the step) and refuses the save when the lease there is not a live
one of this run, proved with the run's secret: held by another run, under this run id by a process without
the secret, removed, or no longer renewed. Once it saw another run holding the lease it refuses every later
save without looking again: a run whose lease was taken never writes there again.

This is a check, then a write: a lease taken over between the two is seen at the next save. Object stores
offer fsspec no write conditioned on another object, so no store-side fence closes that window.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from orchestrator.trust.secret import RUN_SECRET_ENV

from .lease import LeaseFiles
from .lease_record import Verdict, judge
from .storage import CheckpointStorage, normalize_url, url_scheme

RUN_ID_ENV = "ORCH_RUN_ID"


class LeaseFence:
    """Whether the lease on ``url`` is a live lease of ``run_id`` (proved with ``secret`` where the lease
    carries a proof: see :func:`~.lease_record.judge`)."""

    def __init__(self, url: str, run_id: str, secret: Optional[str] = None):
        self.url, self.run_id, self.secret = url, run_id, secret or None
        self.files = LeaseFiles(CheckpointStorage(url))
        self.lost: Optional[Verdict] = None

    def refusal(self) -> Optional[Verdict]:
        """None when a save may go on, else why not (``lost_to`` set when another run holds the lease)."""
        if self.lost is not None:
            return self.lost
        verdict = judge(self.files.current()[1], self.run_id, self.secret, time.time())
        if verdict is not None:
            why = f"the lease on {self.url} is not a live lease of this run ({self.run_id}): {verdict.reason}"
            verdict = Verdict(why, verdict.lost_to)
            if verdict.lost_to is not None:
                self.lost = verdict
        return verdict


def fence_from_env(url: str, leased_url: Optional[str]) -> Optional[LeaseFence]:
    """The fence for a worker saving to ``url`` under orch's launcher: None outside orch (no ``ORCH_RUN_ID``),
    for a URL other than the one the launcher leased (``leased_url``: ``checkpoint.url`` or the run dir's
    ``checkpoints``; a script's own URL is not leased), and for ``memory://`` (each process has its own)."""
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id or leased_url is None or url_scheme(url) == "memory":
        return None
    try:
        if normalize_url(url) != normalize_url(leased_url):
            return None
    except ValueError:
        return None
    return LeaseFence(url, run_id, os.environ.get(RUN_SECRET_ENV))
