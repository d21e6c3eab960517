"""The c10d rendezvous store, hosted by a long-lived orch process and never by a worker node.

torchrun agents connect with ``--rdzv-conf is_host=false``, so losing any node never takes rendezvous down:
the survivors re-rendezvous against this store within the keep-alive timeouts.

The store is orch's own (:mod:`~orchestrator.rendezvous.kvstore`, speaking torch's protocol through
:mod:`~orchestrator.rendezvous.tcpstore_server`), behind the run's gate (:mod:`orchestrator.trust.gate`): the
one port it opens admits only clients that prove they hold the run's secret, and no TCPStore server listens
anywhere else, loopback included. Agents reach it through their relays (:mod:`~orchestrator.rendezvous.agent`).
Its routes:

- ``store/run``: the run's store (every rendezvous of the run, per_step's process-group handles); a write of
  a rendezvous state that is not sealed with the run's secret is refused (``on_value_refused``);
- ``store/workers/<name>``: a fresh store per rendezvous round for the workers' ``MASTER_ADDR:MASTER_PORT``
  (made on first use; the newest :data:`WORKER_STORES_KEPT` are kept);
- whatever :meth:`add_route` adds (the per_step quorum service).

Whoever hosts the store also sees every agent exit, which torchrun's rendezvous only learns from a missed
keep-alive: ``evict`` takes a departed agent out of the round at once, so the next round need not wait for
its keep-alive to expire, and reopens a round its departure broke, so the survivors never wait for it.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Callable, Optional

from orchestrator.rendezvous import state as rdzv_state
from orchestrator.rendezvous.kvstore import KEY_PREFIX, KeyValueStore, LocalClient
from orchestrator.rendezvous.state import NULL_SENTINEL, Eviction, ForgedStateError, RendezvousState
from orchestrator.rendezvous.tcpstore_server import serve_store
from orchestrator.trust.acceptor import listening_socket
from orchestrator.trust.gate import Gate, Handler
from orchestrator.trust.acceptor import Refused

RUN_ROUTE = "store/run"
WORKERS_ROUTE = "store/workers/"  # + a round's store name
WORKER_STORES_KEPT = 64
_STATE_KEY = re.compile(re.escape(KEY_PREFIX + rdzv_state.KEY_PREFIX) + r"[^./]+")
_STORE_NAME = re.compile(r"[0-9a-f]{8,64}")

ValueRefused = Callable[[str, str], None]  # (key, peer)


def sealed_states_only(secret: str, on_refused: Optional[ValueRefused] = None):
    """A store write policy: a rendezvous state (``torch.rendezvous.<id>``) is written only when it is torch's
    placeholder or sealed with ``secret``; every other write passes."""

    def policy(key: str, value: bytes, peer: str) -> bool:
        if not _STATE_KEY.fullmatch(key) or value == NULL_SENTINEL:
            return True
        try:
            rdzv_state.unseal(secret, key[len(KEY_PREFIX):], value)
            return True
        except ForgedStateError:
            if on_refused is not None:
                on_refused(key[len(KEY_PREFIX):], peer)
            return False

    return policy


class RendezvousStore:
    """The run's store behind its gate on ``host``:``port`` (0 picks a free port). ``endpoint`` is what agents
    dial. The gate listens on ``listen`` only (default: ``host``, the address the plan gives agents), never on
    every interface unless asked (``listen="0.0.0.0"``: a pod's store, behind its NetworkPolicy).
    ``on_refused(peer, reason)`` hears of every client turned away, ``on_value_refused(key, peer)`` of every
    forged rendezvous state refused."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: str,
                 listen: Optional[str] = None, on_refused: Optional[Refused] = None,
                 on_value_refused: Optional[ValueRefused] = None):
        if not secret:
            raise ValueError("orch's store admits only holders of the run's secret: give it one")
        self.host, self.secret = host, secret
        self.listen = host if listen is None else listen
        self.kv = KeyValueStore("run", policy=sealed_states_only(secret, on_value_refused))
        self._workers: OrderedDict[str, KeyValueStore] = OrderedDict()
        self._routes: dict[str, Handler] = {RUN_ROUTE: serve_store(self.kv)}
        self._lock = threading.Lock()
        self.gate = Gate(listening_socket(self.listen, port), secret, self._route, on_refused, name="orch-store-gate")

    def _route(self, route: str) -> Optional[Handler]:
        if route.startswith(WORKERS_ROUTE) and _STORE_NAME.fullmatch(route[len(WORKERS_ROUTE):]):
            return serve_store(self.workers_store(route[len(WORKERS_ROUTE):]))
        with self._lock:
            return self._routes.get(route)

    def add_route(self, route: str, handler: Handler) -> None:
        """Serve ``route`` on the gate with ``handler`` (the per_step quorum service, for one)."""
        with self._lock:
            self._routes[route] = handler

    def workers_store(self, name: str) -> KeyValueStore:
        """Round store ``name`` (made on first use; the oldest beyond :data:`WORKER_STORES_KEPT` are dropped)."""
        with self._lock:
            store = self._workers.get(name)
            if store is None:
                store = self._workers[name] = KeyValueStore(f"workers/{name}")
                while len(self._workers) > WORKER_STORES_KEPT:
                    self._workers.popitem(last=False)
            self._workers.move_to_end(name)
            return store

    @property
    def port(self) -> int:
        """The port agents dial: the gate's."""
        return self.gate.port

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self) -> LocalClient:
        """A client of the run's store in this process (no socket)."""
        return LocalClient(self.kv)

    def state(self, run_id: str) -> Optional[RendezvousState]:
        """Rendezvous ``run_id`` as the agents see it now; None before the first agent joined."""
        return rdzv_state.read_state(self.client(), run_id, self.secret)

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
        return rdzv_state.evict(self.client(), run_id, agent_pid, self.secret)

    def close(self) -> None:
        """Stop admitting; agents still connected see their next store call fail."""
        self.gate.close()
