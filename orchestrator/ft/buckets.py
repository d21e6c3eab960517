"""per_step's cross-group gradient averaging, started while the backward pass runs.

Each rank averages its gradients (its shards under FSDP2) with the same rank of every other replica group of
the quorum. Instead of one flat all-reduce after the backward pass, the parallelism strategy hands the
gradients over as soon as the group's own reduction made them final, and their all-reduces run on the process
group's threads while autograd computes the rest. Two ways in:

- :meth:`GradientBuckets.reduce`, from DDP's comm hook: a DDP bucket's flat buffer is all-reduced in place,
  with no copy (DDP then writes it into ``.grad`` as usual). Under per_step DDP never rebuilds its buckets
  (``find_unused_parameters``, see :mod:`orchestrator.parallel.ddp`), so bucket *i* holds the same parameters in
  every group, a healing group's first step included.
- :meth:`GradientBuckets.ready`, from FSDP2's post-accumulate-grad hook: each gradient shard is copied into
  fixed buckets of about DDP's size (``ddp.bucket_cap_mb``; the layout comes from the parameter order alone)
  and a bucket is all-reduced as soon as its last gradient arrived.

Either way buckets are issued strictly in order (DDP's, or the layout's), so every group issues the same
collectives in the same order whichever thread finds one ready. :meth:`GradientBuckets.finish` (before the
optimizer steps or a grad scaler unscales) all-reduces whatever nobody handed over (a module orch did not wrap:
all of it, after the backward pass, as per_step always did), waits for everything and leaves the averages in
``.grad``. An unused parameter (no gradient) contributes zeros and takes the others' average. The numbers are
the flat all-reduce's: each element summed over the same groups, divided by the same participant count
(tests/test_ft_buckets.py compares them bit for bit). A backward pass that synchronizes twice in one step (no
``no_sync``) all-reduces every bucket again; the last round's averages are the ones kept.

A collective that fails makes the step discarded (the issuer reports it: ``should_commit`` says no) and the
process group is aborted at once, from the moment the failure is known, not when the step waits for it.
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
"""Starts the cross-group average of a flat buffer, in place; returns a future that completes, never with an
error, with the buffer once it is done, or with None if it failed (None instead of a future: not started, e.g.
after an earlier failure)."""


@dataclass
class _InPlace:
    """A buffer handed to :meth:`GradientBuckets.reduce`: averaged in place once it arrived and its predecessors
    are issued; ``done`` completes with the buffer (what DDP waits for), ``result`` with None on failure."""

    buffer: torch.Tensor
    params: list[torch.Tensor]
    done: torch.futures.Future
    arrived: bool = False
    error: Optional[BaseException] = None  # the group's own all-reduce of it failed
    result: Optional[torch.futures.Future] = None


class GradientBuckets:
    """One rank's cross-group averaging, reused every step (the strategy's ``handoff``). ``cap_mb``: the size
    of the buckets gradients are copied into. Unbound (nothing is averaged, :meth:`finish` reports nothing
    wrong) until :meth:`bind` gives it the parameters and the collective.

    The strategy calls :meth:`reduce` or :meth:`ready` (from any thread); the step protocol calls
    :meth:`start_step`, then :meth:`finish` once the backward passes are done."""

    def __init__(self, cap_mb: float = 25.0):
        self.cap_bytes = max(1, int(cap_mb * MB))
        self.layout: Optional[BucketLayout] = None  # every parameter, for gradients handed over one by one
        self._issue: Optional[Issue] = None
        self._lock = threading.Lock()
        self._active = False
        self._rest: dict[tuple[int, ...], BucketLayout] = {}  # what in-place buckets left out, by their params
        self._filled: list[list[bool]] = []
        self._missing: list[int] = []
        self._next = 0  # the next copied bucket to issue (they go strictly in order)
        self._futures: list[torch.futures.Future] = []  # this round's copied buckets', in issue order
        self._inplace: list[_InPlace] = []  # this step's in-place buffers, in the order handed over
        self._next_inplace = 0
        self.rounds = 0  # rounds of copied buckets this step (a round: every bucket all-reduced once)
        self.overlapped = 0  # buckets issued before finish() this step (during the backward pass)

    def bind(self, params: list[torch.Tensor], issue: Issue) -> None:
        """The parameters whose gradients are averaged (every group passes the same list, in the same order) and
        the collective that averages a buffer over the groups."""
        with self._lock:
            self.layout = BucketLayout.of(params, self.cap_bytes)
            self._rest.clear()
            self._issue = issue

    @property
    def bound(self) -> bool:
        return self.layout is not None

    # -- a step --------------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """A new step: nothing handed over yet. (A previous step's all-reduces were waited for by its
        :meth:`finish`; one abandoned without it is dropped: its process group is reconfigured or aborted.)"""
        with self._lock:
            self._active = self.layout is not None
            self.rounds = self.overlapped = 0
            self._inplace, self._next_inplace = [], 0
            self._new_round(self.layout)

    def reduce(self, buffer: torch.Tensor, params: list[torch.Tensor],
               after: Optional[torch.futures.Future] = None) -> torch.futures.Future:
        """Average ``buffer`` (the flat gradients of ``params``, in order: a DDP bucket) over the groups, in
        place, once ``after`` (the group's own all-reduce of it, if any) completed and every buffer handed over
        before it is issued. Returns a future that completes with ``buffer`` when it is averaged (never with
        the collective's error: a failure is reported and the step discarded)."""
        done: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if not self._active:  # outside a step: nothing to average (the group's own result as it is)
                return after.then(lambda f: f.value()) if after is not None else _done(buffer)
            index = len(self._inplace)
            self._inplace.append(_InPlace(buffer, list(params), done))
        if after is None or after.done():
            self._arrived(index, after)
        else:
            after.add_done_callback(lambda fut: self._arrived(index, fut))
        return done

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
                self._complete_round(self.layout)
                for fut in self._futures:
                    fut.wait()  # before the buffers are written again
                self._new_round(self.layout)
            self._copy_in(self.layout, b, i, grad)
            while self._next < len(self._missing) and self._missing[self._next] == 0:
                self._issue_next(self.layout)
                self.overlapped += 1

    def finish(self) -> bool:
        """Average what nobody handed over (``.grad`` as it is; zeros where there is none), wait for every
        all-reduce of the step and leave the averages in ``.grad`` (one is made where there was none). Returns
        False if a collective failed (the gradients are then not to be used: the step is discarded); True
        without a binding (nothing to average)."""
        with self._lock:
            if not self._active or self.layout is None:
                return True
            self._active = False
            inplace = self._inplace
            # In-place buckets cover their parameters; the copied ones take the rest (every parameter if none).
            layout = self._left_out(inplace) if inplace else self.layout
            if layout is not self.layout:
                self._new_round(layout)
            self._complete_round(layout)
            futures = self._futures
        for entry in inplace:
            entry.done.wait()
        for fut in futures:
            fut.wait()  # completes normally; a failure was reported by the issuer
        ok = all(e.result is not None and e.result.value() is not None for e in inplace) and \
            all(f.value() is not None for f in futures) and len(futures) == len(layout.buckets)
        if ok:
            self._copy_out(layout)
            self._unused_in_place(inplace)
        return ok

    # -- in place ------------------------------------------------------------------------------------------
    def _arrived(self, index: int, after: Optional[torch.futures.Future]) -> None:
        """Buffer ``index``'s own group all-reduce is done: issue it, and every later one that arrived, in order.
        If that all-reduce failed, the group itself is broken: DDP gets the error (its backward pass raises)."""
        error: Optional[BaseException] = None
        if after is not None:
            try:
                after.value()
            except Exception as e:  # noqa: BLE001 - handed to DDP as it is
                error = e
        with self._lock:
            self._inplace[index].arrived, self._inplace[index].error = True, error
            while self._next_inplace < len(self._inplace) and self._inplace[self._next_inplace].arrived:
                entry = self._inplace[self._next_inplace]
                self._next_inplace += 1
                if entry.error is not None:
                    entry.result = _done(None)
                    entry.done.set_exception(entry.error)
                    continue
                result = self._issue(entry.buffer) if self._issue is not None else None
                entry.result = result if result is not None else _done(None)
                entry.result.add_done_callback(lambda _, e=entry: e.done.set_result(e.buffer))
                if self._active:
                    self.overlapped += 1

    def _left_out(self, inplace: list[_InPlace]) -> BucketLayout:
        """The registered parameters no in-place buffer covered, as a layout of their own (the same in every
        group: the strategy covers the same parameters everywhere)."""
        covered = {id(p) for e in inplace for p in e.params}
        params = [p for b in self.layout.buckets[::-1] for p in b.params[::-1] if id(p) not in covered]
        key = tuple(id(p) for p in params)
        if key not in self._rest:
            self._rest[key] = BucketLayout.of(params, self.cap_bytes)
        return self._rest[key]

    @staticmethod
    def _unused_in_place(inplace: list[_InPlace]) -> None:
        """DDP leaves ``.grad`` unset for a parameter no rank of the group used, but the other groups may have:
        it takes the average its bucket got (the last round's, where one was handed over twice)."""
        last: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for entry in inplace:
            offset = 0
            for p in entry.params:
                last[id(p)] = (p, entry.buffer, offset)
                offset += p.numel()
        with torch.no_grad():
            for p, buffer, offset in last.values():
                if p.grad is None:
                    p.grad = buffer[offset:offset + p.numel()].view_as(p).clone()

    # -- copied, inside the lock ---------------------------------------------------------------------------
    def _new_round(self, layout: Optional[BucketLayout]) -> None:
        if layout is None:
            return
        self._filled = [[False] * len(b.params) for b in layout.buckets]
        self._missing = [len(b.params) for b in layout.buckets]
        self._next = 0
        self._futures = []

    @staticmethod
    def _buffer(layout: BucketLayout, b: int) -> torch.Tensor:
        bucket = layout.buckets[b]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        return bucket.buffer

    def _copy_in(self, layout: BucketLayout, b: int, i: int, grad: Optional[torch.Tensor]) -> None:
        bucket = layout.buckets[b]
        p, offset = bucket.params[i], bucket.offsets[i]
        n = local(p).numel()
        dst = self._buffer(layout, b)[offset:offset + n]
        with torch.no_grad():
            if grad is None:
                dst.zero_()  # unused this step: it still takes the others' average
            else:
                dst.copy_(local(grad).reshape(-1))
        self._filled[b][i] = True
        self._missing[b] -= 1

    def _complete_round(self, layout: BucketLayout) -> None:
        """Fill every slot not handed over from ``.grad`` and issue every bucket left, in order."""
        for b, filled in enumerate(self._filled):
            for i, done in enumerate(filled):
                if not done:
                    self._copy_in(layout, b, i, layout.buckets[b].params[i].grad)
        while self._next < len(self._missing):
            self._issue_next(layout)
        self.rounds += 1

    def _issue_next(self, layout: BucketLayout) -> None:
        fut = self._issue(self._buffer(layout, self._next)) if self._issue is not None else None
        self._futures.append(fut if fut is not None else _done(None))
        self._next += 1

    @staticmethod
    def _copy_out(layout: BucketLayout) -> None:
        with torch.no_grad():
            for bucket in layout.buckets:
                for p, offset in zip(bucket.params, bucket.offsets):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    g = local(p.grad)
                    g.copy_(bucket.buffer[offset:offset + g.numel()].view_as(g))


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
