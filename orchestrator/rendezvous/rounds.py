"""Following the rounds of one rendezvous from the store's side: who is in the current round, who waits, and
which member went silent (a test cluster's partition watch acts on that)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional

from orchestrator.rendezvous.state import Member, RendezvousState, RendezvousStateError, read_state


class RoundWatch:
    """Reads rendezvous ``run_id``'s state through ``client()`` (a store client: the hosting store's own,
    :meth:`~orchestrator.rendezvous.RendezvousStore.client`); ``secret``: the run's, which seals the state;
    ``silence_s``: how old a member's newest keep-alive may be before :meth:`silent` names it."""

    def __init__(self, client: Callable[[], Any], run_id: str, silence_s: float, secret: Optional[str] = None):
        self.client, self.run_id, self.silence_s, self.secret = client, run_id, silence_s, secret
        self._store: Any = None
        self.round: Optional[int] = None
        self.last_seen: dict[Member, Optional[datetime]] = {}  # member of the round -> newest keep-alive

    def _read(self) -> Optional[RendezvousState]:
        if self._store is None:
            self._store = self.client()
        try:
            return read_state(self._store, self.run_id, self.secret)
        except RendezvousStateError:  # a format this orch does not know: nothing to watch (the contract test says why)
            return None

    def silent(self) -> list[Member]:
        """Members of the current complete round whose newest keep-alive is older than ``silence_s``."""
        state = self._read()
        if state is None or state.closed or not state.complete:
            return []
        if state.round != self.round:
            self.round = state.round
            self.last_seen = {m: state.last_heartbeats.get(m) for m in state.participants}
        for member, beat in state.last_heartbeats.items():
            seen = self.last_seen.get(member, False)
            if seen is not False and beat is not None and (seen is None or beat > seen):
                self.last_seen[member] = beat
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=self.silence_s)
        return [m for m, beat in self.last_seen.items() if beat is not None and beat < cutoff]

    def follow(self, run_id: str) -> None:
        """Watch rendezvous ``run_id`` from now on (the Ray controller uses a fresh id for every restart)."""
        if run_id != self.run_id:
            self.run_id, self.round, self.last_seen = run_id, None, {}

    def members(self) -> Optional[set[int]]:
        """The agent PIDs the rendezvous knows now: the round's participants and the nodes waiting to join."""
        state = self._read()
        if state is None:
            return None
        return {m.pid for m in state.members()}

    def silence(self) -> dict[str, float]:
        """Seconds since each member's newest keep-alive, by its address."""
        now = datetime.now(timezone.utc)
        return {m.addr: round((now - b).total_seconds(), 2) for m, b in self.last_seen.items() if b is not None}

    def close(self) -> None:
        self._store = None
