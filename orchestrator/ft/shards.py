"""A replica group's sharded state as plain tensors, and back: how per_step sends FSDP2 shards to a healing group.

Under ``parallelism.strategy=hsdp`` with ``fault_tolerance.mode=per_step`` each replica group holds a full
replica of the model sharded over its own ranks (FSDP2 inside the group; the quorum is the replicate
dimension). Rank *i* of a healing group is sent rank *i*'s state by the live group (torchft pairs group ranks),
so what travels is that rank's own shards: the local tensors of every DTensor in its state dict (model and
optimizer state alike), never a gathered full tensor, and no collective runs inside the group to make it.

:func:`to_local` replaces each DTensor by its local tensor and writes down where it was (its path in the state
dict, global shape, stride and placements) and the mesh it lay on; :func:`from_local` rebuilds the DTensors on
the receiving rank's own mesh, which must have the same shape (the same intra-group layout), else
:class:`LayoutMismatch` says why in one line. A DDP group's state has no DTensor: both are the identity.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

LAYOUT_KEY = "_shards"  # the layout beside the state a peer sends (no registered name starts with "_")


class LayoutMismatch(RuntimeError):
    """The live group's shards are laid out differently from this group's: it cannot heal shard by shard."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a view of it: writing it writes the DTensor's shard); a plain tensor as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def to_local(state: Any) -> tuple[Any, dict[str, Any]]:
    """``state`` with every DTensor replaced by its local tensor, and the layout :func:`from_local` needs."""
    entries: list[dict[str, Any]] = []
    meshes: list[list[int]] = []

    def leaf(value: Any, path: tuple) -> Any:
        if not isinstance(value, DTensor):
            return _DESCEND
        mesh = list(value.device_mesh.shape)
        if mesh not in meshes:
            meshes.append(mesh)
        entries.append({"path": list(path), "shape": list(value.shape), "stride": list(value.stride()),
                        "placements": [_placement(p) for p in value.placements]})
        return value.to_local()

    out = _map(state, (), leaf)
    if len(meshes) > 1:
        raise LayoutMismatch(f"the state's shards lie on meshes of shapes {meshes}: per_step heals one mesh per "
                             "replica group")
    return out, {"mesh": meshes[0] if meshes else None, "tensors": entries}


def from_local(state: Any, layout: Optional[dict[str, Any]], mesh: Optional[DeviceMesh]) -> Any:
    """``state`` (from :func:`to_local` on the peer's same group rank) with its DTensors rebuilt on ``mesh``,
    this rank's mesh (None: this group's state is not sharded). LayoutMismatch if the layouts differ."""
    sent = layout["mesh"] if layout else None
    mine = list(mesh.shape) if mesh is not None else None
    if sent != mine:
        def say(shape: Optional[list[int]]) -> str:
            return f"sharded over a {'x'.join(map(str, shape))} mesh" if shape else "not sharded"

        raise LayoutMismatch(f"the live replica group's state is {say(sent)}, this group's is {say(mine)}: a group "
                             "heals shard by shard only from a group with the same layout (the same "
                             "parallelism.strategy and cluster.nproc_per_node on every node)")
    if not sent:
        return state
    specs = {tuple(e["path"]): e for e in layout["tensors"]}

    def leaf(value: Any, path: tuple) -> Any:
        spec = specs.get(path)
        if spec is None:
            return _DESCEND
        return DTensor.from_local(value, mesh, [_unplacement(p) for p in spec["placements"]], run_check=False,
                                  shape=torch.Size(spec["shape"]), stride=tuple(spec["stride"]))

    return _map(state, (), leaf)


def mesh_of(modules: Iterable[torch.nn.Module]) -> Optional[DeviceMesh]:
    """The mesh the first sharded parameter of ``modules`` lies on (None: nothing is sharded)."""
    for module in modules:
        for p in module.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh
    return None


def local_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over parameter names and this rank's bytes of each (its shards under FSDP2, the whole tensor
    otherwise): equal on two ranks only for bit-identical shards, computed with no collective."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(local(p.detach()).cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_DESCEND = object()


def _map(value: Any, path: tuple, leaf: Callable[[Any, tuple], Any]) -> Any:
    """``value`` with ``leaf(v, path)`` in place of each element for which it returns anything but _DESCEND;
    dicts, lists and tuples (a state dict's containers) are walked into."""
    replaced = leaf(value, path)
    if replaced is not _DESCEND:
        return replaced
    if isinstance(value, dict):
        return {k: _map(v, path + (k,), leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_map(v, path + (i,), leaf) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _placement(p: Any) -> list:
    if type(p) is Shard:
        return ["shard", p.dim]
    if type(p) is Replicate:
        return ["replicate"]
    raise LayoutMismatch(f"a DTensor placed as {p} cannot be sent shard by shard (Shard and Replicate only)")


def _unplacement(p: list) -> Any:
    return Shard(int(p[1])) if p[0] == "shard" else Replicate()
