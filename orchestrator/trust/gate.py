"""The gate: a run's one listening port, which admits only clients that prove they hold the run's secret.

A client completes :mod:`~orchestrator.trust.handshake` and names a route; the gate hands the connection to
that route's handler (the rendezvous store, a per-round workers' store, the per_step quorum service, a peer's
state), which then speaks its own protocol on it. A client that cannot prove the secret, or names no known
route, is cut off before a byte reaches a handler, and ``on_refused`` hears of it.
"""

from __future__ import annotations

import socket
from typing import Callable, Optional

from orchestrator.trust.acceptor import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PENDING, BoundedAcceptor, Refused
from orchestrator.trust.handshake import HANDSHAKE_TIMEOUT_S, HandshakeError, serve

Handler = Callable[[socket.socket, str], None]  # (connection, peer "host:port"); returns when it is done
Routes = Callable[[str], Optional[Handler]]  # route -> its handler, None for an unknown route


class Gate(BoundedAcceptor):
    """Listens on ``sock`` (bound to the plan's address); serves each proven client through ``routes``."""

    def __init__(self, sock: socket.socket, secret: str, routes: Routes, on_refused: Optional[Refused] = None,
                 name: str = "orch-gate", handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_pending: int = DEFAULT_MAX_PENDING):
        if not secret:
            raise ValueError("a gate needs the run's secret")
        super().__init__(sock, name, on_refused, max_connections=max_connections, max_pending=max_pending)
        self.secret, self.routes, self.handshake_timeout_s = secret, routes, handshake_timeout_s
        self.start()

    def admit(self, conn: socket.socket, peer) -> Optional[Handler]:
        try:
            route = serve(conn, self.secret, self.handshake_timeout_s)
        except (HandshakeError, OSError) as exc:  # silence, garbage, a wrong proof: all the same to us
            self.refuse(peer, str(exc) or type(exc).__name__)
            return None
        handler = self.routes(route)
        if handler is None:
            self.refuse(peer, f"unknown route {route[:80]!r}")
        return handler

    def serve(self, conn: socket.socket, peer, admitted: object) -> None:
        admitted(conn, f"{peer[0]}:{peer[1]}")  # type: ignore[operator]
