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

import json
import logging
import os
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch

from .._base import EngineCheckpointer
from .._capture import FailureCapture, check_steps_per_update
from .._engine import Engine, SaveHandle, gc_paused, place
from .._errors import CheckpointError, StateMismatchError
from .._options import Options, resolve_options
from ..restore._reshard import (LAYOUT_KEY, Fill, Piece, RangeReader, path_key, read_header, read_layout, read_sources,
                        skeleton_child)
from ..memory._tree import merge_into
from ..restore._sources import Agreement, Source
from ._checkpointer import collective_for
from ._fsdp_capture import CaptureShards
from ._fsdp_state import SaveCache, Target, all_live, fsdp_api, live_key, local_piece
from ._tensors import DTYPE_NAMES, host_byte_array

__all__ = ["FsdpCheckpointer"]

log = logging.getLogger("flashckpt")

LAYOUT_VERSION = 1
FRESH = "fresh"
"""The layout's ``optimizer`` value for an optimizer saved before its first step."""


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
        self._save_cache: SaveCache | None = None
        self._model: torch.nn.Module | None = None
        self._optimizer: Any = None
        """Those of the last ``load`` or ``save``: the ones :meth:`save_on_failure` captures."""
        self._shards: CaptureShards | None = None
        self._collecting = False

    # -- state ----------------------------------------------------------------------

    def _collect(self, model: torch.nn.Module, optimizer: Any, extra: Any, *, filling: bool = False) -> Target:
        """The state tree of this rank. ``get_state_dict`` initialises an optimizer that has
        no state yet (a step with zero gradients: Adam's step count becomes 1); unless the
        state is about to be filled (``filling``), that is undone and the optimizer is
        recorded as fresh, so saving before the first step changes no training."""
        self._collecting = True  # a fresh optimizer's state is made by a step: no capture refresh inside it
        try:
            with torch.no_grad():  # DTensor.to_local is then a plain attribute read
                return self._collect_state(model, optimizer, extra, filling)
        finally:
            self._collecting = False

    def _collect_state(self, model: torch.nn.Module, optimizer: Any, extra: Any, filling: bool) -> Target:
        api = fsdp_api()
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
            local, records[key] = local_piece(value, key)
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
        return Target(tree, msd, osd, layout, locals_)

    # -- save -----------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None, *, extra: Any = None,
             persist: bool | None = None) -> SaveHandle:
        """Copy this rank's shards of ``model`` (and ``optimizer``) and ``extra`` into
        shared memory; persist them if due (or if ``persist``); returns a
        :class:`~flashckpt.SaveHandle`. Every rank calls this
        for the same step: flashckpt adds no communication, but FSDP1's sharded state
        dict is itself collective (FSDP2's is not)."""
        self._use(model, optimizer, "save")
        capture = self._capture
        with capture.saving(step, extra) if capture is not None else nullcontext(), gc_paused():
            target = self._reuse(model, optimizer, extra)
            if target is None:
                target = self._collect(model, optimizer, extra)
                self._remember(model, optimizer, target)
            return self._engine.save(step, target.tree, persist=persist)

    def _reuse(self, model: torch.nn.Module, optimizer: Any, extra: Any) -> Target | None:
        """The previous save's target with fresh plain values, if its tensors are still the
        live ones (``get_state_dict`` costs more than the rest of a save's bookkeeping)."""
        cache = self._save_cache
        if cache is None or cache.key != live_key(model, optimizer):
            return None
        if cache.moved():
            return None
        cache.target.tree = cache.tree(optimizer, extra)
        return cache.target

    def _remember(self, model: torch.nn.Module, optimizer: Any, target: Target) -> None:
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
        self._save_cache = SaveCache.of(live_key(model, optimizer), target)

    # -- failure capture --------------------------------------------------------------

    def save_on_failure(self, state_fn: Callable[[], Any], *, optimizer: Any,
                        boundary_state: Callable[[], Any] | None = None,
                        steps_per_update: int = 1) -> FailureCapture:
        """On a failure, save the last finished optimizer step from this rank's local shards
        (see ``flashckpt._capture``). Every rank calls it once, from the main thread, after
        ``load(model, optimizer)`` (or a ``save``): the model and optimizer are that call's,
        and later saves and loads must name the same ones. ``steps_per_update``: save steps
        per optimizer update, where ``save``'s step counts micro-batches (as for
        :meth:`flashckpt.torch.Checkpointer.save_on_failure`).

        ``state_fn()`` returns what ``save`` takes as ``extra`` (or None); it is checked
        against the next save's ``extra``. On SIGTERM/SIGINT (also while the main thread is
        blocked in a collective, in forward or backward), an uncaught exception or
        ``capture()`` of the returned object, a rank not inside ``optimizer.step()`` writes
        its local shards of that step with ``state_fn()`` into its memory slot and has them
        persisted: no collective, and the model is not touched (FSDP2 puts unsharded
        parameters in the modules during forward and backward; the capture copies the
        sharded ones, which only ``optimizer.step()`` changes). The tree is collected on the
        main thread after each load and again at the end of an optimizer step that gave the
        optimizer's state new tensors; a capture finding its tensors replaced since (the
        optimizer's ``load_state_dict``, a new buffer) writes nothing and logs why. The state is
        sharded: a restart loads a capture only where every rank captured it. FSDP2 only:
        FSDP1's sharded state dict is collective, and a model with parameters outside the
        optimizer is refused (:class:`~flashckpt.CheckpointError` naming why).

        As of the step's end (see ``flashckpt._boundary``): the model's buffers (BatchNorm's
        running statistics, which the next forward changes) are copied at every optimizer
        step's end and a capture writes the copies; ``boundary_state()``, called there too,
        gives parts of ``state_fn()``'s tree (the ``extra``: a sampler's state,
        ``flashckpt.rng_state()``) that a capture writes in place of the live ones.
        """
        self._check_no_capture()
        check_steps_per_update(steps_per_update)
        model, known = self._model, self._optimizer
        if model is None:
            raise CheckpointError("save_on_failure: no model known yet; call load(model, optimizer) (or save) first: "
                                  "the capture saves the model and optimizer of the last load or save")
        if optimizer is None or optimizer is not known:
            raise ValueError("save_on_failure: optimizer is not the optimizer of the last load or save "
                             f"({'none' if known is None else type(known).__name__}): its step() is the boundary and "
                             "its state is what the capture saves")
        if not callable(state_fn):
            raise TypeError(f"state_fn must be callable (returning what save takes as extra), got "
                            f"{type(state_fn).__name__}")
        shards = CaptureShards(model, optimizer, lambda: self._collect(model, optimizer, None),
                                lambda: self._collecting)
        capture = self.engine_capture(state_fn, optimizer, tree=shards.tree, boundary_state=boundary_state,
                                      steps_per_update=steps_per_update)
        self._shards = shards
        return self.capture_with(capture, guard_saves=False)

    def _use(self, model: torch.nn.Module, optimizer: Any, what: str) -> None:
        shards = self._shards
        if shards is not None and (model is not shards.model or optimizer not in (None, shards.optimizer)):
            raise ValueError(f"{what}: save_on_failure armed this checkpointer for another model and optimizer "
                             "(the capture would save those)")
        self._model, self._optimizer = model, optimizer

    def close(self, timeout: float | None = None) -> None:
        """As :meth:`flashckpt._base.EngineCheckpointer.close`; the capture's optimizer hook is removed."""
        try:
            super().close(timeout)
        finally:
            if self._shards is not None:
                self._shards.close()
                self._shards = None

    # -- load -----------------------------------------------------------------------

    def load(self, model: torch.nn.Module, optimizer: Any = None, *, step: int | None = None) -> int | None:
        """Restore ``model`` (and ``optimizer``) in place; returns the step, or None if
        there is none. ``extra`` of that step is then in :attr:`extra`.

        All ranks must call this. The ranks agree on one step like
        :meth:`flashckpt.torch.Checkpointer.load`; if the step was saved with another
        world size or mesh it is resharded from storage.
        """
        with self._loading():
            return self._load(model, optimizer, step)

    def _load(self, model: torch.nn.Module, optimizer: Any, step: int | None) -> int | None:
        start = time.perf_counter()
        self._use(model, optimizer, "load")
        self._save_cache = None
        if self._shards is not None:
            self._shards.stale = True
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

    def _peek(self, target: Target, agreement: Agreement) -> tuple[bool, Any, list[str]]:
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

    def _reshard(self, target: Target, step: int) -> int:
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
    def _drop_unsaved_state(optimizer: Any, target: Target, saved: set[str]) -> None:
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

    def _apply(self, model: torch.nn.Module, optimizer: Any, target: Target) -> None:
        if optimizer is not None:
            target.osd["param_groups"] = target.tree["optim"]["param_groups"]
        if self._aliased(model, optimizer, target):  # FSDP2: we filled the live tensors
            if optimizer is not None:
                self._set_hyperparameters(optimizer, target.osd["param_groups"])
        elif optimizer is None:
            fsdp_api().sd.set_model_state_dict(model, target.msd, options=fsdp_api().options)
        else:
            fsdp_api().sd.set_state_dict(model, optimizer, model_state_dict=target.msd, optim_state_dict=target.osd,
                                     options=fsdp_api().options)

    @staticmethod
    def _aliased(model: torch.nn.Module, optimizer: Any, target: Target) -> bool:
        """Whether every filled local tensor is a live parameter, buffer or optimizer state."""
        return all_live(target, list(model.parameters()) + list(model.buffers()), optimizer)

    @staticmethod
    def _set_hyperparameters(optimizer: Any, saved: list[dict[str, Any]]) -> None:
        if len(saved) != len(optimizer.param_groups):
            raise StateMismatchError(f"the checkpoint has {len(saved)} optimizer param groups, "
                                     f"the optimizer {len(optimizer.param_groups)}")
        for group, values in zip(optimizer.param_groups, saved):
            for k, v in values.items():
                if k != "params":
                    group[k] = v
