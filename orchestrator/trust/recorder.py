"""What a run records of the strangers its ports turned away: one event per refusal, rate-limited per peer
host, so a scanner cannot flood the run's events."""

from __future__ import annotations

import threading
import time
from typing import Callable

from orchestrator.events import Event, StoreClientRefused, StoreValueRefused
from orchestrator.rundir import EventLog


def _limited(events: EventLog, per_s: float = 1.0) -> Callable[[str, Event], None]:
    """``write(peer, event)``: ``event``, unless one was written for ``peer``'s host within ``per_s``."""
    last: dict[str, float] = {}
    lock = threading.Lock()

    def write(peer: str, event: Event) -> None:
        host = peer.rsplit(":", 1)[0]
        with lock:
            now = time.monotonic()
            if now - last.get(host, -1e9) < per_s:
                return
            last[host] = now
        events.write(event)

    return write


def refusal_recorder(events: EventLog, port: str = "store") -> Callable[[str, str], None]:
    """``on_refused(peer, reason)`` for a listener of the run: ``store_client_refused`` events (``port`` names
    which listener: the store's gate, an agent's relay, a peer's state server)."""
    write = _limited(events)
    return lambda peer, reason: write(peer, StoreClientRefused(peer=peer, port=port, reason=reason))


def value_refusal_recorder(events: EventLog) -> Callable[[str, str], None]:
    """``on_value_refused(key, peer)`` for the run's store: ``store_value_refused`` events."""
    write = _limited(events)
    reason = "not sealed with the run's secret"
    return lambda key, peer: write(peer, StoreValueRefused(key=key, peer=peer, reason=reason))
