"""per_step with hsdp (orchestrator/ft/shards.py): a rank's FSDP2 state travels as its own local shards, through
the pickle-free wire, and is rebuilt on the receiving rank's mesh; a layout that differs is refused in one
line. Fast: a world of one gloo process in this one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from orchestrator.checkpoint.wire import decode, encode
from orchestrator.ft.shards import LayoutMismatch, from_local, local_sha256, mesh_of, to_local

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()


def test_a_ranks_shards_travel_as_plain_tensors_and_load_into_a_fresh_group(world):
    from torch.distributed.tensor import DTensor

    live, live_optim = sharded(0)
    train(live, live_optim, torch.randn(4, 5))
    sent, layout = to_local({"model": live.state_dict(), "optim": live_optim.state_dict()})
    assert layout["mesh"] == [1] and len(layout["tensors"]) == 4 + 2 * 4  # weights, biases; exp_avg(_sq) each
    assert not any(isinstance(t, DTensor) for t in [*sent["model"].values(), *sent["optim"]["state"][0].values()])
    received = decode(encode({"state": sent, "layout": layout}))  # what the transport carries

    joiner, joiner_optim = sharded(1)  # other weights, and an optimizer that never stepped (no state yet)
    state = from_local(received["state"], received["layout"], mesh_of([joiner]))
    joiner.load_state_dict(state["model"])
    joiner_optim.load_state_dict(state["optim"])
    assert local_sha256(joiner) == local_sha256(live)
    x = torch.randn(4, 5)
    train(live, live_optim, x)
    train(joiner, joiner_optim, x)  # the optimizer state came too: the next step is the same step
    assert local_sha256(joiner) == local_sha256(live)


def test_a_group_laid_out_otherwise_is_refused_in_one_line(world):
    live, _ = sharded(0)
    sent, layout = to_local({"model": live.state_dict()})
    with pytest.raises(LayoutMismatch, match="sharded over a 1 mesh, this group's is not sharded") as refused:
        from_local(sent, layout, None)  # a DDP group
    assert "\n" not in str(refused.value) and "cluster.nproc_per_node" in str(refused.value)
    plain = {"model": torch.nn.Linear(2, 2).state_dict()}
    same, none = to_local(plain)
    assert none["mesh"] is None and from_local(same, none, None) is same  # DDP's state: as it was
    with pytest.raises(LayoutMismatch, match="is not sharded, this group's is sharded over a 1 mesh"):
        from_local(same, none, mesh_of([live]))
