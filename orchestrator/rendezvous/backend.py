"""orch's torchrun rendezvous, as the agents run it (``--rdzv-backend=orch``, registered by
:mod:`~orchestrator.rendezvous.agent` in each agent's process).

It is torch's own dynamic rendezvous (``DynamicRendezvousHandler``) with two things changed:

- :class:`SealedBackend` keeps the state in orch's store like torch's c10d backend, but seals every state it
  writes with the run's secret and checks the seal of every state it reads *before* torch unpickles it
  (torch's handler calls ``pickle.loads`` on whatever the backend returns). A state without a valid seal is
  refused and reported (``store_value_refused``); torch is given the last state that was sealed (or a fresh
  one) with the forged value as the compare-and-set token, so its next write replaces the forgery and the run
  goes on.
- :class:`OrchRendezvousHandler` gives the workers, each round, a fresh store of their own behind the agent's
  relay (``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=<relay>``, ``TORCHELASTIC_USE_AGENT_STORE=True``), instead
  of a TCPStore server that rank 0's worker would open on every interface.
"""

from __future__ import annotations

import base64
import pickle
import secrets
from datetime import timedelta
from typing import Any, Callable, Optional

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousConnectionError, RendezvousHandler, RendezvousInfo,
                                                  RendezvousParameters, RendezvousStateError)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from orchestrator.rendezvous.store import WORKERS_ROUTE
from orchestrator.rendezvous.state import NULL_SENTINEL, ForgedStateError, seal, state_key, unseal

BACKEND_NAME = "orch"
WORKERS_STORE_KEY = "orch.workers_store"
"""Key of the round's store name, under the round's own prefix of the run's store (set by the round's rank 0)."""

Refused = Callable[[str], None]  # (key)


class SealedBackend(RendezvousBackend):
    """The rendezvous state of ``run_id`` in ``store``, sealed with ``secret``."""

    def __init__(self, store: Store, run_id: str, secret: str, on_refused: Optional[Refused] = None):
        self._store, self._key, self._secret, self._on_refused = store, state_key(run_id), secret, on_refused
        self._last_sealed: Optional[bytes] = None  # torch's pickled state, the newest one read with a good seal
        self._call("compare_set", self._key, "", NULL_SENTINEL.decode())

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError("The connection to orch's store has failed. See inner exception "
                                            "for details.") from exc

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        return self._decode(self._call("get", self._key))

    def set_state(self, state: bytes, token: Optional[Token] = None) -> Optional[tuple[bytes, Token, bool]]:
        if token is not None and not isinstance(token, bytes):  # torch's own shortcut for a foreign token
            result = self.get_state()
            return (*result, False) if result is not None else None
        new = seal(self._secret, self._key, base64.b64encode(state))
        stored = self._call("compare_set", self._key, token or NULL_SENTINEL, new)
        result = self._decode(stored)
        if result is None:
            return None
        return result[0], result[1], stored == new

    def _decode(self, stored: bytes) -> Optional[tuple[bytes, Token]]:
        if stored == NULL_SENTINEL:
            return None
        try:
            payload = unseal(self._secret, self._key, stored)
        except ForgedStateError:
            if self._on_refused is not None:
                self._on_refused(self._key)
            return self._fallback(), stored
        try:
            state = base64.b64decode(payload, validate=True)
        except ValueError as exc:
            raise RendezvousStateError("The state object is corrupt. See inner exception for details.") from exc
        self._last_sealed = state
        return state, stored

    def _fallback(self) -> bytes:
        """What torch reads instead of a forged state: the newest sealed one, else a fresh state (orch's own
        pickle of torch's class, never the forged bytes)."""
        if self._last_sealed is not None:
            return self._last_sealed
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

        return pickle.dumps(_RendezvousState())


class OrchRendezvousHandler(RendezvousHandler):
    """torch's handler ``inner``, with each round's workers pointed at a fresh store behind ``workers_relay``
    (an object with ``port`` and a settable ``route``)."""

    def __init__(self, inner: RendezvousHandler, workers_relay: Any):
        self._inner, self._relay = inner, workers_relay

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store = info.store  # the round's own prefix of the run's store
        if info.rank == 0:
            store.set(WORKERS_STORE_KEY, secrets.token_hex(8))
        name = store.get(WORKERS_STORE_KEY).decode()
        self._relay.route = WORKERS_ROUTE + name
        return RendezvousInfo(store, info.rank, info.world_size, RendezvousStoreInfo("127.0.0.1", self._relay.port))

    @property
    def use_agent_store(self) -> bool:
        return True  # every worker is a client of the round's store: none of them hosts one

    def get_backend(self) -> str:
        return BACKEND_NAME

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # anything else torch's agent may ask of its handler
        return getattr(self._inner, name)


def handler_factory(secret: str, workers_relay: Any, on_refused: Optional[Refused] = None):
    """torch's ``RendezvousHandlerCreator`` for :data:`BACKEND_NAME`: the store at ``--rdzv-endpoint`` (the
    agent's relay to the run's store), the sealed backend, torch's handler, orch's workers' stores."""

    def create(params: RendezvousParameters) -> RendezvousHandler:
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
        read_timeout = params.get_as_int("read_timeout", 60) or 60
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=read_timeout))
        backend = SealedBackend(store, params.run_id, secret, on_refused)
        return OrchRendezvousHandler(create_handler(store, backend, params), workers_relay)

    return create
