"""The controller acts: it starts and stops node agents through a NodePool, on what the failure, scaling and
standby policies decide, and records every event in the run dir. Every site runs this one loop (torch
elastic's ``SimpleElasticAgent`` shape: one loop; a pool fills in start, stop and poll).

It runs next to the rendezvous store (``orchestrator.rendezvous``), so losing any worker node never loses
rendezvous: torchrun agents on the surviving nodes re-rendezvous by themselves, and the controller's part is
to account for it (node_lost, recovered with its MTTR), to take a departed agent out of its rendezvous or
quorum at once (the fault-tolerance mode's business, through :class:`~orchestrator.controller.agents.AgentMaker`),
to bring agents to machines that become available, and to stop a run whose budgets are spent. It knows no
mode, site or host: the agent maker, the pool and the site's hooks do.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from orchestrator.config.schema import OrchConfig
from orchestrator.controller.agents import AgentMaker
from orchestrator.controller.api import AgentExit, AgentStarted, Clock, ExitKind, NodePool, RunHooks, RunStatus
from orchestrator.controller.exit_barrier import ExitBarrier
from orchestrator.controller.failure_policy import ExitVerdict, FailureAction, FailureBudget, classify
from orchestrator.controller.hang_watch import HangWatch
from orchestrator.controller.roster import Agent, Fleet, Roster
from orchestrator.controller.scaling_policy import ScalingDecision, ScalingPolicy
from orchestrator.controller.standby_policy import standby_machine, standbys_to_boot
from orchestrator.controller.states import (RECOVERING, RUNNING, SCHEDULING, State, StateName, failed, finished,
                                            stopping)
from orchestrator.controller.worker_view import WorkerView
from orchestrator.events import (AgentsStopped, AgentsUnresponsive, ControllerState, DeterministicFailure, Interrupted,
                                 NodeStartFailed, NodeStopped, PreemptionNoticeForwarded, Recovered, Restart,
                                 RunFinished, StopRequested)
from orchestrator.plan.plan import LaunchPlan
from orchestrator.processes import kill_tree
from orchestrator.rundir import LOGS_DIR, EventLog

POLL_S = 0.2
SCALE_INTERVAL_S = 1.0
STOP_GRACE_S = 10.0
STOP_TIMEOUT_S = 60.0
STOP_SIGNAL = signal.SIGUSR1  # `orch stop`: like SIGTERM (every node saves and leaves), but the run ends `stopped`
SIGTERM_STOPS_ENV = "ORCH_SIGTERM_STOPS"  # "1": SIGTERM means STOP_SIGNAL (a Ray job, stopped by the Jobs API)


class Controller:
    """Runs one launch through its states until it is finished or failed; ``run()`` returns the status.

    ``agents``: what each agent runs and what its departure does (:class:`AgentMaker`: the plan's templates
    under the fault-tolerance mode). ``nodes``: the node indexes this controller plays (default: every node of
    the plan; a Kubernetes pod plays one). ``notify(node, agent_pid, grace_s)``: tells a node's workers that the
    SIGTERM coming is a real preemption notice (not torchrun restarting them). ``hooks``: the site's duties and
    placement (:class:`~orchestrator.controller.api.RunHooks`)."""

    def __init__(self, cfg: OrchConfig, plan: LaunchPlan, pool: NodePool, events: EventLog, agents: AgentMaker,
                 nodes: Optional[list[int]] = None, notify: Optional[Callable[[int, int, float], None]] = None,
                 hooks: Optional[RunHooks] = None, clock: Optional[Clock] = None):
        self.cfg, self.pool, self.events, self.maker = cfg, pool, events, agents
        self.notify, self.hooks, self.clock = notify, hooks or RunHooks(), clock or Clock()
        self.node_indexes = sorted(nodes if nodes is not None else range(cfg.cluster.max_nodes))
        self.run_dir = Path(plan.run_dir)
        self.min_nodes = min(cfg.cluster.min_nodes, len(self.node_indexes))
        self.scaling = ScalingPolicy(self.min_nodes, len(self.node_indexes), cfg.failure.wait_for_nodes_s)
        self.roster = Roster(self.run_dir)
        self.fleet = Fleet(self.roster, pool, agents, events, self.clock)
        self.view = WorkerView(events, self.clock.monotonic)
        self.hangs = HangWatch(self.run_dir, cfg.hang, events)
        self.exit_codes: dict[int, Optional[int]] = {}
        self.budget = FailureBudget(cfg.failure)
        self.attempt = 0
        self.loss_t: Optional[float] = None  # wall time of the earliest loss not yet recovered from
        self.any_finished = False
        self.signal: Optional[int] = None
        self._signal_handled = self._lease_stop_sent = False
        self._notices_acted_on: set[tuple[Any, float]] = set()  # (node, t) of notices a standby was booted for
        self._attempt_t = self.clock.time()
        self._replace: set[int] = set()  # preempted nodes to replace without waiting for recovery
        self._below_min_since: Optional[float] = None
        self._next_scale = 0.0
        self.exit_barrier = ExitBarrier()
        self.state: State = SCHEDULING

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> RunStatus:
        while not self.state.is_terminal:
            self._step()
        self.events.write(RunFinished(status=self.state.status, attempts=self.attempt + 1,
                                      node_exit_codes={str(n): rc for n, rc in sorted(self.exit_codes.items())},
                                      reason=self.state.reason or None))
        return self.state.status

    def _step(self) -> tuple[State, State]:
        previous = self.state
        handler = {StateName.SCHEDULING: self._schedule, StateName.RUNNING: self._active,
                   StateName.RECOVERING: self._active, StateName.STOPPING: self._stopping}[previous.name]
        self.state = handler(previous)
        if self.state.name != previous.name:
            self.events.write(ControllerState(previous=previous.name, state=self.state.name, attempt=self.attempt))
        return previous, self.state

    def request_stop(self, signum: int) -> None:
        """From a signal handler: SIGTERM (and STOP_SIGNAL) forwards a preemption notice to every node, SIGINT
        stops them."""
        self.signal = signum

    # -- the states -------------------------------------------------------------------------------------------

    def _schedule(self, state: State) -> State:
        # Agents are due to start: read what is there without waiting (the launch's first agent would otherwise
        # start a whole poll later).
        due = self.clock.monotonic() >= self._next_scale
        nxt = self._handle_signal() or self._handle_updates(wait_s=0.0 if due else POLL_S)
        if nxt:
            return nxt
        decision = self._scale(grow=True)
        if decision.fail_reason:
            return self._stop_all_then(failed(decision.fail_reason))
        return RUNNING if self.roster.started() >= self.min_nodes else state

    def _active(self, state: State) -> State:
        """Running and recovering: record agent exits, finish when training has, keep nodes coming (growth
        toward MAX waits while a loss is not recovered from; getting back to MIN never waits)."""
        nxt = self._handle_signal() or self._handle_updates()
        if nxt:
            return nxt
        done = self.view.training_finished is not None
        if not self.roster and (done or self.any_finished):
            return self._conclude()
        if done:
            self._stop_lingering_agents()
            return state
        self._boot_standbys()
        self._end_hung_nodes()
        # An agent that finished cleanly means training reached its end (a mode's replica groups may finish one by one):
        # no node is added or replaced any more, and none is missed.
        decision = ScalingDecision() if self.any_finished else self._scale(grow=self.loss_t is None or bool(self._replace))
        if decision.fail_reason:
            return self._stop_all_then(failed(decision.fail_reason))
        if state.name == StateName.RUNNING:
            return RECOVERING if self.loss_t is not None else state
        return RUNNING if self._check_recovered() else state

    def _stopping(self, state: State) -> State:
        self._handle_updates()
        if self.roster and self.clock.monotonic() > self.fleet.stop_deadline:
            self.events.write(AgentsUnresponsive(nodes=sorted({a.node for a in self.roster})))
            self.roster.clear()
        if self.roster:
            return state
        then = failed(self.view.lease_lost) if self.view.lease_lost else state.then
        if then.status in (RunStatus.PREEMPTED, RunStatus.STOPPED) and self.view.training_finished is not None:
            return finished(RunStatus.SUCCEEDED)  # the notice came after the last step: nothing was cut short
        return then

    def _conclude(self) -> State:
        if self.cfg.entrypoint.builtin and self.view.training_finished is None and self.hooks.records_training:
            return failed("every node agent exited but training did not finish (see logs/node*.log)")
        return finished(RunStatus.SUCCEEDED)

    # -- what the states ask ----------------------------------------------------------------------------------

    @property
    def rdzv_id(self) -> str:
        """The run's rendezvous id in this attempt (an agent's own may differ: its mode's)."""
        return self.maker.run_rendezvous(self.attempt)

    def _handle_signal(self) -> Optional[State]:
        if self.signal is None or self._signal_handled:
            return None
        self._signal_handled = True
        if self.signal in (signal.SIGTERM, STOP_SIGNAL):
            grace = self.cfg.preemption.grace_period_s
            if self.signal == STOP_SIGNAL:
                self.events.write(StopRequested(grace_period_s=grace))
            self.events.write(PreemptionNoticeForwarded(reason=f"orch got {signal.Signals(self.signal).name}",
                                                        grace_period_s=grace))
            if self.notify:
                for node, pid in self.roster.running().items():
                    self.notify(node, pid, grace)
            status = RunStatus.STOPPED if self.signal == STOP_SIGNAL else RunStatus.PREEMPTED
            return self._stop_all_then(finished(status), grace_s=grace, agent_only=True)
        self.events.write(Interrupted(reason=f"orch got {signal.Signals(self.signal).name}"))
        return self._stop_all_then(finished(RunStatus.INTERRUPTED))

    def _handle_updates(self, wait_s: float = POLL_S) -> Optional[State]:
        """Read what the workers said, then agent starts and exits (waiting up to ``wait_s`` for one); the next
        state if one calls for it."""
        self.view.update()
        for t in self.view.take_losses():
            self._note_loss(t)
        if self.view.lease_lost and not self._lease_stop_sent:  # before any exit is judged: no restart, no agent
            self._lease_stop_sent = True
            return self._stop_all_then(failed(self.view.lease_lost))
        fatal = self.hooks.on_tick(self.roster.running(), self.rdzv_id)
        if fatal:  # the machines themselves are gone: nothing is left to stop
            self.roster.clear()
            return failed(fatal)
        nxt: Optional[State] = None
        for update in self.pool.poll(wait_s):
            if isinstance(update, AgentStarted):
                self.fleet.started(update, self.attempt, STOP_GRACE_S)
            else:
                nxt = self._on_exit(update) or nxt
        return nxt

    def _scale(self, grow: bool) -> ScalingDecision:
        """Ask the scaling policy (once a second) and start the agents it places."""
        now = self.clock.monotonic()
        self._below_min_since = (self._below_min_since or now) if len(self.roster.playing) < self.min_nodes else None
        if now < self._next_scale:
            return ScalingDecision()
        self._next_scale = now + SCALE_INTERVAL_S
        self.fleet.drop_unplaceable(self.cfg.failure.wait_for_nodes_s)
        machines = self.pool.nodes()
        ips = {m.node_id: m.ip for m in machines}
        decision = self.scaling.decide(machines, Counter(a.node_id for a in self.roster.playing.values()), grow,
                                       now - self._below_min_since if self._below_min_since else 0.0,
                                       Counter(a.node_id for a in self.roster.standbys.values()))
        for node_id in decision.start_on:
            self._start_agent(node_id, ips.get(node_id, ""))
        return decision

    def _check_recovered(self) -> bool:
        """After a loss: has a training step completed since? Then record ``recovered`` with the MTTR."""
        if self.loss_t is None:
            return True
        step = self.view.first_step_since(self.loss_t)
        if step is None:
            return False
        self.events.write(Recovered(step_t=step.t, lost_t=self.loss_t, mttr_s=round(step.t - self.loss_t, 3),
                                    step=step.step, world_size=step.world_size))
        self.loss_t = None
        return True

    def _stop_lingering_agents(self) -> None:
        """Agents left in torchrun's exit barrier after training finished (see exit_barrier)."""
        if self.exit_barrier.stop_lingering(self.clock.monotonic(), self.view.training_finished, bool(self.roster)):
            self.events.write(AgentsStopped(reason="training finished; agents still waiting on departed peers"))
            self.fleet.stop_all(STOP_GRACE_S, agent_only=False, timeout_s=STOP_TIMEOUT_S)

    def _stop_all_then(self, then: State, grace_s: float = STOP_GRACE_S, agent_only: bool = False) -> State:
        self.fleet.stop_all(grace_s, agent_only, STOP_TIMEOUT_S)
        return stopping(then)

    # -- acting on agents -------------------------------------------------------------------------------------

    def _start_agent(self, node_id: str, ip: str, standby_for: Optional[int] = None) -> None:
        index = standby_for if standby_for is not None else self.hooks.node_for(
            ip, sorted(set(self.node_indexes) - set(self.roster.playing)))
        if index is None:
            return  # no node is free, or none may run on that machine (a test host of another node)
        self.fleet.start(index, node_id, self.attempt, standby=standby_for is not None)
        if standby_for is None:
            self._replace.discard(index)

    def _end_hung_nodes(self) -> None:
        """A node whose worker hangs (or straggles, with hang.evict_stragglers) is ended like a lost machine
        (SIGKILL to its agent and workers): the others recover at once instead of waiting in a collective."""
        running = {n: (a.pid, a.requested_t) for n, a in self.roster.playing.items() if a.pid is not None and not a.stopping}
        for node in self.hangs.tick(running, self.clock.time()):
            self._note_loss(self.clock.time())
            kill_tree(running[node][0])

    def _boot_standbys(self) -> None:
        """On a notice, boot the node's replacement now, where a machine has a free slot (see standby_policy)."""
        if not self.cfg.preemption.replace_nodes or not self.view.notices:
            return
        fresh = [n for n in self.view.notices if (n.node, n.t) not in self._notices_acted_on]
        boot = standbys_to_boot(fresh, {n: a.requested_t for n, a in self.roster.playing.items() if not a.stopping},
                                set(self.roster.standbys))
        self._notices_acted_on.update((n.node, n.t) for n in fresh if n.node in boot)
        used = Counter(a.node_id for a in self.roster)
        for node in boot:
            machine = standby_machine(node, self.roster.playing[node].node_id, self.pool.nodes(), used,
                                      lambda ip: self.hooks.node_for(ip, [node]) == node)
            if machine is not None:  # else no room: the replacement starts when the node has left
                used[machine.node_id] += 1
                self._start_agent(machine.node_id, machine.ip, standby_for=node)

    def _on_exit(self, exit: AgentExit) -> Optional[State]:
        agent = self.roster.remove(exit.agent_id)
        if agent is None:
            return None
        if agent.standby:
            self.events.write(NodeStopped(node=exit.node, exit_code=exit.exit_code, standby=True,
                                          reason=f"standby for node {exit.node} ended before it played "
                                                 f"({exit.detail or exit.exit_code})"))
            return None
        if agent.pid is None and exit.actor_died and not agent.stopping:
            # Placed on a machine that died before the agent started (the cluster still listed it as alive):
            # nothing of the job ran there, so nothing is lost and nothing to recover; the slot is free again.
            self.events.write(NodeStartFailed(node=exit.node, ray_node=agent.node_id, reason=exit.detail))
            return None
        self.exit_codes[exit.node] = exit.exit_code
        done = self.view.training_finished is not None
        self.exit_barrier.agent_exited(self.clock.monotonic(), done)
        recent = self.clock.time() - self.cfg.preemption.grace_period_s - STOP_GRACE_S
        noticed = self.view.noticed(exit.node, since=max(agent.requested_t, recent))
        explained = None if noticed or agent.stopping else self.hooks.explain_exit(exit.node, exit.exit_code,
                                                                                   agent.requested_t)
        verdict = classify(exit, agent.stopping, noticed, done, explained)
        self.events.write(verdict.kind.event(exit.node, exit.exit_code, verdict.reason, self.attempt))
        standby = self.roster.promote(exit.node)
        if standby is not None and standby.pid is not None:
            self.fleet.announce(standby, self.attempt, standby=True)
        self.roster.write_nodes()
        if agent.stopping or (done and verdict.kind in (ExitKind.FAILED, ExitKind.LOST, ExitKind.PREEMPTED)):
            return None  # the controller stopped it, or training is done: nothing to recover or to retry
        return self._after_exit(agent, verdict)

    def _after_exit(self, agent: Agent, verdict: ExitVerdict) -> Optional[State]:
        """What an exit the controller did not ask for calls for: a loss to recover from, a failure to retry."""
        if verdict.kind == ExitKind.FINISHED:
            self.any_finished = True
        elif verdict.kind in (ExitKind.LOST, ExitKind.PREEMPTED):
            if agent.pid is not None:  # the survivors need not wait for its keep-alive (or heartbeat) to expire
                self.maker.gone(agent.agent_id, agent.node, agent.pid, agent.rdzv_id)
            self._note_loss(self.clock.time())
            if (verdict.kind == ExitKind.PREEMPTED and self.cfg.preemption.replace_nodes
                    and agent.node not in self.roster.playing):
                self._replace.add(agent.node)
        decision, repeated = self.budget.charge(verdict, self.view.failures_since(self._attempt_t),
                                                self.run_dir / LOGS_DIR / f"node{agent.node}.log", agent.log_offset)
        if decision.action == FailureAction.FAIL:
            if repeated and self.budget.failures <= self.cfg.failure.max_failures:
                self.events.write(DeterministicFailure(node=agent.node, failure=repeated, attempts=self.attempt + 1))
            return self._stop_all_then(failed(decision.reason))
        if decision.action == FailureAction.RESTART:
            self.events.write(Restart(reason=decision.reason, scope="every node", attempt=self.attempt + 1))
            self.attempt += 1
            self._attempt_t = self.clock.time()
            self.loss_t = None
            self._replace.clear()
            return self._stop_all_then(SCHEDULING)
        return None

    def _note_loss(self, t: float) -> None:
        self.loss_t = t if self.loss_t is None else min(self.loss_t, t)


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
