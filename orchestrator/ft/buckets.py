"""per_step's cross-group gradient averaging, bucketed so that it overlaps the backward pass.

Each rank averages its gradients (its shards under FSDP2) with the same rank of every other replica group of
the quorum. Instead of one flat all-reduce after the backward pass, the gradients go into fixed buckets of
about DDP's size (``ddp.bucket_cap_mb``) and each bucket's all-reduce starts as soon as its last gradient is
final within the group: the parallelism strategy hands each one over (:meth:`GradientBuckets.ready`, from
DDP's comm hook after the group's own all-reduce of a DDP bucket, or from FSDP2's post-accumulate-grad hook
after its reduce-scatter), so the all-reduces run on the process group's threads while autograd computes the
rest. :meth:`GradientBuckets.finish` (before the optimizer step or a grad scaler's unscale) hands over what is
left, waits for every bucket and writes the averages into ``.grad``.

Why the numbers equal the flat all-reduce's: a bucket is a fixed slice of the same parameters in every group
(the layout comes from the parameter order alone, never from the order gradients happened to arrive in, which
DDP's rebuilt buckets or a healing group's first step could change), each element is summed over the same
groups and divided by the same participant count, and an unused parameter (no gradient) contributes zeros and
takes the others' average, as before. Buckets are issued strictly in index order, so every group issues the
same collectives in the same order whichever thread finds a bucket full. A backward pass that synchronizes
twice in one step (no ``no_sync``) starts a second round that all-reduces every bucket again; the last round's
averages are the ones kept.

A collective that fails makes the step discarded (the Manager's ``report_error``: ``should_commit`` says no)
and the process group is aborted at once, from the moment the failure is known, not when the step waits for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from orchestrator.ft.shards import local

MB = 1024 * 1024


@dataclass
class Bucket:
    """A fixed run of parameters (all of one dtype and device) and the flat buffer their gradients meet in."""

    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: Optional[torch.Tensor] = None


@dataclass
class BucketLayout:
    """Which bucket and offset each parameter's gradient (its local shard) takes. Built from the parameter list
    alone: every group builds the same layout from the same model."""

    buckets: list[Bucket] = field(default_factory=list)
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(param) -> (bucket index, slot index)

    @classmethod
    def of(cls, params: list[torch.Tensor], cap_bytes: int) -> "BucketLayout":
        """Buckets of at most ``cap_bytes`` (a parameter larger than that gets one of its own), over ``params``
        in reverse order, as DDP's first buckets: a model's last parameters get their gradients first."""
        layout = cls()
        current: Optional[Bucket] = None
        for p in reversed(params):
            t = local(p)
            nbytes = t.numel() * t.element_size()
            if (current is None or current.dtype != t.dtype or current.device != t.device
                    or (current.numel and (current.numel * t.element_size() + nbytes) > cap_bytes)):
                current = Bucket([], [], 0, t.dtype, t.device)
                layout.buckets.append(current)
            layout.slots[id(p)] = (len(layout.buckets) - 1, len(current.params))
            current.params.append(p)
            current.offsets.append(current.numel)
            current.numel += t.numel()
        return layout


Issue = Callable[[torch.Tensor], Optional[torch.futures.Future]]
"""Starts the cross-group all-reduce (a sum) of a bucket's buffer; returns a future that completes, never with an
error, once it is done (None: nothing to wait for, e.g. after an earlier failure)."""


class GradientBuckets:
    """One rank's buckets, reused every step. ``cap_mb``: the bucket size. Unbound (every method a no-op, and
    :meth:`finish` reporting nothing) until :meth:`bind` gives it the parameters and the collective.

    The strategy calls :meth:`ready` (any thread); the step protocol calls :meth:`start_step`, then
    :meth:`finish` once the backward passes are done."""

    def __init__(self, cap_mb: float = 25.0):
        self.cap_bytes = max(1, int(cap_mb * MB))
        self.layout: Optional[BucketLayout] = None
        self._issue: Optional[Issue] = None
        self._lock = threading.Lock()
        self._active = False
        self._filled: list[list[bool]] = []
        self._missing: list[int] = []
        self._next = 0  # the next bucket to issue (they go strictly in order)
        self._futures: list[torch.futures.Future] = []  # this round's, in issue order
        self.rounds = 0  # rounds this step (a round: every bucket all-reduced once)
        self.overlapped = 0  # buckets issued by ready() this step, before finish() (the overlapped ones)

    def bind(self, params: list[torch.Tensor], issue: Issue) -> None:
        """The parameters whose gradients are averaged (every group passes the same list, in the same order) and
        the collective that sums a buffer over the groups."""
        with self._lock:
            self.layout = BucketLayout.of(params, self.cap_bytes)
            self._issue = issue

    @property
    def bound(self) -> bool:
        return self.layout is not None

    # -- a step --------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """A new step: no gradient handed over yet. (A previous step's all-reduces were waited for by its
        :meth:`finish`; one abandoned without it is dropped: its process group is reconfigured or aborted.)"""
        with self._lock:
            self._active = self.layout is not None
            self.rounds = self.overlapped = 0
            self._new_round()

    def _new_round(self) -> None:
        layout = self.layout
        if layout is None:
            return
        self._filled = [[False] * len(b.params) for b in layout.buckets]
        self._missing = [len(b.params) for b in layout.buckets]
        self._next = 0
        self._futures = []

    def ready(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param``'s gradient for this step, final within the group (``grad``: its local shard, or a view of
        it). Copied into its bucket at once (the caller may reuse ``grad``); a full bucket whose predecessors
        are issued is issued now, from this thread. A parameter handed over twice in one step starts a new
        round (a second synchronizing backward pass)."""
        if not self._active:
            return
        slot = self.layout.slots.get(id(param)) if self.layout is not None else None
        if slot is None:
            return  # not a registered parameter: nothing of the step protocol's
        b, i = slot
        with self._lock:
            if not self._active:
                return
            if self._filled[b][i]:
                self._complete_round()
                self._wait_round()
                self._new_round()
            self._copy_in(b, i, grad)
            while self._next < len(self._missing) and self._missing[self._next] == 0:
                self._issue_next()
                self.overlapped += 1

    def finish(self) -> bool:
        """Hand over every gradient not handed over yet (``.grad`` as it is; zeros where there is none), issue
        the buckets left, wait for all of them and write the averages into every parameter's ``.grad`` (one is
        made where there was none). Returns False if a collective failed (the gradients are then left as
        they were: the step is discarded); True without a binding (nothing to average)."""
        with self._lock:
            if not self._active or self.layout is None:
                return True
            self._complete_round()
            self._active = False
            futures = self._futures
        for fut in futures:
            fut.wait()  # completes normally; a failure was reported to the issue's owner
        ok = all(f.value() is not None for f in futures) and len(futures) == len(self.layout.buckets)
        if ok:
            self._copy_out()
        return ok

    # -- inside the lock -----------------------------------------------------------------------------------
    def _buffer(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return bucket.buffer

    def _copy_in(self, b: int, i: int, grad: Optional[torch.Tensor]) -> None:
        bucket = self.layout.buckets[b]
        p, offset = bucket.params[i], bucket.offsets[i]
        n = local(p).numel()
        dst = self._buffer(b)[offset:offset + n]
        with torch.no_grad():
            if grad is None:
                dst.zero_()  # unused this step: it still takes the others' average
            else:
                dst.copy_(local(grad).reshape(-1))
        self._filled[b][i] = True
        self._missing[b] -= 1

    def _complete_round(self) -> None:
        """Fill every slot not handed over from ``.grad`` and issue every bucket left, in order."""
        for b, filled in enumerate(self._filled):
            for i, done in enumerate(filled):
                if not done:
                    self._copy_in(b, i, self.layout.buckets[b].params[i].grad)
        while self._next < len(self._missing):
            self._issue_next()
        self.rounds += 1

    def _issue_next(self) -> None:
        fut = self._issue(self._buffer(self._next)) if self._issue is not None else None
        self._futures.append(fut if fut is not None else _done(None))
        self._next += 1

    def _wait_round(self) -> None:
        for fut in self._futures:
            fut.wait()  # before the buffers are written again

    def _copy_out(self) -> None:
        with torch.no_grad():
            for bucket in self.layout.buckets:
                for p, offset in zip(bucket.params, bucket.offsets):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    g = local(p.grad)
                    g.copy_(bucket.buffer[offset:offset + g.numel()].view_as(g))


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
