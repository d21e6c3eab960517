"""Aborting per_step's cross-group process group ends a collective blocked on a peer that froze without closing
its connections at once, not after ``collective_timeout_s`` (orchestrator/ft/sockets.py, the process group of
orchestrator/ft/coordination.py). Fast: gloo ranks on threads of this process, a TCPStore on port 0."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch

from orchestrator.ft import sockets, torchft_problem

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(torchft_problem() is not None, reason=str(torchft_problem())),
              pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc/self/fd here")]

TIMEOUT = timedelta(seconds=30)  # the collective timeout a frozen peer would make a survivor wait out


def test_the_sockets_opened_meanwhile_are_told_from_older_servers_and_clients_and_cut():
    older_server = socket.create_server(("127.0.0.1", 0))
    older_peer = socket.create_server(("127.0.0.1", 0))
    older_client = socket.create_connection(older_peer.getsockname())
    held = [older_server, older_peer, older_client, older_peer.accept()[0]]
    before = sockets.open_sockets()
    new_server = socket.create_server(("127.0.0.1", 0))  # a process group's listener and both ends of a pair
    mine = socket.create_connection(new_server.getsockname())
    accepted = new_server.accept()[0]
    caller = socket.create_connection(older_server.getsockname())  # a caller of an older server, both ends
    served = older_server.accept()[0]
    again = socket.create_connection(older_peer.getsockname())  # a client reconnecting to where it was
    held += [new_server, mine, accepted, caller, served, again, older_peer.accept()[0]]
    try:
        found = sockets.opened_since(before)
        assert sorted(fd for fd, _ in found) == sorted([mine.fileno(), accepted.fileno()])
        assert sockets.cut(found) == 2
        assert mine.recv(1) == b"" and accepted.recv(1) == b"", "both ends shut down"
        caller.sendall(b"x")
        assert served.recv(1) == b"x", "the older server's connection is untouched"
        fd, inode = found[0]
        mine.close()  # the fd number may name another socket now: never that one
        other = socket.create_connection(older_peer.getsockname())
        held += [other, older_peer.accept()[0]]
        assert sockets.cut([(other.fileno(), inode)]) == 0
        other.sendall(b"y")
    finally:
        for s in held:
            s.close()


def _pair(monkeypatch):
    """Two of per_step's process groups (rank 0 of two replica groups) meeting through a store on port 0."""
    from torch.distributed import TCPStore

    from orchestrator.ft.coordination import process_group
    from orchestrator.rendezvous.agent import RUN_STORE_ENV

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(RUN_STORE_ENV, f"127.0.0.1:{store.port}")
    monkeypatch.setenv("RANK", "0")
    return store, [process_group("gloo", TIMEOUT, hold_s=1.0) for _ in range(2)]


def _reconfigure(pgs, quorum_id: int, monkeypatch) -> None:
    """Both process groups made at once, as two workers' are. Here both live in this one process, so each one's
    "before" snapshot of the process's sockets is taken before either opens any: otherwise a slow thread's
    snapshot would hold the other's new listener, and its pairs to it would not count as its own (only in this
    test: a worker makes one process group at a time)."""
    from torchft.process_group import ReconfigureOptions

    real, together, mine = sockets.open_sockets, threading.Barrier(len(pgs)), threading.local()

    def snapshot_together() -> sockets.Sockets:
        found = real()
        if not getattr(mine, "snapped", False):  # the first call of each thread is its "before"
            mine.snapped = True
            together.wait(30)
        return found

    monkeypatch.setattr(sockets, "open_sockets", snapshot_together)
    opts = ReconfigureOptions()
    opts.uuid, opts.handles, opts.timeout = quorum_id, [pg.get_reconfigure_handle() for pg in pgs], TIMEOUT
    threads = [threading.Thread(target=lambda pg=pg: pg.reconfigure(opts).wait()) for pg in pgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def _allreduce(pg, value: float):
    from torch.distributed import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    tensor = torch.full((4096,), value)
    return pg.allreduce([tensor], opts), tensor


def test_an_abort_ends_a_collective_waiting_on_a_frozen_peer_at_once_and_only_for_its_own_quorum(monkeypatch):
    store, (a, b) = _pair(monkeypatch)
    _reconfigure([a, b], 1, monkeypatch)
    works = [_allreduce(pg, v) for pg, v in ((a, 1.0), (b, 2.0))]
    for work, tensor in works:
        work.wait()
        assert tensor[0].item() == 3.0
    first = a._pg
    # b is frozen: it never joins a's next all-reduce and closes nothing.
    work, _ = _allreduce(a, 1.0)
    started = time.monotonic()
    threading.Timer(0.3, a.abort_if, args=(first,)).start()
    with pytest.raises(Exception):
        work.wait()
    assert time.monotonic() - started < 10, "ended by the abort, not by the 30 s collective timeout"
    assert not a.abort_if(first), "aborted once"
    waited, _ = _allreduce(b, 2.0)  # and b, once it runs again, fails at once too (its peer cut it off)
    started = time.monotonic()
    with pytest.raises(Exception):
        waited.wait()
    assert time.monotonic() - started < 10
    # The next quorum's process group works, and an abort meant for the earlier one leaves it alone.
    b.abort_if()
    _reconfigure([a, b], 2, monkeypatch)
    assert not a.abort_if(first)
    works = [_allreduce(pg, v) for pg, v in ((a, 1.0), (b, 5.0))]
    for work, tensor in works:
        work.wait()
        assert tensor[0].item() == 6.0
    for pg in (a, b):
        pg.abort_if()
    del store


def test_a_workers_abort_on_news_of_a_drop_is_for_the_quorum_it_trains_in_only():
    """ReplicaGroup._peer_dropped (the watch thread's call): the process group it runs on for that quorum is
    aborted; news of a quorum it already left, or for one whose process group is gone, aborts nothing."""
    from types import SimpleNamespace

    from orchestrator.ft.replica import ReplicaGroup

    aborted: list[object] = []
    inner = object()
    pg = SimpleNamespace(abort_if=lambda which: aborted.append(which) or True)
    group = SimpleNamespace(_pg=pg, _in_use=(7, inner), _lost="", _wanted=threading.Lock(), _requorum=False)
    group._abort_once = lambda which=None: ReplicaGroup._abort_once(group, which)
    ReplicaGroup._peer_dropped(group, 6, ["b:2"])  # an earlier quorum's news
    assert aborted == [] and group._lost == ""
    assert group._requorum, "any drop: the next step asks for a quorum (a steady one does not go on)"
    ReplicaGroup._peer_dropped(group, 7, ["b:2", "c:3"])
    assert aborted == [inner] and group._lost == "quorum 7 lost b:2, c:3 (aborted at once)"
    group._in_use = (8, None)  # no process group made for it (its reconfiguration failed): nothing to abort
    ReplicaGroup._peer_dropped(group, 8, ["b:2"])
    assert aborted == [inner]


def test_a_steady_step_is_aborted_only_when_another_member_wants_a_quorum_for_it():
    """ReplicaGroup._quorum_wanted (the watch thread's call, steady quorums): any news makes the next step ask
    for a quorum; the process group is aborted only when another member of the quorum asks for one for a step
    this worker trains without asking (its collectives would wait for that member for ever), never for a group
    outside the quorum asking to join, nor for an earlier step than the one trained."""
    from types import SimpleNamespace

    from orchestrator.ft.replica import ReplicaGroup

    aborted: list[object] = []
    inner = object()
    pg = SimpleNamespace(abort_if=lambda which: aborted.append(which) or True)
    group = SimpleNamespace(_pg=pg, _in_use=(7, inner), _lost="", _wanted=threading.Lock(), _requorum=False,
                            _steady_at=12)
    group._abort_once = lambda which=None: ReplicaGroup._abort_once(group, which)
    ReplicaGroup._quorum_wanted(group, 7, 1, None)  # a group outside it asks to join
    assert group._requorum and aborted == []
    ReplicaGroup._quorum_wanted(group, 7, 2, 13)  # a member asks for the step after the one trained
    assert aborted == []
    ReplicaGroup._quorum_wanted(group, 6, 2, 12)  # news of an earlier quorum
    assert aborted == []
    group._steady_at = None  # between steps, or in a step that asked: the next quorum has everyone
    ReplicaGroup._quorum_wanted(group, 7, 2, 12)
    assert aborted == []
    group._steady_at = 12
    ReplicaGroup._quorum_wanted(group, 7, 2, 12)
    assert aborted == [inner] and group._lost == "quorum 7 wanted anew for step 12 (aborted at once)"
