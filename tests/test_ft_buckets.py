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


def test_ddp_hands_over_each_gradient_of_a_synchronizing_backward_once_and_none_inside_no_sync(solo_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrator.parallel.ddp import DDPStrategy
    from orchestrator.runtime.distributed import DistContext
    from orchestrator.runtime.models import BertMLM
    from orchestrator.runtime.timing import StepTimer

    handed: list[tuple[nn.Parameter, torch.Tensor]] = []

    class Handoff:
        def ready(self, param, grad):
            handed.append((param, grad.clone()))

    torch.manual_seed(0)
    model = BertMLM(500, 32, 2, 4, 64, 8)
    reference = BertMLM(500, 32, 2, 4, 64, 8)
    reference.load_state_dict(model.state_dict())
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, restart_count=0)
    timer = StepTimer()
    ddp = DDPStrategy(None).wrap(model, ctx, torch.device("cpu"), timer=timer, handoff=Handoff())
    assert isinstance(ddp, DDP)
    x = torch.randint(0, 500, (4, 8))
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration: the handoff does not care
        handed.clear()
        with ddp.no_sync():
            ddp(x, x).backward()
        assert handed == [], "no_sync: nothing is final yet"
        ddp(x, x).backward()
        reference(x, x).backward()
        reference(x, x).backward()
        assert len(handed) == len(list(model.parameters())) == len({id(p) for p, _ in handed})
        expected = {id(p): rp.grad for p, rp in zip(model.parameters(), reference.parameters())}
        assert all(torch.equal(g, expected[id(p)].reshape(-1)) for p, g in handed)
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
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

    buckets = GradientBuckets(cap_mb=0.1)  # ~ a bucket per layer: many go out during the backward pass
    buckets.bind(ps, issue)
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
                       "buckets": len(buckets.layout.buckets), "rounds": buckets.rounds,
                       "spare_nonzero": bool(ps[-1].grad.abs().sum() > 0)})
        for p in [*ps, *reference.parameters()]:
            p.grad = None
    torch.save(report, f"{results}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bucketed_average_is_the_flat_all_reduce_bit_for_bit_on_two_gloo_processes(tmp_path):
    import torch.multiprocessing as mp

    results = str(tmp_path / "report")
    mp.start_processes(_two_groups, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        report = torch.load(f"{results}.{rank}")
        assert [r["equal"] for r in report] == [True] * 3, report
        assert all(r["rounds"] == 1 for r in report), "no_sync: one round of all-reduces per step"
        assert all(0 < r["overlapped"] <= r["buckets"] and r["buckets"] > 3 for r in report), \
            "buckets went out during the backward pass"
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

