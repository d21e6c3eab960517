"""The controller acts: it starts and stops node agents through a NodePool, on what the failure and scaling
policies decide, and records every event in the run dir.

It runs in the driver process next to the rendezvous store (``orchestrator.rendezvous``), so losing any worker
node never loses rendezvous: torchrun agents on the surviving nodes re-rendezvous by themselves, and the
controller's part is to account for it (node_lost, recovered with its MTTR), to bring agents to nodes that
become available, and to stop a run whose budgets are spent.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.chaos import NODES_FILE  # {"<node>": <torchrun agent pid>}, read by `orch chaos kill-node`
from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import AgentExit, AgentSpec, AgentStarted, NodePool
from orchestrator.controller.failure_policy import (FAIL, FAILED, FINISHED, LOST, PREEMPTED, RESTART, STOPPED,
                                                    classify, decide)
from orchestrator.controller.scaling_policy import ScalingDecision, ScalingPolicy
from orchestrator.controller.states import Failed, Finished, Scheduling, State, Stopping
from orchestrator.plan.plan import LaunchPlan
from orchestrator.report.runlog import EventLog

EXIT_EVENTS = {FINISHED: "node_finished", STOPPED: "node_stopped", PREEMPTED: "node_preempted", LOST: "node_lost",
               FAILED: "node_failed"}
FORWARDED_ENV = ("PYTHONPATH",)  # the entrypoint must import on every node as it does here
POLL_S = 0.2
SCALE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
STOP_TIMEOUT_S = 60.0
EXIT_BARRIER_GRACE_S = 10.0  # training done, yet an agent waits in torchrun's exit barrier for a departed peer


@dataclass
class Agent:
    """One node agent as the controller tracks it, from the start request to its exit."""

    node: int
    node_id: str
    requested_t: float
    requested_mono: float
    pid: Optional[int] = None
    ip: Optional[str] = None
    stopping: bool = False


class _EventTail:
    """New complete lines of events.jsonl since the last read (workers and chaos drills write there too)."""

    def __init__(self, path: Path):
        self.path, self._offset, self._partial = path, path.stat().st_size if path.exists() else 0, b""

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [event for event in map(_parse, lines) if event is not None]


def _parse(line: bytes) -> Optional[dict[str, Any]]:
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None  # a line torn by a crashed writer: read_jsonl skips it too


class Controller:
    """Runs one launch through its states until it is finished or failed; ``run()`` returns the status."""

    def __init__(self, cfg: OrchConfig, plan: LaunchPlan, pool: NodePool, events: EventLog,
                 evict: Optional[Callable[[str, int], bool]] = None,
                 on_tick: Optional[Callable[[dict[int, int], str], Optional[str]]] = None):
        self.cfg, self.plan, self.pool, self.events = cfg, plan, pool, events
        self.evict = evict  # RendezvousStore.evict: drop a departed agent from the round at once
        # Side duties every poll, given {node: torchrun pid} and the rendezvous id (test clusters: fault events,
        # partitioned rounds, the hosts' Ray nodes); a returned reason fails the run at once.
        self.on_tick = on_tick
        # Test clusters: node i runs on the Ray node whose IP is host i's address, with host i's settings.
        self.hosted = {p.address: p.node for p in plan.nodes if p.address}
        self._node_ips: dict[str, str] = {}
        self.run_dir = Path(plan.run_dir)
        self.min_nodes = cfg.cluster.min_nodes
        self.scaling = ScalingPolicy(cfg.cluster.min_nodes, cfg.cluster.max_nodes, cfg.failure.wait_for_nodes_s)
        self.agents: dict[int, Agent] = {}
        self.exit_codes: dict[int, Optional[int]] = {}
        self.attempt = self.failures = self.preemptions = 0
        self.loss_t: Optional[float] = None  # wall time of the earliest loss not yet recovered from
        self.training_finished: Optional[float] = None  # monotonic time training_finished was seen
        self.any_finished = False
        self.signal: Optional[int] = None
        self._signal_handled = False
        self._tail = _EventTail(events.path)
        self._first_steps: list[dict[str, Any]] = []
        self._notices: list[dict[str, Any]] = []
        self._below_min_since: Optional[float] = None
        self._next_scale = 0.0
        self._stop_deadline = 0.0
        self._lingering_stopped = False
        self.state: State = Scheduling()

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> str:
        while not self.state.terminal:
            self._step()
        reason = getattr(self.state, "reason", None)
        self.events.emit("run_finished", status=self.state.status, attempts=self.attempt + 1,
                         node_exit_codes={str(n): rc for n, rc in sorted(self.exit_codes.items())},
                         **({"reason": reason} if reason else {}))
        return self.state.status

    def _step(self) -> tuple[State, State]:
        previous = self.state
        self.state = previous.step(self)
        if self.state is not previous:
            self.events.emit("controller_state", previous=previous.name, state=self.state.name, attempt=self.attempt)
        return previous, self.state

    def request_stop(self, signum: int) -> None:
        """From a signal handler: SIGTERM forwards a preemption notice to every node, SIGINT stops them."""
        self.signal = signum

    # -- what the states ask ----------------------------------------------------------------------------------

    @property
    def rdzv_id(self) -> str:
        """A fresh rendezvous id for every restart of all nodes (a failed agent closed the previous one)."""
        return self.plan.run_id if self.attempt == 0 else f"{self.plan.run_id}-{self.attempt}"

    def started_agents(self) -> int:
        return sum(1 for a in self.agents.values() if a.pid is not None and not a.stopping)

    def all_done(self) -> bool:
        return not self.agents and bool(self.training_finished or self.any_finished)

    def conclude(self) -> State:
        if self.cfg.entrypoint.builtin and not self.training_finished:
            return Failed("every node agent exited but training did not finish (see logs/node*.log)")
        return Finished("succeeded")

    def stopped_or_timed_out(self) -> bool:
        if self.agents and time.monotonic() > self._stop_deadline:
            self.events.emit("agents_unresponsive", nodes=sorted(self.agents))
            self.agents.clear()
        return not self.agents

    def handle_signal(self) -> Optional[State]:
        if self.signal is None or self._signal_handled:
            return None
        self._signal_handled = True
        if self.signal == signal.SIGTERM:
            grace = self.cfg.preemption.grace_period_s
            self.events.emit("preemption_notice_forwarded", reason="orch got SIGTERM", grace_period_s=grace)
            return self.stop_all_then(Finished("preempted"), grace_s=grace, agent_only=True)
        self.events.emit("interrupted", reason=f"orch got {signal.Signals(self.signal).name}")
        return self.stop_all_then(Finished("interrupted"))

    def handle_updates(self) -> Optional[State]:
        """Read new events, then agent starts and exits; returns the next state if an exit calls for one."""
        self._read_events()
        if self.on_tick:
            fatal = self.on_tick({n: a.pid for n, a in self.agents.items() if a.pid is not None and not a.stopping},
                                 self.rdzv_id)
            if fatal:  # the machines themselves are gone: nothing is left to stop through Ray
                self.agents.clear()
                return Failed(fatal)
        nxt: Optional[State] = None
        for update in self.pool.poll(POLL_S):
            if isinstance(update, AgentStarted):
                self._on_started(update)
            else:
                nxt = self._on_exit(update) or nxt
        return nxt

    def scale(self, grow: bool) -> ScalingDecision:
        """Ask the scaling policy (once a second) and start the agents it places."""
        now = time.monotonic()
        if len(self.agents) < self.min_nodes:
            self._below_min_since = self._below_min_since or now
        else:
            self._below_min_since = None
        if now < self._next_scale:
            return ScalingDecision()
        self._next_scale = now + SCALE_INTERVAL_S
        self._drop_unplaceable(now)
        nodes = self.pool.nodes()
        self._node_ips = {n.node_id: n.ip for n in nodes}
        decision = self.scaling.decide(nodes, Counter(a.node_id for a in self.agents.values()), grow,
                                       now - self._below_min_since if self._below_min_since else 0.0)
        for node_id in decision.start_on:
            self._start_agent(node_id)
        return decision

    def check_recovered(self) -> bool:
        """After a loss: has a training step completed since? Then record ``recovered`` with the MTTR."""
        if self.loss_t is None:
            return True
        step = next((e for e in self._first_steps if e["t"] >= self.loss_t), None)
        if step is None:
            return False
        self.events.emit("recovered", step_t=step["t"], lost_t=self.loss_t, mttr_s=round(step["t"] - self.loss_t, 3),
                         step=step.get("step"), world_size=step.get("world_size"))
        self.loss_t = None
        return True

    def stop_lingering_agents(self) -> None:
        if (not self._lingering_stopped and self.agents
                and time.monotonic() - self.training_finished > EXIT_BARRIER_GRACE_S):
            self._lingering_stopped = True
            self.events.emit("agents_stopped", reason="training finished; agents still waiting on departed peers")
            self._stop_all(STOP_GRACE_S, agent_only=False)

    def stop_all_then(self, then: State, grace_s: float = STOP_GRACE_S, agent_only: bool = False) -> State:
        self._stop_all(grace_s, agent_only)
        return Stopping(then)

    def _stop_all(self, grace_s: float, agent_only: bool) -> None:
        for agent in self.agents.values():
            if not agent.stopping:
                agent.stopping = True
                self.pool.stop(agent.node, grace_s, agent_only)
        self._stop_deadline = time.monotonic() + grace_s + STOP_TIMEOUT_S

    # -- acting on agents -------------------------------------------------------------------------------------

    def _start_agent(self, node_id: str) -> None:
        if self.hosted:
            index = self.hosted.get(self._node_ips.get(node_id, ""))
            if index is None or index in self.agents:
                return  # not a test host of this run, or its previous agent is still leaving
        else:
            index = min(set(range(self.cfg.cluster.max_nodes)) - set(self.agents))
        plan = self.plan.nodes[index]
        argv = tuple(f"--rdzv-id={self.rdzv_id}" if a.startswith("--rdzv-id=") else a for a in plan.argv)
        env = {**{k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}, **plan.env}
        self.agents[index] = Agent(index, node_id, time.time(), time.monotonic())
        self.pool.start(AgentSpec(index, argv, env, str(self.run_dir / "logs" / f"node{index}.log"), os.getcwd()),
                        node_id)

    def _drop_unplaceable(self, now: float) -> None:
        """An agent Ray could not place within wait_for_nodes_s (its resources taken) gives its slot back."""
        for agent in self.agents.values():
            if agent.pid is None and not agent.stopping and now - agent.requested_mono > self.cfg.failure.wait_for_nodes_s:
                self.events.emit("node_unplaceable", node=agent.node, ray_node=agent.node_id)
                agent.stopping = True
                self.pool.stop(agent.node, 0.0)

    def _on_started(self, started: AgentStarted) -> None:
        agent = self.agents.get(started.node)
        if agent is None:
            return
        agent.pid, agent.ip = started.pid, started.ip
        self.events.emit("node_joined", node=started.node, pid=started.pid, ip=started.ip, ray_node=started.node_id,
                         attempt=self.attempt, rdzv_id=self.rdzv_id)
        self._write_nodes()
        if agent.stopping:  # told to stop while it was starting
            self.pool.stop(started.node, STOP_GRACE_S)

    def _on_exit(self, exit: AgentExit) -> Optional[State]:
        agent = self.agents.pop(exit.node, None)
        if agent is None:
            return None
        if agent.pid is None and exit.actor_died and not agent.stopping:
            # Placed on a Ray node that died before the agent started (Ray still listed it as alive): nothing of
            # the job ran there, so nothing is lost and nothing to recover; the slot is free for a live node.
            self.events.emit("node_start_failed", node=exit.node, ray_node=agent.node_id, reason=exit.detail)
            return None
        self.exit_codes[exit.node] = exit.exit_code
        verdict = classify(exit, agent.stopping, self._noticed(exit.node, since=agent.requested_t))
        self.events.emit(EXIT_EVENTS[verdict.kind], node=exit.node, exit_code=exit.exit_code, reason=verdict.reason,
                         attempt=self.attempt)
        self._write_nodes()
        if self.training_finished and verdict.kind in (FAILED, LOST, PREEMPTED):
            return None  # training is done: nothing is left to recover or to retry
        if verdict.kind == FINISHED:
            self.any_finished = self.any_finished or not agent.stopping
        elif verdict.kind in (LOST, PREEMPTED):
            if self.evict and agent.pid is not None and self.evict(self.rdzv_id, agent.pid):
                self.events.emit("rendezvous_evicted", node=exit.node, agent_pid=agent.pid)
            self.preemptions += 1
            self._note_loss(time.time())
        elif verdict.kind == FAILED:
            self.failures += 1
        decision = decide(verdict, self.cfg.failure, self.failures, self.preemptions)
        if decision.action == FAIL:
            return self.stop_all_then(Failed(decision.reason))
        if decision.action == RESTART:
            self.events.emit("restart", reason=decision.reason, scope="every node", attempt=self.attempt + 1)
            self.attempt += 1
            self.loss_t = None
            return self.stop_all_then(Scheduling())
        return None

    # -- what the run dir says --------------------------------------------------------------------------------

    def _read_events(self) -> None:
        for e in self._tail.read():
            kind = e.get("event")
            if kind == "chaos_kill":
                self._note_loss(e["t"])
            elif kind == "training_finished" and self.training_finished is None:
                self.training_finished = time.monotonic()
            elif kind == "preemption_notice":
                self._notices.append(e)
            elif kind == "first_step":
                self._first_steps = [*self._first_steps[-9:], e]

    def _note_loss(self, t: float) -> None:
        self.loss_t = t if self.loss_t is None else min(self.loss_t, t)

    def _noticed(self, node: int, since: float) -> bool:
        """A preemption notice for ``node`` since its agent started and within the grace period: torchrun's own
        SIGTERM to workers it restarts reads as a notice too, and must not excuse a failure much later."""
        recent = time.time() - self.cfg.preemption.grace_period_s - STOP_GRACE_S
        return any(e.get("node") == node and e["t"] >= max(since, recent) for e in self._notices)

    def _write_nodes(self) -> None:
        pids = {str(n): a.pid for n, a in sorted(self.agents.items()) if a.pid is not None}
        tmp = self.run_dir / f".{NODES_FILE}.tmp"
        tmp.write_text(json.dumps(pids) + "\n")
        tmp.replace(self.run_dir / NODES_FILE)
