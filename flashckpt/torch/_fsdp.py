"""Flash checkpoints of FSDP training (FSDP2 ``fully_shard`` and FSDP1), with resharding.

Each rank saves only its local shards: ``get_state_dict`` with sharded options gives
DTensors (FSDP2) or ShardedTensors (FSDP1); their local tensors go into the state tree
as plain tensors, and this rank's *layout* (every tensor's global shape and the piece
this rank holds) goes next to them as one JSON string under
:data:`flashckpt.restore._reshard.LAYOUT_KEY`, so the engine stores it in the shard's header
without knowing about sharding.

Loading with the same layout goes through the engine: from memory when every rank
holds the step, else from storage with checksums, in place into the local tensors
(FSDP2's state-dict tensors are the live parameters and optimizer states, so nothing
else is copied; FSDP1's are copies and are handed to ``set_state_dict``). Loading with
another world size or mesh reads every committed shard's header and then only the byte
ranges that overlap this rank's new pieces (see :mod:`flashckpt.restore._reshard`); such a
load checks every shard's size and header but not its whole-file checksum (that would
read every byte of every shard) -- ``flashckpt convert`` and ``LocalStorage.verify`` do.

Placements: ``Shard`` and ``Replicate`` on any mesh (FSDP2, HSDP, FSDP1's ShardedTensor
with one local shard per rank); ``_StridedShard`` and ``Partial`` are refused with a
clear error.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base import EngineCheckpointer
from .._engine import Engine, SaveHandle, gc_paused, place
from .._errors import CheckpointError, StateMismatchError
from .._options import Options, resolve_options
from ..restore._reshard import (LAYOUT_KEY, Fill, Piece, RangeReader, path_key, read_header, read_layout, read_sources,
                        skeleton_child)
from ..memory._tree import merge_into
from ..restore._sources import Agreement, Source
from ._checkpointer import collective_for
from ._tensors import DTYPE_NAMES, host_byte_array

__all__ = ["FsdpCheckpointer"]

log = logging.getLogger("flashckpt")

LAYOUT_VERSION = 1
FRESH = "fresh"
"""The layout's ``optimizer`` value for an optimizer saved before its first step."""


@functools.cache
def _api() -> types.SimpleNamespace:
    """torch.distributed's state-dict and tensor APIs, imported on first use (they
    take about a second to import, which ``import flashckpt.torch`` should not pay)."""
    from torch.distributed.checkpoint import state_dict as sd
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover - torch without the FSDP1 shard package
        ShardedTensor = None
    return types.SimpleNamespace(sd=sd, options=sd.StateDictOptions(full_state_dict=False), DTensor=DTensor,
                                 Shard=Shard, Replicate=Replicate, ShardedTensor=ShardedTensor,
                                 local_shape_and_offset=compute_local_shape_and_global_offset)


@dataclass(slots=True)
class _Target:
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
    lengths, offsets = _api().local_shape_and_offset(shape, mesh, placements)
    return tuple(lengths), tuple(offsets)


@dataclass(slots=True)
class _SaveCache:
    """What the next save of the same FSDP2 model reuses: its state-dict tensors are the
    live parameters and optimizer states, so while those are the same tensors only the
    plain values (param groups' hyper-parameters, ``extra``) are read again."""

    key: tuple
    target: _Target
    pointers: tuple[int, ...]
    group_params: list[list[str]]
    """Each param group's parameter names, as ``get_state_dict`` gave them."""


def _live_key(model: torch.nn.Module, optimizer: Any) -> tuple:
    """Identities of the tensors a state dict of ``model`` and ``optimizer`` is made of."""
    key = (id(model), tuple(map(id, model.parameters())), tuple(map(id, model.buffers())))
    if optimizer is None:
        return key
    state = tuple((id(p), tuple((k, id(v)) for k, v in st.items())) for p, st in optimizer.state.items())
    return key + (id(optimizer), len(optimizer.param_groups), state)


def _local_piece(value: Any, key: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """The local tensor of a (possibly sharded) tensor and its layout record."""
    api = _api()
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
    return t.to_local() if isinstance(t, _api().DTensor) else t


class FsdpCheckpointer(EngineCheckpointer):
    """Flash checkpoints of an FSDP2 (``fully_shard``) or FSDP1 model and its optimizer.

    ``save(step, model, optimizer, extra=...)`` blocks only while this rank's local
    shards are copied into shared memory; storage gets
    ``<directory>/step-<N>/rank-<R>.safetensors`` in the background, each with this
    rank's layout. ``load(model, optimizer)`` fills both in place: from memory or
    storage when the layout is unchanged, else resharded from storage reading only
    the byte ranges each rank needs. Same options as
    :class:`flashckpt.torch.Checkpointer` (``options=`` and its keyword shorthands).

    Call protocol: every rank of the process group constructs the checkpointer and
    calls ``save`` and ``load`` with its part of the same model; ``load`` is collective
    (ranks agree on one step) and ``save`` adds no communication. After ``load``,
    :attr:`extra` holds what ``extra`` held at that step and ``last_load`` says where
    it came from. FSDP1 on CPU needs ``FullyShardedDataParallel(..., device_id=torch.device("cpu"))``.
    """

    def __init__(self, directory: str | os.PathLike, *, options: Options | None = None, process_group: Any = None,
                 **shorthands: Any) -> None:
        resolved = resolve_options(options, **shorthands)
        collective = collective_for(process_group)
        self._engine = Engine(os.fspath(directory), resolved, place(collective, replicated=False), collective)
        self.extra: Any = None
        """What ``extra`` held at the step the last ``load`` restored (None before)."""
        self._save_cache: _SaveCache | None = None

    # -- state ----------------------------------------------------------------------

    def _collect(self, model: torch.nn.Module, optimizer: Any, extra: Any, *, filling: bool = False) -> _Target:
        """The state tree of this rank. ``get_state_dict`` initialises an optimizer that has
        no state yet (a step with zero gradients: Adam's step count becomes 1); unless the
        state is about to be filled (``filling``), that is undone and the optimizer is
        recorded as fresh, so saving before the first step changes no training."""
        with torch.no_grad():  # DTensor.to_local is then a plain attribute read
            return self._collect_state(model, optimizer, extra, filling)

    def _collect_state(self, model: torch.nn.Module, optimizer: Any, extra: Any, filling: bool) -> _Target:
        api = _api()
        fresh = False
        if optimizer is None:
            msd, osd = api.sd.get_model_state_dict(model, options=api.options), None
        else:
            fresh = not optimizer.state and not filling
            msd, osd = api.sd.get_state_dict(model, optimizer, options=api.options)
            if fresh:
                optimizer.state.clear()
                osd = {"state": {}, "param_groups": osd["param_groups"]}
        records: dict[str, dict[str, Any]] = {}
        locals_: dict[str, torch.Tensor] = {}

        def leaf(value: Any, parts: tuple) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            key = path_key(parts)
            local, records[key] = _local_piece(value, key)
            locals_[key] = local
            return local

        tree: dict[str, Any] = {"model": {fqn: leaf(v, ("model", fqn)) for fqn, v in msd.items()}}
        if osd is not None:
            tree["optim"] = {
                "state": {fqn: {k: leaf(v, ("optim", "state", fqn, k)) for k, v in st.items()}
                          for fqn, st in osd["state"].items()},
                "param_groups": osd["param_groups"],
            }
        tree["extra"] = extra
        coll = self._engine.collective
        layout = {"version": LAYOUT_VERSION, "rank": coll.rank, "world_size": coll.world_size,
                  "optimizer": FRESH if fresh else osd is not None, "tensors": records}
        tree[LAYOUT_KEY] = json.dumps(layout, separators=(",", ":"))
        return _Target(tree, msd, osd, layout, locals_)

    # -- save -----------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None, *, extra: Any = None,
             persist: bool | None = None) -> SaveHandle:
        """Copy this rank's shards of ``model`` (and ``optimizer``) and ``extra`` into
        shared memory; persist them if due (or if ``persist``); returns a
        :class:`~flashckpt.SaveHandle`. Every rank calls this
        for the same step: flashckpt adds no communication, but FSDP1's sharded state
        dict is itself collective (FSDP2's is not)."""
        with gc_paused():
            target = self._reuse(model, optimizer, extra)
            if target is None:
                target = self._collect(model, optimizer, extra)
                self._remember(model, optimizer, target)
            return self._engine.save(step, target.tree, persist=persist)

    def _reuse(self, model: torch.nn.Module, optimizer: Any, extra: Any) -> _Target | None:
        """The previous save's target with fresh plain values, if its tensors are still the
        live ones (``get_state_dict`` costs more than the rest of a save's bookkeeping)."""
        cache = self._save_cache
        if cache is None or cache.key != _live_key(model, optimizer):
            return None
        if tuple(t.data_ptr() for t in cache.target.locals.values()) != cache.pointers:
            return None
        tree = cache.target.tree
        if optimizer is not None:
            tree["optim"]["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                                             for group, names in zip(optimizer.param_groups, cache.group_params)]
        tree["extra"] = extra
        return cache.target

    def _remember(self, model: torch.nn.Module, optimizer: Any, target: _Target) -> None:
        """Keep ``target`` for :meth:`_reuse` when every tensor of it is live (FSDP2) and the
        optimizer's state holds nothing but tensors (FSDP1's state dicts are copies)."""
        self._save_cache = None
        optim = target.tree.get("optim")
        if target.layout["optimizer"] == FRESH or not self._aliased(model, optimizer, target):
            return
        if not all(isinstance(v, torch.Tensor) for v in target.tree["model"].values()):
            return
        if optim is not None and not all(isinstance(v, torch.Tensor) for st in optim["state"].values()
                                         for v in st.values()):
            return
        groups = [list(g["params"]) for g in optim["param_groups"]] if optim is not None else []
        self._save_cache = _SaveCache(_live_key(model, optimizer), target,
                                      tuple(t.data_ptr() for t in target.locals.values()), groups)

    # -- load -----------------------------------------------------------------------

    def load(self, model: torch.nn.Module, optimizer: Any = None, *, step: int | None = None) -> int | None:
        """Restore ``model`` (and ``optimizer``) in place; returns the step, or None if
        there is none. ``extra`` of that step is then in :attr:`extra`.

        All ranks must call this. The ranks agree on one step like
        :meth:`flashckpt.torch.Checkpointer.load`; if the step was saved with another
        world size or mesh it is resharded from storage.
        """
        start = time.perf_counter()
        self._save_cache = None
        eng = self._engine
        coll = eng.collective
        eng.wait()  # a crash flush of the previous run commits first
        agreement = eng.agree(step, direct=True)  # memory (own node, a peer's replica, own node-local directory)
        if agreement.step is None:
            # Nothing anywhere: the engine reports a fresh start. The optimizer is not
            # touched (get_state_dict would initialise its state with a zero step).
            return eng.load_agreed({}, agreement, start)
        step, source = agreement.step, agreement.source
        target = self._collect(model, None, {})
        state_names: list[str] = []  # this rank's: no rank needs another's

        def peek() -> tuple[bool, Any]:
            same, optim, names = self._peek(target, agreement)
            state_names.extend(names)
            return same, optim

        peeks = self._engine.on_all_ranks(peek, f"reading the layout of step {step} from {source}")
        saved_optim = {optim for _, optim in peeks}
        filling = optimizer is not None and saved_optim == {True}
        if optimizer is not None and False in saved_optim:
            raise StateMismatchError(f"step {step} in {eng.storage.root} holds no optimizer state (it was saved "
                                     "without an optimizer); call load(model) without one, or load another step")
        if filling:
            target = self._collect(model, optimizer, {}, filling=True)
            self._drop_unsaved_state(optimizer, target, set(state_names))
        elif optimizer is not None:  # saved before its first step: it gets its hyper-parameters only
            target.tree["optim"] = {"state": {}, "param_groups": []}
        elif saved_optim != {False}:
            target.tree["optim"] = {}  # read and dropped: a model-only load of a checkpoint with optimizer
        if all(same for same, _ in peeks):  # exactly the step whose layout was read: no fallbacks
            loaded = eng.load_agreed(target.tree, agreement.pinned(), start)
        else:
            if step not in eng.storage.committed_steps():
                raise CheckpointError(f"step {step} has another layout than this job and is not committed in "
                                      f"{eng.storage.root}; only committed steps can be resharded")
            read = self._engine.on_all_ranks(lambda: self._reshard(target, step),
                                      f"resharding step {step} from {eng.storage.root}")[coll.rank]
            log.info("resharded step %d from storage (%.1f MiB read)", step, read / 2**20)
            eng.finish_load(step, "storage", start, resharded=True, bytes_read=read)
            eng.prepare_for(target.tree)  # size the slots for this world's shards
            loaded = step
        self._apply(model, optimizer if filling else None, target)
        if optimizer is not None and not filling:
            optimizer.state.clear()
            self._set_hyperparameters(optimizer, target.tree["optim"]["param_groups"])
        self.extra = target.tree["extra"]
        return loaded

    def _peek(self, target: _Target, agreement: Agreement) -> tuple[bool, Any, list[str]]:
        """(same layout as ``target``, the layout's ``optimizer``: True, False or
        :data:`FRESH`, the parameters the saved optimizer holds state for) for this rank's
        copy of the agreed step."""
        coll, step = self._engine.collective, agreement.step
        if agreement.source == Source.MEMORY:  # its slot, or its own node-local directory (``own_disk``)
            own_disk = self._engine.placement.storage_rank in agreement.own_disk
            image, world = self._engine.agreed_image(agreement), coll.world_size
            layout = read_layout(image, f"step {step} in {'its node-local directory' if own_disk else 'memory'}")
        else:
            world = int(self._engine.storage.metadata(step)["world_size"])
            f, record = self._engine.storage.open_shard(step, coll.rank if coll.rank < world else 0)
            with f:
                image = read_header(f, record["size"])[0]
                layout = read_layout(image, f.name)
        theirs, mine = layout["tensors"], target.layout["tensors"]
        same = world == coll.world_size and all(
            (theirs[k]["shape"], theirs[k]["offsets"], theirs[k]["lengths"]) == (r["shape"], r["offsets"], r["lengths"])
            for k, r in mine.items() if k in theirs)
        state = skeleton_child(image.meta.get("tree", {}), "optim", "state")
        return same, layout.get("optimizer", False), [name for name, _ in state.get("d", ())]

    def _reshard(self, target: _Target, step: int) -> int:
        """Fill ``target`` from the overlapping byte ranges of every shard of ``step``;
        returns the number of tensor bytes read."""
        rank = self._engine.collective.rank
        sources = read_sources(self._engine.storage, step, verify_headers=False)  # verified as read
        home = sources[rank] if rank < len(sources) else sources[0]
        home.reader.verify_header()  # its skeleton, plain values and layout decide what follows
        skeleton = home.image.meta["tree"]
        if "optim" not in target.tree or target.tree["optim"] == {}:
            target.tree.pop("optim", None)
            skeleton = {"d": [[k, v] for k, v in skeleton["d"] if k != "optim"]}
        theirs, mine = home.layout["tensors"], target.layout["tensors"]
        problems = [f"{k}: checkpoint has global shape {theirs[k]['shape']}, state has {r['shape']}"
                    for k, r in mine.items() if k in theirs and theirs[k]["shape"] != r["shape"]]
        if problems:
            raise StateMismatchError(f"checkpoint does not match the state ({len(problems)} problems):\n  "
                                     + "\n  ".join(problems[:20]))
        entries = {e.name: (e.dtype, tuple(e.shape)) for e in home.image.entries}
        keys_by_name: dict[str, list[str]] = {}  # tied weights: one saved entry, several keys
        for key, rec in mine.items():
            name = home.names.get(key)
            if name is not None and key in theirs:
                entries[name] = (entries[name][0], tuple(rec["lengths"]))
                keys_by_name.setdefault(name, []).append(key)
        merge = merge_into(target.tree, skeleton, entries, allow_pickle=self._engine.options.allow_pickle)
        fills, copies = [], []
        for name, obj in merge.fills:
            if obj.numel() == 0:
                continue
            dst = host_byte_array(obj)
            if dst is None:  # no host bytes (an accelerator): through a host tensor, copied once read
                copies.append((obj, torch.empty(obj.shape, dtype=obj.dtype)))
                dst = host_byte_array(copies[-1][1])
            key = next((k for k in keys_by_name.get(name, ()) if target.locals.get(k) is obj), None)
            if key is not None:
                rec = mine[key]
                fills.append(Fill(dst, key=key, want=Piece(tuple(rec["offsets"]), tuple(rec["lengths"])),
                                  dtype=DTYPE_NAMES[obj.dtype], global_shape=tuple(rec["shape"]), prefer=home.rank))
            else:  # not in the layout (extra): this rank's home shard holds it whole
                fills.append(Fill(dst, source=home, entry=home.entries[name]))
        with RangeReader(sources) as reader:
            reader.fill_many(fills)
        with torch.no_grad():
            for obj, host in copies:
                obj.copy_(host)
        merge.apply_plain()
        return reader.bytes_read

    @staticmethod
    def _drop_unsaved_state(optimizer: Any, target: _Target, saved: set[str]) -> None:
        """A parameter the saved optimizer held no state for (it never had a gradient) gets
        none: ``get_state_dict`` made some for every parameter of a fresh optimizer. FSDP2's
        state dict holds the optimizer's own per-parameter dicts, which go too (FSDP1's
        ``set_state_dict`` replaces the optimizer's state anyway)."""
        state = target.tree["optim"]["state"]
        dropped = []
        for fqn in [fqn for fqn in state if fqn not in saved]:
            del state[fqn]
            dropped.append(target.osd["state"].pop(fqn, None))
            prefix = path_key(("optim", "state", fqn)) + "/"
            for key in [key for key in target.locals if key.startswith(prefix)]:
                del target.locals[key]
                target.layout["tensors"].pop(key, None)
        for param in [p for p, st in optimizer.state.items() if any(st is d for d in dropped)]:
            del optimizer.state[param]

    # -- hand over to the model and optimizer ----------------------------------------------

    def _apply(self, model: torch.nn.Module, optimizer: Any, target: _Target) -> None:
        if optimizer is not None:
            target.osd["param_groups"] = target.tree["optim"]["param_groups"]
        if self._aliased(model, optimizer, target):  # FSDP2: we filled the live tensors
            if optimizer is not None:
                self._set_hyperparameters(optimizer, target.osd["param_groups"])
        elif optimizer is None:
            _api().sd.set_model_state_dict(model, target.msd, options=_api().options)
        else:
            _api().sd.set_state_dict(model, optimizer, model_state_dict=target.msd, optim_state_dict=target.osd,
                                     options=_api().options)

    @staticmethod
    def _aliased(model: torch.nn.Module, optimizer: Any, target: _Target) -> bool:
        """Whether every filled local tensor is a live parameter, buffer or optimizer state."""
        live = {_local(t).data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        if optimizer is not None:
            live |= {_local(v).data_ptr() for st in optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor)}
        return all(t.numel() == 0 or t.data_ptr() in live for t in target.locals.values())

    @staticmethod
    def _set_hyperparameters(optimizer: Any, saved: list[dict[str, Any]]) -> None:
        if len(saved) != len(optimizer.param_groups):
            raise StateMismatchError(f"the checkpoint has {len(saved)} optimizer param groups, "
                                     f"the optimizer {len(optimizer.param_groups)}")
        for group, values in zip(optimizer.param_groups, saved):
            for k, v in values.items():
                if k != "params":
                    group[k] = v
