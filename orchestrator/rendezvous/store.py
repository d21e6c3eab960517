"""The c10d rendezvous store, hosted by a long-lived orch process and never by a worker node.

torchrun agents connect with ``--rdzv-conf is_host=false``, so losing any node never takes rendezvous down:
the survivors re-rendezvous against this store within the keep-alive timeouts.

Whoever hosts the store also sees every agent exit, which torchrun's rendezvous only learns from a missed
keep-alive: ``evict`` takes a departed agent out of the round at once, so the next round need not wait for
its keep-alive to expire, and reopens a round its departure broke, so the survivors never wait for it.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Callable, Optional

from torch.distributed import TCPStore

from orchestrator.rendezvous import state as rdzv_state
from orchestrator.rendezvous.gate import StoreGate
from orchestrator.rendezvous.state import Eviction, RendezvousState


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address``:``port`` only (0: a free port); ``"0.0.0.0"`` or ``"::"`` for
    every interface."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # every interface, IPv4 too
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class RendezvousStore:
    """A TCPStore server on ``host``:``port`` (0 picks a free port). ``endpoint`` is what agents dial.

    The server listens on ``listen`` only (default: ``host``, the address the plan gives agents), never on
    every interface unless asked (``listen="0.0.0.0"``): whoever reaches the store can rewrite the rendezvous.
    torch's ``TCPStore`` server binds ``::`` (every interface) whatever host it is given, so orch binds the
    socket itself and hands torch the listening descriptor (``master_listen_fd``); torch owns it from then on.

    With a ``secret`` (the run's), the TCPStore listens on 127.0.0.1 only and ``listen``:``port`` is a
    :class:`~orchestrator.rendezvous.gate.StoreGate`: only clients that prove they hold the secret reach the
    store (agents through ``orchestrator.rendezvous.tunnel``); ``on_refused(peer)`` hears of every other one.
    orch's own clients in this process (:meth:`client`, ``local_address``) dial the store directly.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0,
                 listen: Optional[str] = None, secret: Optional[str] = None,
                 on_refused: Optional[Callable[[str], None]] = None):
        self.host = host
        self.listen = host if listen is None else listen
        self.gate: Optional[StoreGate] = None
        if secret:
            self.gate = StoreGate(listening_socket(self.listen, port), ("127.0.0.1", 0), secret, on_refused)
            sock = listening_socket("127.0.0.1", 0)
        else:
            sock = listening_socket(self.listen, port)
        port = sock.getsockname()[1]
        # torch owns the descriptor from here: its server closes it when it stops, and also when the
        # constructor fails (so closing it here too could close another file that reused the number).
        fd = sock.detach()
        # multi_tenant: torchrun's own clients open it that way; wait_for_workers=False: agents come and go;
        # use_libuv: the backend whose master_listen_fd is checked here (tests/test_rendezvous_security.py).
        self._store = TCPStore("127.0.0.1" if secret else host, port, is_master=True, multi_tenant=True,
                               wait_for_workers=False, timeout=timedelta(seconds=timeout_s), master_listen_fd=fd,
                               use_libuv=True)
        self.local_address = ("127.0.0.1" if secret else host, port)
        """Where clients in this process dial the store itself (behind the gate, if there is one)."""
        if self.gate is not None:
            self.gate.backend = self.local_address
        self._port = self.gate.port if self.gate is not None else port

    @property
    def port(self) -> int:
        """The port agents dial: the gate's when there is one."""
        return self._port

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, timeout_s: float = 10.0):
        """A fresh client of this store (one per caller: the controller and a watch may run in two threads)."""
        return rdzv_state.connect(*self.local_address, timeout_s)

    def state(self, run_id: str) -> Optional[RendezvousState]:
        """Rendezvous ``run_id`` as the agents see it now; None before the first agent joined."""
        return rdzv_state.read_state(self.client(), run_id)

    def evict(self, run_id: str, agent_pid: int) -> Eviction:
        """Take the torchrun agent ``agent_pid``, which has exited, out of rendezvous ``run_id``: out of the
        round's participants and waiting nodes, as torchrun's own sweep does once its keep-alive is
        ``keep_alive_interval x keep_alive_max_attempt`` old, and as torchrun's exit op does (a signalled agent
        never runs it). A round still forming then completes with whoever is there. A complete round the agent
        was part of is broken (the survivors' new workers would wait for its rank until ``backend.timeout_s``):
        with others left it is reopened, so their agents re-rendezvous at once; with none left the next round
        opens, as in torch.

        Returns an :class:`~orchestrator.rendezvous.state.Eviction`, true when the agent was there; its
        ``reopened`` tells the caller to log ``rendezvous_reopened``. Writes by compare-and-set, so a concurrent
        change by an agent wins and the eviction is applied again to the new state."""
        return rdzv_state.evict(self.client(), run_id, agent_pid)

    def close(self) -> None:
        """Drop the server; agents still connected see their next store call fail."""
        if self.gate is not None:
            self.gate.close()
        self._store = None
