"""A worker's watch on the quorum it trains in (per_step): told at once when another member of that quorum is
dropped, so the worker aborts the collectives it would otherwise leave to ``collective_timeout_s``.

One daemon thread per worker and one authenticated connection to the quorum service (op ``watch``, see
:meth:`orchestrator.ft.quorum.QuorumService.call`), long-polled: the service answers when a member of the
watched quorum is no longer healthy (dropped by the driver, left on a notice, its heartbeats aged out or its
heartbeat connection closed), else after ``poll_s`` with nothing, and the thread asks again. A quorum is
reported once; the next one is watched once the worker follows it (:meth:`QuorumWatch.follow`). The thread
never keeps the worker from exiting (a daemon, blocked at most in a socket read).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from orchestrator.ft.coordination import QuorumClient

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""How long the thread waits before asking again after the service could not be reached or refused."""


class QuorumWatch:
    """Watches quorum after quorum for rank ``group_rank`` of replica group ``replica_id`` (its full id, as the
    quorum service knows it) and calls ``on_dropped(quorum_id, replica_ids)`` from its own thread when members of
    the quorum being followed are gone."""

    def __init__(self, replica_id: str, group_rank: int, on_dropped: Callable[[int, list[str]], None],
                 client: Optional[QuorumClient] = None, poll_s: float = 30.0):
        self.replica_id, self.group_rank = replica_id, group_rank
        self.on_dropped = on_dropped
        self.poll_s = poll_s
        self._client = client if client is not None else QuorumClient()
        self._cond = threading.Condition()
        self._following: Optional[int] = None
        self._reported: Optional[int] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="orch-ft-watch")
        self._thread.start()

    def follow(self, quorum_id: Optional[int]) -> None:
        """The quorum this worker trains in from now on (None: one without other groups, nothing to watch)."""
        with self._cond:
            self._following = quorum_id
            self._cond.notify_all()

    def close(self) -> None:
        """Stop asking (a watch being held ends when the service answers it or the process exits)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> Optional[int]:
        """The quorum to watch: the one followed, unless it was reported already; None once closed."""
        with self._cond:
            while not self._closed and (self._following is None or self._following == self._reported):
                self._cond.wait()
            return None if self._closed else self._following

    def _run(self) -> None:
        while (quorum_id := self._next()) is not None:
            try:
                answer = self._client.call("watch", timeout_s=self.poll_s, replica_id=self.replica_id,
                                           group_rank=self.group_rank, quorum_id=quorum_id)
                dropped = [str(r) for r in answer.get("dropped") or []]
                if dropped and answer.get("quorum_id") == quorum_id:
                    with self._cond:
                        self._reported = quorum_id
                    self.on_dropped(quorum_id, dropped)
            except Exception as exc:  # noqa: BLE001 - the service away, this group out of it: ask again later
                log.debug("quorum watch of %s: %s", self.replica_id, exc)
                with self._cond:
                    self._cond.wait(RETRY_S)
        self._client.close()
