"""What a run records of the strangers its ports turned away: one event per refusal, rate-limited per peer
host, so a scanner cannot flood the run's events."""

from __future__ import annotations

import threading
import time
from typing import Callable

from orchestrator.rundir import EventLog, EventName


def _limited(events: EventLog, event: str, per_s: float = 1.0) -> Callable[..., None]:
    last: dict[str, float] = {}
    lock = threading.Lock()

    def emit(peer: str, **fields) -> None:
        host = peer.rsplit(":", 1)[0]
        with lock:
            now = time.monotonic()
            if now - last.get(host, -1e9) < per_s:
                return
            last[host] = now
        events.emit(event, peer=peer, **fields)

    return emit


def refusal_recorder(events: EventLog, port: str = "store") -> Callable[[str, str], None]:
    """``on_refused(peer, reason)`` for a listener of the run: ``store_client_refused`` events (``port`` names
    which listener: the store's gate, an agent's relay, a peer's state server)."""
    emit = _limited(events, EventName.STORE_CLIENT_REFUSED)
    return lambda peer, reason: emit(peer, port=port, reason=reason)


def value_refusal_recorder(events: EventLog) -> Callable[[str, str], None]:
    """``on_value_refused(key, peer)`` for the run's store: ``store_value_refused`` events."""
    emit = _limited(events, EventName.STORE_VALUE_REFUSED)
    return lambda key, peer: emit(peer, key=key, reason="not sealed with the run's secret")
