"""What a launcher does differently on a test cluster: fault events, partition detection, healed nodes.

A partitioned node is the hard case for torchrun. Its agent and workers keep running, but nothing reaches
them: no TCP reset tells the survivors, so their gloo collective would wait for ``backend.timeout_s``
(30 minutes by default) before failing. ``ClusterWatch`` ends that wait from two signals, both required:

1. **Silence in the rendezvous store.** Every agent writes a keep-alive into the c10d rendezvous state each
   ``rendezvous.keep_alive_interval_s``; the launcher hosts the store, so it reads that state. A member of
   the current round whose keep-alive is older than interval x ``keep_alive_max_attempt`` + 2 s is silent.
2. **Blocked survivors.** Every worker of every other member used (almost) no CPU over the last 3 s: they
   wait in a collective. This is what tells a cut-off node from one torchrun merely dropped from its
   bookkeeping (a starved agent misses keep-alives under load, and torchrun then stops its keep-alives for
   good) while its workers train on: acting then would break a healthy job.

Then the watch ends the survivors' workers (SIGKILL, like a crash). Their agents restart them, as after a
kill, and re-rendezvous without the silent node: recovery takes the keep-alive timeouts plus a restart, not
the collective timeout. ``backend.timeout_s`` stays the backstop where no launcher watches (a bare torchrun).

The cut-off node's stale workers can never come back with an old step: each round's process group lives on
a store its rank 0 creates for that round, so their group is dead; they fail once they can talk again (or
at ``backend.timeout_s``), their agent restarts them (or, if the agent gave up while cut off, the launcher
starts a fresh one when the node is healed), and the fresh workers join the next rendezvous as a waiting
node, which scales the job up; every rank then restores the newest checkpoint.
"""

from __future__ import annotations

import signal
import os
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

import psutil

from orchestrator.rendezvous.rounds import RoundWatch
from orchestrator.events import (ChaosHeal, ChaosKill, ChaosPartition, RoundBroken, StaleWorkersEnded,
                                 TestclusterBindings)
from orchestrator.rundir import EventLog
from orchestrator.testcluster import cluster
from orchestrator.testcluster import netns as nx
from orchestrator.testcluster.state import ClusterState

POLL_INTERVAL_S = 0.5
FAULT_EVENTS = {"partition": ChaosPartition, "heal": ChaosHeal, "kill": ChaosKill}
SILENCE_MARGIN_S = 2.0
"""Added to interval x attempts: a keep-alive is written only once the last one is an interval old, and
read through a cache of up to a second, so a healthy member's can be that much older."""
BINDINGS_INTERVAL_S = 1.0
IDLE_WINDOW_S = 3.0
IDLE_CPU_S = 0.15
"""A worker that used less CPU than this over IDLE_WINDOW_S is blocked (a training worker uses far more,
even sharing two cores with a dozen processes)."""


def _end(workers: list[psutil.Process]) -> list[int]:
    """SIGKILL ``workers`` (as a crash would: their torchrun agent restarts them); returns the PIDs ended."""
    ended = []
    for proc in workers:
        try:
            proc.send_signal(signal.SIGKILL)
            ended.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return ended


class CpuHistory:
    """CPU seconds used by each worker process, sampled every poll, to tell blocked workers from busy ones."""

    def __init__(self):
        self._samples: dict[int, deque] = {}

    def sample(self, procs: list[psutil.Process]) -> None:
        now, alive = time.monotonic(), set()
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            alive.add(p.pid)
            history = self._samples.setdefault(p.pid, deque(maxlen=64))
            history.append((now, t.user + t.system))
        for pid in set(self._samples) - alive:
            del self._samples[pid]

    def idle(self, pids: list[int], window_s: float = IDLE_WINDOW_S, cpu_s: float = IDLE_CPU_S) -> bool:
        """Every one of ``pids`` was sampled for at least ``window_s`` and used less than ``cpu_s`` in it."""
        if not pids:
            return False
        now = time.monotonic()
        for pid in pids:
            history = self._samples.get(pid)
            if not history or now - history[0][0] < window_s:
                return False
            base = next(cpu for t, cpu in reversed(history) if now - t >= window_s)
            if history[-1][1] - base >= cpu_s:
                return False
        return True


class ClusterWatch:
    """The local launcher's companion on a test cluster (``cluster.testcluster``)."""

    def __init__(self, state: ClusterState, run_dir: str, run_id: str, events: EventLog, rendezvous,
                 since: float, store):
        self.state, self.events, self.since, self.run_dir = state, events, since, Path(run_dir)
        self.silence_s = rendezvous.keep_alive_interval_s * rendezvous.keep_alive_max_attempt + SILENCE_MARGIN_S
        self.rounds = RoundWatch(store.client, run_id, self.silence_s, store.secret)  # the hosted store, in process
        self.cpu = CpuHistory()
        self._acted_round: Optional[int] = None
        self._bound_round: Optional[int] = None
        self._next_bindings = 0.0
        self._faults_seen = 0
        self._cut_off: set[int] = set()  # nodes whose agent left while partitioned: restart them once healed
        self._healed: set[int] = set()  # nodes healed since the last tick: end their stale workers
        self._next_poll = 0.0

    def follow(self, run_id: str) -> None:
        """Watch rendezvous ``run_id`` from now on (the Ray controller uses a fresh id for every restart)."""
        self.rounds.follow(run_id)

    def poll(self, agent_pids: dict[int, int], running: Callable[[int], bool]) -> list[int]:
        """One tick (acts at most every 0.5 s): record new faults as run events; end the survivors' workers
        when a round has a silent member and blocked survivors; returns the nodes to start a fresh agent for
        (cut off while their agent gave up, now healed)."""
        if time.monotonic() < self._next_poll:
            return []
        self._next_poll = time.monotonic() + POLL_INTERVAL_S
        if not os.path.exists(f"/sys/class/net/{self.state.bridge}"):
            # `testcluster down` removed the bridge, and with it the store's address: a store client would
            # block on a dead connection. Nothing is left to watch; the agents' exits end the launch.
            return []
        self._record_faults()
        live = {n: pid for n, pid in agent_pids.items() if running(n)}
        self._check_round(live)
        self._end_stale_workers(live)
        self._record_bindings(live)
        healed = [n for n in sorted(self._cut_off) if cluster.link_up(self.state, n)]
        self._cut_off.difference_update(healed)
        return healed

    def _record_faults(self) -> None:
        faults = cluster.faults(self.state.name)
        for fault in faults[self._faults_seen:]:
            if fault["t"] >= self.since and fault["fault"] in FAULT_EVENTS:
                # The fault's own time, not when this tick saw it: recovery times start at the fault.
                event = FAULT_EVENTS[fault["fault"]](node=fault["node"], host=fault["hostname"], source="testcluster",
                                                     **({"pids": fault["pids"]} if "pids" in fault else {}))
                self.events.write(event, t=fault["t"])
                if fault["fault"] == "heal":
                    self._healed.add(fault["node"])
        self._faults_seen = len(faults)

    def _check_round(self, agent_pids: dict[int, int]) -> None:
        # Workers are listed before the state is read: a survivor that already moved on to the next round
        # starts its new workers after this list, and those are never touched.
        workers: dict[int, list[psutil.Process]] = {}
        for node, pid in agent_pids.items():
            try:
                workers[node] = psutil.Process(pid).children()
            except psutil.NoSuchProcess:
                continue
        self.cpu.sample([p for procs in workers.values() for p in procs])
        try:
            silent = self.rounds.silent()
        except Exception:  # the store is going away (end of run): nothing to watch
            return
        if not silent or self.rounds.round == self._acted_round:
            return
        by_pid = {pid: node for node, pid in agent_pids.items()}
        survivors = sorted(by_pid[m.pid] for m in self.rounds.last_seen if m not in silent and m.pid in by_pid)
        victims = [p for node in survivors for p in workers.get(node, [])]
        if not self.cpu.idle([p.pid for p in victims]):
            return  # the survivors still compute: torchrun dropped a slow member from its books, nothing hangs
        self._acted_round = self.rounds.round
        ended = _end(victims)
        hosts = [m.addr for m in silent]
        self.events.write(RoundBroken(
            round=self.rounds.round, silent_nodes=sorted(by_pid.get(m.pid, -1) for m in silent), silent_hosts=hosts,
            silent_for_s=self.rounds.silence(), survivors=survivors, ended_worker_pids=ended,
            reason=f"no rendezvous keep-alive from {', '.join(hosts)} for over {self.silence_s:g} s while the other "
                   f"nodes' workers sat blocked for {IDLE_WINDOW_S:g} s: ended those workers so their agents "
                   "re-rendezvous instead of waiting out backend.timeout_s"))

    def _end_stale_workers(self, agent_pids: dict[int, int]) -> None:
        """A healed node whose agent the rendezvous no longer knows (the survivors went on without it) still runs
        workers of the dead round. Nothing tells them: they wait to receive, and TCP retransmits what they sent
        only at a backed-off timer (a minute or more after a long partition). End them now, as after a crash:
        their agent restarts them, they join the next rendezvous as a waiting node, and the job grows back."""
        for node in sorted(self._healed):
            self._healed.discard(node)
            if node not in agent_pids:
                continue  # its agent left while cut off: poll() starts a fresh one
            try:
                members = self.rounds.members()
            except Exception:
                return
            if members is None or agent_pids[node] in members:
                continue  # the round never broke (a short cut), or the node already rejoins by itself
            try:
                workers = psutil.Process(agent_pids[node]).children()
            except psutil.NoSuchProcess:
                continue
            self.events.write(StaleWorkersEnded(node=node, ended_worker_pids=_end(workers),
                                                reason=f"node {node} was healed but the rendezvous went on without it: "
                                                       "ended its workers of the dead round so its agent rejoins "
                                                       "instead of waiting on them"))

    def _record_bindings(self, agent_pids: dict[int, int]) -> None:
        """Once per round, when every rank is connected to another node: which address each rank's TCP
        sockets use (``ss`` in its namespace), as a ``testcluster_bindings`` event. On a test cluster every
        one must be its own node's address: gloo went out through the node's own veth."""
        if self.rounds.round is None or self.rounds.round == self._bound_round or time.monotonic() < self._next_bindings:
            return
        self._next_bindings = time.monotonic() + BINDINGS_INTERVAL_S
        ranks = []
        for node, pid in sorted(agent_pids.items()):
            host = self.state.nodes[node]
            try:
                workers = [(w, w.environ()) for w in psutil.Process(pid).children(recursive=True)]
                conns = nx.tcp_connections(host.netns)
            except (psutil.Error, OSError):
                return  # an agent or a worker between rounds: try again next tick
            for w, env in workers:
                if "RANK" not in env:
                    continue  # not a rank (a helper process of torch's or Python's)
                # Loopback is the worker's own host (its agent's store relay): only what leaves it counts.
                mine = [c for c in conns if w.pid in c["pids"] and not _loopback(c["local"])]
                ranks.append({"rank": int(env["RANK"]), "node": node, "host": host.hostname,
                              "address": host.address, "pid": w.pid,
                              "local_addresses": sorted({c["local"].rsplit(":", 1)[0] for c in mine}),
                              "peer_addresses": sorted({c["peer"].rsplit(":", 1)[0] for c in mine})})
        addresses = {n.address for n in self.state.nodes}
        if len(ranks) < 2 or not all(set(r["peer_addresses"]) & (addresses - {r["address"]}) for r in ranks):
            return  # workers still starting, or a single node: nothing crosses a link yet
        self._bound_round = self.rounds.round
        ranks.sort(key=lambda r: r["rank"])
        self.events.write(TestclusterBindings(round=self.rounds.round, ranks=ranks,
                                              own_address_only=all(r["local_addresses"] == [r["address"]] for r in ranks)))
        with (self.run_dir / "logs" / "testcluster.log").open("a") as log:
            for r in ranks:
                log.write(f"round {self.rounds.round}: rank {r['rank']} on {r['host']} ({r['address']}): TCP sockets "
                          f"bound to {', '.join(r['local_addresses'])}; peers {', '.join(r['peer_addresses'])}\n")

    def exit_reason(self, node: int, rc: int, started_at: float) -> Optional[str]:
        """Why ``node``'s agent left, if a partition explains it: then it is a lost node, not a failure."""
        if rc == 0:
            return None
        partitions = [f for f in cluster.faults(self.state.name, since=started_at)
                      if f["node"] == node and f["fault"] == "partition"]
        if not partitions and cluster.link_up(self.state, node):
            return None
        self._cut_off.add(node)
        return f"cut off by a network partition (agent exited with code {rc})"

    def close(self) -> None:
        self.rounds.close()


def _loopback(endpoint: str) -> bool:
    """``ADDRESS:PORT`` (``ss``'s form) is on a loopback address."""
    address = endpoint.rsplit(":", 1)[0].strip("[]")
    return address.startswith(("127.", "::ffff:127.")) or address == "::1"
