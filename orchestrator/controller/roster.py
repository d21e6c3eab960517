"""The node agents a controller has asked for: each node's current agent, the standbys booted on a notice,
and ``nodes.json`` (node -> agent PID, read by ``orch chaos``); :class:`Fleet` starts, announces and stops
them through the pool. The controller decides when; these only carry it out and keep the books."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from orchestrator.controller.agents import AgentMaker
from orchestrator.controller.api import AgentStarted, Clock, NodePool
from orchestrator.events import NodeJoined, NodeStandbyStarted, NodeStarted, NodeUnplaceable
from orchestrator.rundir import LOGS_DIR, NODES_FILE, EventLog, write_json_atomic


@dataclass
class Agent:
    """One node agent as the controller tracks it, from the start request to its exit."""

    agent_id: int
    node: int
    node_id: str
    requested_t: float
    requested_mono: float
    rdzv_id: str = ""
    log_offset: int = 0
    pid: Optional[int] = None
    ip: Optional[str] = None
    stopping: bool = False
    standby: bool = False


class Roster:
    """Agents by node (``playing``), standbys by node, and every live one by id."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.playing: dict[int, Agent] = {}
        self.standbys: dict[int, Agent] = {}
        self.by_id: dict[int, Agent] = {}
        self.next_id = 0
        self.ever_started: set[int] = set()

    def add(self, agent: Agent) -> None:
        self.next_id = max(self.next_id, agent.agent_id + 1)
        self.by_id[agent.agent_id] = agent
        (self.standbys if agent.standby else self.playing)[agent.node] = agent

    def remove(self, agent_id: int) -> Optional[Agent]:
        """The agent, out of the roster; None for one it does not know (already gone)."""
        agent = self.by_id.pop(agent_id, None)
        if agent is None:
            return None
        table = self.standbys if agent.standby else self.playing
        if table.get(agent.node) is agent:
            del table[agent.node]
        return agent

    def promote(self, node: int) -> Optional[Agent]:
        """``node``'s standby plays it from now on (its agent left); None when it has none."""
        standby = self.standbys.pop(node, None)
        if standby is not None:
            standby.standby = False
            self.playing[node] = standby
        return standby

    def clear(self) -> None:
        self.playing.clear()
        self.standbys.clear()
        self.by_id.clear()

    def __iter__(self) -> Iterator[Agent]:
        return iter(list(self.by_id.values()))

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def running(self) -> dict[int, int]:
        """node -> PID of the agents playing and not being stopped."""
        return {n: a.pid for n, a in self.playing.items() if a.pid is not None and not a.stopping}

    def started(self) -> int:
        return len(self.running())

    def write_nodes(self) -> None:
        write_json_atomic(self.run_dir / NODES_FILE,
                          {str(n): a.pid for n, a in sorted(self.playing.items()) if a.pid is not None})


class Fleet:
    """Acting on the run's agents: ``pool`` runs them, ``maker`` says what each runs, ``events`` hears of it."""

    def __init__(self, roster: Roster, pool: NodePool, maker: AgentMaker, events: EventLog, clock: Clock):
        self.roster, self.pool, self.maker, self.events, self.clock = roster, pool, maker, events, clock
        self.stop_deadline = 0.0

    def start(self, node: int, node_id: str, attempt: int, standby: bool = False) -> Agent:
        """An agent for ``node`` on machine ``node_id`` (a standby: booted to take over when the node leaves)."""
        log_path = self.roster.run_dir / LOGS_DIR / f"node{node}.log"
        spec, rdzv_id = self.maker.spec(self.roster.next_id, node, attempt, str(log_path))
        agent = Agent(spec.agent_id, node, node_id, self.clock.time(), self.clock.monotonic(), rdzv_id=rdzv_id,
                      log_offset=log_path.stat().st_size if log_path.exists() else 0, standby=standby)
        self.roster.add(agent)
        self.pool.start(spec, node_id)
        return agent

    def started(self, started: AgentStarted, attempt: int, stop_grace_s: float) -> None:
        """The pool says an agent runs: it plays its node from now on (a standby: it waits)."""
        agent = self.roster.by_id.get(started.agent_id)
        if agent is None:
            return
        agent.pid, agent.ip = started.pid, started.ip
        if agent.standby:
            self.events.write(NodeStandbyStarted(node=started.node, pid=started.pid, ip=started.ip,
                                                 ray_node=started.node_id))
        else:
            self.announce(agent, attempt)
        if agent.stopping:  # told to stop while it was starting
            self.pool.stop(agent.agent_id, stop_grace_s)

    def announce(self, agent: Agent, attempt: int, standby: bool = False) -> None:
        """``node_started`` and ``node_joined``: the agent plays its node from now on."""
        replacement = agent.node in self.roster.ever_started
        self.roster.ever_started.add(agent.node)
        self.events.write(NodeStarted(node=agent.node, pid=agent.pid, replacement=replacement,
                                      standby=True if standby else None))
        self.events.write(NodeJoined(node=agent.node, pid=agent.pid, ip=agent.ip, ray_node=agent.node_id,
                                     attempt=attempt, rdzv_id=agent.rdzv_id))
        self.roster.write_nodes()

    def stop_all(self, grace_s: float, agent_only: bool, timeout_s: float) -> None:
        """Tell every agent to stop (``agent_only``: torchrun alone, which forwards SIGTERM: a notice); the
        stragglers are given up on ``timeout_s`` after the grace."""
        for agent in self.roster:
            if not agent.stopping:
                agent.stopping = True
                self.pool.stop(agent.agent_id, grace_s, agent_only and not agent.standby)
        self.stop_deadline = self.clock.monotonic() + grace_s + timeout_s

    def drop_unplaceable(self, wait_s: float) -> None:
        """An agent the pool could not place within ``wait_s`` (its resources taken) gives its slot back."""
        now = self.clock.monotonic()
        for agent in self.roster:
            if agent.pid is None and not agent.stopping and now - agent.requested_mono > wait_s:
                self.events.write(NodeUnplaceable(node=agent.node, ray_node=agent.node_id))
                agent.stopping = True
                self.pool.stop(agent.agent_id, 0.0)
