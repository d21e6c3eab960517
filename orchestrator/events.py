"""The events a run records: their names (:class:`EventName`) and one typed constructor per event.

Each event is a frozen, keyword-only dataclass whose class docstring says what it means and whose fields are
its JSON fields, in the order they are written; :meth:`orchestrator.rundir.EventLog.write` appends it as
``{"t": unix seconds, "event": NAME, **fields}``::

    events.write(NodeLost(node=1, exit_code=-9, reason="agent killed by SIGKILL", attempt=0))

The JSON is what orch always wrote: a field's name is its key (``async_`` is written ``async``, a Python
keyword); a field made with :func:`optional` is left out while it is None (it never was always there); a
field made with :func:`spread` is a mapping written as top-level keys of its own (a site's launch fields,
start-up milestones, a script's own fields at the finish). Readers take a record back with :func:`parse`.
docs/run-dir.md lists every event; tests/test_events.py keeps the enum, the constructors and that page equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Mapping, Optional, TypeVar


class EventName(StrEnum):
    """Every event a run records. String-valued: the JSON says ``"event": "node_lost"`` as it always did."""

    # the launch and the controller
    LAUNCH_STARTED = "launch_started"
    CONTROLLER_STATE = "controller_state"
    RUN_FINISHED = "run_finished"
    INTERRUPTED = "interrupted"
    STOP_REQUESTED = "stop_requested"  # `orch stop`: the nodes get a notice, save and leave; status `stopped`
    PREEMPTION_NOTICE_FORWARDED = "preemption_notice_forwarded"
    RESTART = "restart"
    RUN_STOPPED_DETERMINISTIC = "deterministic_failure"
    AGENTS_STOPPED = "agents_stopped"
    AGENTS_UNRESPONSIVE = "agents_unresponsive"
    RECOVERED = "recovered"
    # node agents
    NODE_STARTED = "node_started"
    NODE_STANDBY_STARTED = "node_standby_started"
    NODE_JOINED = "node_joined"
    NODE_START_FAILED = "node_start_failed"
    NODE_UNPLACEABLE = "node_unplaceable"
    NODE_FINISHED = "node_finished"
    NODE_STOPPED = "node_stopped"
    NODE_PREEMPTED = "node_preempted"
    NODE_LOST = "node_lost"
    NODE_FAILED = "node_failed"
    # rendezvous
    RENDEZVOUS_EVICTED = "rendezvous_evicted"
    RENDEZVOUS_REOPENED = "rendezvous_reopened"
    RENDEZVOUS_COMPLETE = "rendezvous_complete"
    ROUND_BROKEN = "round_broken"
    # workers
    WORKER_STARTED = "worker_started"
    FIRST_STEP = "first_step"
    # fault_tolerance.mode=per_step (orchestrator/ft/)
    QUORUM_CHANGED = "quorum_changed"  # the leader, at the first committed step of a new set of replica groups
    REPLICA_HEALED = "replica_healed"  # a group loaded a live peer's state (which one, at which step)
    STEP_DISCARDED = "step_discarded"  # a step that did not commit everywhere: redone with the same samples
    HANG_DETECTED = "hang_detected"  # a rank's heartbeat went silent: its stack, then its node is ended
    STRAGGLER = "straggler"  # a rank consistently busier per step than its peers (ratio)
    STORE_CLIENT_REFUSED = "store_client_refused"  # a connection to a port of the run without the run's secret
    STORE_VALUE_REFUSED = "store_value_refused"  # a rendezvous state not sealed with the run's secret (key, peer)
    REPLICA_STARTED = "replica_started"  # a group's workers joined their own one-node rendezvous
    REPLICA_LEFT = "replica_left"  # a noticed group left at a step boundary, its peers holding the state
    REPLICA_DROPPED = "replica_dropped"  # per_step: the quorum service took a group out at once (no heartbeat wait)
    TRAINING_FINISHED = "training_finished"
    WORKER_FAILED = "worker_failed"
    PREEMPTION_NOTICE = "preemption_notice"
    PREEMPTION_GRACE_SHORT = "preemption_grace_short"
    EMERGENCY_CHECKPOINT = "emergency_checkpoint"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_RETENTION_FAILED = "checkpoint_retention_failed"
    CHECKPOINT_CONFIG_CHANGED = "checkpoint_config_changed"
    CHECKPOINT_INTERVAL = "checkpoint_interval"  # every_n_steps=auto set a new interval (orchestrator/checkpoint/interval.py)
    LEASE_LOST = "lease_lost"  # the run's lease on its run dir or checkpoint URL is another run's: the run stops
    # fault injection
    CHAOS_KILL = "chaos_kill"
    CHAOS_PREEMPT = "chaos_preempt"
    CHAOS_PARTITION = "chaos_partition"
    CHAOS_HEAL = "chaos_heal"
    # test clusters
    STALE_WORKERS_ENDED = "stale_workers_ended"
    TESTCLUSTER_BINDINGS = "testcluster_bindings"
    TESTCLUSTER_RAY_NODE_STARTED = "testcluster_ray_node_started"


_WRITTEN = "written"  # a field's metadata key: how it is written
_OPTIONAL, _SPREAD = "optional", "spread"
EVENT_TYPES: dict[EventName, type["Event"]] = {}
"""The constructor of each event name."""


def optional() -> Any:
    """A field that is left out of the JSON while it is None (some writers of the event never had it)."""
    return field(default=None, metadata={_WRITTEN: _OPTIONAL})


def spread() -> Any:
    """A mapping written as top-level fields of the event (keys its constructor cannot know in advance)."""
    return field(default_factory=dict, metadata={_WRITTEN: _SPREAD})


def _key(name: str) -> str:
    return name[:-1] if name.endswith("_") else name  # async_ -> "async"


E = TypeVar("E", bound="Event")


@dataclass(frozen=True, kw_only=True)
class Event:
    """One event: ``event`` is its name, the dataclass fields are its JSON fields."""

    event: ClassVar[EventName]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("event")
        if name is not None:  # a shared base (no name of its own) is no event
            if name in EVENT_TYPES:
                raise TypeError(f"{cls.__name__}: event {name!r} already has a constructor, "
                                f"{EVENT_TYPES[name].__name__}")
            EVENT_TYPES[name] = cls

    def fields(self) -> dict[str, Any]:
        """The JSON fields, in order (without ``t`` and ``event``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value, written = getattr(self, f.name), f.metadata.get(_WRITTEN)
            if written == _SPREAD:
                out.update(value)
            elif written != _OPTIONAL or value is not None:
                out[_key(f.name)] = value
        return out

    @classmethod
    def from_record(cls: type[E], record: Mapping[str, Any]) -> E:
        """The event a record holds, leniently: a field the record lacks (an older run dir, a hand-written
        line) reads as None; keys this event does not know go to its spread field, if it has one."""
        kwargs: dict[str, Any] = {}
        known = {"t", "event"}
        spread_to = None
        for f in dataclasses.fields(cls):
            if f.metadata.get(_WRITTEN) == _SPREAD:
                spread_to = f.name
            else:
                kwargs[f.name] = record.get(_key(f.name))
                known.add(_key(f.name))
        if spread_to is not None:
            kwargs[spread_to] = {k: v for k, v in record.items() if k not in known}
        return cls(**kwargs)


def parse(record: Mapping[str, Any]) -> Optional[Event]:
    """The typed event of one ``events.jsonl`` record (see :meth:`Event.from_record`); None for a record
    without a known ``"event"`` (or no JSON object at all)."""
    name = record.get("event") if isinstance(record, Mapping) else None
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None  # type: ignore[call-overload]
    return cls.from_record(record) if cls is not None else None


def event_of(name: str, fields: Mapping[str, Any]) -> Event:
    """The event ``name`` with ``fields`` (JSON keys), strictly, as its constructor takes them: for a callback
    that hands an event on as a name and fields. ValueError for a name not in :class:`EventName`; TypeError
    for a field the event does not have (and no spread field takes), or a field it needs that is not given."""
    cls = EVENT_TYPES.get(name)  # type: ignore[call-overload]
    if cls is None:
        raise ValueError(f"{name!r} is not an event of orchestrator.events.EventName")
    attrs = {_key(f.name): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in fields.items():
        f = attrs.get(key)
        if f is not None and f.metadata.get(_WRITTEN) != _SPREAD:
            kwargs[f.name] = value
        else:
            extra[key] = value
    spread_to = next((f.name for f in attrs.values() if f.metadata.get(_WRITTEN) == _SPREAD), None)
    if spread_to is not None:
        kwargs[spread_to] = extra
    elif extra:
        raise TypeError(f"{cls.__name__} ({name}) has no field {', '.join(map(repr, extra))}")
    return cls(**kwargs)


# -- the launch and the controller ------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LaunchStarted(Event):
    """A launch began: the store is up and plan.json written (a run dir launched again has several)."""

    event = EventName.LAUNCH_STARTED
    preset: str
    run_id: str
    launcher: str
    nodes: int
    rendezvous_endpoint: Optional[str]
    command_t: Optional[float] = optional()
    """When the command that launched the run started (the ``orch launch`` process; a Python launch: its call):
    ``wall_s`` and goodput count from here, the time before this event being goodput's ``launch``."""
    site: Mapping[str, Any] = spread()  # the site's own: ray, driver_ip, placement, dashboard, testcluster


@dataclass(frozen=True, kw_only=True)
class ControllerState(Event):
    """The controller went from one state to another (scheduling, running, recovering, stopping, ...)."""

    event = EventName.CONTROLLER_STATE
    previous: str
    state: str
    attempt: int


@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    """Every agent has exited: the launch's outcome (``status``: succeeded, failed, interrupted, preempted, stopped)."""

    event = EventName.RUN_FINISHED
    status: str
    attempts: int
    node_exit_codes: Mapping[str, Optional[int]]
    reason: Optional[str] = optional()


@dataclass(frozen=True, kw_only=True)
class Interrupted(Event):
    """orch got SIGINT and stops every node."""

    event = EventName.INTERRUPTED
    reason: str


@dataclass(frozen=True, kw_only=True)
class StopRequested(Event):
    """``orch stop``: every node gets a notice, saves and leaves; the run ends ``stopped``."""

    event = EventName.STOP_REQUESTED
    grace_period_s: float


@dataclass(frozen=True, kw_only=True)
class PreemptionNoticeForwarded(Event):
    """orch got SIGTERM (or ``orch stop``) and forwards a preemption notice to every node."""

    event = EventName.PREEMPTION_NOTICE_FORWARDED
    reason: str
    grace_period_s: float


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    """Workers restarted: by their torchrun agent (rank 0 writes ``restart_count``, ``world_size``), or every
    node by the controller after a failure (``scope``, ``attempt``)."""

    event = EventName.RESTART
    restart_count: Optional[int] = optional()
    world_size: Optional[int] = optional()
    reason: str
    scope: Optional[str] = optional()
    attempt: Optional[int] = optional()


@dataclass(frozen=True, kw_only=True)
class DeterministicFailure(Event):
    """The same failure came back after a restart: the run stops instead of spending its failure budget."""

    event = EventName.RUN_STOPPED_DETERMINISTIC
    node: int
    failure: str
    attempts: int


@dataclass(frozen=True, kw_only=True)
class AgentsStopped(Event):
    """Training finished but agents still waited on departed peers (torchrun's exit barrier): orch stopped them."""

    event = EventName.AGENTS_STOPPED
    reason: str


@dataclass(frozen=True, kw_only=True)
class AgentsUnresponsive(Event):
    """Agents told to stop had not exited by the deadline: orch gave up on them."""

    event = EventName.AGENTS_UNRESPONSIVE
    nodes: list[int]


@dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    """A training step completed after a loss: the recovery time (MTTR) from the loss to that step."""

    event = EventName.RECOVERED
    step_t: float
    lost_t: float
    mttr_s: float
    step: Optional[int]
    world_size: Optional[int]


# -- node agents ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NodeStarted(Event):
    """A node's torchrun agent runs and plays its node (``replacement``: the node had an agent before)."""

    event = EventName.NODE_STARTED
    node: int
    pid: Optional[int]
    replacement: bool
    standby: Optional[bool] = optional()  # True: a standby took the node over


@dataclass(frozen=True, kw_only=True)
class NodeStandbyStarted(Event):
    """A standby agent booted for a noticed node; it waits to take the node over."""

    event = EventName.NODE_STANDBY_STARTED
    node: int
    pid: Optional[int]
    ip: Optional[str]
    ray_node: Optional[str]


@dataclass(frozen=True, kw_only=True)
class NodeJoined(Event):
    """Where a playing agent runs: its machine, attempt and rendezvous id."""

    event = EventName.NODE_JOINED
    node: int
    pid: Optional[int]
    ip: Optional[str]
    ray_node: Optional[str]
    attempt: int
    rdzv_id: Optional[str]


@dataclass(frozen=True, kw_only=True)
class NodeStartFailed(Event):
    """An agent's machine died before the agent started: nothing ran there, the slot is free again."""

    event = EventName.NODE_START_FAILED
    node: int
    ray_node: Optional[str]
    reason: Optional[str]


@dataclass(frozen=True, kw_only=True)
class NodeUnplaceable(Event):
    """The pool could not place an agent within ``failure.wait_for_nodes_s``: its slot is given back."""

    event = EventName.NODE_UNPLACEABLE
    node: int
    ray_node: Optional[str]


@dataclass(frozen=True, kw_only=True)
class NodeExit(Event):
    """A node agent exited, and what the exit was (the base of the ``node_<kind>`` events)."""

    node: int
    exit_code: Optional[int]
    reason: str
    attempt: int


@dataclass(frozen=True, kw_only=True)
class NodeFinished(NodeExit):
    """An agent exited 0: its workers are done."""

    event = EventName.NODE_FINISHED


@dataclass(frozen=True, kw_only=True)
class NodePreempted(NodeExit):
    """An agent left after a preemption notice."""

    event = EventName.NODE_PREEMPTED


@dataclass(frozen=True, kw_only=True)
class NodeLost(NodeExit):
    """An agent was killed, or its machine is gone: lost, not the job's fault."""

    event = EventName.NODE_LOST


@dataclass(frozen=True, kw_only=True)
class NodeFailed(NodeExit):
    """An agent exited non-zero: user code failed, or torchrun gave up after ``cluster.max_restarts``."""

    event = EventName.NODE_FAILED


@dataclass(frozen=True, kw_only=True)
class NodeStopped(Event):
    """An agent ended while orch was stopping it (``standby``: a standby that never played)."""

    event = EventName.NODE_STOPPED
    node: int
    exit_code: Optional[int]
    standby: Optional[bool] = optional()
    reason: str
    attempt: Optional[int] = optional()


# -- rendezvous ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RendezvousEvicted(Event):
    """A departed agent was taken out of its rendezvous round at once (no keep-alive to wait out)."""

    event = EventName.RENDEZVOUS_EVICTED
    node: int
    agent_pid: int


@dataclass(frozen=True, kw_only=True)
class RendezvousReopened(Event):
    """The departed agent was in a complete round: the next round opens with its survivors waiting."""

    event = EventName.RENDEZVOUS_REOPENED
    node: int
    round: Optional[int]
    reason: str


@dataclass(frozen=True, kw_only=True)
class RendezvousComplete(Event):
    """Rank 0 joined the process group of a rendezvous round (restart mode)."""

    event = EventName.RENDEZVOUS_COMPLETE
    world_size: int
    restart_count: int
    nnodes: int


@dataclass(frozen=True, kw_only=True)
class RoundBroken(Event):
    """A test cluster's round member went silent while the others sat blocked: their workers were ended."""

    event = EventName.ROUND_BROKEN
    round: Optional[int]
    silent_nodes: list[int]
    silent_hosts: list[str]
    silent_for_s: Optional[float]
    survivors: list[int]
    ended_worker_pids: list[int]
    reason: str


# -- workers -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WorkerStarted(Event):
    """Rank 0, right before an attempt's first step: each start-up milestone's latest time over all ranks."""

    event = EventName.WORKER_STARTED
    world_size: int
    restart_count: int
    step: int
    max_steps: Optional[int] = optional()
    """The step the script trains to (the session's ``max_steps``, HF's ``max_steps``): the live progress's total."""
    milestones: Mapping[str, float] = spread()  # agent_start_t, process_start_t, entry_t, ..., ready_t


@dataclass(frozen=True, kw_only=True)
class FirstStep(Event):
    """The first step completed after a (re)start: recovery times end here."""

    event = EventName.FIRST_STEP
    step: int
    world_size: int
    restart_count: int


@dataclass(frozen=True, kw_only=True)
class QuorumChanged(Event):
    """per_step: the first committed step of a new set of replica groups (the quorum's leader writes it)."""

    event = EventName.QUORUM_CHANGED
    step: int
    replicas: int
    previous: Optional[int]
    world_size: int


@dataclass(frozen=True, kw_only=True)
class ReplicaHealed(Event):
    """per_step: a replica group loaded a live peer's state instead of a checkpoint."""

    event = EventName.REPLICA_HEALED
    node: int
    replica_id: str
    source_replica: Optional[str]
    source_node: Optional[int]
    step: int
    heal_s: float
    checkpoint_read: bool
    params_sha256: Optional[str]
    source_params_sha256: Optional[str]


@dataclass(frozen=True, kw_only=True)
class StepDiscarded(Event):
    """per_step: a step that did not commit everywhere; it is trained again with the same samples."""

    event = EventName.STEP_DISCARDED
    node: int
    step: int
    replicas: int
    error: str


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    """A rank's heartbeat went silent past the threshold: its stacks, then its node is ended."""

    event = EventName.HANG_DETECTED
    node: int
    rank: int
    pid: int
    step: Optional[int]
    silent_s: float
    threshold_s: float
    stack: str


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A rank consistently busier per step than its peers (``evicted``: its node is ended)."""

    event = EventName.STRAGGLER
    node: int
    rank: int
    ratio: float
    busy_s: float
    peers_busy_s: list[float]
    evicted: bool


@dataclass(frozen=True, kw_only=True)
class StoreClientRefused(Event):
    """A connection to a port of the run without the run's secret (``port``: which listener)."""

    event = EventName.STORE_CLIENT_REFUSED
    node: Optional[int | str] = optional()  # the agent's or worker's node, for a listener on a node
    peer: str
    port: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class StoreValueRefused(Event):
    """A rendezvous state not sealed with the run's secret: the store refused it, or an agent would not read it."""

    event = EventName.STORE_VALUE_REFUSED
    node: Optional[str] = optional()  # the agent that refused to read it
    key: str
    peer: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class ReplicaStarted(Event):
    """per_step: a replica group's workers joined their own one-node rendezvous."""

    event = EventName.REPLICA_STARTED
    node: int
    world_size: int
    restart_count: int


@dataclass(frozen=True, kw_only=True)
class ReplicaLeft(Event):
    """per_step: a noticed group left at a step boundary with nothing saved, its peers holding the state."""

    event = EventName.REPLICA_LEFT
    node: int
    step: int
    since_notice_s: float


@dataclass(frozen=True, kw_only=True)
class ReplicaDropped(Event):
    """per_step, the driver: the quorum service took a replica group out of the next quorum at once, because
    the group said it leaves (``cause`` ``left``: a preemption notice, or its end) or the controller saw its
    agent exit (``agent_exited``); the survivors' next quorum does not wait for its heartbeats to age out."""

    event = EventName.REPLICA_DROPPED
    replica_id: str
    cause: str


@dataclass(frozen=True, kw_only=True)
class TrainingFinished(Event):
    """Rank 0, after the last step and the final checkpoint: how training ended."""

    event = EventName.TRAINING_FINISHED
    steps_completed: int
    final_loss: Optional[float]
    params_sha256: Optional[str] = optional()  # of the first registered module, when there is one
    world_size: int
    progress: Optional[Mapping[str, Any]] = optional()  # {step, samples_consumed, epoch}
    extra: Mapping[str, Any] = spread()  # what the script passed to Session.finish()


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(Event):
    """A rank's worker raised: its error (``Type: message``) and the last 4000 characters of its traceback."""

    event = EventName.WORKER_FAILED
    rank: int
    node: int
    restart_count: int
    error: str
    traceback: str


@dataclass(frozen=True, kw_only=True)
class PreemptionNotice(Event):
    """A node's local rank 0 received a preemption notice (``source``: chaos, a cloud's, sigterm)."""

    event = EventName.PREEMPTION_NOTICE
    node: int
    source: str
    detail: str
    step: int
    notice_t: float


@dataclass(frozen=True, kw_only=True)
class PreemptionGraceShort(Event):
    """The emergency save probably does not fit in what is left of the grace period."""

    event = EventName.PREEMPTION_GRACE_SHORT
    step: int
    expected_save_s: float
    remaining_s: float
    grace_period_s: float


@dataclass(frozen=True, kw_only=True)
class EmergencyCheckpoint(Event):
    """The checkpoint saved on a preemption notice is committed."""

    event = EventName.EMERGENCY_CHECKPOINT
    step: int
    save_s: float
    since_notice_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointSaved(Event):
    """A checkpoint is committed: orch's (``bytes``, ``async``, ``url``) or a Hugging Face one (``path``,
    ``reason``, ``source``)."""

    event = EventName.CHECKPOINT_SAVED
    step: int
    path: Optional[str] = optional()
    stall_s: float
    write_s: float
    bytes: Optional[int] = optional()
    async_: Optional[bool] = optional()
    url: Optional[str] = optional()
    reason: Optional[str] = optional()
    source: Optional[str] = optional()


@dataclass(frozen=True, kw_only=True)
class CheckpointLoaded(Event):
    """Rank 0 resumed from a checkpoint (``source``: hf for a Hugging Face one)."""

    event = EventName.CHECKPOINT_LOADED
    step: int
    world_size: int
    saved_world_size: Optional[int] = optional()
    restore_s: Optional[float] = optional()
    source: Optional[str] = optional()


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(Event):
    """Resuming passed over an invalid checkpoint."""

    event = EventName.CHECKPOINT_SKIPPED
    step: int
    reason: str
    url: str


@dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Event):
    """A save failed, or was refused (``error`` starts ``refused, nothing committed:``)."""

    event = EventName.CHECKPOINT_FAILED
    step: int
    error: str
    async_: bool
    url: str


@dataclass(frozen=True, kw_only=True)
class CheckpointRetentionFailed(Event):
    """Deleting old checkpoints failed (the new one is committed)."""

    event = EventName.CHECKPOINT_RETENTION_FAILED
    error: str
    url: str


@dataclass(frozen=True, kw_only=True)
class CheckpointConfigChanged(Event):
    """A resume under changed math-relevant settings (``keys``: which)."""

    event = EventName.CHECKPOINT_CONFIG_CHANGED
    step: int
    keys: list[str]


@dataclass(frozen=True, kw_only=True)
class CheckpointInterval(Event):
    """``checkpoint.every_n_steps=auto`` set a new interval, and what it decided from."""

    event = EventName.CHECKPOINT_INTERVAL
    step: int
    every_n_steps: int
    previous: Optional[int]
    step_s: float
    stall_s: float
    mtbf_s: float
    interruptions: int
    elapsed_s: float


@dataclass(frozen=True, kw_only=True)
class LeaseLost(Event):
    """The run's lease on its run dir or checkpoint URL is not its own any more (``by``: launcher or worker)."""

    event = EventName.LEASE_LOST
    url: str
    setting: str
    holder: Optional[str]  # the run id now holding it; None when the lease file is gone
    by: str
    step: Optional[int] = optional()  # the worker's step
    reason: str


# -- fault injection -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ChaosKill(Event):
    """A node was killed on purpose: by ``orch chaos kill-node`` (``pids``, ``signal``) or a test cluster's
    fault (``host``, ``source``)."""

    event = EventName.CHAOS_KILL
    node: int
    host: Optional[str] = optional()
    source: Optional[str] = optional()
    pids: Optional[list[int]] = optional()
    signal: Optional[str] = optional()


@dataclass(frozen=True, kw_only=True)
class ChaosPreempt(Event):
    """``orch chaos preempt`` gave a node a notice; it is killed after ``grace_s`` if still there."""

    event = EventName.CHAOS_PREEMPT
    node: int
    grace_s: float
    agent_pid: int


@dataclass(frozen=True, kw_only=True)
class ChaosPartition(Event):
    """A test cluster's host was cut off the network."""

    event = EventName.CHAOS_PARTITION
    node: int
    host: str
    source: str


@dataclass(frozen=True, kw_only=True)
class ChaosHeal(Event):
    """A test cluster's host was connected again."""

    event = EventName.CHAOS_HEAL
    node: int
    host: str
    source: str


# -- test clusters -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StaleWorkersEnded(Event):
    """A healed node's workers of a dead round were ended, so its agent rejoins."""

    event = EventName.STALE_WORKERS_ENDED
    node: int
    ended_worker_pids: list[int]
    reason: str


@dataclass(frozen=True, kw_only=True)
class TestclusterBindings(Event):
    """Once per round on a test cluster: the addresses each rank's TCP sockets use."""

    event = EventName.TESTCLUSTER_BINDINGS
    __test__ = False  # a Test* name pytest must not collect
    round: Optional[int]
    ranks: list[dict[str, Any]]
    own_address_only: bool


@dataclass(frozen=True, kw_only=True)
class TestclusterRayNodeStarted(Event):
    """A Ray node was started inside a test cluster's host (``restart``: brought back after the host came back)."""

    event = EventName.TESTCLUSTER_RAY_NODE_STARTED
    __test__ = False  # a Test* name pytest must not collect
    node: int
    host: str
    address: str
    pid: int
    restart: bool
