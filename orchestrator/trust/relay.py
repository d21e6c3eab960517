"""A loopback relay for clients that cannot do the handshake: torch's own TCPStore client.

torchrun's agent and the workers it starts speak torch's store protocol and nothing else. Each agent runs a
:class:`LocalRelay` per store it needs, on 127.0.0.1 at a free port. It admits a connection only when the
connecting socket belongs to its own process tree (:mod:`~orchestrator.trust.peers`): the agent itself and its
workers. It then dials the run's gate, completes the handshake for the relay's route on the client's behalf
(the secret is in the agent's environment), and copies bytes both ways. Anyone else on the host, of any user,
is refused and reported.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Optional, Union

from orchestrator.trust.acceptor import BoundedAcceptor, Refused, relay
from orchestrator.trust.handshake import connect
from orchestrator.trust.peers import connected_from_tree

Route = Union[str, Callable[[], str]]


class LocalRelay(BoundedAcceptor):
    """127.0.0.1:``port`` (free) -> the gate at ``upstream``, route ``route`` (or ``route()``, read at each
    connection: a per-round store changes name between rounds), for ``root_pid``'s process tree only."""

    def __init__(self, upstream: tuple[str, int], secret: str, route: Route, root_pid: Optional[int] = None,
                 on_refused: Optional[Refused] = None, name: str = "orch-relay"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        super().__init__(sock, name, on_refused)
        self.upstream, self.secret, self.route = upstream, secret, route
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.start()

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: what a torch client of this relay dials."""
        return f"127.0.0.1:{self.port}"

    def admit(self, conn: socket.socket, peer) -> Optional[socket.socket]:
        if connected_from_tree(peer[:2], self.address, self.root_pid) is None:
            self.refuse(peer, f"not a process of agent {self.root_pid}'s tree")
            return None
        route = self.route() if callable(self.route) else self.route
        try:
            upstream = connect(self.upstream, self.secret, route)
        except OSError as exc:
            self.refuse(peer, f"upstream {self.upstream[0]}:{self.upstream[1]} failed: {exc}")
            return None
        return upstream

    def serve(self, conn: socket.socket, peer, admitted: object) -> None:
        relay(conn, admitted)  # type: ignore[arg-type]
