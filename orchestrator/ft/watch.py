"""A worker's watch on the quorum it trains in (per_step): told at once when another member of that quorum is
dropped, so the worker aborts the collectives it would otherwise leave to ``collective_timeout_s``.

One daemon thread per worker and one authenticated connection to the quorum service (op ``watch``, see
:meth:`orchestrator.ft.quorum.QuorumService.call`), long-polled: the service answers when a member of the
watched quorum is no longer healthy (dropped by the driver, left on a notice, its heartbeats aged out or its
heartbeat connection closed), else after ``poll_s`` with nothing, and the thread asks again. A quorum is
reported once; the next one is watched once the worker follows it (:meth:`QuorumWatch.follow`). The thread
never keeps the worker from exiting (a daemon, blocked at most in a socket read).

With ``on_wanted`` the watch is also told when the quorum followed is wanted anew (a *steady* quorum, trained
in without a round trip per step: see :mod:`orchestrator.ft.replica`), once per level (1: a group outside it
asks to join; 2: another member asks already), and goes on watching it for drops.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from orchestrator.ft.coordination import QuorumClient

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""How long the thread waits before asking again after the service could not be reached or refused."""
STEADY_POLL_S = 0.5
"""How long a watch with ``on_wanted`` is held at most: a quorum followed anew (even under the same id) is
asked about within that."""


class QuorumWatch:
    """Watches quorum after quorum for rank ``group_rank`` of replica group ``replica_id`` (its full id, as the
    quorum service knows it) and calls ``on_dropped(quorum_id, replica_ids)`` from its own thread when members of
    the quorum being followed are gone."""

    def __init__(self, replica_id: str, group_rank: int, on_dropped: Callable[[int, list[str]], None],
                 client: Optional[QuorumClient] = None, poll_s: float = 30.0,
                 on_wanted: Optional[Callable[[int, int, Optional[int]], None]] = None):
        self.replica_id, self.group_rank = replica_id, group_rank
        self.on_dropped = on_dropped
        self.on_wanted = on_wanted
        """Called ``(quorum_id, level, at_step)`` from the thread when the quorum followed is wanted anew."""
        self._seen: tuple[Optional[int], int] = (None, 0)  # (quorum id, the wanted level reported of it)
        self.poll_s = poll_s if on_wanted is None else min(poll_s, STEADY_POLL_S)
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
            self._seen = (None, 0)  # a quorum formed anew: what it was wanted for is answered
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
                seen = self._seen[1] if self._seen[0] == quorum_id else 0
                steady = {"steady": True, "seen": seen} if self.on_wanted is not None else {}
                answer = self._client.call("watch", timeout_s=self.poll_s, replica_id=self.replica_id,
                                           group_rank=self.group_rank, quorum_id=quorum_id, **steady)
                if answer.get("quorum_id") != quorum_id:
                    continue
                dropped = [str(r) for r in answer.get("dropped") or []]
                if dropped:
                    with self._cond:
                        self._reported = quorum_id
                    self.on_dropped(quorum_id, dropped)
                elif self.on_wanted is not None and int(answer.get("wanted") or 0) > seen:
                    self._seen = (quorum_id, int(answer["wanted"]))
                    self.on_wanted(quorum_id, self._seen[1], answer.get("at_step"))
            except Exception as exc:  # noqa: BLE001 - the service away, this group out of it: ask again later
                log.debug("quorum watch of %s: %s", self.replica_id, exc)
                with self._cond:
                    self._cond.wait(RETRY_S)
        self._client.close()
