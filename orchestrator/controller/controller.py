"""The controller acts: it starts and stops node agents through a NodePool, on what the failure, scaling and
standby policies decide, and records every event in the run dir. Every launcher runs this one loop (torch
elastic's ``SimpleElasticAgent`` shape: one loop; a pool fills in start, stop and poll).

It runs next to the rendezvous store (``orchestrator.rendezvous``), so losing any worker node never loses
rendezvous: torchrun agents on the surviving nodes re-rendezvous by themselves, and the controller's part is
to account for it (node_lost, recovered with its MTTR), to take a departed agent out of the round at once, to
bring agents to machines that become available, and to stop a run whose budgets are spent.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.config.schema import OrchConfig
from orchestrator.controller.api import (AgentExit, AgentSpec, AgentStarted, Clock, ExitKind, NodePool, RunHooks,
                                         RunStatus)
from orchestrator.controller.failure_policy import FailureAction, classify, decide, failure_signature, same_failure
from orchestrator.controller.scaling_policy import ScalingDecision, ScalingPolicy
from orchestrator.controller.hang_watch import HangWatch
from orchestrator.controller.standby_policy import standbys_to_boot
from orchestrator.controller.states import (RECOVERING, RUNNING, SCHEDULING, State, StateName, failed, finished,
                                            stopping)
from orchestrator.plan.plan import LaunchPlan
from orchestrator.processes import kill_tree
from orchestrator.ft import REPLICA_ENV
from orchestrator.rendezvous.agent import MODULE as AGENT_MODULE
from orchestrator.rundir import LOGS_DIR, NODES_FILE, EventLog, EventName, write_json_atomic

from orchestrator.controller.agent_env import forwarded_env  # the driver's variables node agents get
POLL_S = 0.2
SCALE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
STOP_TIMEOUT_S = 60.0
STOP_SIGNAL = signal.SIGUSR1  # `orch stop`: like SIGTERM (every node saves and leaves), but the run ends `stopped`
SIGTERM_STOPS_ENV = "ORCH_SIGTERM_STOPS"  # "1": SIGTERM means STOP_SIGNAL (a Ray job, stopped by the Jobs API)
EXIT_BARRIER_GRACE_S = 10.0  # training done and a peer gone, yet an agent waits in torchrun's exit barrier for it
EXIT_TIMEOUT_S = 120.0  # training done, and no agent has exited at all: stop them (a peer died after the last step)


@dataclass
class Agent:
    """One node agent as the controller tracks it, from the start request to its exit."""

    agent_id: int
    node: int
    node_id: str
    requested_t: float
    requested_mono: float
    log_offset: int = 0
    pid: Optional[int] = None
    ip: Optional[str] = None
    stopping: bool = False
    standby: bool = False


class Controller:
    """Runs one launch through its states until it is finished or failed; ``run()`` returns the status.

    ``nodes``: the node indexes this controller plays (default: every node of the plan; a Kubernetes pod plays
    one). ``evict(rdzv_id, agent_pid)``: the store host's eviction of a departed agent (None when the store is
    elsewhere). ``notify(node, agent_pid, grace_s)``: tells a node's workers that the SIGTERM coming is a real
    preemption notice (not torchrun restarting them)."""

    def __init__(self, cfg: OrchConfig, plan: LaunchPlan, pool: NodePool, events: EventLog,
                 nodes: Optional[list[int]] = None, evict: Optional[Callable[[str, int], Any]] = None,
                 notify: Optional[Callable[[int, int, float], None]] = None, hooks: Optional[RunHooks] = None,
                 clock: Optional[Clock] = None, pod: bool = False, agent_env: Optional[dict[str, str]] = None,
                 gated: bool = False):
        self.cfg, self.plan, self.pool, self.events = cfg, plan, pool, events
        self.agent_env = agent_env or {}  # secrets for the agents' environment only (never plan.json or events)
        self.gated = gated  # the store is behind a gate: agents dial it through orch's tunnel
        self.per_step = cfg.fault_tolerance.mode == "per_step"
        self.evict, self.notify, self.hooks, self.clock = evict, notify, hooks or RunHooks(), clock or Clock()
        self.pod = pod  # one node of a multi-pod job: rank 0 may train elsewhere
        self.node_indexes = sorted(nodes if nodes is not None else range(cfg.cluster.max_nodes))
        # Test clusters: node i runs on the machine whose IP is host i's address.
        self.hosted = {p.address: p.node for p in plan.nodes if p.address}
        self.run_dir = Path(plan.run_dir)
        self.min_nodes = min(cfg.cluster.min_nodes, len(self.node_indexes))
        self.scaling = ScalingPolicy(self.min_nodes, len(self.node_indexes), cfg.failure.wait_for_nodes_s)
        self.agents: dict[int, Agent] = {}  # node -> its current agent
        self.standbys: dict[int, Agent] = {}  # node -> a replacement booted on a notice, not yet playing
        self._by_id: dict[int, Agent] = {}
        self._next_id = 0
        self._ever_started: set[int] = set()
        self.exit_codes: dict[int, Optional[int]] = {}
        self.attempt = self.failures = self.preemptions = 0
        self.loss_t: Optional[float] = None  # wall time of the earliest loss not yet recovered from
        self.training_finished: Optional[float] = None  # monotonic time training_finished was seen
        self.any_finished = False
        self.signal: Optional[int] = None
        self._signal_handled = False
        self._tail = events.tail()
        self._first_steps: list[dict[str, Any]] = []
        self._notices: list[dict[str, Any]] = []
        self._worker_failures: list[dict[str, Any]] = []
        self._notices_acted_on: set[tuple[Any, float]] = set()  # (node, t) of notices a standby was booted for
        self._attempt_t = self.clock.time()
        self._previous_failure: Optional[str] = None
        self._replace: set[int] = set()  # preempted nodes to replace without waiting for recovery
        self._below_min_since: Optional[float] = None
        self._next_scale = 0.0
        self._stop_deadline = 0.0
        self._lingering_stopped = False
        self._first_exit_after_training: Optional[float] = None
        self.lease_lost: Optional[str] = None  # a lease_lost event's reason: the run's writes are fenced; stop
        self._lease_stop_sent = False
        self.state: State = SCHEDULING
        self.hangs = HangWatch(self.run_dir, cfg.hang, events)

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> RunStatus:
        while not self.state.is_terminal:
            self._step()
        self.events.emit(EventName.RUN_FINISHED, status=self.state.status, attempts=self.attempt + 1,
                         node_exit_codes={str(n): rc for n, rc in sorted(self.exit_codes.items())},
                         **({"reason": self.state.reason} if self.state.reason else {}))
        return self.state.status

    def _step(self) -> tuple[State, State]:
        previous = self.state
        handler = {StateName.SCHEDULING: self._schedule, StateName.RUNNING: self._active,
                   StateName.RECOVERING: self._active, StateName.STOPPING: self._stopping}[previous.name]
        self.state = handler(previous)
        if self.state.name != previous.name:
            self.events.emit(EventName.CONTROLLER_STATE, previous=previous.name, state=self.state.name,
                             attempt=self.attempt)
        return previous, self.state

    def request_stop(self, signum: int) -> None:
        """From a signal handler: SIGTERM (and STOP_SIGNAL) forwards a preemption notice to every node, SIGINT
        stops them."""
        self.signal = signum

    # -- the states -------------------------------------------------------------------------------------------

    def _schedule(self, state: State) -> State:
        nxt = self._handle_signal() or self._handle_updates()
        if nxt:
            return nxt
        decision = self._scale(grow=True)
        if decision.fail_reason:
            return self._stop_all_then(failed(decision.fail_reason))
        return RUNNING if self._started_agents() >= self.min_nodes else state

    def _active(self, state: State) -> State:
        """Running and recovering: record agent exits, finish when training has, keep nodes coming (growth
        toward MAX waits while a loss is not recovered from; getting back to MIN never waits)."""
        nxt = self._handle_signal() or self._handle_updates()
        if nxt:
            return nxt
        if self._all_done():
            return self._conclude()
        if self.training_finished is not None:
            self._stop_lingering_agents()
            return state
        self._boot_standbys()
        self._end_hung_nodes()
        decision = self._scale(grow=self.loss_t is None or bool(self._replace))
        if decision.fail_reason:
            return self._stop_all_then(failed(decision.fail_reason))
        if state.name == StateName.RUNNING:
            return RECOVERING if self.loss_t is not None else state
        return RUNNING if self._check_recovered() else state

    def _stopping(self, state: State) -> State:
        self._handle_updates()
        if self._by_id and self.clock.monotonic() > self._stop_deadline:
            self.events.emit(EventName.AGENTS_UNRESPONSIVE, nodes=sorted({a.node for a in self._by_id.values()}))
            self._by_id.clear()
            self.agents.clear()
            self.standbys.clear()
        if self._by_id:
            return state
        then = failed(self.lease_lost) if self.lease_lost else state.then
        if then.status in (RunStatus.PREEMPTED, RunStatus.STOPPED) and self.training_finished is not None:
            return finished(RunStatus.SUCCEEDED)  # the notice came after the last step: nothing was cut short
        return then

    # -- what the states ask ----------------------------------------------------------------------------------

    @property
    def rdzv_id(self) -> str:
        """A fresh rendezvous id for every restart of all nodes (a failed agent closed the previous one)."""
        return self.plan.run_id if self.attempt == 0 else f"{self.plan.run_id}-{self.attempt}"

    def _started_agents(self) -> int:
        return sum(1 for a in self.agents.values() if a.pid is not None and not a.stopping)

    def _all_done(self) -> bool:
        return not self._by_id and bool(self.training_finished is not None or self.any_finished)

    def _conclude(self) -> State:
        if self.cfg.entrypoint.builtin and self.training_finished is None and not self.pod:
            return failed("every node agent exited but training did not finish (see logs/node*.log)")
        return finished(RunStatus.SUCCEEDED)

    def _handle_signal(self) -> Optional[State]:
        if self.signal is None or self._signal_handled:
            return None
        self._signal_handled = True
        if self.signal in (signal.SIGTERM, STOP_SIGNAL):
            grace = self.cfg.preemption.grace_period_s
            if self.signal == STOP_SIGNAL:
                self.events.emit(EventName.STOP_REQUESTED, grace_period_s=grace)
            self.events.emit(EventName.PREEMPTION_NOTICE_FORWARDED, reason=f"orch got {signal.Signals(self.signal).name}",
                             grace_period_s=grace)
            if self.notify:
                for agent in self.agents.values():
                    if agent.pid is not None and not agent.stopping:
                        self.notify(agent.node, agent.pid, grace)
            status = RunStatus.STOPPED if self.signal == STOP_SIGNAL else RunStatus.PREEMPTED
            return self._stop_all_then(finished(status), grace_s=grace, agent_only=True)
        self.events.emit(EventName.INTERRUPTED, reason=f"orch got {signal.Signals(self.signal).name}")
        return self._stop_all_then(finished(RunStatus.INTERRUPTED))

    def _handle_updates(self) -> Optional[State]:
        """Read new events, then agent starts and exits; returns the next state if an exit calls for one."""
        self._read_events()
        if self.lease_lost and not self._lease_stop_sent:  # before any exit is judged: no restart, no new agent
            self._lease_stop_sent = True
            return self._stop_all_then(failed(self.lease_lost))
        running = {n: a.pid for n, a in self.agents.items() if a.pid is not None and not a.stopping}
        fatal = self.hooks.on_tick(running, self.rdzv_id)
        if fatal:  # the machines themselves are gone: nothing is left to stop
            self._by_id.clear()
            self.agents.clear()
            self.standbys.clear()
            return failed(fatal)
        nxt: Optional[State] = None
        for update in self.pool.poll(POLL_S):
            if isinstance(update, AgentStarted):
                self._on_started(update)
            else:
                nxt = self._on_exit(update) or nxt
        return nxt

    def _scale(self, grow: bool) -> ScalingDecision:
        """Ask the scaling policy (once a second) and start the agents it places."""
        now = self.clock.monotonic()
        if len(self.agents) < self.min_nodes:
            self._below_min_since = self._below_min_since or now
        else:
            self._below_min_since = None
        if now < self._next_scale:
            return ScalingDecision()
        self._next_scale = now + SCALE_INTERVAL_S
        self._drop_unplaceable(now)
        machines = self.pool.nodes()
        ips = {m.node_id: m.ip for m in machines}
        decision = self.scaling.decide(machines, Counter(a.node_id for a in self.agents.values()), grow,
                                       now - self._below_min_since if self._below_min_since else 0.0,
                                       Counter(a.node_id for a in self.standbys.values()))
        for node_id in decision.start_on:
            self._start_agent(node_id, ips.get(node_id, ""))
        return decision

    def _check_recovered(self) -> bool:
        """After a loss: has a training step completed since? Then record ``recovered`` with the MTTR."""
        if self.loss_t is None:
            return True
        step = next((e for e in self._first_steps if e["t"] >= self.loss_t), None)
        if step is None:
            return False
        self.events.emit(EventName.RECOVERED, step_t=step["t"], lost_t=self.loss_t,
                         mttr_s=round(step["t"] - self.loss_t, 3), step=step.get("step"),
                         world_size=step.get("world_size"))
        self.loss_t = None
        return True

    def _stop_lingering_agents(self) -> None:
        """torchrun's exit barrier waits 300 s (not configurable) for a peer that left after the last step.
        Once one agent has exited, the others get EXIT_BARRIER_GRACE_S to follow; with none gone, workers may
        still be writing their last checkpoint on a loaded machine, so they get EXIT_TIMEOUT_S."""
        now = self.clock.monotonic()
        since = now - (self._first_exit_after_training or self.training_finished)
        if (not self._lingering_stopped and self._by_id
                and since > (EXIT_BARRIER_GRACE_S if self._first_exit_after_training else EXIT_TIMEOUT_S)):
            self._lingering_stopped = True
            self.events.emit(EventName.AGENTS_STOPPED, reason="training finished; agents still waiting on departed peers")
            self._stop_all(STOP_GRACE_S, agent_only=False)

    def _stop_all_then(self, then: State, grace_s: float = STOP_GRACE_S, agent_only: bool = False) -> State:
        self._stop_all(grace_s, agent_only)
        return stopping(then)

    def _stop_all(self, grace_s: float, agent_only: bool) -> None:
        for agent in self._by_id.values():
            if not agent.stopping:
                agent.stopping = True
                self.pool.stop(agent.agent_id, grace_s, agent_only and not agent.standby)
        self._stop_deadline = self.clock.monotonic() + grace_s + STOP_TIMEOUT_S

    # -- acting on agents -------------------------------------------------------------------------------------

    def _start_agent(self, node_id: str, ip: str, standby_for: Optional[int] = None) -> None:
        if standby_for is not None:
            index = standby_for
        elif self.hosted:
            index = self.hosted.get(ip)
            if index is None or index in self.agents or index not in self.node_indexes:
                return  # not a test host of this run, or its previous agent is still leaving
        else:
            free = sorted(set(self.node_indexes) - set(self.agents))
            if not free:
                return
            index = free[0]
        plan = self.plan.nodes[index]
        rdzv_id, env = self.rdzv_id, {**forwarded_env(os.environ, os.getcwd()), **plan.env, **self.agent_env}
        if self.per_step:
            # A replica group of its own: a one-node rendezvous that no other agent, not even this node's next
            # one, ever joins; its replica id names the node and the incarnation.
            rdzv_id = f"{rdzv_id}-node{index}-a{self._next_id}"
            env[REPLICA_ENV] = f"node{index}-a{self._next_id}"
        argv = tuple(f"--rdzv-id={rdzv_id}" if a.startswith("--rdzv-id=") else a for a in plan.argv)
        if self.gated:  # python -m torch.distributed.run ... -> python -m orchestrator.rendezvous.agent ...
            argv = (argv[0], "-m", AGENT_MODULE, *argv[3:])
        log_path = self.run_dir / LOGS_DIR / f"node{index}.log"
        agent = Agent(self._next_id, index, node_id, self.clock.time(), self.clock.monotonic(),
                      log_offset=log_path.stat().st_size if log_path.exists() else 0, standby=standby_for is not None)
        self._next_id += 1
        self._by_id[agent.agent_id] = agent
        if agent.standby:
            self.standbys[index] = agent
        else:
            self.agents[index] = agent
            self._replace.discard(index)
        self.pool.start(AgentSpec(agent.agent_id, index, argv, env, str(log_path), os.getcwd()), node_id)

    def _end_hung_nodes(self) -> None:
        """A node whose worker hangs (or straggles, with hang.evict_stragglers) is ended like a lost machine
        (SIGKILL to its agent and workers): the others recover at once instead of waiting in a collective."""
        running = {n: (a.pid, a.requested_t) for n, a in self.agents.items() if a.pid is not None and not a.stopping}
        for node in self.hangs.tick(running, self.clock.time()):
            self._note_loss(self.clock.time())
            kill_tree(running[node][0])

    def _boot_standbys(self) -> None:
        """On a notice, boot the node's replacement now, where a machine has a free slot (see standby_policy)."""
        if not self.cfg.preemption.replace_nodes or not self._notices:
            return
        fresh = [e for e in self._notices if (e.get("node"), e["t"]) not in self._notices_acted_on]
        boot = standbys_to_boot(fresh, {n: a.requested_t for n, a in self.agents.items() if not a.stopping},
                                set(self.standbys))
        self._notices_acted_on.update((e.get("node"), e["t"]) for e in fresh if e.get("node") in boot)
        if not boot:
            return
        used = Counter(a.node_id for a in self._by_id.values())
        for node in boot:
            current = self.agents[node]
            # A test-cluster node runs on its own host only; elsewhere any machine with a free slot will do.
            machines = [m for m in self.pool.nodes() if m.slots > used[m.node_id]
                        and (not self.hosted or self.hosted.get(m.ip) == node)]
            if not machines:
                continue  # no room: the replacement starts when the node has left
            machine = min(machines, key=lambda m: (used[m.node_id], m.node_id != current.node_id, m.node_id))
            used[machine.node_id] += 1
            self._start_agent(machine.node_id, machine.ip, standby_for=node)

    def _drop_unplaceable(self, now: float) -> None:
        """An agent the pool could not place within wait_for_nodes_s (its resources taken) gives its slot back."""
        for agent in self._by_id.values():
            if agent.pid is None and not agent.stopping and now - agent.requested_mono > self.cfg.failure.wait_for_nodes_s:
                self.events.emit(EventName.NODE_UNPLACEABLE, node=agent.node, ray_node=agent.node_id)
                agent.stopping = True
                self.pool.stop(agent.agent_id, 0.0)

    def _on_started(self, started: AgentStarted) -> None:
        agent = self._by_id.get(started.agent_id)
        if agent is None:
            return
        agent.pid, agent.ip = started.pid, started.ip
        if agent.standby:
            self.events.emit(EventName.NODE_STANDBY_STARTED, node=started.node, pid=started.pid, ip=started.ip,
                             ray_node=started.node_id)
        else:
            self._announce(agent)
        if agent.stopping:  # told to stop while it was starting
            self.pool.stop(agent.agent_id, STOP_GRACE_S)

    def _announce(self, agent: Agent, standby: bool = False) -> None:
        """``node_started`` and ``node_joined``: the agent plays its node from now on."""
        replacement = agent.node in self._ever_started
        self._ever_started.add(agent.node)
        self.events.emit(EventName.NODE_STARTED, node=agent.node, pid=agent.pid, replacement=replacement,
                         **({"standby": True} if standby else {}))
        self.events.emit(EventName.NODE_JOINED, node=agent.node, pid=agent.pid, ip=agent.ip, ray_node=agent.node_id,
                         attempt=self.attempt, rdzv_id=self.rdzv_id)
        self._write_nodes()

    def _on_exit(self, exit: AgentExit) -> Optional[State]:
        agent = self._by_id.pop(exit.agent_id, None)
        if agent is None:
            return None
        if agent.standby:
            if self.standbys.get(agent.node) is agent:
                del self.standbys[agent.node]
            self.events.emit(EventName.NODE_STOPPED, node=exit.node, exit_code=exit.exit_code, standby=True,
                             reason=f"standby for node {exit.node} ended before it played ({exit.detail or exit.exit_code})")
            return None
        del self.agents[agent.node]
        if agent.pid is None and exit.actor_died and not agent.stopping:
            # Placed on a machine that died before the agent started (the cluster still listed it as alive):
            # nothing of the job ran there, so nothing is lost and nothing to recover; the slot is free again.
            self.events.emit(EventName.NODE_START_FAILED, node=exit.node, ray_node=agent.node_id, reason=exit.detail)
            return None
        self.exit_codes[exit.node] = exit.exit_code
        if self.training_finished is not None and self._first_exit_after_training is None:
            self._first_exit_after_training = self.clock.monotonic()
        noticed = self._noticed(exit.node, since=agent.requested_t)
        explained = None if noticed or agent.stopping else self.hooks.explain_exit(exit.node, exit.exit_code,
                                                                                   agent.requested_t)
        verdict = classify(exit, agent.stopping, noticed, self.training_finished is not None, explained)
        self.events.emit(verdict.kind.event, node=exit.node, exit_code=exit.exit_code, reason=verdict.reason,
                         attempt=self.attempt)
        self._promote_standby(exit.node)
        self._write_nodes()
        if self.training_finished is not None and verdict.kind in (ExitKind.FAILED, ExitKind.LOST, ExitKind.PREEMPTED):
            return None  # training is done: nothing is left to recover or to retry
        if agent.stopping:
            return None  # the controller stopped it: a restart, a signal or the end, already decided
        repeated = None
        if verdict.kind == ExitKind.FINISHED:
            self.any_finished = True
        elif verdict.kind in (ExitKind.LOST, ExitKind.PREEMPTED):
            self._evict(agent)
            self.preemptions += 1
            self._note_loss(self.clock.time())
            if verdict.kind == ExitKind.PREEMPTED and self.cfg.preemption.replace_nodes and exit.node not in self.agents:
                self._replace.add(exit.node)
        elif verdict.kind == ExitKind.FAILED:
            self.failures += 1
            signature = failure_signature(self._attempt_failures(), self.run_dir / LOGS_DIR / f"node{exit.node}.log",
                                          agent.log_offset)
            repeated = signature if same_failure(signature, self._previous_failure) else None
            self._previous_failure = signature
        decision = decide(verdict, self.cfg.failure, self.failures, self.preemptions, repeated)
        if decision.action == FailureAction.FAIL:
            if repeated and self.failures <= self.cfg.failure.max_failures:
                self.events.emit(EventName.RUN_STOPPED_DETERMINISTIC, node=exit.node, failure=repeated,
                                 attempts=self.attempt + 1)
            return self._stop_all_then(failed(decision.reason))
        if decision.action == FailureAction.RESTART:
            self.events.emit(EventName.RESTART, reason=decision.reason, scope="every node", attempt=self.attempt + 1)
            self.attempt += 1
            self._attempt_t = self.clock.time()
            self.loss_t = None
            self._replace.clear()
            return self._stop_all_then(SCHEDULING)
        return None

    def _promote_standby(self, node: int) -> None:
        standby = self.standbys.pop(node, None)
        if standby is None:
            return
        standby.standby = False
        self.agents[node] = standby
        if standby.pid is not None:
            self._announce(standby, standby=True)

    def _evict(self, agent: Agent) -> None:
        """The survivors' next round need not wait for the departed agent's keep-alive to expire."""
        if self.evict is None or agent.pid is None or self.per_step:
            return  # per_step: the agent's rendezvous was its own; the quorum drops it by heartbeat
        result = self.evict(self.rdzv_id, agent.pid)
        if result:
            self.events.emit(EventName.RENDEZVOUS_EVICTED, node=agent.node, agent_pid=agent.pid)
            if getattr(result, "reopened", False):
                self.events.emit(EventName.RENDEZVOUS_REOPENED, node=agent.node, round=getattr(result, "round", None),
                                 reason="a member of a complete round left: its survivors re-rendezvous now instead "
                                        "of waiting for it in process-group init")

    # -- what the run dir says --------------------------------------------------------------------------------

    def _read_events(self) -> None:
        for e in self._tail.read_new():
            kind = e.get("event")
            if kind == EventName.CHAOS_KILL:
                self._note_loss(e["t"])
            elif kind == EventName.TRAINING_FINISHED and self.training_finished is None:
                self.training_finished = self.clock.monotonic()
            elif kind == EventName.PREEMPTION_NOTICE:
                self._notices.append(e)
            elif kind in (EventName.FIRST_STEP, EventName.QUORUM_CHANGED):
                self._first_steps = [*self._first_steps[-9:], e]
            elif kind == EventName.WORKER_FAILED:
                self._worker_failures = [*self._worker_failures[-63:], e]
            elif kind == EventName.LEASE_LOST and self.lease_lost is None:
                self.lease_lost = e.get("reason") or f"lease on {e.get('url')} lost"

    def _attempt_failures(self) -> list[dict[str, Any]]:
        return [e for e in self._worker_failures if e["t"] >= self._attempt_t]

    def _note_loss(self, t: float) -> None:
        self.loss_t = t if self.loss_t is None else min(self.loss_t, t)

    def _noticed(self, node: int, since: float) -> bool:
        """A preemption notice for ``node`` since its agent started and within the grace period."""
        recent = self.clock.time() - self.cfg.preemption.grace_period_s - STOP_GRACE_S
        return any(e.get("node") == node and e["t"] >= max(since, recent) for e in self._notices)

    def _write_nodes(self) -> None:
        write_json_atomic(self.run_dir / NODES_FILE,
                          {str(n): a.pid for n, a in sorted(self.agents.items()) if a.pid is not None})


def run_with_signals(controller: Controller, run_dir: str, schedule) -> RunStatus:
    """Run ``controller`` with SIGINT/SIGTERM/STOP_SIGNAL routed to it (SIGTERM: a preemption notice to every
    node; STOP_SIGNAL, or SIGTERM under ``$ORCH_SIGTERM_STOPS=1``: the same, ending ``stopped``) and
    ``preemption.schedule`` drills going, restoring the previous handlers afterwards."""
    from orchestrator.chaos import PreemptionDrill

    drill = PreemptionDrill(run_dir, schedule)
    term_stops = os.environ.get(SIGTERM_STOPS_ENV) == "1"

    def route(signum: int, _frame: Any) -> None:
        controller.request_stop(STOP_SIGNAL if signum == signal.SIGTERM and term_stops else signum)

    previous = {s: signal.signal(s, route) for s in (signal.SIGINT, signal.SIGTERM, STOP_SIGNAL)}
    drill.start()
    try:
        return controller.run()
    finally:
        drill.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def notice_sender(run_dir: str) -> Callable[[int, int, float], None]:
    """``Controller.notify`` for launches whose run dir the workers read: a notice file per agent, written
    before the SIGTERM, tells its workers that this SIGTERM is a real notice."""
    from orchestrator.preemption.notices import deliver_notice

    def notify(node: int, agent_pid: int, grace_s: float) -> None:
        deliver_notice(run_dir, node, agent_pid, grace_s, source="sigterm", detail="orch got SIGTERM")

    return notify
