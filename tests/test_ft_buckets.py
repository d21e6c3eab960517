"""per_step's bucketed cross-group gradient averaging (orchestrator/ft/buckets.py) and the strategies' handoff
to it (orchestrator/parallel: DDP's comm hook, FSDP2's post-accumulate-grad hooks): in one process, the layout,
the order buckets go out in and what a step hands over; on two gloo processes, that the averages are the flat
all-reduce's, bit for bit, while buckets go out during the backward pass."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orchestrator.ft.buckets import BucketLayout, GradientBuckets

MB = 1024 * 1024


def params_of(*shapes, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


class Recorder:
    """An issue function that records what went out and completes at once (the identity average)."""

    def __init__(self, fail_at: int = -1):
        self.sizes: list[int] = []
        self.fail_at = fail_at

    def __call__(self, buffer: torch.Tensor):
        self.sizes.append(buffer.numel())
        fut = torch.futures.Future()
        fut.set_result(None if len(self.sizes) - 1 == self.fail_at else buffer)
        return fut


def test_the_layout_is_fixed_by_parameter_order_and_size_alone():
    ps = params_of((10, 10), (50,), (30,), (200,), (5,), (5,), (3,), dtype=torch.float32)
    ps.insert(3, nn.Parameter(torch.zeros(7, dtype=torch.float64)))  # another dtype: a bucket of its own
    layout = BucketLayout.of(ps, cap_bytes=4 * 100)
    # Reverse order (a model's last parameters get gradients first); a new bucket when the next one would not fit,
    # a lone parameter larger than the cap in one of its own, dtypes never mixed.
    index = {id(p): i for i, p in enumerate(ps)}
    assert [[index[id(p)] for p in b.params] for b in layout.buckets] == [[7, 6, 5], [4], [3], [2, 1], [0]]
    assert [b.numel for b in layout.buckets] == [13, 200, 7, 80, 100]
    assert layout.buckets[1].offsets == [0] and layout.buckets[3].offsets == [0, 30]
    again = BucketLayout.of([nn.Parameter(p.detach().clone()) for p in ps], cap_bytes=4 * 100)
    assert [b.numel for b in again.buckets] == [b.numel for b in layout.buckets], "every group builds the same"


def test_buckets_go_out_in_order_as_they_fill_and_the_step_gets_every_gradient_back():
    torch.manual_seed(0)
    ps = params_of((40,), (30,), (20,), (10,), (25,))
    grads = [torch.randn_like(p) for p in ps]
    issue = Recorder()
    buckets = GradientBuckets(cap_mb=50 * 4 / MB)
    buckets.bind(ps, issue)
    assert [len(b.params) for b in buckets.layout.buckets] == [2, 2, 1]  # (25, 10), (20, 30), (40)
    buckets.ready(ps[0], grads[0])  # before the step: ignored
    buckets.start_step()
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    buckets.ready(ps[2], grads[2])  # bucket 1 half full
    buckets.ready(ps[1], grads[1])  # bucket 1 full, but bucket 0 is not out yet: it waits
    assert issue.sizes == []
    buckets.ready(ps[4], grads[4])
    buckets.ready(ps[3], grads[3])  # bucket 0 full: 0 and then 1 go out, in order
    assert issue.sizes == [35, 50]
    ps[0].grad = None  # unused this step: zeros go into the average, and a gradient comes back
    assert buckets.finish() and issue.sizes == [35, 50, 40]
    assert buckets.overlapped == 2 and buckets.rounds == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(ps[1:], grads[1:]))
    assert torch.equal(ps[0].grad, torch.zeros(40))


def test_a_second_synchronizing_backward_all_reduces_every_bucket_again_and_its_values_are_kept():
    ps = params_of((8,), (8,))
    issue = Recorder()
    buckets = GradientBuckets(cap_mb=8 * 4 / MB)
    buckets.bind(ps, issue)
    buckets.start_step()
    buckets.ready(ps[1], torch.ones(8))  # first backward hands over only one (bucket 0 goes out)
    ps[0].grad, ps[1].grad = torch.full((8,), 2.0), torch.full((8,), 3.0)
    buckets.ready(ps[1], ps[1].grad)  # handed over again: the first round is completed, a second begins
    assert issue.sizes == [8, 8, 8] and buckets.rounds == 1
    assert buckets.finish() and issue.sizes == [8, 8, 8, 8] and buckets.rounds == 2
    assert torch.equal(ps[0].grad, torch.full((8,), 2.0)) and torch.equal(ps[1].grad, torch.full((8,), 3.0))


def test_in_place_buffers_go_out_in_the_order_handed_over_whenever_their_group_all_reduce_ends():
    """DDP's buckets in a group of several ranks: each one's own all-reduce may end on any of the group's
    threads, in any order; the cross-group all-reduces still go out in bucket order."""
    ps = params_of((3,), (2,), (4,))
    issue = Recorder()
    buckets = GradientBuckets()
    buckets.bind(ps, issue)
    buckets.start_step()
    groups = [torch.futures.Future() for _ in ps]
    buffers = [torch.full((p.numel(),), float(i)) for i, p in enumerate(ps)]
    dones = [buckets.reduce(buffers[i], [ps[i]], after=groups[i]) for i in range(3)]
    groups[2].set_result([buffers[2]])
    groups[0].set_result([buffers[0]])
    assert issue.sizes == [3] and dones[0].done() and not dones[2].done()
    groups[1].set_result([buffers[1]])
    assert issue.sizes == [3, 2, 4] and all(d.done() for d in dones)
    assert buckets.finish() and buckets.overlapped == 3
    # No DDP wrote .grad here (as for a parameter no rank of the group used): each takes its bucket's average.
    assert all(torch.equal(p.grad, torch.full((p.numel(),), float(i))) for i, p in enumerate(ps))


def test_a_failed_bucket_leaves_the_gradients_as_they_were():
    ps = params_of((4,), (4,))
    buckets = GradientBuckets(cap_mb=4 * 4 / MB)
    buckets.bind(ps, Recorder(fail_at=0))
    buckets.start_step()
    for p in ps:
        p.grad = torch.ones(4)
    buckets.ready(ps[1], torch.full((4,), 9.0))
    assert buckets.finish() is False
    assert all(torch.equal(p.grad, torch.ones(4)) for p in ps), "the step is discarded: nothing written back"


def test_unbound_buckets_take_nothing_and_report_nothing_wrong():
    buckets = GradientBuckets()
    buckets.start_step()
    p = nn.Parameter(torch.ones(2))
    buckets.ready(p, torch.ones(2))
    assert buckets.finish() and not buckets.bound


@pytest.fixture
def solo_group():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()


def test_ddp_hands_each_bucket_over_in_place_once_per_synchronizing_backward_and_none_inside_no_sync(solo_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrator.parallel.ddp import DDPStrategy
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.runtime.models import BertMLM
    from orchestrator.runtime.timing import StepTimer

    handed: list[tuple[list[nn.Parameter], torch.Tensor]] = []

    class Handoff:
        def reduce(self, buffer, params, after=None):
            assert after is None, "a group of one rank: nothing to all-reduce in the group first"
            handed.append((params, buffer.clone()))
            buffer.mul_(2)  # "averaged" in place: DDP must write this into .grad
            fut = torch.futures.Future()
            fut.set_result(buffer)
            return fut

    torch.manual_seed(0)
    model = BertMLM(500, 32, 2, 4, 64, 8)
    reference = BertMLM(500, 32, 2, 4, 64, 8)
    reference.load_state_dict(model.state_dict())
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
    timer = StepTimer()
    ddp = DDPStrategy(None).wrap(model, ctx, torch.device("cpu"), timer=timer, handoff=Handoff())
    assert isinstance(ddp, DDP) and ddp.find_unused_parameters, "fixed buckets: the same in every group"
    x = torch.randint(0, 500, (4, 8))
    layouts = []
    for _ in range(3):  # DDP would rebuild its buckets after the first iteration: here it keeps them
        handed.clear()
        with ddp.no_sync():
            ddp(x, x).backward()
        assert handed == [], "no_sync: nothing is final yet"
        ddp(x, x).backward()
        reference(x, x).backward()
        reference(x, x).backward()
        layouts.append([[id(p) for p in params] for params, _ in handed])
        assert sorted(id(p) for params, _ in handed for p in params) == sorted(id(p) for p in model.parameters())
        expected = {id(p): rp.grad for p, rp in zip(model.parameters(), reference.parameters())}
        for params, buffer in handed:
            offset = 0
            for p in params:
                assert torch.equal(buffer[offset:offset + p.numel()], expected[id(p)].reshape(-1))
                assert torch.equal(p.grad, 2 * expected[id(p)]), "DDP wrote the handoff's result"
                offset += p.numel()
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
    assert layouts[0] == layouts[1] == layouts[2]
    assert timer.window(3)["comm_inflight_s"] >= 0  # the timer still times the bucket hook


# -- two gloo processes: the bucketed average is the flat all-reduce's, bit for bit ----------------------------

def _two_groups(rank: int, world: int, store_path: str, results: str) -> None:
    """Rank ``rank`` as a replica group of one rank: its own DDP (a group of one), the cross-group average over
    the world group through GradientBuckets, and the flat all-reduce of the same gradients as the reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrator.parallel.ddp import handing_hook
    from orchestrator.runtime.models import BertMLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    own = [dist.new_group([r]) for r in range(world)][rank]

    class WithSpare(nn.Module):
        """The built-in model, and a layer only rank 0 uses (unused on the other: zeros go into its average)."""

        def __init__(self):
            super().__init__()
            self.bert = BertMLM(2000, 64, 3, 4, 128, 16)
            self.spare = nn.Linear(64, 64)

        def forward(self, x, y):
            loss = self.bert(x, y)
            return loss + self.spare(torch.ones(1, 64)).sum() * 1e-3 if rank == 0 else loss

    torch.manual_seed(0)
    model = WithSpare()
    reference = WithSpare()
    reference.load_state_dict(model.state_dict())
    ps = list(model.parameters())

    def issue(buffer):
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: buffer.div_(world))

    buckets = GradientBuckets(cap_mb=0.1)
    buckets.bind(ps, issue)
    # As orch's DDP strategy makes it under per_step (fixed buckets), ~ a bucket per layer: many go out during
    # the backward pass, in place.
    ddp = DDP(model, process_group=own, find_unused_parameters=True, bucket_cap_mb=0.05)
    ddp.register_comm_hook(own, handing_hook(buckets))
    g = torch.Generator().manual_seed(100 + rank)  # each group its own data
    report = []
    for step in range(3):
        buckets.start_step()
        batches = [torch.randint(0, 2000, (2, 16), generator=g) for _ in range(2)]
        with ddp.no_sync():  # gradient accumulation: only the last micro-batch's backward synchronizes
            (ddp(batches[0], batches[0]) / 2).backward()
        (ddp(batches[1], batches[1]) / 2).backward()
        assert buckets.finish()
        for b in batches:
            (reference(b, b) / 2).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in reference.parameters()]
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        flat /= world
        ours = torch.cat([p.grad.reshape(-1) for p in ps])
        report.append({"equal": bool(torch.equal(ours, flat)), "overlapped": buckets.overlapped,
                       "buckets": len(buckets._inplace), "rounds": buckets.rounds,
                       "spare_nonzero": bool(ps[-1].grad.abs().sum() > 0)})
        for p in [*ps, *reference.parameters()]:
            p.grad = None
    # The same without DDP, as FSDP2 hands gradients over (one by one, copied into fixed buckets): the hooks
    # hand over only in the backward pass that synchronizes.
    syncing = {"on": False}
    for p in ps:
        p.register_post_accumulate_grad_hook(lambda p: buckets.ready(p, p.grad) if syncing["on"] else None)
    copied = []
    for step in range(2):
        buckets.start_step()
        batches = [torch.randint(0, 2000, (2, 16), generator=g) for _ in range(2)]
        (model(batches[0], batches[0]) / 2).backward()
        syncing["on"] = True
        (model(batches[1], batches[1]) / 2).backward()
        syncing["on"] = False
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in ps]
        assert buckets.finish()
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        flat /= world
        copied.append({"equal": bool(torch.equal(torch.cat([p.grad.reshape(-1) for p in ps]), flat)),
                       "overlapped": buckets.overlapped, "buckets": len(buckets.layout.buckets),
                       "rounds": buckets.rounds})
        for p in ps:
            p.grad = None
    torch.save({"ddp": report, "copied": copied}, f"{results}.{rank}")
    dist.destroy_process_group()
    from orchestrator.trainer.train import leave

    leave(0)  # as tests/dcp_ranks.py: a normal interpreter exit after gloo could abort the rank (SIGABRT)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bucketed_average_is_the_flat_all_reduce_bit_for_bit_on_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    results = str(tmp_path / "report")
    mp.start_processes(_two_groups, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        both = torch.load(f"{results}.{rank}")
        report, copied = both["ddp"], both["copied"]
        assert [r["equal"] for r in report] == [True] * 3, report
        assert [r["equal"] for r in copied] == [True] * 2, copied
        # Rank 0 hands every gradient over during the backward pass, so every bucket went out then; rank 1
        # never uses the spare layer, whose gradient would complete the first bucket: its buckets wait for the
        # sync (strictly in order), and the averages are the same.
        assert all(r["rounds"] == 1 for r in copied), copied
        assert [r["overlapped"] for r in copied] == ([copied[0]["buckets"]] * 2 if rank == 0 else [0, 0]), copied
        assert all(r["buckets"] == report[0]["buckets"] > 3 for r in report), "no_sync: DDP's buckets once a step"
        assert all(r["overlapped"] == r["buckets"] for r in report), "each went out during the backward pass"
        assert all(r["spare_nonzero"] for r in report), "a parameter unused in one group takes the others' average"


def test_fsdp2_hands_each_shard_over_after_its_reduce_scatter_and_not_inside_no_sync(solo_group):
    from orchestrator.config.compose import compose_config
    from orchestrator.parallel.fsdp2 import HSDPStrategy
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.runtime.models import BertMLM

    handed: list[nn.Parameter] = []

    class Handoff:
        def ready(self, param, grad):
            assert grad is param.grad
            handed.append(param)

    random.seed(0)
    torch.manual_seed(0)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
    strategy = HSDPStrategy(compose_config("cpu_fsdp", ["parallelism.strategy=hsdp"]))
    model = strategy.build(lambda: BertMLM(500, 32, 2, 4, 64, 8), ctx, torch.device("cpu"), handoff=Handoff())
    x = torch.randint(0, 500, (4, 8))
    with strategy.no_sync(model):
        model(x, x).backward()
    assert handed == []
    model(x, x).backward()
    assert sorted(map(id, handed)) == sorted(id(p) for p in model.parameters())

