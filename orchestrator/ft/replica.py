"""A worker's replica group under ``fault_tolerance.mode=per_step``: its torchft Manager, and the step protocol
(:class:`~orchestrator.ft.steps.StepProtocol`) that the session runs with it.

Every step trains in a quorum of replica groups (orch's quorum service in the driver, through the run's gate:
:mod:`~orchestrator.ft.coordination`). The quorum of the next step is asked for as soon as this step committed
(torchft's asynchronous quorum), so it forms while the optimizer steps and the step boundary runs; the group
waits for it at the top of the next step, where a group that must heal loads a live peer's state before its
forward pass, so its first committed step starts from the survivors' weights, and where the step's data
(the sampler's world, rank and position) is drawn from it. Until then the state a peer would copy and the
process group the committed step used are held as they are (see :meth:`ReplicaGroup.commit`).

The gradients are averaged across the quorum's groups in buckets while the backward pass runs
(:mod:`~orchestrator.ft.buckets`: the parallelism strategy hands each gradient over once the group's own DDP
or FSDP2 reduction made it final), and waited for before any grad-scaler unscale or clipping, as DDP would
have. The optimizer steps only if every participant finished the step (``should_commit``); otherwise the
step is discarded: the registered schedulers, grad scalers, module buffers and RNG states go back to where the
step began, and the session redoes the step, with the same samples, in the next quorum.

The state a peer sends is the training state's one serializer (:meth:`TrainingState.state_dict
<orchestrator.runtime.state.TrainingState.state_dict>`, as in a checkpoint) with this group's records beside
it: the sender's RNG state, its metrics window, its quorum seconds so far and where the state came from.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import types
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from orchestrator.config.schema import OrchConfig
from orchestrator.ft import REPLICA_ENV
from orchestrator.ft.buckets import GradientBuckets
from orchestrator.ft.coordination import install, process_group
from orchestrator.ft.shards import LAYOUT_KEY, from_local, local_sha256, mesh_of, to_local
from orchestrator.events import (Event, QuorumChanged, ReplicaHealed, ReplicaLeft, ReplicaStarted, StepDiscarded,
                                 StoreClientRefused)
from orchestrator.ft.steps import Emit, Membership, RestartSteps, StepProtocol, send
from orchestrator.ft.transport import PeerStateTransport
from orchestrator.ft.watch import QuorumWatch
from orchestrator.runtime.distributed import DistContext
from orchestrator.runtime.state import Record, RngState, Stateful, TrainingState, rng_state, set_rng_state

# Where a replica group's loop spends time besides committed steps (metrics records' ``ft``; goodput's badput).
WINDOW_KEYS = ("quorum_wait_s", "healing_s", "discarded_s")
# The records a peer sends beside the training state (no registered name starts with "_").
SOURCE_RECORD, METRICS_RECORD, FT_RECORD, RNG_RECORD = "_source", "_metrics_window", "_ft_window", "_rng"


class _ReplicaRecords:
    """What per_step writes down the same way before and after the group is attached."""

    def record_start(self, emit: Emit, ctx: DistContext) -> None:
        """A replica group's own one-node round: the job's world is the quorum's (``quorum_changed``), and the
        job's attempts are not cut by a group joining."""
        if ctx.rank == 0:
            send(emit, ReplicaStarted(node=ctx.node, world_size=ctx.world_size, restart_count=ctx.restart_count))

    def sample_record(self, ctx: DistContext, start_sample: int, world_size: int, rank: int) -> tuple[str, dict]:
        """One file per replica group's rank, with the step's data position and the rank's place in the
        step's world: an audit recomputes what each rank had to draw."""
        return (f"node{ctx.node}-rank{ctx.rank}",
                {"start_sample": start_sample, "world_size": world_size, "job_rank": rank})


class PerStepSteps(_ReplicaRecords, RestartSteps):
    """per_step before the training state is registered: nothing to coordinate yet (as in restart mode);
    :meth:`attach` makes the :class:`ReplicaGroup` once the process group exists. The gradient buckets exist
    from the start: the model is spread over the ranks (and hands its gradients to them) before it is
    registered. ``max_steps``: the loop's last step."""

    def __init__(self, cfg: OrchConfig, ctx: DistContext, device: torch.device, max_steps: Optional[int] = None):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.max_steps = cfg.trainer.max_steps if max_steps is None else max_steps
        self.buckets = GradientBuckets(cfg.ddp.bucket_cap_mb)
        self._pending: Callable[[], bool] = lambda: False

    def attach(self, state: TrainingState, emit: Emit, window: Stateful) -> StepProtocol:
        group = ReplicaGroup(self.cfg, self.ctx, self.device, state, emit, window, buckets=self.buckets,
                             max_steps=self.max_steps)
        group.notices(self._pending)
        wrap_for_commit(state, group)
        return group

    def gradient_handoff(self) -> GradientBuckets:
        return self.buckets

    def notices(self, pending: Callable[[], bool]) -> None:
        self._pending = pending


class ReplicaGroup(_ReplicaRecords):
    """This worker's membership in the job's quorum (one per worker; every rank of a group has one): the
    per_step :class:`~orchestrator.ft.steps.StepProtocol`. ``emit`` writes this worker's events: the group's
    own (healed, discarded, left) from its rank 0, the run's (``quorum_changed``) from the leader's.
    ``window``: the open metrics window, handed to a healing group with the state. ``buckets``: where the
    strategy hands the gradients (:meth:`gradient_handoff`). ``max_steps``: the loop's last step (no quorum is
    formed ahead of a step that will not come)."""

    def __init__(self, cfg: OrchConfig, ctx: DistContext, device: torch.device, state: TrainingState,
                 emit: Emit, window: Optional[Stateful] = None, buckets: Optional[GradientBuckets] = None,
                 max_steps: Optional[int] = None):
        from torchft import Manager

        ft = cfg.fault_tolerance
        self.buckets = buckets if buckets is not None else GradientBuckets(cfg.ddp.bucket_cap_mb)
        self.max_steps = cfg.trainer.max_steps if max_steps is None else max_steps
        self._notice_pending: Callable[[], bool] = lambda: False
        self.ctx, self.device, self.state = ctx, device, state
        self.emit = emit
        self.metrics_window = window
        self.replica_id = os.environ.get(REPLICA_ENV, f"node{ctx.node}")
        self.healed_from: Optional[dict[str, Any]] = None
        self._heal_started = 0.0
        self.transport = PeerStateTransport(timeout=timedelta(seconds=max(30.0, ft.collective_timeout_s)),
                                            on_refused=self._refused)
        self._last_refusal = -1e9
        install()  # torchft's Manager on orch's quorum service, not on torchft's Rust servers
        self._pg: Any = None  # the cross-group process group, made with the Manager
        self._hold_s = max(30.0, ft.quorum_timeout_s)
        self._collective_s = ft.collective_timeout_s
        self._make_manager = lambda: Manager(
            pg=self._new_process_group(cfg.backend.name, timedelta(seconds=ft.collective_timeout_s)),
            load_state_dict=self._load, state_dict=self._state_dict,
            min_replica_size=cfg.cluster.min_nodes, use_async_quorum=True,
            timeout=timedelta(seconds=max(30.0, ft.collective_timeout_s)),
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timedelta(seconds=30),
            replica_id=self.replica_id, lighthouse_addr="orch", checkpoint_transport=self.transport, init_sync=True)
        self._manager: Optional[Any] = None
        self.participants = 0
        self.participating_rank: Optional[int] = None
        self.last_committed_participants: Optional[int] = None
        self.committed: Optional[bool] = None
        self._began = self._synced = False
        self._ahead = False  # the next step's quorum is being formed (asked for at this step's commit)
        self._held = False  # since then: the state a peer copies and the committed step's process group held
        self._staged = 0  # states staged for a peer when the quorum being waited for was asked for
        self._error = ""  # the committed (or discarded) step's collective error, if any
        self._aborting: list[threading.Thread] = []  # aborts started by failed buckets, joined at the sync
        self._watch: Optional[QuorumWatch] = None  # told when a member of the quorum in use is dropped
        self._in_use: Optional[tuple[int, Any]] = None  # (quorum id, the process group it runs on) of this step
        self._lost = ""  # why the quorum in use was aborted by the watch, if it was
        self._snapshot: dict[str, Any] = {}
        # A steady quorum (see _steady_step): a group of one rank trains on in the quorum it is in without asking
        # for one per step, until it is wanted anew (the watch says so), a step is discarded, or it restored.
        self._steady_ok = ctx.world_size == 1
        self._wanted = threading.Lock()  # the watch's news against the step this worker is in
        self._requorum = True  # the next step asks for a quorum
        self._steady_at: Optional[int] = None  # the step being trained without asking (its Manager step)
        self._quorum_s = self._step_t0 = 0.0
        self._quorum_started: Optional[float] = None  # while this group is in a quorum
        self._loaded_at: Optional[float] = None  # when this group took over a peer's state in this quorum
        self.window = dict.fromkeys(WINDOW_KEYS, 0.0)
        self._healed_source: dict[str, Any] = {}

    def _new_process_group(self, backend: str, timeout: timedelta) -> Any:
        self._pg = process_group(backend, timeout, hold_s=self._hold_s)
        return self._pg

    def _abort_failed_collective(self) -> None:
        """This group's cross-group collective failed (a peer died): abort the process group now. Releasing it
        closes its connections, so a peer still blocked on this group in the same collective (gloo: a receive
        from this rank, in a ring whose dead member this rank saw first) fails at once too, instead of after
        ``collective_timeout_s`` while the quorum waits for it. The next quorum reconfigures it anyway. Once
        per process group (a bucket's failure may have aborted it already)."""
        if self._pg is not None and self.manager.errored() is not None:
            self._abort_once()

    def _abort_once(self, inner: Any = None) -> bool:
        """Abort the process group the reconfigurable one runs on (``inner``: that one only, if it still is),
        atomically with a reconfiguration: torchft lets it go when aborting it, so a second call finds none."""
        return bool(self._pg.abort_if(inner))

    def _peer_dropped(self, quorum_id: int, dropped: list[str]) -> None:
        """The watch's news (its own thread): members of quorum ``quorum_id`` are gone. If this worker still
        trains in that quorum, its process group is aborted now: a collective in flight on it (or the next one
        issued) fails at once and the step is discarded and redone in the next quorum, instead of waiting
        ``collective_timeout_s`` for a peer that may be frozen with its connections open. A step whose
        collectives all finished keeps its result (the dropped group's gradients were in it). Nothing for a
        quorum this worker already left behind (its process group was reconfigured since)."""
        with self._wanted:
            self._requorum = True
        in_use = self._in_use
        if in_use is None or in_use[0] != quorum_id or in_use[1] is None:
            return
        before, self._lost = self._lost, f"quorum {quorum_id} lost {', '.join(dropped)} (aborted at once)"
        if not self._abort_once(in_use[1]):  # said before the abort: the step may fail the moment it is done
            self._lost = before

    def _pg_inner(self) -> Any:
        """The process group the reconfigurable one runs on now (a new one after every reconfiguration)."""
        return getattr(self._pg, "_pg", None)

    def _failed(self, error: Exception) -> None:
        """A bucket's all-reduce failed (told from the thread that finished it): the step is discarded, and the
        process group is aborted now, from a thread of its own (never from the collective's own thread)."""
        self.manager.report_error(error)
        aborting = threading.Thread(target=self._abort_once, args=(self._pg_inner(),), daemon=True,
                                    name="orch-ft-abort")
        aborting.start()
        self._aborting.append(aborting)

    def _refused(self, peer: str, reason: str) -> None:
        """A caller of this worker's state server without the run's secret: one event a second at most."""
        now = time.monotonic()
        if now - self._last_refusal >= 1.0:
            self._last_refusal = now
            self._send_group(StoreClientRefused(node=self.ctx.node, peer=peer, port="peer state server", reason=reason))

    def _send_group(self, event: Event) -> None:
        """The group's own events come from its rank 0."""
        if self.ctx.rank == 0:
            send(self.emit, event)

    @property
    def manager(self) -> Any:
        """The torchft Manager, made at the first quorum: its group heartbeats to the quorum from then on,
        and a group that heartbeats without asking for a quorum holds up its peers' quorum (a majority of the
        heartbeating groups must join), so it starts only when this group is ready to train."""
        if self._manager is None:
            self._manager = self._make_manager()
            self._watch = QuorumWatch(self._manager._client.replica_id, self.ctx.rank, self._peer_dropped,
                                      on_wanted=self._quorum_wanted if self._steady_ok else None)
        return self._manager

    # -- the state a peer sends and a healing group loads ---------------------------------------------------
    def _records(self) -> dict[str, Stateful]:
        """What a peer sends beside the training state, through the same serializer."""
        records: dict[str, Stateful] = {RNG_RECORD: RngState(self.device),
                                        SOURCE_RECORD: Record(self._source, self._loaded_source),
                                        FT_RECORD: Record(self._ft_window, self._load_ft_window)}
        if self.metrics_window is not None:  # the window since the run's last record, as the peer has it
            records[METRICS_RECORD] = self.metrics_window
        return records

    def _state_dict(self) -> dict[str, Any]:
        """This rank's state for the same rank of a healing group: its own shards under FSDP2 (plain local
        tensors and their layout, :mod:`~orchestrator.ft.shards`), the whole state under DDP."""
        sd, layout = to_local(self.state.state_dict(self.ctx.world_size, self._records()))
        return {**sd, LAYOUT_KEY: layout}

    def _load(self, sd: dict[str, Any]) -> None:
        layout = sd.pop(LAYOUT_KEY, None)
        self.state.load_state_dict(from_local(sd, layout, mesh_of(self._modules())), self._records())
        self._loaded_at = time.perf_counter()
        model = self.state.first_model()
        self.healed_from = {**self._healed_source, "step": self.state.progress.step,
                            "loaded_sha256": local_sha256(model) if model is not None else None}

    def _modules(self) -> list[torch.nn.Module]:
        return [m for m in self.state.components.values() if isinstance(m, torch.nn.Module)]

    def _source(self) -> dict[str, Any]:
        """Where the state comes from; its hash is over this rank's shards (compared with the same rank's)."""
        model = self.state.first_model()
        return {"replica_id": self.replica_id, "node": self.ctx.node,
                "params_sha256": local_sha256(model) if model is not None else None}

    def _loaded_source(self, source: dict[str, Any]) -> None:
        self._healed_source = source

    def _ft_window(self) -> dict[str, float]:
        """The window's seconds include this quorum so far (the peer goes on counting from where it loads it)."""
        ft = dict(self.window)
        if self._quorum_started is not None:
            ft["healing_s"] += time.perf_counter() - self._quorum_started
        return ft

    def _load_ft_window(self, ft: dict[str, Any]) -> None:
        self.window = {k: float(ft.get(k, 0.0)) for k in WINDOW_KEYS}  # the peer's, as it sent it

    # -- the step protocol ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum (healing first if this group is behind); idempotent until the step ends. The
        quorum was asked for at the last commit (then this waits for what is left of it), else it is now."""
        if self._began:
            return
        if self._steady_step():
            return
        started = time.perf_counter()
        self.healed_from, self._quorum_started, self._loaded_at = None, started, None
        if not self._ahead:
            self._staged = self.transport.staged
            self.manager.start_quorum()  # asynchronous: waited for just below
        self._ahead = False
        self._release()  # a healing peer copies this state now; the process group may be reconfigured
        try:
            self.manager.wait_quorum()
            self._apply_heal()
            # A source of a healing group starts its step once the peer has the state (the peer's step waits
            # for that anyway), so that its first all-reduce does not time out while the state is still sent.
            self.transport.wait_served(self._collective_s, self.transport.timeout.total_seconds())
        finally:
            self._quorum_started = None
        ended = time.perf_counter()
        self._quorum_s = ended - started
        # A quorum in which a group healed (this one, or one this one served) is healing time; else waiting.
        # A group that took over its peer's window counts only the time since (the peer's window had the rest).
        healing = self.healed_from is not None or self.transport.staged != self._staged
        counted = ended - (self._loaded_at if self._loaded_at is not None else started)
        self.window["healing_s" if healing else "quorum_wait_s"] += counted
        with self._wanted:
            self._requorum = not self._steady_ok  # news from here on is of this quorum
        self.participants = self.manager.num_participants()
        self.participating_rank = self.manager.participating_rank()
        self.ctx.leader = self.participating_rank == 0
        self.ctx.replicas = max(1, self.participants)
        self._follow_quorum()
        if not self.buckets.bound:
            self.buckets.bind(self._trainable(), self._issue)
        self._start_training()
        if self.healed_from is not None and self.healed_from["step"] > 0:  # step 0: torchft's initial weight sync
            self._send_group(ReplicaHealed(node=self.ctx.node, replica_id=self.replica_id,
                                           source_replica=self.healed_from["replica_id"],
                                           source_node=self.healed_from["node"], step=self.healed_from["step"],
                                           heal_s=round(self._quorum_s, 4), checkpoint_read=False,
                                           params_sha256=self.healed_from["loaded_sha256"],
                                           source_params_sha256=self.healed_from["params_sha256"]))

    def _steady_step(self) -> bool:
        """Begin this step in the quorum of the last one, without asking (a steady quorum): if this group is of
        one rank (it decides alone), its last step committed, no quorum was asked for ahead, and the watch
        brought no news since the quorum formed. A step that was wanted elsewhere meanwhile is aborted by
        :meth:`_quorum_wanted` (its collectives would wait for a member that asks for the next quorum)."""
        with self._wanted:
            if self._requorum or self._ahead or not self.committed:
                return False
            self._steady_at = self.manager._step  # the step a member asking for the next quorum would name
        self._start_training()
        return True

    def _start_training(self) -> None:
        self._step_t0 = time.perf_counter()
        self._snapshot = self._take_snapshot()  # after healing: a discarded step goes back to the healed state
        self._began, self._synced, self.committed, self._error = True, False, None, ""
        self.buckets.start_step()

    def _quorum_wanted(self, quorum_id: int, level: int, at_step: Optional[int]) -> None:
        """The watch's news (its own thread): quorum ``quorum_id`` is wanted anew, by a group outside it (level 1)
        or by another member, for step ``at_step`` (level 2). The next step asks for a quorum; a step this worker
        trains without asking in that quorum, at or after ``at_step``, is aborted now: that member is not in it."""
        with self._wanted:
            self._requorum = True
            steady_at = self._steady_at
        in_use = self._in_use
        if level >= 2 and at_step is not None and steady_at is not None and steady_at >= at_step \
                and in_use is not None and in_use[0] == quorum_id and in_use[1] is not None:
            self._lost = f"quorum {quorum_id} wanted anew for step {at_step} (aborted at once)"
            self._abort_once(in_use[1])

    def _follow_quorum(self) -> None:
        """Watch the quorum this step trains in (with the process group it runs on), if other groups are in it."""
        quorum_id = self.manager._client.quorum_id
        if self._in_use is None or self._in_use[0] != quorum_id:
            self._lost = ""
        self._in_use = (quorum_id, self._pg_inner()) if quorum_id is not None else None
        if self._watch is not None:  # a steady quorum of one group is watched too: for a group that asks to join
            self._watch.follow(quorum_id if self.participants > 1 or self._steady_ok else None)

    def _apply_heal(self) -> None:
        """A group that must heal loads the state its quorum fetched now, before its forward pass: torchft's
        Manager does this in ``start_quorum`` when the quorum is synchronous, and at ``should_commit`` when it is
        asynchronous (the group then sits the step out); orch forms the quorum asynchronously but heals here,
        so the group trains the step (tests/test_ft_quorum.py checks these names against the installed
        torchft)."""
        manager = self.manager
        if manager._healing:
            manager._apply_pending_state_dict()
            manager._healing = False

    def _start_ahead(self) -> None:
        """Ask for the next step's quorum now, right after this step's commit, so it forms while the optimizer
        steps and the step boundary runs, unless no next step comes or this worker holds a preemption notice
        (a group about to leave must not join the survivors' next quorum). Until the next step begins, the
        state a healing peer would copy is held (torchft's state-dict lock: the peer gets the state as it is at
        the top of the next step, as without the async quorum) and so is the process group (a record's means of
        this step still use it)."""
        step = self.state.progress.step + (1 if self.committed else 0)
        if step >= self.max_steps or self._notice_pending():
            return
        with self._wanted:
            if self.committed and not self._requorum:
                return  # the quorum holds (_steady_step); the watch's news makes the next step ask
        self.manager.disallow_state_dict_read()
        self._pg.free.clear()
        self._held = True
        self._staged = self.transport.staged
        self.manager.start_quorum()
        self._ahead = True

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._pg.free.set()
            self.manager.allow_state_dict_read()

    def attach(self, state: TrainingState, emit: Emit, window: Stateful) -> StepProtocol:
        return self  # attached when made: a later register() adds to the same state

    def heal(self) -> bool:
        """Join the first quorum; a group that is behind a live peer loads its state there."""
        self.begin_step()
        return self.healed_from is not None and self.healed_from["step"] > 0

    def restored(self, step: int) -> None:
        """After a restore from storage (no live peer had the state): the Manager counts from that step, and
        the first training step forms a fresh quorum."""
        if step > 0:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
            self._began = False
            with self._wanted:
                self._requorum = True

    def membership(self) -> Optional[Membership]:
        return self._membership

    def _membership(self) -> tuple[int, int, int]:
        """(world size, rank, data position) of the coming step, from its quorum. A group that sits this step
        out (no participating rank) draws rank 0's samples; its gradients are zeroed by the all-reduce and its
        step counts for nothing."""
        self.begin_step()
        size = self.ctx.world_size  # ranks per replica group
        return (self.participants * size, (self.participating_rank or 0) * size + self.ctx.rank,
                self.state.progress.samples_consumed)

    def sync_gradients(self) -> None:
        """Average the gradients across the quorum's groups, once per step (a no-op after the first call): wait
        for the buckets the backward pass started and all-reduce what is left (:mod:`~orchestrator.ft.buckets`).
        Each rank all-reduces its own part with the same rank of every other group: the whole gradient under
        DDP, its gradient shards under FSDP2 (every group shards alike, so shard i meets shard i)."""
        if self._synced:
            return
        self._synced = True
        self.begin_step()
        self.buckets.finish()
        for aborting in self._aborting:  # a failed bucket's abort is done before the step goes on
            aborting.join()
        self._aborting.clear()
        self._abort_failed_collective()

    def gradient_handoff(self) -> GradientBuckets:
        return self.buckets

    def _trainable(self) -> list[torch.Tensor]:
        """The registered modules' trainable parameters, in module order: the same list in every group."""
        return [p for m in self._modules() for p in m.parameters() if p.requires_grad]

    def _issue(self, buffer: torch.Tensor) -> Optional[torch.futures.Future]:
        """Start summing ``buffer`` over the quorum's groups (what torchft's ``Manager.allreduce`` does: nothing
        after a failure, zeros from a group that sits the step out, the sum divided by the participants), on
        the process group itself, so that a failure is acted on the moment it is known. The future completes
        with the average, or with None if the all-reduce failed (the step is then discarded)."""
        if self.manager.errored() is not None:
            return None
        if self.participating_rank is None:
            buffer.zero_()
        participants = self.participants
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            future = self._pg.allreduce([buffer], opts).get_future()
        except Exception as error:  # e.g. a process group aborted by an earlier bucket's failure
            self._failed(error)
            return None

        def averaged(fut: torch.futures.Future) -> Optional[torch.Tensor]:
            try:
                fut.value()
            except Exception as error:
                self._failed(error)
                return None
            return buffer.div_(participants)

        return future.then(averaged)

    def mean_across_groups(self, means: torch.Tensor) -> torch.Tensor:
        """A logged record's values averaged over the committed step's groups (all of them log the same step,
        having committed it together): one small all-reduce on that step's process group (the next step's
        quorum may be forming already; it reconfigures the process group only after this), on logging steps
        only. If a group failed since the commit, this group's own means (the process group is aborted; the
        next quorum replaces it)."""
        if self.participants <= 1:
            return means
        from torch.distributed import AllreduceOptions, ReduceOp

        mean = means.clone() if self.participating_rank is not None else torch.zeros_like(means)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            self._pg.allreduce([mean], opts).wait()
        except Exception:
            self._abort_once()
            return means
        return mean / self.participants

    def commit(self) -> bool:
        """Whether every participant finished this step (decided once; the optimizer steps only then). Once
        decided, the next step's quorum is asked for (:meth:`_start_ahead`)."""
        if self.committed is None:
            self.sync_gradients()
            self.committed = bool(self.manager.should_commit())
            error = str(self.manager.errored() or "")  # before the next quorum starts afresh
            self._error = (f"{self._lost}: {error}" if self._lost and error else error)[:300]
            self._start_ahead()
        return self.committed

    def end_step(self) -> bool:
        """At the step boundary: commit if the loop did not step an optimizer; on a discarded step put the
        registered state back as it was when the step began (``step_discarded``); a committed step with
        another set of groups than the last one records ``quorum_changed``. Returns whether it committed."""
        committed = self.commit()
        step = self.state.progress.step + 1
        with self._wanted:
            self._steady_at = None
            self._requorum = self._requorum or not committed
        if not committed:
            self.window["discarded_s"] += time.perf_counter() - self._step_t0
            self._restore_snapshot()
            self._send_group(StepDiscarded(node=self.ctx.node, step=step, replicas=self.participants,
                                           error=self._error))
        elif self.last_committed_participants != self.participants:
            if self.ctx.is_main:
                send(self.emit, QuorumChanged(step=step, replicas=self.participants,
                                              previous=self.last_committed_participants,
                                              world_size=self.participants * self.ctx.world_size))
            self.last_committed_participants = self.participants
        self._began = False
        return committed

    def peers_hold_state(self) -> bool:
        """Other replica groups are in this step's quorum, so a noticed group leaves without saving."""
        return self.participants > 1

    def left(self, step: int, notice_t: float) -> None:
        """Announce the departure first: the survivors' next quorum forms without this group at once instead
        of waiting for its heartbeats to age out (``heartbeat_timeout_ms``) or for its agent's exit (the
        worker leaves with ``os._exit``, so no :meth:`shutdown` would tell the quorum service)."""
        self.shutdown()  # rank 0's server calls the quorum service's leave through the run's gate
        self._send_group(ReplicaLeft(node=self.ctx.node, step=step, since_notice_s=time.time() - notice_t))

    # -- a discarded step leaves nothing behind ----------------------------------------------------------------
    def _take_snapshot(self) -> dict[str, Any]:
        """What a step changes besides parameters and optimizer state (which only a committed step changes):
        schedulers, scalers and other small states, module buffers (batch-norm statistics), RNG states, and
        the optimizers' hyperparameters per parameter group (a scheduler stepped on a discarded step has set the
        next step's learning rate there; restoring only the scheduler's own state would leave it)."""
        snap: dict[str, Any] = {"rng": rng_state(self.device), "buffers": {}, "states": {}, "groups": {}}
        for name, obj in self.state.components.items():
            if isinstance(obj, torch.nn.Module):
                snap["buffers"][name] = [b.detach().clone() for b in obj.buffers()]
            elif isinstance(obj, torch.optim.Optimizer):
                snap["groups"][name] = [_copy({k: v for k, v in g.items() if k != "params"}) for g in obj.param_groups]
            else:
                snap["states"][name] = _copy(obj.state_dict())
        return snap

    def _restore_snapshot(self) -> None:
        snap = self._snapshot
        for name, obj in self.state.components.items():
            if name in snap["buffers"]:
                with torch.no_grad():
                    for b, saved in zip(obj.buffers(), snap["buffers"][name]):
                        b.copy_(saved)
            elif name in snap["states"]:
                obj.load_state_dict(_copy(snap["states"][name]))
            elif isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
                for group, saved in zip(obj.param_groups, snap["groups"].get(name, [])):
                    for key, value in saved.items():
                        if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                            group[key].copy_(value)  # a tensor learning rate (capturable, compiled) stays the same object
                        else:
                            group[key] = _copy(value)
        set_rng_state(snap["rng"], self.device)

    def window_rolled(self) -> dict[str, float]:
        """Seconds of this metrics window spent in quorums, healing and discarded steps (then reset): every
        group starts the next window at zero, the leader included."""
        window, self.window = self.window, dict.fromkeys(WINDOW_KEYS, 0.0)
        return {k: round(v, 4) for k, v in window.items()}

    def notices(self, pending: Callable[[], bool]) -> None:
        self._notice_pending = pending

    def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._manager is not None:
            self._release()  # a quorum asked for ahead must not wait on this worker's state or process group
            self._manager.shutdown(wait=False)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def wrap_for_commit(state: TrainingState, group: ReplicaGroup) -> None:
    """Make the registered optimizers and grad scalers follow the step protocol without a change in the
    training code: ``optimizer.step()`` averages the gradients across the quorum and steps only on commit;
    ``scaler.unscale_()`` (explicit, or inside ``scaler.step``) averages them first, so every group sees the
    same inf/NaN check and clips the same gradients, as under DDP."""
    for obj in state.components.values():
        if isinstance(obj, torch.optim.Optimizer):
            original_step = obj.step

            @functools.wraps(original_step)  # keeps torch's marks on it (an LR scheduler's "step was overridden")
            def step(_optimizer: Any, *args: Any, _original: Callable = original_step, **kwargs: Any) -> Any:
                if group.commit():
                    return _original(*args, **kwargs)
                return None

            # A bound method, as torch's LR schedulers expect to find (they wrap step's __func__), set on the
            # instance: the schedulers and GradScaler call it.
            obj.step = types.MethodType(step, obj)
        elif isinstance(obj, torch.amp.GradScaler):
            original_unscale = obj.unscale_

            def unscale_(optimizer: Any, _original: Callable = original_unscale) -> Any:
                group.sync_gradients()
                return _original(optimizer)

            obj.unscale_ = unscale_
