"""torchft's Manager on orch's quorum service instead of torchft's Rust servers, in a worker.

torchft's Python ``Manager`` (quorum per step, healing, ``should_commit``) is kept as it is. What it talks to
is replaced: it creates a ``ManagerServer`` (rank 0 of each group: a gRPC server on every interface, which
heartbeats to the Lighthouse) and ``ManagerClient``\\ s (every rank: gRPC to that server, and to a heal
source's). :func:`install` puts :class:`ManagerServer` and :class:`ManagerClient` of this module in their place,
in ``torchft.manager`` (the names it looks up when it makes them; tests/test_ft_contract.py checks they still
are): both talk to :class:`~orchestrator.ft.quorum.QuorumService` through the run's gate with the run's
secret, and neither listens on any port.

The process group is torchft's reconfigurable gloo one, minus the TCPStore server its handle would host:
:class:`ProcessGroupGloo` exchanges its peers' addresses through the run's store instead, via this agent's
relay (``ORCH_RUN_STORE``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from orchestrator.ft import QUORUM_ENV, sockets
from orchestrator.ft.quorum import ADDRESS_PREFIX, ROUTE
from orchestrator.rendezvous.agent import RUN_STORE_ENV
from orchestrator.trust.frames import recv_json, send_json
from orchestrator.trust.handshake import connect
from orchestrator.trust.secret import RUN_SECRET_ENV

ORCH_STORE = "orch"  # what a process group's handle names as its store: the run's store, through the relay


class QuorumError(RuntimeError):
    """The quorum service refused or failed a request (the message says why)."""


class QuorumClient:
    """Requests to the quorum service at ``gate`` (``host:port``), one authenticated connection per thread."""

    def __init__(self, gate: Optional[str] = None, secret: Optional[str] = None, connect_timeout_s: float = 30.0):
        gate = gate or os.environ[QUORUM_ENV]
        host, _, port = gate.rpartition(":")
        self.address = (host.strip("[]"), int(port))
        self.secret = secret if secret is not None else os.environ.get(RUN_SECRET_ENV, "")
        if not self.secret:
            raise QuorumError(f"{RUN_SECRET_ENV} is not set: orch's driver gives every agent the run's secret")
        self.connect_timeout_s = connect_timeout_s
        self._local = threading.local()

    def call(self, op: str, timeout_s: Optional[float] = None, **fields: Any) -> dict[str, Any]:
        request = {"op": op, **fields, **({"timeout_s": timeout_s} if timeout_s is not None else {})}
        for attempt in (0, 1):  # a connection the service closed (a restart of nothing, a timeout): once more
            sock = self._socket()
            try:
                sock.settimeout(None if timeout_s is None else timeout_s + 30)
                send_json(sock, request)
                answer = recv_json(sock)
                break
            except OSError:
                self._drop_socket()
                if attempt:
                    raise
        if "error" in answer:
            raise QuorumError(answer["error"])
        return answer

    def _socket(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = connect(self.address, self.secret, ROUTE, self.connect_timeout_s)
        return sock

    def _drop_socket(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        self._drop_socket()


@dataclass
class QuorumResult:
    """torchft's ``QuorumResult`` (the fields its Manager reads)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    recover_src_manager_address: str
    recover_src_replica_rank: Optional[int]
    recover_dst_replica_ranks: list[int]
    store_address: str
    max_step: int
    max_replica_rank: Optional[int]
    max_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: list[str]
    reconfigure_handles: list[str]


class ManagerServer:
    """In torchft's ``ManagerServer``'s place (rank 0 of each group): registers the group with the quorum
    service and heartbeats for it until :meth:`shutdown`, which takes it out of the quorum at once."""

    def __init__(self, replica_id: str, lighthouse_addr: str, hostname: str, bind: str, store_addr: str,
                 world_size: int, heartbeat_interval: timedelta, connect_timeout: timedelta,
                 quorum_retries: int = 0):
        self.replica_id = replica_id
        self._client = QuorumClient(connect_timeout_s=connect_timeout.total_seconds())
        self._client.call("register", replica_id=replica_id, world_size=world_size)
        self._interval = max(0.01, heartbeat_interval.total_seconds())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="orch-ft-heartbeat")
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._client.call("heartbeat", replica_id=self.replica_id)
            except (OSError, QuorumError):
                pass  # the next beat tries again; a group that cannot beat drops out, as in torchft

    def address(self) -> str:
        return ADDRESS_PREFIX + self.replica_id

    def shutdown(self) -> None:
        self._stopped.set()
        try:
            self._client.call("leave", replica_id=self.replica_id)
        except (OSError, QuorumError):
            pass
        self._client.close()


class ManagerClient:
    """In torchft's ``ManagerClient``'s place: a rank's requests for its group (``addr`` is what
    :meth:`ManagerServer.address` returned: the group's replica id)."""

    def __init__(self, addr: str, connect_timeout: timedelta):
        if not addr.startswith(ADDRESS_PREFIX):
            raise QuorumError(f"not a replica group of orch's quorum service: {addr!r}")
        self.replica_id = addr[len(ADDRESS_PREFIX):]
        self.quorum_id: Optional[int] = None
        """The id of the last quorum this client was given (the one the worker trains in once it waited for it)."""
        self._client = QuorumClient(connect_timeout_s=connect_timeout.total_seconds())
        # The ranks of this worker's group (torchrun's world: one node's), as torchft's Manager counts them.
        self._group_size = int(os.environ.get("WORLD_SIZE", "0"))

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool, timeout: timedelta,
                commit_failures: int, reconfigure_handle: str, init_sync: bool = True) -> QuorumResult:
        answer = self._client.call("quorum", timeout_s=timeout.total_seconds(), replica_id=self.replica_id,
                                   group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata,
                                   shrink_only=shrink_only, commit_failures=commit_failures,
                                   reconfigure_handle=reconfigure_handle, init_sync=init_sync)
        # With torchft's asynchronous quorum a healing group sits its first step out (it loads the state at
        # should_commit), so torchft's Manager counts only the groups already at the newest step. orch's step
        # protocol applies the fetched state before the forward pass instead, so every member of the quorum
        # trains the step: the participating rank and size are the quorum's own, as without the async quorum.
        answer["max_replica_rank"], answer["max_world_size"] = answer["replica_rank"], answer["replica_world_size"]
        self.quorum_id = int(answer["quorum_id"])
        return QuorumResult(**answer)

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self._client.call("checkpoint_metadata", timeout_s=timeout.total_seconds(),
                                 replica_id=self.replica_id, rank=rank)["metadata"]

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """The group's decision: every rank's vote, agreed through the service. A group of one rank has no one
        to agree with, so its vote is its decision, without a round trip at every step (a group the service
        dropped meanwhile is refused at its next quorum instead of here)."""
        if self._group_size == 1:
            return bool(should_commit)
        return bool(self._client.call("should_commit", timeout_s=timeout.total_seconds(), replica_id=self.replica_id,
                                      group_rank=group_rank, step=step, should_commit=should_commit)["should_commit"])


def install() -> None:
    """Make torchft's Manager use this module's server and client (idempotent)."""
    import torchft.manager as manager

    manager.ManagerServer = ManagerServer
    manager.ManagerClient = ManagerClient


def process_group(backend: str, timeout: timedelta, hold_s: float = 60.0):
    """torchft's reconfigurable process group for the cross-replica all-reduce, with its handles exchanged
    through the run's store (gloo; NCCL the same way). While its ``free`` event is clear, a reconfiguration waits
    (at most ``hold_s``): the step protocol clears it from a step's commit to the next step, while the group may
    still use the committed step's process group (a record's means) and the next step's quorum is being formed.

    Aborting it ends its collectives at once, those waiting on a peer that froze included: under gloo its
    connections are shut down first (:mod:`orchestrator.ft.sockets`; NCCL's abort does that itself).
    :meth:`abort_if` aborts the process group it runs on only if that is still the one given, atomically with a
    reconfiguration, so an abort meant for an earlier quorum never hits the next one's."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
    cuts_sockets = base is ProcessGroupGloo

    class OrchProcessGroup(base):  # type: ignore[misc, valid-type]
        """The handle names the run's store instead of a TCPStore this process would host on every interface;
        ``reconfigure`` reaches it through this node's relay."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self.free = threading.Event()
            self.free.set()
            self._swap = threading.RLock()  # a reconfiguration, and an abort of the process group it replaces
            self._connections: list[tuple[int, int]] = []  # the gloo process group's sockets (fd, inode)

        def get_reconfigure_handle(self) -> str:
            return json.dumps({"id": self._handle_id(), "store": ORCH_STORE, "global_rank": self._global_rank})

        def reconfigure(self, opts: Any) -> Any:
            self.free.wait(hold_s)  # the committed step's last collectives first (then go on regardless)
            with self._swap:
                return super().reconfigure(_through_relay(opts))

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            before = sockets.open_sockets() if cuts_sockets else {}
            pg = super()._create_pg(store, rank, world_size)
            self._connections = sockets.opened_since(before) if cuts_sockets else []
            return pg

        def abort(self, errored: bool = True) -> None:
            with self._swap:
                connections, self._connections = self._connections, []
                sockets.cut(connections)
                super().abort(errored=errored)

        def abort_if(self, inner: Any = None) -> bool:
            """Abort the process group this one runs on now if that is ``inner`` (whichever it is, if None);
            whether it did (torchft lets an aborted one go, so a second call finds none)."""
            with self._swap:
                current = getattr(self, "_pg", None)
                if current is None or (inner is not None and current is not inner):
                    return False
                self.abort()
                return True

    return OrchProcessGroup(timeout=timeout)


def _through_relay(opts: Any) -> Any:
    """``opts`` with its first handle's store (where all peers meet, under the quorum's own prefix) replaced by
    this node's relay to the run's store: every peer, on any host, reaches the same store that way. Each group
    rank's process group (rank i of every group) meets under a prefix of its own: with torchft's stores, one per
    process group, the quorum's prefix was enough; in the one run's store, rank 0's and rank 1's groups of a
    quorum would write the same keys and connect to each other's peers."""
    from torchft.process_group import ReconfigureOptions

    handles = list(opts.handles)
    first = json.loads(handles[0])
    if first.get("store") != ORCH_STORE:
        raise QuorumError(f"a peer's process group handle names a store of its own: {first.get('store')!r}")
    first["store"] = f"{os.environ[RUN_STORE_ENV]}/ft-rank{int(os.environ.get('RANK', 0))}"
    handles[0] = json.dumps(first)
    changed = ReconfigureOptions()
    changed.uuid, changed.handles, changed.timeout = opts.uuid, handles, opts.timeout
    if hasattr(opts, "hints"):
        changed.hints = opts.hints
    return changed
