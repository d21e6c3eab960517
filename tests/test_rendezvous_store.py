"""The store orch hosts for torchrun's c10d rendezvous, and its eviction of departed agents, against torch's own
rendezvous state and backend (what every torchrun agent reads and writes)."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from orchestrator.rendezvous import RendezvousStore

pytestmark = pytest.mark.timeout(60)


def write_round(store: RendezvousStore, run_id: str, members: list[_NodeDesc], waiting: list[_NodeDesc]) -> None:
    state = _RendezvousState()
    state.round, state.complete = 4, True
    state.participants = {m: rank for rank, m in enumerate(members)}
    state.wait_list = set(waiting)
    state.last_heartbeats = {m: datetime.now(timezone.utc) for m in [*members, *waiting]}
    backend = C10dRendezvousBackend(TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=5)), run_id)
    assert backend.set_state(pickle.dumps(state))[2]  # the first state, as the first agent writes it


def read_round(store: RendezvousStore, run_id: str) -> _RendezvousState:
    backend = C10dRendezvousBackend(TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=5)), run_id)
    return pickle.loads(backend.get_state()[0])


def test_evicting_departed_agents_opens_the_next_round_once_no_participant_is_left():
    store = RendezvousStore()
    try:
        a, b, c = _NodeDesc("node0", 1001, 0), _NodeDesc("node1", 1002, 0), _NodeDesc("node2", 1003, 0)
        write_round(store, "job", [a, b], waiting=[c])

        assert store.evict("job", 1002)  # b left (preempted): out of the round and the keep-alives at once
        state = read_round(store, "job")
        assert set(state.participants) == {a} and b not in state.last_heartbeats
        assert state.complete and state.round == 4, "a survivor still holds the round: it leaves it on restart"

        assert store.evict("job", 1003)  # a waiting node that died is dropped from the wait list too
        assert read_round(store, "job").wait_list == set()

        assert store.evict("job", 1001)
        state = read_round(store, "job")
        assert not state.participants and not state.complete and state.round == 5, "the next round is open"

        assert not store.evict("job", 1001), "an agent no longer in the rendezvous is not evicted twice"
        assert not store.evict("other-job", 1001), "another rendezvous id is untouched"
    finally:
        store.close()
