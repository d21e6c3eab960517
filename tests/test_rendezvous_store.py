"""The store orch hosts for torchrun's c10d rendezvous, and its eviction of departed agents, against torch's own
rendezvous backend and handler (the code every torchrun agent runs): torch's agents see what orch wrote."""

from __future__ import annotations

import base64
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler, RendezvousBackend,
                                                                     RendezvousSettings, RendezvousTimeout,
                                                                     _BackendRendezvousStateHolder, _NodeDesc)

from orchestrator.rendezvous import RendezvousStore
from orchestrator.rendezvous.agent import store_client
from orchestrator.rendezvous.backend import SealedBackend
from orchestrator.rendezvous.state import (Member, RendezvousState, RendezvousStateError, decode, encode, evict_member,
                                           state_key, update_state)

pytestmark = pytest.mark.timeout(60)

ADDR = "127.0.0.1"  # every agent on this host; orch tells agents apart by PID (fake ones here)
SECRET = "the-runs-secret"


class KillableBackend(RendezvousBackend):
    """torch's c10d backend until ``kill()``: then every call fails, as for an agent that was SIGKILLed (its
    last write stays in the store, nobody takes it out but a sweep or orch)."""

    def __init__(self, backend: C10dRendezvousBackend):
        self.backend, self.killed = backend, False

    @property
    def name(self) -> str:
        return self.backend.name

    def get_state(self):
        if self.killed:
            raise RendezvousConnectionError("killed")
        return self.backend.get_state()

    def set_state(self, state, token=None):
        if self.killed:
            raise RendezvousConnectionError("killed")
        return self.backend.set_state(state, token)

    def kill(self) -> None:
        self.killed = True


def agent(store: RendezvousStore, run_id: str, pid: int, min_nodes: int, max_nodes: int, relays: list,
          last_call_s: float = 1.0) -> DynamicRendezvousHandler:
    """torch's rendezvous handler as an orch agent with PID ``pid`` builds it (``--rdzv-backend=orch``,
    orchestrator/rendezvous/agent.py): torch's own client of the store through a relay, orch's sealed backend,
    torch's state holder and handler."""
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    relays.append(relay)
    timeout = RendezvousTimeout(join=timedelta(seconds=30), last_call=timedelta(seconds=last_call_s))
    settings = RendezvousSettings(run_id, min_nodes, max_nodes, timeout, keep_alive_interval=timedelta(seconds=5),
                                  keep_alive_max_attempt=3)
    backend = KillableBackend(SealedBackend(client, run_id, SECRET))
    return DynamicRendezvousHandler(_NodeDesc(ADDR, pid, 0), settings, "orch", client,
                                    _BackendRendezvousStateHolder(backend, settings))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Harness:
    """orch's store, and torch handlers acting as agents against it, joining in background threads."""

    def __init__(self):
        self.store = RendezvousStore(secret=SECRET)
        self.pool = ThreadPoolExecutor(max_workers=4)
        self.handlers: list[DynamicRendezvousHandler] = []
        self.relays: list = []

    def agents(self, run_id: str, pids: list[int], min_nodes: int, max_nodes: int,
               **kw) -> list[DynamicRendezvousHandler]:
        made = [agent(self.store, run_id, pid, min_nodes, max_nodes, self.relays, **kw) for pid in pids]
        self.handlers.extend(made)
        return made

    def join(self, *handlers: DynamicRendezvousHandler) -> list[Future]:
        """Each handler's ``next_rendezvous()`` (what an agent runs to (re)start its workers), in the background."""
        return [self.pool.submit(h.next_rendezvous) for h in handlers]

    def close(self) -> None:
        for h in self.handlers:
            h._stop_heartbeats()
            h._state_holder._backend.kill()  # a handler still joining ends at its next backend call
        self.pool.shutdown(wait=True, cancel_futures=True)
        for relay in self.relays:
            relay.close()
        self.store.close()


@pytest.fixture
def rdzv(monkeypatch):
    # As orch's agents run (rendezvous.args): rank 0 publishes a bootstrap address every round, hosts no store.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    harness = Harness()
    yield harness
    harness.close()


def test_evicting_a_participant_of_a_complete_round_reopens_it_and_torchs_agents_rejoin_at_once(rdzv):
    """The broken scale-up: three agents formed a round, then the newcomer died before its workers set up the
    process group. The survivors' workers would wait for its rank until backend.timeout_s; the reopened round
    makes torch's own handler report waiting nodes (what makes an agent restart its workers), and the
    survivors' next rendezvous completes a round of two."""
    a, b, joiner = rdzv.agents("job", [1001, 1002, 1003], min_nodes=2, max_nodes=3, last_call_s=3.0)
    results = [f.result(timeout=30) for f in rdzv.join(a, b, joiner)]
    assert sorted(r.world_size for r in results) == [3, 3, 3]
    formed = rdzv.store.state("job")
    assert formed.complete and a.num_nodes_waiting() == 0

    joiner._stop_heartbeats()
    joiner._state_holder._backend.kill()  # SIGKILLed: it never leaves the round by itself
    eviction = rdzv.store.evict("job", 1003)
    assert eviction and eviction.was_participant and eviction.reopened
    assert eviction.member == Member(ADDR, 1003, 0) and eviction.round == formed.round + 1

    state = rdzv.store.state("job")
    assert not state.complete and state.round == formed.round + 1 and not state.participants
    assert state.wait_list == {Member(ADDR, 1001, 0), Member(ADDR, 1002, 0)}, "the survivors wait for the new round"
    # torch's own handler (cached state: up to a second old) now tells each survivor's agent to restart.
    assert wait_for(lambda: a.num_nodes_waiting() == 2 and b.num_nodes_waiting() == 2, 5, "waiting nodes")

    t0 = time.monotonic()
    rejoined = [f.result(timeout=30) for f in rdzv.join(a, b)]
    assert sorted(r.rank for r in rejoined) == [0, 1] and {r.world_size for r in rejoined} == {2}
    assert time.monotonic() - t0 < 15, "a round of the survivors within last_call_timeout, not backend.timeout_s"
    after = rdzv.store.state("job")
    assert after.complete and after.round == formed.round + 1 and set(after.participants) == state.wait_list
    assert not after.wait_list and a.num_nodes_waiting() == 0


def test_a_member_lost_while_the_round_forms_is_evicted_so_the_round_closes_with_whoever_is_there(rdzv):
    """min 2: the joiner and ``a`` formed half a round (its deadline set) when the joiner died. Left in, it would
    complete the round with a dead rank at the deadline; evicted, the round completes with ``a`` and ``b``."""
    joiner, a, b = rdzv.agents("job", [1003, 1001, 1002], min_nodes=2, max_nodes=4, last_call_s=5.0)
    pending = rdzv.join(joiner)
    wait_for(lambda: (s := rdzv.store.state("job")) and len(s.participants) == 1, 10, "the joiner to join")
    pending += rdzv.join(a)
    wait_for(lambda: (s := rdzv.store.state("job")) and len(s.participants) == 2, 10, "a to join")
    joiner._state_holder._backend.kill()
    eviction = rdzv.store.evict("job", 1003)
    assert eviction and eviction.was_participant and not eviction.reopened, "a forming round is not reopened"
    state = rdzv.store.state("job")
    assert set(state.participants) == {Member(ADDR, 1001, 0)} and not state.complete

    pending += rdzv.join(b)
    with pytest.raises(RendezvousConnectionError):
        pending[0].result(timeout=10)
    ranks = sorted(f.result(timeout=30).rank for f in pending[1:])
    assert ranks == [0, 1]
    done = rdzv.store.state("job")
    assert done.complete and set(done.participants) == {Member(ADDR, 1001, 0), Member(ADDR, 1002, 0)}


def test_evicting_the_last_participant_opens_the_next_round_as_torch_does(rdzv):
    (a,) = rdzv.agents("job", [1001], min_nodes=1, max_nodes=2)
    rdzv.join(a)[0].result(timeout=30)
    a._stop_heartbeats()
    round_ = rdzv.store.state("job").round
    eviction = rdzv.store.evict("job", 1001)
    assert eviction and not eviction.reopened and eviction.round == round_ + 1
    state = rdzv.store.state("job")
    assert not state.participants and not state.complete and state.round == round_ + 1 and not state.wait_list


def write_round(store: RendezvousStore, run_id: str, members: list[Member], waiting: list[Member],
                closed: bool = False) -> None:
    state = RendezvousState(round=4, complete=True, closed=closed,
                            participants={m: rank for rank, m in enumerate(members)}, wait_list=set(waiting),
                            last_heartbeats={m: datetime.now(timezone.utc) for m in [*members, *waiting]})
    # Through orch's agents' backend, as the first agent writes the first state.
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    try:
        assert SealedBackend(client, run_id, SECRET).set_state(base64.b64decode(encode(state)))[2]
    finally:
        relay.close()


def test_evicting_a_waiting_agent_leaves_the_round_alone():
    store = RendezvousStore(secret=SECRET)
    try:
        a, b, c = Member("node0", 1001, 0), Member("node1", 1002, 0), Member("node2", 1003, 0)
        write_round(store, "job", [a, b], waiting=[c])
        eviction = store.evict("job", 1003)  # a waiting node that died is dropped from the wait list
        assert eviction and not eviction.was_participant and not eviction.reopened
        state = store.state("job")
        assert state.wait_list == set() and c not in state.last_heartbeats
        assert state.complete and state.round == 4 and set(state.participants) == {a, b}

        assert not store.evict("job", 1003), "an agent no longer in the rendezvous is not evicted twice"
        assert not store.evict("other-job", 1001), "another rendezvous id is untouched"
        assert store.state("other-job") is None
    finally:
        store.close()


def test_a_closed_rendezvous_is_never_reopened():
    """Closed: the job is over (an agent finished and closed it); the others are finishing, not re-forming."""
    store = RendezvousStore(secret=SECRET)
    try:
        a, b = Member("node0", 1001, 0), Member("node1", 1002, 0)
        write_round(store, "job", [a, b], waiting=[], closed=True)
        eviction = store.evict("job", 1002)
        assert eviction and not eviction.reopened
        state = store.state("job")
        assert state.complete and state.closed and set(state.participants) == {a} and state.round == 4
    finally:
        store.close()


def test_one_pid_on_two_hosts_is_left_to_torchs_sweep():
    state = RendezvousState(round=1, complete=True, participants={Member("h0", 7, 0): 0, Member("h1", 7, 0): 1})
    assert evict_member(state, 7) is None and len(state.participants) == 2


def test_an_update_that_loses_to_an_agent_is_applied_again_to_the_agents_state():
    store = RendezvousStore(secret=SECRET)
    try:
        a, b = Member("node0", 1001, 0), Member("node1", 1002, 0)
        write_round(store, "job", [a], waiting=[])
        client, calls = store.client(), []

        def change(state: RendezvousState):
            calls.append(set(state.wait_list))
            if len(calls) == 1:  # an agent writes in between this read and the compare-and-set
                other = store.state("job")
                other.wait_list.add(b)
                client.set(state_key("job"), encode(other, state_key("job"), SECRET))
            state.closed = True
            return "done"

        assert update_state(client, "job", change, secret=SECRET) == "done"
        assert calls == [set(), {b}]
        state = store.state("job")
        assert state.closed and state.wait_list == {b}, "the agent's write was kept, and ours applied on top"
    finally:
        store.close()


def test_unreadable_states_name_the_key_the_torch_version_and_the_fix():
    assert decode(b"Y2FuaW1hZGFt") is None, "torch's placeholder before the first state"
    with pytest.raises(RendezvousStateError, match=r"'torch.rendezvous.job' is not base64 .*torch 2\..*Fix: "):
        decode(b"not base64!", "torch.rendezvous.job")
    with pytest.raises(RendezvousStateError, match=r"does not unpickle"):
        decode(base64.b64encode(b"junk"), "torch.rendezvous.job")
