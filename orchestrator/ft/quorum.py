"""The per_step quorum service: what torchft's Lighthouse and its per-group ManagerServers do, in orch's driver
(or in a process of its own, ``orch quorum-service``: a Kubernetes job's, see orchestrator/k8s/quorum.py), behind
the run's gate (route :data:`ROUTE`).

torchft's Lighthouse and ManagerServer are Rust gRPC servers with no authentication: the ManagerServer listens
on every interface and obeys a ``Kill`` call from anyone, the Lighthouse's dashboard kills a replica for
anyone who POSTs ``/replica/<id>/kill``, and any process that joins its quorum claiming a high step becomes
the heal source, to which every healing group then connects. This service keeps their semantics (the same
quorum rules, the same per-rank results torchft's Python ``Manager`` expects, see
:mod:`orchestrator.ft.coordination`) and none of those ports: every worker reaches it through the run's gate
with the run's secret, nothing in it kills anything, and a heal source is always a member of the quorum it
computed, named by replica id.

The rules (torchft's ``quorum_compute`` and ``compute_quorum_results``):

- a replica group is *healthy* while its heartbeats are fresher than ``heartbeat_timeout_ms`` and it was not
  dropped (:meth:`QuorumService.drop`: its agent died; :meth:`leave`: it left on a notice);
- a group joins the forming quorum once all its ranks asked for one; the quorum forms at once when every
  group of the previous quorum is back (fast quorum), else when at least ``min_replicas`` and more than half
  of the healthy groups joined, and either all healthy groups did or ``join_timeout_ms`` passed;
- the quorum id changes when its members do (or a member reports commit failures): the groups' process group
  is rebuilt then;
- members behind the newest step heal from one that has it (assigned round-robin), as does every member but
  the first at step 0 (``init_sync``).

And one of orch's own (torchft has none: its users ask for it, torchft#196): a worker *watches* the quorum it
trains in (op ``watch``, long-polled by one thread per worker, :mod:`orchestrator.ft.watch`), and is answered as
soon as another member of that quorum stops being healthy (dropped, left, its heartbeats aged out or its
heartbeat connection closed), so that it aborts a cross-group collective that would otherwise wait out
``collective_timeout_s`` for a peer that froze without closing its connections.

The same watch lets a *steady* quorum go on without a round trip per step (``"steady": true``; groups of one
rank, see :mod:`orchestrator.ft.replica`): its members train step after step in it without asking, and are
told when it is wanted anew. ``wanted`` 1: a group outside it asks to join (come to the next quorum at your
next step boundary); 2: another member asks already, for step ``at_step`` (a collective of that step on the
old quorum will never complete: abort it).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from orchestrator.trust.frames import FrameError, recv_json, send_json

log = logging.getLogger(__name__)

ROUTE = "ft/quorum"
"""The gate route of the service."""
ADDRESS_PREFIX = "orch-quorum:"
"""A group's "manager address" as torchft's Manager passes it around: this prefix and the group's replica id."""
WATCH_MAX_S = 60.0
"""The longest a ``watch`` is held before it is answered with no drop (its watcher then asks again)."""
WATCH_POLL_S = 1.0
"""The longest a held ``watch`` sleeps between looks (its caller may have hung up)."""
QUORUMS_KEPT = 16
"""How many of the latest quorums' members a ``watch`` can be answered about (a worker watches the newest)."""


@dataclass
class Member:
    """One replica group's request to join the quorum (torchft's ``QuorumMember``)."""

    replica_id: str
    step: int
    world_size: int
    shrink_only: bool = False
    commit_failures: int = 0
    handles: dict[int, str] = field(default_factory=dict)  # group rank -> its process group's reconfigure handle
    joined: float = 0.0


@dataclass
class Group:
    """What the service knows of one replica group (torchft's ManagerServer state)."""

    replica_id: str
    world_size: int
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)  # group rank -> its quorum request
    metadata: dict[int, str] = field(default_factory=dict)  # group rank -> its checkpoint server's address
    votes: dict[tuple[int, int], dict[int, bool]] = field(default_factory=dict)  # (step, attempt) -> rank -> vote
    decisions: dict[tuple[int, int], bool] = field(default_factory=dict)  # (step, attempt) -> the group's decision
    rounds: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, step) -> its decided votes on it


@dataclass
class Quorum:
    quorum_id: int
    members: list[Member]


class QuorumService:
    """The quorum of one run's replica groups. ``handler`` serves one gate connection; :meth:`drop` and
    :meth:`leave` take a group out at once (the controller saw its agent die; it left on a notice)."""

    def __init__(self, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int,
                 clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[str, str], None] = lambda replica_id, cause: None,
                 disconnect_is_silence: bool = False):
        self.min_replicas = max(1, min_replicas)
        self.on_drop = on_drop
        """Told ``(replica id, cause)`` of every group :meth:`drop` or :meth:`leave` took out (outside the lock),
        and, with ``disconnect_is_silence``, of every group whose heartbeat connection closed (``disconnected``)."""
        self.disconnect_is_silence = disconnect_is_silence
        """A group whose heartbeat connection closes counts at once as one whose heartbeats aged out: for a service
        that sees no agent exit (``orch quorum-service`` in a pod of its own), where a pod killed whole closes its
        connections as its processes die. Not a drop: a group that still beats is healthy again at its next beat."""
        self.join_timeout_s = join_timeout_ms / 1000
        self.tick_s = max(0.005, quorum_tick_ms / 1000)
        self.heartbeat_timeout_s = heartbeat_timeout_ms / 1000
        self.clock = clock
        self._lock = threading.Condition()
        self._groups: dict[str, Group] = {}
        self._heartbeats: dict[str, float] = {}
        self._dropped: set[str] = set()
        self._participants: dict[str, Member] = {}
        self._prev: Optional[Quorum] = None
        self._quorum_id = 0
        self._results: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}  # (replica, rank) -> (serial, result)
        self._serial = 0
        self._members: dict[int, tuple[str, ...]] = {}  # quorum id -> its members' replica ids (the latest few)
        self._watchers: dict[tuple[str, int], object] = {}  # (replica, group rank) -> its one watch being held
        self._closed = False
        self._ticker = threading.Thread(target=self._tick_loop, daemon=True, name="orch-quorum-tick")
        self._ticker.start()

    @classmethod
    def for_run(cls, cfg: Any) -> Optional["QuorumService"]:
        """The run's service in per_step mode; None in restart mode."""
        ft = cfg.fault_tolerance
        if ft.mode != "per_step":
            return None
        return cls(cfg.cluster.min_nodes, ft.join_timeout_ms, ft.quorum_tick_ms, ft.heartbeat_timeout_ms)

    # -- membership --------------------------------------------------------------------------------------
    def drop(self, prefix: str, cause: str = "agent_exited") -> list[str]:
        """Take every group whose replica id is ``prefix`` or starts with ``prefix:`` out of the quorum now
        (torchft's Manager appends ``:<uuid>`` to the id orch gives it): a quorum its survivors wait for forms
        at once. Returns the ids dropped (none: already out)."""
        with self._lock:
            gone = sorted(rid for rid in {*self._groups, *self._heartbeats}
                          if rid == prefix or rid.startswith(prefix + ":"))
            for rid in gone:
                self._forget(rid)
            self._evaluate()
            self._lock.notify_all()
        for rid in gone:
            self.on_drop(rid, cause)
        return gone

    def leave(self, replica_id: str) -> None:
        """A group leaving on its own (a preemption notice, its end): out of the quorum at once."""
        self.drop(replica_id, cause="left")

    def _forget(self, rid: str) -> None:
        self._dropped.add(rid)
        self._heartbeats.pop(rid, None)
        self._participants.pop(rid, None)
        group = self._groups.pop(rid, None)
        if group is not None:
            for rank in group.pending:
                self._deliver(rid, rank, {"error": f"replica {rid} left the quorum"})

    def _healthy(self, now: float) -> set[str]:
        return {rid for rid, t in self._heartbeats.items()
                if now - t < self.heartbeat_timeout_s and rid not in self._dropped}

    # -- the quorum (torchft's quorum_compute) -----------------------------------------------------------
    def _compute(self, now: float) -> Optional[list[Member]]:
        healthy = self._healthy(now)
        joined = {rid: m for rid, m in self._participants.items() if rid in healthy}
        candidates = sorted(joined.values(), key=lambda m: m.replica_id)
        if self._prev is not None:
            prev_ids = {m.replica_id for m in self._prev.members}
            if any(m.shrink_only for m in joined.values()):
                candidates = [m for m in candidates if m.replica_id in prev_ids]
            if prev_ids and prev_ids <= set(joined):
                return candidates  # fast quorum: everyone of the last one is back
        if len(joined) < self.min_replicas or len(joined) <= len(healthy) // 2:
            return None
        if len(joined) < len(healthy) and now - min(m.joined for m in joined.values()) < self.join_timeout_s:
            return None  # a valid quorum, but healthy stragglers may still join
        return candidates

    def _evaluate(self) -> None:
        """Form a quorum if one is due, and answer its members' waiting ranks (called with the lock held)."""
        if not self._participants:
            return
        members = self._compute(self.clock())
        if not members:
            return
        ids = [m.replica_id for m in members]
        if self._prev is None or ids != [m.replica_id for m in self._prev.members] or \
                any(m.commit_failures > 0 for m in members):
            self._quorum_id += 1
        quorum = Quorum(self._quorum_id, members)
        self._prev = quorum
        self._members[quorum.quorum_id] = tuple(ids)
        for old in [q for q in self._members if q <= quorum.quorum_id - QUORUMS_KEPT]:
            del self._members[old]
        for m in members:
            self._participants.pop(m.replica_id, None)
            group = self._groups.get(m.replica_id)
            if group is None:
                continue
            requests, group.pending = group.pending, {}
            for rank, request in requests.items():
                self._deliver(m.replica_id, rank, results(quorum, m.replica_id, rank, bool(request["init_sync"])))

    def _deliver(self, rid: str, rank: int, result: dict[str, Any]) -> None:
        self._serial += 1
        self._results[(rid, rank)] = (self._serial, result)
        self._lock.notify_all()

    def _tick_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                self._evaluate()
                self._lock.wait(self.tick_s)

    # -- the calls of a group's ranks ----------------------------------------------------------------------
    def call(self, request: dict[str, Any], hung_up: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Serve one request (see :mod:`orchestrator.ft.coordination` for the client side). ``hung_up``: whether
        the caller is gone (a ``watch`` held for it ends then)."""
        op = request.get("op")
        rid = str(request.get("replica_id", ""))
        if op == "heartbeat":
            with self._lock:
                if rid not in self._dropped:
                    self._heartbeats[rid] = self.clock()
            return {}
        if op == "register":
            with self._lock:
                if rid in self._dropped:
                    return {"error": f"replica {rid} left the quorum"}
                size = int(request["world_size"])
                now = self.clock()
                other = next((g for g in self._groups.values() if g.world_size != size and g.replica_id != rid
                              and now - self._heartbeats.get(g.replica_id, -1e18) < self.heartbeat_timeout_s), None)
                if other is not None:  # rank i all-reduces with, and heals from, rank i of every other group
                    return {"error": f"replica group {rid} has {size} rank(s), {other.replica_id} has "
                                     f"{other.world_size}: per_step pairs rank i of every group (gradients, "
                                     "healing shard by shard), so every node runs the same cluster.nproc_per_node"}
                self._groups[rid] = Group(rid, size)
                self._heartbeats[rid] = self.clock()
            return {}
        if op == "leave":
            self.leave(rid)
            return {}
        if op == "drop":  # a pod's launch saw its agent exit (the service runs in a pod of its own)
            return {"dropped": self.drop(rid)} if rid else {"error": "drop needs a replica_id"}
        if op == "ping":  # a pod's launch waits for the service to admit it before starting its agent
            return {}
        if op == "quorum":
            return self._quorum(rid, request)
        if op == "checkpoint_metadata":
            with self._lock:
                group = self._groups.get(rid)
                metadata = group.metadata.get(int(request["rank"])) if group else None
            return {"metadata": metadata} if metadata is not None else {"error": f"no checkpoint server for {rid}"}
        if op == "should_commit":
            return self._should_commit(rid, request)
        if op == "watch":
            return self._watch(rid, request, hung_up)
        return {"error": f"unknown request {op!r}"}

    def _quorum(self, rid: str, request: dict[str, Any]) -> dict[str, Any]:
        rank, timeout_s = int(request["group_rank"]), float(request["timeout_s"])
        with self._lock:
            group = self._groups.get(rid)
            if group is None:
                return {"error": f"replica {rid} is not registered (or left the quorum)"}
            group.metadata[rank] = str(request["checkpoint_metadata"])
            group.pending[rank] = request
            self._results.pop((rid, rank), None)
            if len(group.pending) == group.world_size:  # the whole group asked: it joins the forming quorum
                member = Member(rid, int(request["step"]), group.world_size, bool(request["shrink_only"]),
                                max(int(r["commit_failures"]) for r in group.pending.values()),
                                {r: str(q["reconfigure_handle"]) for r, q in group.pending.items()}, self.clock())
                self._participants[rid] = member
                self._evaluate()
                self._lock.notify_all()  # a steady quorum's watchers: it is wanted anew
            deadline = time.monotonic() + timeout_s
            while (rid, rank) not in self._results:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    group.pending.pop(rank, None)
                    self._participants.pop(rid, None)  # a group missing a rank is not ready
                    return {"error": f"quorum timed out after {timeout_s:.0f} s"}
                self._lock.wait(min(left, self.tick_s))
            return self._results.pop((rid, rank))[1]

    def _should_commit(self, rid: str, request: dict[str, Any]) -> dict[str, Any]:
        """The group's decision on a step: every rank's vote of this attempt at it. A discarded step is voted on
        again under the same step number, so each rank's n-th vote on a step counts in the n-th decision on it
        (never the decision of an earlier attempt, which a fast rank would otherwise read before its peers vote)."""
        rank, step = int(request["group_rank"]), int(request["step"])
        deadline = time.monotonic() + float(request["timeout_s"])
        with self._lock:
            group = self._groups.get(rid)
            if group is None:
                return {"error": f"replica {rid} is not registered (or left the quorum)"}
            key = (step, group.rounds.get((rank, step), 0))
            votes = group.votes.setdefault(key, {})
            votes[rank] = bool(request["should_commit"])
            if len(votes) == group.world_size:
                group.decisions[key] = all(votes.values())
                group.votes.pop(key)
                for old in [k for k in group.decisions if k[0] < step - 4]:
                    group.decisions.pop(old)
                for old in [k for k in group.rounds if k[1] < step - 4]:
                    group.rounds.pop(old)
                self._lock.notify_all()
            while key not in group.decisions:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed or rid not in self._groups:
                    votes.pop(rank, None)
                    return {"error": "should_commit timed out"}
                self._lock.wait(min(left, self.tick_s))
            group.rounds[(rank, step)] = key[1] + 1
            return {"should_commit": group.decisions[key]}

    def _watch(self, rid: str, request: dict[str, Any], hung_up: Callable[[], bool]) -> dict[str, Any]:
        """Answer rank ``group_rank`` of group ``rid`` when a member of quorum ``quorum_id`` other than its own
        group is no longer healthy (``{"quorum_id", "dropped": [replica ids]}``, at once if one already is), else
        after ``timeout_s`` (at most :data:`WATCH_MAX_S`) with ``"dropped": []``; the same when its group is out,
        the service closes, or a newer watch of the same rank takes its place. One watch per rank of a registered
        group is held at a time, and the one held for a caller that hung up ends within :data:`WATCH_POLL_S`.
        With ``steady`` the answer also says how much the quorum is wanted anew (``wanted``, ``at_step``: see the
        module's doc), and comes as soon as that is more than ``seen``, the level the watcher already knows."""
        rank, quorum_id = int(request["group_rank"]), int(request["quorum_id"])
        steady, seen = bool(request.get("steady")), int(request.get("seen", 0))
        deadline = time.monotonic() + min(max(0.0, float(request["timeout_s"])), WATCH_MAX_S)
        key, token = (rid, rank), object()
        with self._lock:
            group = self._groups.get(rid)
            if group is None:
                return {"error": f"replica {rid} is not registered (or left the quorum)"}
            if not 0 <= rank < group.world_size:
                return {"error": f"replica {rid} has {group.world_size} rank(s): no group_rank {rank}"}
            self._watchers[key] = token  # an earlier watch of this rank (its caller gone, or asking again) ends
            self._lock.notify_all()
            try:
                while True:
                    dropped, ages_out_s = self._gone_from(quorum_id, rid)
                    wanted = self._wanted(quorum_id, rid) if steady else None
                    news = {"wanted": wanted[0], "at_step": wanted[1]} if wanted is not None else {}
                    if dropped or (wanted is not None and wanted[0] > seen):
                        return {"quorum_id": quorum_id, "dropped": dropped, **news}
                    if self._watchers.get(key) is not token or rid not in self._groups or self._closed \
                            or time.monotonic() >= deadline or hung_up():
                        return {"quorum_id": quorum_id, "dropped": [], **news}
                    # A drop, a leave or a closed connection wakes it; a heartbeat ageing out it sees when due (at
                    # most ``WATCH_POLL_S`` apart, so a caller that hung up is noticed).
                    self._lock.wait(max(0.0, min(deadline - time.monotonic(), WATCH_POLL_S,
                                                 max(self.tick_s, ages_out_s))))
            finally:
                if self._watchers.get(key) is token:
                    del self._watchers[key]

    def _wanted(self, quorum_id: int, rid: str) -> tuple[int, Optional[int]]:
        """Whether steady quorum ``quorum_id`` is wanted anew, for its member ``rid``: (2, the step they ask for)
        when other members of it ask for a quorum, (1, None) when only healthy groups outside it do, else (0,
        None)."""
        members = self._members.get(quorum_id, ())
        healthy = self._healthy(self.clock())
        asking = [m for r, m in self._participants.items() if r != rid and r in healthy]
        inside = [m.step for m in asking if m.replica_id in members]
        return (2, min(inside)) if inside else (1, None) if asking else (0, None)

    def _gone_from(self, quorum_id: int, rid: str) -> tuple[list[str], float]:
        """The members of quorum ``quorum_id`` but ``rid`` that are not healthy now (none for a quorum no longer
        kept: its members are long reconfigured away), and the seconds until the next one's heartbeat ages out."""
        now = self.clock()
        healthy = self._healthy(now)
        others = [m for m in self._members.get(quorum_id, ()) if m != rid]
        ages_out = min((self._heartbeats[m] + self.heartbeat_timeout_s - now for m in others if m in healthy),
                       default=float("inf"))
        return sorted(m for m in others if m not in healthy), ages_out

    # -- the gate's side ---------------------------------------------------------------------------------
    def handler(self, sock: socket.socket, peer: str) -> None:
        """Serve one authenticated connection: a JSON request, a JSON answer, until the client hangs up."""
        beating: set[str] = set()  # the groups whose heartbeats came on this connection
        try:
            while True:
                request = recv_json(sock)
                if not isinstance(request, dict):
                    raise FrameError("a request is a JSON object")
                if request.get("op") == "heartbeat":
                    beating.add(str(request.get("replica_id", "")))
                try:
                    answer = self.call(request, hung_up=lambda: _hung_up(sock))
                except (KeyError, TypeError, ValueError) as exc:
                    answer = {"error": f"bad request: {exc}"}
                send_json(sock, answer)
        except (FrameError, OSError):
            pass
        if self.disconnect_is_silence and beating:
            self._silence(beating)

    def _silence(self, replica_ids: set[str]) -> None:
        """Their heartbeats stop counting now (see ``disconnect_is_silence``)."""
        with self._lock:
            if self._closed:
                return
            silenced = sorted(rid for rid in replica_ids if self._heartbeats.pop(rid, None) is not None)
            self._evaluate()
            self._lock.notify_all()
        for rid in silenced:
            self.on_drop(rid, "disconnected")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def _hung_up(sock: socket.socket) -> bool:
    """Whether the client of ``sock`` closed it while waiting for an answer (it sends nothing meanwhile)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def results(quorum: Quorum, rid: str, group_rank: int, init_sync: bool) -> dict[str, Any]:
    """What rank ``group_rank`` of group ``rid`` needs of ``quorum`` (torchft's ``compute_quorum_results``,
    plus the process-group handles and ids torchft's Manager reconfigures with)."""
    members = sorted(quorum.members, key=lambda m: m.replica_id)
    rank = next(i for i, m in enumerate(members) if m.replica_id == rid)
    max_step = max(m.step for m in members)
    at_max = [m for m in members if m.step == max_step]
    max_rank = next((i for i, m in enumerate(at_max) if m.replica_id == rid), None)
    primary = at_max[group_rank % len(at_max)]
    force = init_sync and max_step == 0
    recovering = [i for i, m in enumerate(members)
                  if m.step != max_step or (force and m.replica_id != primary.replica_id)]
    up_to_date = [i for i in range(len(members)) if i not in recovering]
    assignments: dict[int, list[int]] = {}
    source: Optional[int] = None
    for i, dst in enumerate(recovering):
        src = up_to_date[(i + group_rank) % len(up_to_date)]
        assignments.setdefault(src, []).append(dst)
        if dst == rank:
            source = src
    return {
        "quorum_id": quorum.quorum_id,
        "replica_rank": rank,
        "replica_world_size": len(members),
        "recover_src_manager_address": ADDRESS_PREFIX + members[source].replica_id if source is not None else "",
        "recover_src_replica_rank": source,
        "recover_dst_replica_ranks": assignments.get(rank, []),
        "store_address": "",
        "max_step": max_step,
        "max_replica_rank": max_rank,
        "max_world_size": len(at_max),
        "heal": source is not None,
        "commit_failures": max(m.commit_failures for m in members),
        "replica_ids": [m.replica_id for m in members],
        "reconfigure_handles": [m.handles.get(group_rank, next(iter(m.handles.values()), "")) for m in members],
    }
