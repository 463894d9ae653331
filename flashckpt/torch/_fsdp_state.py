"""This rank's part of an FSDP model's state: the local pieces of its (sharded) tensors,
their layout records, and the tree a save reuses while those are the live tensors."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import CheckpointError


@functools.cache
def fsdp_api() -> types.SimpleNamespace:
    """torch.distributed's state-dict and tensor APIs, imported on first use (they
    take about a second to import, which ``import flashckpt.torch`` should not pay)."""
    from torch.distributed.checkpoint import state_dict as sd
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.fsdp import FullyShardedDataParallel
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without the FSDP1 shard package
        ShardedTensor = None
    return types.SimpleNamespace(sd=sd, options=sd.StateDictOptions(full_state_dict=False), DTensor=DTensor,
                                 Shard=Shard, Replicate=Replicate, ShardedTensor=ShardedTensor,
                                 FSDP1=FullyShardedDataParallel,
                                 local_shape_and_offset=compute_local_shape_and_global_offset)


@dataclass(slots=True)
class Target:
    """One rank's view of model and optimizer for a save or a load."""

    tree: dict[str, Any]
    """What the engine saves or loads: local tensors, plain values, the layout string."""
    msd: dict[str, Any]
    osd: dict[str, Any] | None
    layout: dict[str, Any]
    locals: dict[str, torch.Tensor] = field(default_factory=dict)
    """Layout key -> the local tensor that holds (or receives) this rank's piece."""


@functools.lru_cache(maxsize=4096)
def _local_shape_and_offset(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple[tuple, tuple]:
    """This rank's piece of a DTensor of ``shape`` (the same for every save of a model)."""
    lengths, offsets = fsdp_api().local_shape_and_offset(shape, mesh, placements)
    return tuple(lengths), tuple(offsets)


@dataclass(slots=True)
class SaveCache:
    """What the next save of the same FSDP2 model reuses: its state-dict tensors are the
    live parameters and optimizer states, so while those are the same tensors only the
    plain values (param groups' hyper-parameters, ``extra``) are read again."""

    key: tuple
    target: Target
    pointers: tuple[int, ...]
    group_params: list[list[str]]
    """Each param group's parameter names, as ``get_state_dict`` gave them."""

    @classmethod
    def of(cls, key: tuple, target: Target) -> "SaveCache":
        optim = target.tree.get("optim")
        groups = [list(g["params"]) for g in optim["param_groups"]] if optim is not None else []
        return cls(key, target, _pointers(target), groups)

    def moved(self) -> bool:
        """Whether a cached local tensor was given other storage since."""
        return _pointers(self.target) != self.pointers

    def tree(self, optimizer: Any, extra: Any) -> dict[str, Any]:
        """The cached tree (a new dict, the same tensors) with its plain values read again:
        the param groups' hyper-parameters, ``extra``."""
        tree = dict(self.target.tree, extra=extra)
        if optimizer is not None:
            groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                      for group, names in zip(optimizer.param_groups, self.group_params)]
            tree["optim"] = dict(tree["optim"], param_groups=groups)
        return tree


def _pointers(target: Target) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in target.locals.values())


def live_key(model: torch.nn.Module, optimizer: Any) -> tuple:
    """Identities of the tensors a state dict of ``model`` and ``optimizer`` is made of."""
    key = (id(model), tuple(map(id, model.parameters())), tuple(map(id, model.buffers())))
    if optimizer is None:
        return key
    state = tuple((id(p), tuple((k, id(v)) for k, v in st.items())) for p, st in optimizer.state.items())
    return key + (id(optimizer), len(optimizer.param_groups), state)


def local_piece(value: Any, key: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The local tensor of a (possibly sharded) tensor and its layout record."""
    api = fsdp_api()
    if isinstance(value, api.DTensor):
        for p in value.placements:
            if type(p) not in (api.Shard, api.Replicate):
                raise CheckpointError(f"{key}: placement {p} is not supported (only Shard and Replicate)")
        local = value.to_local()
        lengths, offsets = _local_shape_and_offset(tuple(value.shape), value.device_mesh, tuple(value.placements))
        if tuple(local.shape) != tuple(lengths):
            raise CheckpointError(f"{key}: local shard has shape {list(local.shape)}, its placements "
                                  f"{value.placements} imply {list(lengths)}; this layout cannot be described")
        return local, {"shape": list(value.shape), "offsets": list(offsets), "lengths": list(lengths),
                       "placements": [str(p) for p in value.placements], "mesh": list(value.device_mesh.shape)}
    if api.ShardedTensor is not None and isinstance(value, api.ShardedTensor):
        shards = value.local_shards()
        shape = list(value.size())
        if len(shards) > 1:
            raise CheckpointError(f"{key}: {len(shards)} local shards on one rank are not supported")
        if not shards:
            lengths = [0] * len(shape)
            return torch.empty(lengths, dtype=value.dtype), {"shape": shape, "offsets": lengths, "lengths": lengths}
        md = shards[0].metadata
        return shards[0].tensor, {"shape": shape, "offsets": list(md.shard_offsets), "lengths": list(md.shard_sizes)}
    shape = list(value.shape)
    return value, {"shape": shape, "offsets": [0] * len(shape), "lengths": shape, "replicated": True}


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, fsdp_api().DTensor) else t


def all_live(target: Target, tensors: list[torch.Tensor], optimizer: Any) -> bool:
    """Whether every local tensor of ``target`` starts where the local tensor of one of
    ``tensors`` or of ``optimizer``'s state does."""
    with torch.no_grad():
        live = {_local(t).data_ptr() for t in tensors}
        if optimizer is not None:
            live |= {_local(v).data_ptr() for st in optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)}
    return all(t.numel() == 0 or t.data_ptr() in live for t in target.locals.values())
