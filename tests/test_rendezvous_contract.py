"""The contract between orch and torch's private c10d rendezvous: every field and behaviour that
``orchestrator/rendezvous/state.py`` relies on, checked against the installed torch with torch's own classes
(a real TCPStore, ``C10dRendezvousBackend``, ``DynamicRendezvousHandler``, the rendezvous ops, the elastic
agent's loop). When a torch release changes one, the failure names it and the torch version.

Run it against each torch that pyproject.toml allows (docs/architecture.md lists the versions it passed on).
Fast: no subprocesses, one store on loopback.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import time
from dataclasses import fields
from datetime import datetime, timedelta, timezone

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from orchestrator.rendezvous import RendezvousStore
from orchestrator.rendezvous import state as rs
from orchestrator.rendezvous.agent import store_client
from orchestrator.rendezvous.backend import SealedBackend

pytestmark = pytest.mark.timeout(60)

SECRET = "the-runs-secret"
SETTINGS = dr.RendezvousSettings("job", 1, 3, dr.RendezvousTimeout(last_call=timedelta(seconds=1)),
                                 keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3)


def expect(ok: bool, what: str, detail: str) -> None:
    """Fail naming the part of torch's rendezvous that changed, and this torch's version."""
    if not ok:
        pytest.fail(f"torch {torch.__version__} changed its private c10d rendezvous: {what}: {detail}. "
                    "orch's orchestrator/rendezvous/state.py relies on it: update it (and this test), or keep "
                    "pyproject.toml's torch range to the versions this test passes on", pytrace=False)


def node(pid: int, addr: str = "127.0.0.1", local_id: int = 0) -> dr._NodeDesc:
    return dr._NodeDesc(addr, pid, local_id)


def join_action(state: dr._RendezvousState, me: dr._NodeDesc) -> dr._Action:
    """What torch's join op tells agent ``me`` to do next on ``state`` (deadline far away)."""
    return dr._RendezvousJoinOp()(dr._RendezvousContext(me, state, SETTINGS), time.monotonic() + 60)


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as orch's agents run
    store = RendezvousStore(secret=SECRET)
    yield store
    store.close()


@pytest.fixture
def torch_client(store):
    """torch's own TCPStore client of the store, through a relay, as an orch agent's torchrun has."""
    client, relay = store_client(("127.0.0.1", store.port), SECRET)
    yield client
    relay.close()


@pytest.fixture
def joined(torch_client):
    """A state torch itself wrote: a real handler (this process as the agent) on orch's sealed backend
    completed a round of one."""
    backend = SealedBackend(torch_client, "job", SECRET)
    handler = dr.DynamicRendezvousHandler.from_backend("job", torch_client, backend, min_nodes=1, max_nodes=1,
                                                       local_addr="127.0.0.1")
    info = handler.next_rendezvous()
    yield handler, info
    handler._stop_heartbeats()


def stored_payload(store) -> bytes:
    """torch's base64 state as it is stored, inside orch's seal."""
    return rs.unseal(SECRET, rs.state_key("job"), store.client().get(rs.state_key("job")))


def load_recording_classes(pickled: bytes) -> tuple[object, set[tuple[str, str]]]:
    """Unpickle ``pickled`` with no restriction (it is torch's own state) and return the classes it named."""
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    return Recording(io.BytesIO(pickled)).load(), named


def test_every_class_torchs_state_pickles_is_one_orch_decodes(store, joined):
    """A state with every field filled (a deadline, both lists, keep-alives): the classes its pickle names are
    all in state.PICKLED_CLASSES, and decode reads it."""
    holder = joined[0]._state_holder
    state = holder.state
    state.deadline = datetime.now(timezone.utc) + timedelta(seconds=30)
    state.wait_list, state.redundancy_list = {node(7)}, {node(8)}
    state.last_heartbeats[node(7)] = datetime.now(timezone.utc)
    _, named = load_recording_classes(pickle.dumps(state))
    new = sorted(f"{module}.{name}" for module, name in named - rs.PICKLED_CLASSES)
    expect(not new, "the classes torch's state pickle names", f"new class(es) {new}: orch's decode refuses them "
           "(state.PICKLED_CLASSES); admit them there only if they cannot run code")
    decoded = rs.decode(base64.b64encode(pickle.dumps(state)))
    assert decoded.deadline == state.deadline and {m.pid for m in decoded.members()} >= {7, 8}


def test_the_store_key_and_its_placeholder(store, torch_client):
    client = store.client()
    backend = C10dRendezvousBackend(torch_client, "job")
    expect(getattr(backend, "_key", None) == rs.state_key("job"), "C10dRendezvousBackend._key",
           f"is {getattr(backend, '_key', None)!r}, orch reads {rs.state_key('job')!r}")
    sentinel = getattr(C10dRendezvousBackend, "_NULL_SENTINEL", None)
    expect(sentinel is not None and sentinel.encode() == rs.NULL_SENTINEL, "C10dRendezvousBackend._NULL_SENTINEL",
           f"is {sentinel!r}, orch expects {rs.NULL_SENTINEL!r}")
    expect(client.get(rs.state_key("job")) == rs.NULL_SENTINEL, "the state key before the first state",
           f"holds {client.get(rs.state_key('job'))!r}, not the placeholder")
    assert rs.read_state(client, "job") is None and rs.read_state(client, "no-such-job") is None


def test_the_stored_value_is_a_base64_pickle_of_torchs_state_class(store, joined):
    raw = stored_payload(store)
    try:
        obj, named = load_recording_classes(base64.b64decode(raw, validate=True))
    except Exception as e:
        expect(False, "the stored state's encoding", f"not a base64 pickle ({type(e).__name__}: {e})")
    new = sorted(f"{module}.{name}" for module, name in named - rs.PICKLED_CLASSES)
    expect(not new, "the classes torch's state pickle names", f"new class(es) {new}: orch's decode refuses them "
           "(state.PICKLED_CLASSES); admit them there only if they cannot run code")
    expect(type(obj) is dr._RendezvousState, "the stored state's class", f"is {type(obj).__qualname__}")
    for name in rs.STATE_FIELDS:
        expect(name in vars(obj), f"_RendezvousState.{name}", f"missing (it has {sorted(vars(obj))})")
    unknown = sorted(set(vars(obj)) - set(rs.STATE_FIELDS))
    expect(not unknown, "_RendezvousState fields", f"new field(s) {unknown}: orch carries them over but never "
           "sets them when it reopens a round; check what they mean")


def test_every_field_of_a_round_torch_formed(store, joined):
    handler, info = joined
    me = handler._this_node
    expect([f.name for f in fields(dr._NodeDesc)] == list(rs.MEMBER_FIELDS), "_NodeDesc fields",
           f"are {[f.name for f in fields(dr._NodeDesc)]}, orch reads {list(rs.MEMBER_FIELDS)}")
    expect(me.pid == os.getpid() and me.addr == "127.0.0.1", "_NodeDesc.pid/addr",
           f"an agent's descriptor is {me!r}; orch evicts by the agent's PID on its --local-addr")
    state = rs.read_state(store.client(), "job", SECRET)
    member = rs.Member(me.addr, me.pid, me.local_id)
    expect(state.complete is True and state.closed is False, "_RendezvousState.complete/closed",
           f"a formed round reads complete={state.complete!r} closed={state.closed!r}")
    expect(isinstance(state.round, int) and state.round >= 0, "_RendezvousState.round", f"is {state.round!r}")
    expect(state.participants == {member: info.rank} and info.rank == 0 and info.world_size == 1,
           "_RendezvousState.participants", f"is {state.participants!r} for rank {info.rank} of {info.world_size}")
    expect(state.wait_list == set() and state.redundancy_list == set(), "_RendezvousState.wait_list/redundancy_list",
           f"are {state.wait_list!r}, {state.redundancy_list!r}")
    expect(state.deadline is None, "_RendezvousState.deadline", f"a complete round has {state.deadline!r}")
    beat = state.last_heartbeats.get(member)
    expect(isinstance(beat, datetime) and beat.tzinfo is not None and
           abs((datetime.now(timezone.utc) - beat).total_seconds()) < 30, "_RendezvousState.last_heartbeats",
           f"holds {beat!r}; orch compares keep-alives with an aware UTC datetime")


def test_what_orch_writes_torchs_agents_read_back_and_unknown_fields_survive(store, joined):
    handler, _ = joined
    client = store.client()
    extra_set = rs.update_state(client, "job", lambda s: s.extra.update(future_field=[1, 2]) or True, secret=SECRET)
    assert extra_set
    waiting = node(4242)
    assert rs.update_state(client, "job", lambda s: s.wait_list.add(rs.Member("127.0.0.1", 4242, 0)) or True,
                           secret=SECRET)
    holder = handler._state_holder
    holder._last_sync_time = -1  # past torch's one-second cache: read the store now
    holder.sync()
    seen = holder.state
    expect(seen.wait_list == {waiting}, "a state written by orch", f"torch's agent reads wait_list={seen.wait_list!r}")
    expect(getattr(seen, "future_field", None) == [1, 2], "fields orch does not know",
           "were not written back unchanged")
    expect(handler.num_nodes_waiting() == 1, "DynamicRendezvousHandler.num_nodes_waiting()",
           f"is {handler.num_nodes_waiting()} with one node in the wait list; orch's reopen relies on it counting "
           "the wait list")


def test_the_join_and_exit_ops_orch_relies_on():
    me, other = node(1), node(2)
    state = dr._RendezvousState()
    state.round, state.complete, state.participants = 3, True, {other: 0}
    expect(join_action(state, me) == dr._Action.ADD_TO_WAIT_LIST, "_RendezvousJoinOp on a complete round with room",
           f"returns {join_action(state, me)}: a newcomer no longer waits in wait_list (how a round grows)")
    state.participants = {me: 0, other: 1}
    expect(join_action(state, me) == dr._Action.FINISH, "_RendezvousJoinOp for a participant of a complete round",
           f"returns {join_action(state, me)}")
    # What orch's reopen leaves: the next round open, the old participants in the wait list.
    state.participants, state.wait_list, state.complete, state.round = {}, {me, other}, False, 4
    exit_action = dr._RendezvousExitOp()(dr._RendezvousContext(me, state, SETTINGS), time.monotonic() + 60)
    expect(exit_action == dr._Action.FINISH, "_RendezvousExitOp for a waiting node", f"returns {exit_action}")
    expect(join_action(state, me) == dr._Action.ADD_TO_PARTICIPANTS,
           "_RendezvousJoinOp for a waiting node of an open round",
           f"returns {join_action(state, me)}: a reopened round's survivors would not join it")


def test_adding_a_waiting_node_to_participants_and_ranking_a_complete_round():
    holder = dr._BackendRendezvousStateHolder(None, SETTINGS)  # never synced: the ops work on its state
    a, b = node(20), node(10)
    for me in (a, b):
        executor = dr._DistributedRendezvousOpExecutor(me, holder, SETTINGS)
        executor._state = holder.state
        holder.state.wait_list.add(me)
        executor._add_to_participants()
        expect(me not in holder.state.wait_list, "_add_to_participants", "leaves the node in the wait list")
    expect(holder.state.deadline is not None, "_RendezvousState.deadline", "not set once min_nodes participate")
    executor._mark_rendezvous_complete()
    expect(holder.state.participants == {b: 0, a: 1} and holder.state.complete and holder.state.deadline is None,
           "_mark_rendezvous_complete", f"ranks {holder.state.participants!r}; orch's Member orders as _NodeDesc")
    assert sorted([rs.Member(a.addr, a.pid, a.local_id), rs.Member(b.addr, b.pid, b.local_id)])[0].pid == b.pid


def test_torchs_epilogue_when_the_last_participant_leaves():
    state = dr._RendezvousState()
    state.round, state.complete, state.participants = 5, True, {}
    dr._remove_participant_epilogue(state, SETTINGS)
    expect(not state.complete and state.round == 6, "_remove_participant_epilogue",
           f"leaves complete={state.complete} round={state.round}; orch's evict_member mirrors the old behaviour")


def test_torchs_sweep_drops_a_member_silent_for_interval_times_attempts():
    holder = dr._BackendRendezvousStateHolder(None, SETTINGS)
    live, dead = node(1), node(2)
    now = datetime.now(timezone.utc)
    limit = SETTINGS.keep_alive_interval * SETTINGS.keep_alive_max_attempt
    holder.state.participants = {live: 0, dead: 1}
    holder.state.complete = True
    holder.state.last_heartbeats = {live: now - limit + timedelta(seconds=2), dead: now - limit - timedelta(seconds=1)}
    holder._sanitize()
    expect(set(holder.state.participants) == {live} and dead not in holder.state.last_heartbeats,
           "_BackendRendezvousStateHolder._sanitize", "no longer drops a member silent for keep_alive_interval x "
           "keep_alive_max_attempt (the partition watch's silence threshold assumes it)")


def test_the_elastic_agent_restarts_workers_for_waiting_nodes_without_using_a_restart():
    """The agent's loop: healthy workers and ``num_nodes_waiting() > 0`` stop the workers and rendezvous again
    (a membership change, not a failure). This is what makes a reopened round's survivors rejoin at once."""
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerSpec, WorkerState

    class Handler:
        waiting = [0, 1, 0]

        def num_nodes_waiting(self) -> int:
            return self.waiting.pop(0) if self.waiting else 0

    class Agent(SimpleElasticAgent):
        def __init__(self, spec):
            super().__init__(spec, exit_barrier_timeout=1)
            self.calls: list[str] = []
            self.polls = 0

        def _initialize_workers(self, worker_group):  # rendezvous + start; scripted here
            self.calls.append("rendezvous")
            worker_group.state = WorkerState.HEALTHY

        def _start_workers(self, worker_group):
            return {}

        def _stop_workers(self, worker_group, *args, **kwargs):
            self.calls.append("stop")

        def _monitor_workers(self, worker_group):
            self.polls += 1
            return RunResult(state=WorkerState.HEALTHY if self.polls < 4 else WorkerState.SUCCEEDED)

        def _exit_barrier(self):
            pass

        def _shutdown(self, *args, **kwargs):
            pass

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=Handler(), entrypoint="x", max_restarts=3,
                      monitor_interval=0.01)
    agent = Agent(spec)
    agent._invoke_run()
    expect(agent.calls == ["rendezvous", "stop", "rendezvous"], "SimpleElasticAgent._invoke_run",
           f"on num_nodes_waiting() > 0 with healthy workers it did {agent.calls}, not stop + rendezvous")
    expect(agent._remaining_restarts == 3, "SimpleElasticAgent._remaining_restarts",
           "a membership change used up a restart")


def test_the_agent_tells_a_preemption_exit_in_one_warning_line():
    """torchrun logs an error for every worker that exits non-zero; for orch's agreed preemption exit (75) the
    agent's log says what it is instead (the preempted node's own SIGTERM is one line too: the slow drills)."""
    import logging

    from orchestrator.rendezvous.agent import PreemptedExitLine

    def logged(code: int) -> logging.LogRecord:
        record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
                                   "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                   (code, 0, 123, "python"), None)
        assert PreemptedExitLine().filter(record)
        return record

    preempted, failed = logged(75), logged(1)
    assert (preempted.levelname, preempted.getMessage()) == (
        "WARNING", "local_rank 0 (pid 123) left after a preemption notice (exit 75, its checkpoint saved)")
    assert failed.levelname == "ERROR" and failed.getMessage().startswith("failed (exitcode: 1)")
