"""A worker's replica group under ``fault_tolerance.mode=per_step``: its torchft Manager and the step protocol
the session runs with it.

At the top of every step the group joins the quorum (orch's quorum service in the driver, through the run's
gate: :mod:`~orchestrator.ft.coordination`) (synchronously: a group that must heal loads
a live peer's state before its forward pass, so its first committed step starts from the survivors' weights).
After the backward pass the gradients are averaged across the quorum's groups (one flat all-reduce: the DDP
of the user's code, if any, already averaged them inside the group), before any grad-scaler unscale or
clipping, as DDP would have. The optimizer steps only if every participant finished the step
(``should_commit``); otherwise the step is discarded: the registered schedulers, grad scalers, module buffers
and RNG states go back to where the step began, and the session redoes the step, with the same samples, in
the next quorum.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from orchestrator.config.schema import OrchConfig
from orchestrator.elastic.state import TrainingState, params_sha256, rng_state, set_rng_state
from orchestrator.ft import REPLICA_ENV
from orchestrator.ft.coordination import install, process_group
from orchestrator.ft.transport import PeerStateTransport
from orchestrator.rundir import EventName
from orchestrator.runtime.distributed import DistContext

Emit = Callable[..., Any]
# Where a replica group's loop spends time besides committed steps (metrics records' ``ft``; goodput's badput).
WINDOW_KEYS = ("quorum_wait_s", "healing_s", "discarded_s")


class ReplicaGroup:
    """This worker's membership in the job's quorum (one per worker; every rank of a group has one)."""

    def __init__(self, cfg: OrchConfig, ctx: DistContext, device: torch.device, state: TrainingState,
                 emit_group: Emit, records: Optional[tuple[Callable[[], dict], Callable[[dict], None]]] = None):
        from torchft import Manager

        ft = cfg.fault_tolerance
        self.ctx, self.device, self.state = ctx, device, state
        self.emit_group = emit_group  # this group's rank 0 writes the group's own events
        self.records = records  # (get, load) of the open metrics window, handed to a healing group
        self.took_window = False  # this group's metrics window came from a peer: keep it (no fresh start)
        self.replica_id = os.environ.get(REPLICA_ENV, f"node{ctx.node}")
        self.healed_from: Optional[dict[str, Any]] = None
        self._heal_started = 0.0
        self.transport = PeerStateTransport(timeout=timedelta(seconds=max(30.0, ft.collective_timeout_s)),
                                            on_refused=self._refused)
        self._last_refusal = -1e9
        install()  # torchft's Manager on orch's quorum service, not on torchft's Rust servers
        self._make_manager = lambda: Manager(
            pg=process_group(cfg.backend.name, timedelta(seconds=ft.collective_timeout_s)),
            load_state_dict=self._load, state_dict=self._state_dict,
            min_replica_size=cfg.cluster.min_nodes, use_async_quorum=False,
            timeout=timedelta(seconds=max(30.0, ft.collective_timeout_s)),
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timedelta(seconds=30),
            replica_id=self.replica_id, lighthouse_addr="orch", checkpoint_transport=self.transport, init_sync=True)
        self._manager: Optional[Any] = None
        self.participants = 0
        self.participating_rank: Optional[int] = None
        self.last_committed_participants: Optional[int] = None
        self.committed: Optional[bool] = None
        self._began = self._synced = False
        self._snapshot: dict[str, Any] = {}
        self._params: Optional[list[torch.nn.Parameter]] = None  # the registered modules' trainable ones
        self._quorum_s = self._step_t0 = 0.0
        self._quorum_started: Optional[float] = None  # while this group is in a quorum
        self._loaded_at: Optional[float] = None  # when this group took over a peer's state in this quorum
        self.window = dict.fromkeys(WINDOW_KEYS, 0.0)

    def _refused(self, peer: str, reason: str) -> None:
        """A caller of this worker's state server without the run's secret: one event a second at most."""
        now = time.monotonic()
        if now - self._last_refusal >= 1.0:
            self._last_refusal = now
            self.emit_group(EventName.STORE_CLIENT_REFUSED, node=self.ctx.node, peer=peer, reason=reason,
                            port="peer state server")

    @property
    def manager(self) -> Any:
        """The torchft Manager, made at the first quorum: its group heartbeats to the quorum from then on,
        and a group that heartbeats without asking for a quorum holds up its peers' quorum (a majority of the
        heartbeating groups must join), so it starts only when this group is ready to train."""
        if self._manager is None:
            self._manager = self._make_manager()
        return self._manager

    # -- the state a peer sends and a healing group loads ---------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        model = self.state.first_model()
        source = {"replica_id": self.replica_id, "node": self.ctx.node,
                  "params_sha256": params_sha256(model) if model is not None else None}
        # The window's seconds include this quorum so far (the peer goes on counting from where it loads it).
        ft = dict(self.window)
        if self._quorum_started is not None:
            ft["healing_s"] += time.perf_counter() - self._quorum_started
        return {"components": {name: obj.state_dict() for name, obj in self.state.components.items()},
                "progress": asdict(self.state.progress), "rng": rng_state(self.device), "source": source,
                "records": {"metrics": self.records[0]() if self.records else None, "ft": ft}}

    def _load(self, sd: dict[str, Any]) -> None:
        for name, obj in self.state.components.items():
            obj.load_state_dict(sd["components"][name])
        p = self.state.progress
        p.step, p.samples_consumed, p.epoch = (sd["progress"][k] for k in ("step", "samples_consumed", "epoch"))
        set_rng_state(sd["rng"], self.device)
        if sd["records"]["metrics"] is not None and self.records:
            self.records[1](sd["records"]["metrics"])  # the window since the run's last record, as the peer has it
            self.took_window = True
        self.window = {k: float(sd["records"]["ft"].get(k, 0.0)) for k in WINDOW_KEYS}  # the peer's, as it sent it
        self._loaded_at = time.perf_counter()
        model = self.state.first_model()
        self.healed_from = {**sd["source"], "step": p.step,
                            "loaded_sha256": params_sha256(model) if model is not None else None}

    # -- the step protocol ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Join this step's quorum (healing first if this group is behind); idempotent until the step ends."""
        if self._began:
            return
        started, staged = time.perf_counter(), self.transport.staged
        self.healed_from, self._quorum_started, self._loaded_at = None, started, None
        try:
            self.manager.start_quorum()  # synchronous (use_async_quorum=False): heals before returning
        finally:
            self._quorum_started = None
        ended = time.perf_counter()
        self._quorum_s = ended - started
        # A quorum in which a group healed (this one, or one this one served) is healing time; else waiting.
        # A group that took over its peer's window counts only the time since (the peer's window had the rest).
        healing = self.healed_from is not None or self.transport.staged != staged
        counted = ended - (self._loaded_at if self._loaded_at is not None else started)
        self.window["healing_s" if healing else "quorum_wait_s"] += counted
        self._step_t0 = time.perf_counter()
        self._snapshot = self._take_snapshot()  # after healing: a discarded step goes back to the healed state
        self.participants = self.manager.num_participants()
        self.participating_rank = self.manager.participating_rank()
        self.ctx.leader = self.participating_rank == 0
        self.ctx.replicas = max(1, self.participants)
        self._began, self._synced, self.committed = True, False, None
        if self.healed_from is not None and self.healed_from["step"] > 0:  # step 0: torchft's initial weight sync
            self.emit_group(EventName.REPLICA_HEALED, node=self.ctx.node, replica_id=self.replica_id,
                            source_replica=self.healed_from["replica_id"], source_node=self.healed_from["node"],
                            step=self.healed_from["step"], heal_s=round(self._quorum_s, 4), checkpoint_read=False,
                            params_sha256=self.healed_from["loaded_sha256"],
                            source_params_sha256=self.healed_from["params_sha256"])

    def resume_at(self, step: int) -> None:
        """After a restore from storage (no live peer had the state): the Manager counts from that step, and
        the first training step forms a fresh quorum."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._began = False

    def membership(self) -> tuple[int, Optional[int]]:
        """(replica groups in this step's quorum, this group's rank among them or None when it sits out)."""
        self.begin_step()
        return self.participants, self.participating_rank

    def sync_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Average the gradients across the quorum's groups, once per step (a no-op after the first call)."""
        if self._synced:
            return
        self._synced = True
        self.begin_step()
        if self._params is None:
            self._params = [p for m in modules for p in m.parameters() if p.requires_grad]
        params = self._params
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            synced = flat[offset:offset + n].view_as(g)
            if p.grad is None:
                p.grad = synced.clone()
            else:
                p.grad.copy_(synced)
            offset += n

    def commit(self, modules: list[torch.nn.Module]) -> bool:
        """Whether every participant finished this step (decided once; the optimizer steps only then)."""
        if self.committed is None:
            self.sync_gradients(modules)
            self.committed = bool(self.manager.should_commit())
        return self.committed

    def end_step(self, modules: list[torch.nn.Module]) -> bool:
        """At the step boundary: commit if the loop did not step an optimizer; on a discarded step put the
        registered state back as it was when the step began. Returns whether the step committed."""
        committed = self.commit(modules)
        if not committed:
            self.window["discarded_s"] += time.perf_counter() - self._step_t0
            self._restore_snapshot()
        self._began = False
        return committed

    # -- a discarded step leaves nothing behind ----------------------------------------------------------------
    def _take_snapshot(self) -> dict[str, Any]:
        """What a step changes besides parameters and optimizer state (which only a committed step changes):
        schedulers, scalers and other small states, module buffers (batch-norm statistics), RNG states."""
        snap: dict[str, Any] = {"rng": rng_state(self.device), "buffers": {}, "states": {}}
        for name, obj in self.state.components.items():
            if isinstance(obj, torch.nn.Module):
                snap["buffers"][name] = [b.detach().clone() for b in obj.buffers()]
            elif not isinstance(obj, torch.optim.Optimizer):
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
        set_rng_state(snap["rng"], self.device)

    def take_window(self) -> dict[str, float]:
        """Seconds of this metrics window spent in quorums, healing and discarded steps (then reset)."""
        window, self.window = self.window, dict.fromkeys(WINDOW_KEYS, 0.0)
        return {k: round(v, 4) for k, v in window.items()}

    def shutdown(self) -> None:
        if self._manager is not None:
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
    modules = [m for m in state.components.values() if isinstance(m, torch.nn.Module)]
    for obj in state.components.values():
        if isinstance(obj, torch.optim.Optimizer):
            original_step = obj.step

            def step(*args: Any, _original: Callable = original_step, **kwargs: Any) -> Any:
                if group.commit(modules):
                    return _original(*args, **kwargs)
                return None

            obj.step = step  # an instance attribute: torch's LR schedulers and GradScaler call it
        elif isinstance(obj, torch.amp.GradScaler):
            original_unscale = obj.unscale_

            def unscale_(optimizer: Any, _original: Callable = original_unscale) -> Any:
                group.sync_gradients(modules)
                return _original(optimizer)

            obj.unscale_ = unscale_
