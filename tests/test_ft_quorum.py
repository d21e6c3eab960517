"""orch's per_step quorum service (orchestrator/ft/quorum.py): torchft's quorum rules and per-rank results, a
group dropped or leaving taken out at once, commits decided per group; and its client as torchft's Manager
uses it (orchestrator/ft/coordination.py), through a real gate. Fast: threads in this process."""

from __future__ import annotations

import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from orchestrator.ft.quorum import ADDRESS_PREFIX, ROUTE, QuorumService

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def service(min_replicas=1, join_ms=1000, clock=None) -> QuorumService:
    return QuorumService(min_replicas, join_ms, quorum_tick_ms=10, heartbeat_timeout_ms=1000, clock=clock or Clock())


def ask(svc: QuorumService, rid: str, rank: int, step: int, timeout_s: float = 5.0, handle: str = "h"):
    return svc.call({"op": "quorum", "replica_id": rid, "group_rank": rank, "step": step, "timeout_s": timeout_s,
                     "checkpoint_metadata": f"orch-state://{rid}:{rank}", "shrink_only": False, "init_sync": True,
                     "commit_failures": 0, "reconfigure_handle": f"{handle}-{rid}-{rank}"})


def all_ask(svc: QuorumService, groups: dict[str, int], world: int = 1) -> dict[tuple[str, int], dict]:
    """Every rank of every group (name -> step) asks at once; their answers."""
    with ThreadPoolExecutor(len(groups) * world) as pool:
        futures = {(rid, r): pool.submit(ask, svc, rid, r, step) for rid, step in groups.items() for r in range(world)}
        return {key: f.result() for key, f in futures.items()}


def wait_pending(svc: QuorumService, rid: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with svc._lock:
            if rid in svc._participants:
                return True
        time.sleep(0.01)
    return False


def register(svc: QuorumService, *rids: str, world: int = 1) -> None:
    for rid in rids:
        assert svc.call({"op": "register", "replica_id": rid, "world_size": world}) == {}


def test_a_quorum_of_every_group_ranks_them_by_replica_id_and_keeps_its_id_while_they_stay():
    svc = service()
    try:
        register(svc, "node1-a1:x", "node0-a0:y", world=2)
        first = all_ask(svc, {"node1-a1:x": 0, "node0-a0:y": 0}, world=2)
        assert {r["replica_world_size"] for r in first.values()} == {2}
        assert first[("node0-a0:y", 0)]["replica_rank"] == 0 and first[("node1-a1:x", 1)]["replica_rank"] == 1
        assert first[("node0-a0:y", 1)]["reconfigure_handles"] == ["h-node0-a0:y-1", "h-node1-a1:x-1"]
        assert first[("node0-a0:y", 0)]["replica_ids"] == ["node0-a0:y", "node1-a1:x"]
        # Step 0 with init_sync: all but the primary copy the primary's weights.
        assert not first[("node0-a0:y", 0)]["heal"] and first[("node1-a1:x", 0)]["heal"]
        assert first[("node1-a1:x", 0)]["recover_src_manager_address"] == ADDRESS_PREFIX + "node0-a0:y"
        again = all_ask(svc, {"node1-a1:x": 1, "node0-a0:y": 1}, world=2)
        assert {r["quorum_id"] for r in again.values()} == {first[("node0-a0:y", 0)]["quorum_id"]}
        assert not any(r["heal"] for r in again.values())
    finally:
        svc.close()


def test_a_dropped_group_is_out_of_the_next_quorum_at_once_and_a_behind_group_heals_from_a_live_one():
    clock = Clock()
    svc = service(join_ms=60_000, clock=clock)  # stragglers would hold a quorum for a minute
    try:
        register(svc, "node0-a0:u", "node1-a1:v", "node2-a2:w")
        q1 = all_ask(svc, {"node0-a0:u": 5, "node1-a1:v": 5, "node2-a2:w": 5})
        assert svc.drop("node2-a2") == ["node2-a2:w"]  # its agent died: no heartbeat timeout to wait out
        q2 = all_ask(svc, {"node0-a0:u": 6, "node1-a1:v": 6})
        assert {r["replica_world_size"] for r in q2.values()} == {2}
        assert q2[("node0-a0:u", 0)]["quorum_id"] == q1[("node0-a0:u", 0)]["quorum_id"] + 1
        # A replacement at step 0 joins; the quorum waits for no one else, and the newcomer heals.
        register(svc, "node2-a3:z")
        with ThreadPoolExecutor(1) as pool:  # the newcomer asks first: a fast quorum of the others would not wait
            joining = pool.submit(ask, svc, "node2-a3:z", 0, 0)
            assert wait_pending(svc, "node2-a3:z")
            q3 = all_ask(svc, {"node0-a0:u": 7, "node1-a1:v": 7})
            q3[("node2-a3:z", 0)] = new = joining.result()
        assert new["heal"] and new["max_step"] == 7
        assert new["recover_src_manager_address"] in {ADDRESS_PREFIX + "node0-a0:u", ADDRESS_PREFIX + "node1-a1:v"}
        src = new["recover_src_replica_rank"]
        assert new["replica_ids"][src] != "node2-a3:z"
        assert q3[(new["replica_ids"][src], 0)]["recover_dst_replica_ranks"] == [new["replica_rank"]]
        assert "left" in svc.call({"op": "register", "replica_id": "node2-a2:w", "world_size": 1})["error"]
    finally:
        svc.close()


def test_a_group_that_leaves_frees_the_survivors_waiting_quorum_at_once_and_the_driver_is_told():
    """The clock stands still: heartbeats never age out, so only the leave (a noticed group's rank 0, through
    the gate) or the driver's drop (its agent exited) can form the survivors' quorum."""
    told: list[tuple[str, str]] = []
    svc = QuorumService(1, 60_000, quorum_tick_ms=10, heartbeat_timeout_ms=1000, clock=Clock(),
                        on_drop=lambda rid, cause: told.append((rid, cause)))
    try:
        register(svc, "node0-a0:u", "node1-a1:v", "node2-a2:w")
        all_ask(svc, {"node0-a0:u": 5, "node1-a1:v": 5, "node2-a2:w": 5})
        with ThreadPoolExecutor(1) as pool:
            survivor = pool.submit(lambda: all_ask(svc, {"node0-a0:u": 6, "node2-a2:w": 6}))
            assert wait_pending(svc, "node0-a0:u") and wait_pending(svc, "node2-a2:w")
            time.sleep(0.1)
            assert not survivor.done(), "2 of 3 healthy groups joined: the quorum waits for the third"
            assert svc.call({"op": "leave", "replica_id": "node1-a1:v"}) == {}
            q = survivor.result(timeout=2)
        assert {r["replica_world_size"] for r in q.values()} == {2}
        assert told == [("node1-a1:v", "left")]
        assert svc.drop("node1-a1") == [] and told == [("node1-a1:v", "left")], "already out: nothing to tell"
        assert svc.drop("node2-a2") == ["node2-a2:w"] and told[-1] == ("node2-a2:w", "agent_exited")
    finally:
        svc.close()


def test_a_healthy_straggler_holds_a_new_quorum_until_the_join_timeout():
    clock = Clock()
    svc = service(join_ms=5000, clock=clock)
    try:
        register(svc, "a:1", "b:2", "c:3")  # c heartbeats but never asks
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(ask, svc, rid, 0, 0, 20) for rid in ("a:1", "b:2")]
            time.sleep(0.5)
            assert not any(f.done() for f in waiting), "a majority, but a healthy straggler: the quorum waits"
            clock.t += 6  # past the join timeout; everyone still heartbeating
            for rid in ("a:1", "b:2", "c:3"):
                svc.call({"op": "heartbeat", "replica_id": rid})
            answers = [f.result(timeout=10) for f in waiting]
        assert {tuple(a["replica_ids"]) for a in answers} == {("a:1", "b:2")}
    finally:
        svc.close()


def test_a_group_commits_only_when_every_rank_says_so_and_a_left_group_is_refused():
    svc = service()
    try:
        register(svc, "g:1", world=2)
        vote = lambda rank, ok, step=3: svc.call({"op": "should_commit", "replica_id": "g:1", "group_rank": rank,  # noqa: E731
                                                   "step": step, "should_commit": ok, "timeout_s": 5})
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(vote, 0, True), pool.submit(vote, 1, False)
            assert a.result() == b.result() == {"should_commit": False}
            a, b = pool.submit(vote, 0, True, 4), pool.submit(vote, 1, True, 4)
            assert a.result() == b.result() == {"should_commit": True}
        assert svc.call({"op": "checkpoint_metadata", "replica_id": "g:1", "rank": 0})["error"]
        svc.leave("g:1")
        assert "left" in vote(0, True, 5)["error"] or "registered" in vote(0, True, 5)["error"]
        assert "left" in svc.call({"op": "register", "replica_id": "g:1", "world_size": 2})["error"]
    finally:
        svc.close()


def test_a_redone_step_is_decided_by_the_votes_of_its_own_attempt():
    """A discarded step is voted on again under its step number: a fast rank must wait for its peers' new votes
    instead of reading the first attempt's decision (else the group's ranks would part ways)."""
    svc = service()
    try:
        register(svc, "g:1", world=2)
        vote = lambda rank, ok: svc.call({"op": "should_commit", "replica_id": "g:1", "group_rank": rank,  # noqa: E731
                                          "step": 7, "should_commit": ok, "timeout_s": 5})
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(vote, 0, False), pool.submit(vote, 1, True)
            assert a.result() == b.result() == {"should_commit": False}
            first = pool.submit(vote, 0, True)  # the redo: rank 0 votes first and waits for rank 1's new vote
            time.sleep(0.2)
            assert not first.done()
            assert vote(1, True) == first.result() == {"should_commit": True}
    finally:
        svc.close()


def test_a_group_of_another_size_than_the_live_ones_is_refused_in_one_line():
    """Rank i of every group all-reduces with and heals from rank i of the others: sizes must match."""
    clock = Clock()
    svc = service(clock=clock)
    try:
        register(svc, "a:1", world=2)
        refused = svc.call({"op": "register", "replica_id": "b:1", "world_size": 1})["error"]
        assert "b:1 has 1 rank(s), a:1 has 2" in refused and "cluster.nproc_per_node" in refused
        register(svc, "c:1", world=2)
        clock.t += 5  # a:1 and c:1 stopped beating: a group of any size may start over
        register(svc, "b:1", world=1)
    finally:
        svc.close()


def watch(svc: QuorumService, rid: str, quorum_id: int, rank: int = 0, timeout_s: float = 5.0) -> dict:
    return svc.call({"op": "watch", "replica_id": rid, "group_rank": rank, "quorum_id": quorum_id,
                     "timeout_s": timeout_s})


def test_a_watch_is_answered_at_once_when_a_member_of_its_quorum_is_dropped_and_only_then():
    """The clock stands still: nothing ages out unless the test moves it."""
    svc = service(join_ms=60_000)
    try:
        register(svc, "a:1", "b:2", "c:3")
        q = all_ask(svc, {"a:1": 3, "b:2": 3, "c:3": 3})[("a:1", 0)]["quorum_id"]
        started = time.monotonic()
        assert watch(svc, "a:1", q, timeout_s=0.3) == {"quorum_id": q, "dropped": []}, "nothing dropped: no news"
        assert time.monotonic() - started >= 0.3
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.submit(watch, svc, "a:1", q), pool.submit(watch, svc, "b:2", q)
            time.sleep(0.2)
            assert not a.done() and not b.done()
            assert svc.call({"op": "leave", "replica_id": "c:3"}) == {}
            assert a.result(timeout=2) == b.result(timeout=2) == {"quorum_id": q, "dropped": ["c:3"]}
        assert watch(svc, "a:1", q) == {"quorum_id": q, "dropped": ["c:3"]}, "asked again: still gone"
        # The next quorum is without c: a watch of it hears nothing of c, nor of its own group.
        q2 = all_ask(svc, {"a:1": 4, "b:2": 4})[("a:1", 0)]["quorum_id"]
        assert q2 != q and watch(svc, "a:1", q2, timeout_s=0.2)["dropped"] == []
        assert svc.drop("b") == ["b:2"] and watch(svc, "a:1", q2) == {"quorum_id": q2, "dropped": ["b:2"]}
        assert "registered" in watch(svc, "b:2", q2)["error"], "a group that is out watches nothing"
    finally:
        svc.close()


def steady_watch(svc: QuorumService, rid: str, quorum_id: int, seen: int = 0, timeout_s: float = 5.0) -> dict:
    return svc.call({"op": "watch", "replica_id": rid, "group_rank": 0, "quorum_id": quorum_id,
                     "timeout_s": timeout_s, "steady": True, "seen": seen})


def test_a_steady_quorum_is_told_when_it_is_wanted_anew_by_a_joiner_then_by_a_member():
    """A steady quorum's members ask for no quorum per step; their watches say when one is wanted: 1 when a
    group outside it asks to join, 2 (with the step) once a member of it asks too. A watch that knows the level
    hears nothing more of it; a plain watch (a group that asks every step) never hears of it."""
    svc = service(join_ms=60_000)
    try:
        register(svc, "a:1", "b:2")
        q = all_ask(svc, {"a:1": 5, "b:2": 5})[("a:1", 0)]["quorum_id"]
        assert steady_watch(svc, "a:1", q, timeout_s=0.2) == {"quorum_id": q, "dropped": [], "wanted": 0,
                                                             "at_step": None}, "nobody asks: no news"
        register(svc, "c:3")
        with ThreadPoolExecutor(4) as pool:
            held = pool.submit(steady_watch, svc, "a:1", q)
            time.sleep(0.2)
            assert not held.done()
            joiner = pool.submit(ask, svc, "c:3", 0, 0)  # a group that comes back asks to join
            assert held.result(timeout=2) == {"quorum_id": q, "dropped": [], "wanted": 1, "at_step": None}
            assert steady_watch(svc, "b:2", q, seen=1, timeout_s=0.2)["wanted"] == 1, "known: answered on time"
            assert watch(svc, "b:2", q, timeout_s=0.2) == {"quorum_id": q, "dropped": []}, "a plain watch: no news"
            b_asks = pool.submit(ask, svc, "b:2", 0, 6)  # b comes to the next quorum at its step boundary ...
            assert wait_pending(svc, "b:2")
            # ... while a trains step 6 in q without asking: b will never join that step's collectives there.
            assert steady_watch(svc, "a:1", q, seen=1) == {"quorum_id": q, "dropped": [], "wanted": 2, "at_step": 6}
            a_asks = pool.submit(ask, svc, "a:1", 0, 6)
            new = {f.result(timeout=5)["quorum_id"] for f in (joiner, b_asks, a_asks)}
        assert len(new) == 1 and new != {q}, "one quorum with the joiner, under a new id"
        assert steady_watch(svc, "a:1", new.pop(), timeout_s=0.2)["wanted"] == 0, "answered: wanted no more"
    finally:
        svc.close()


def test_a_watch_hears_of_a_member_whose_heartbeats_aged_out_and_of_no_other_quorum():
    """A frozen group (a stopped process, a frozen VM) closes nothing: only its silence tells."""
    clock = Clock()
    svc = service(join_ms=60_000, clock=clock)
    try:
        register(svc, "a:1", "b:2")
        q = all_ask(svc, {"a:1": 3, "b:2": 3})[("a:1", 0)]["quorum_id"]
        register(svc, "x:9")  # heartbeats, but not in the watched quorum
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(watch, svc, "a:1", q, 0, 10)
            clock.t += 0.6
            svc.call({"op": "heartbeat", "replica_id": "a:1"})
            svc.call({"op": "heartbeat", "replica_id": "b:2"})
            clock.t += 0.6  # x:9 went silent 1.2 s ago, b:2 0.6 s ago: nothing for a watch of q
            time.sleep(0.3)
            assert not held.done()
            svc.call({"op": "heartbeat", "replica_id": "a:1"})
            clock.t += 0.5  # b:2 silent 1.1 s, past heartbeat_timeout_ms
            started = time.monotonic()
            assert held.result(timeout=5) == {"quorum_id": q, "dropped": ["b:2"]}
            assert time.monotonic() - started < 3
        assert watch(svc, "a:1", q + 7, timeout_s=0.2)["dropped"] == [], "a quorum it never formed: no news"
    finally:
        svc.close()


def test_watches_are_one_per_rank_of_a_registered_group_and_freed_when_their_caller_hangs_up():
    from orchestrator.trust.acceptor import listening_socket
    from orchestrator.trust.frames import send_json
    from orchestrator.trust.gate import Gate
    from orchestrator.trust.handshake import connect

    svc = service(join_ms=60_000)
    gate = Gate(listening_socket("127.0.0.1"), "s3cret", lambda r: svc.handler if r == ROUTE else None)
    try:
        register(svc, "a:1", "b:2", world=2)
        q = all_ask(svc, {"a:1": 1, "b:2": 1}, world=2)[("a:1", 0)]["quorum_id"]
        assert "no group_rank 2" in watch(svc, "a:1", q, rank=2)["error"]
        assert "registered" in watch(svc, "stranger:0", q)["error"]
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(watch, svc, "a:1", q, 0, 30)
            time.sleep(0.2)
            again = watch(svc, "a:1", q, timeout_s=0.2)  # the same rank asks again: the first one ends
            assert first.result(timeout=2) == again == {"quorum_id": q, "dropped": []}
        with svc._lock:
            assert svc._watchers == {}
        sock = connect(("127.0.0.1", gate.port), "s3cret", ROUTE, 5.0)
        send_json(sock, {"op": "watch", "replica_id": "a:1", "group_rank": 1, "quorum_id": q, "timeout_s": 60})
        deadline = time.monotonic() + 5
        while ("a:1", 1) not in svc._watchers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ("a:1", 1) in svc._watchers
        sock.close()  # the worker exited: its watch is freed, not held for the minute it asked for
        deadline = time.monotonic() + 5
        while ("a:1", 1) in svc._watchers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ("a:1", 1) not in svc._watchers
    finally:
        gate.close()
        svc.close()


def test_a_workers_watch_thread_reports_each_quorum_it_follows_once():
    """orchestrator/ft/watch.py through a real gate: told of a drop in the quorum it follows, once; it then
    watches the next quorum it is given."""
    from orchestrator.ft.coordination import QuorumClient
    from orchestrator.ft.watch import QuorumWatch
    from orchestrator.trust.acceptor import listening_socket
    from orchestrator.trust.gate import Gate

    svc = service(join_ms=60_000)
    gate = Gate(listening_socket("127.0.0.1"), "s3cret", lambda r: svc.handler if r == ROUTE else None)
    told: list[tuple[int, list[str]]] = []
    news = threading.Event()
    watcher = QuorumWatch("a:1", 0, lambda q, gone: (told.append((q, gone)), news.set()),
                          client=QuorumClient(f"127.0.0.1:{gate.port}", "s3cret"), poll_s=0.3)
    try:
        register(svc, "a:1", "b:2", "c:3")
        q = all_ask(svc, {"a:1": 1, "b:2": 1, "c:3": 1})[("a:1", 0)]["quorum_id"]
        watcher.follow(q)
        time.sleep(0.8)  # a few polls answered with nothing
        assert told == []
        svc.drop("c")
        assert news.wait(5) and told == [(q, ["c:3"])]
        news.clear()
        time.sleep(0.5)
        assert told == [(q, ["c:3"])], "reported once"
        q2 = all_ask(svc, {"a:1": 2, "b:2": 2})[("a:1", 0)]["quorum_id"]
        watcher.follow(q2)
        svc.leave("b:2")
        assert news.wait(5) and told[-1] == (q2, ["b:2"])
    finally:
        watcher.close()
        gate.close()
        svc.close()


def test_torchfts_manager_through_orchs_client_and_a_real_gate():
    """torchft's own Manager code path, its server and client replaced by orch's: registration, a quorum, the
    checkpoint address of a heal source, and a commit, over the run's gate; a wrong secret gets nothing."""
    from orchestrator.ft.coordination import ManagerClient, ManagerServer, QuorumClient, QuorumError
    from orchestrator.trust.acceptor import listening_socket
    from orchestrator.trust.gate import Gate
    from orchestrator.trust.handshake import HandshakeError

    svc = service()
    gate = Gate(listening_socket("127.0.0.1"), "s3cret", lambda r: svc.handler if r == ROUTE else None)
    env = {"ORCH_FT_QUORUM": f"127.0.0.1:{gate.port}", "ORCH_RUN_SECRET": "s3cret"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        server = ManagerServer("node0-a0:abc", "orch", "ignored", "ignored", "ignored", world_size=1,
                               heartbeat_interval=timedelta(milliseconds=50), connect_timeout=timedelta(seconds=5))
        try:
            client = ManagerClient(server.address(), timedelta(seconds=5))
            result = client._quorum(0, 0, "orch-state://127.0.0.1:1", False, timedelta(seconds=5), 0, "h0")
            assert result.replica_world_size == 1 and result.quorum_id >= 1 and result.reconfigure_handles == ["h0"]
            assert client._checkpoint_metadata(0, timedelta(seconds=5)) == "orch-state://127.0.0.1:1"
            assert client.should_commit(0, 0, True, timedelta(seconds=5)) is True
            with pytest.raises(HandshakeError):
                QuorumClient(secret="a guess").call("heartbeat", replica_id="x")
        finally:
            server.shutdown()
        with pytest.raises(QuorumError, match="left|registered"):
            client._quorum(0, 1, "m", False, timedelta(seconds=2), 0, "h0")
        with pytest.raises(QuorumError, match="left|registered"):
            client.should_commit(0, 1, True, timedelta(seconds=2))
        # A group of one rank decides alone: no round trip (the service would refuse this one, gone).
        mp.setenv("WORLD_SIZE", "1")
        alone = ManagerClient(server.address(), timedelta(seconds=5))
        assert alone.should_commit(0, 1, True, timedelta(seconds=2)) is True
        assert alone.should_commit(0, 1, False, timedelta(seconds=2)) is False
    gate.close()
    svc.close()


def test_torchfts_manager_still_makes_its_server_and_clients_by_the_names_orch_replaces():
    """The contract orchestrator/ft/coordination.py relies on (checked against the installed torchft)."""
    torchft_manager = pytest.importorskip("torchft.manager")
    from torchft._torchft import QuorumResult as TorchftQuorumResult

    from orchestrator.ft.coordination import ManagerClient, ManagerServer, QuorumResult

    source = inspect.getsource(torchft_manager.Manager)
    assert "ManagerServer(" in source and "ManagerClient(" in source, "torchft's Manager no longer makes them by name"
    wanted = {n for n in dir(TorchftQuorumResult) if not n.startswith("_")}
    assert wanted <= set(QuorumResult.__dataclass_fields__), wanted - set(QuorumResult.__dataclass_fields__)
    start = source.index("ManagerServer(")
    called = source[start:source.index(")", start)]
    for keyword in ("replica_id", "lighthouse_addr", "hostname", "bind", "store_addr", "world_size",
                    "heartbeat_interval", "connect_timeout", "quorum_retries"):
        assert f"{keyword}=" in called and keyword in inspect.signature(ManagerServer).parameters, keyword
    for method in ("_quorum(", "._checkpoint_metadata(", ".should_commit("):
        assert method in source, f"torchft's Manager no longer calls {method}"
        assert hasattr(ManagerClient, method.strip(".("))
    # The async quorum (orchestrator/ft/replica.py): orch heals before the forward pass as torchft's synchronous
    # start_quorum does, and the participants come from what orch's client reports as max rank and size.
    start = inspect.getsource(torchft_manager.Manager.start_quorum)
    assert "self._apply_pending_state_dict()" in start and "self._healing = False" in start
    quorum = inspect.getsource(torchft_manager.Manager._async_quorum)
    assert "(max_replica_rank, max_replica_world_size)" in quorum and "self._use_async_quorum" in quorum
    # orchestrator/ft/replica.py reads the quorum it trains in from the Manager's client (orch's ManagerClient).
    assert "self._client = ManagerClient(" in source
    for name in ("disallow_state_dict_read", "allow_state_dict_read", "wait_quorum", "report_error"):
        assert callable(getattr(torchft_manager.Manager, name, None)), name
