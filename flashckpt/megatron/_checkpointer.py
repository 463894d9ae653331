"""Flash checkpoints of megatron-core sharded state dicts, loadable with another TP/DP layout."""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch

from .. import _names
from .._base import EngineCheckpointer
from .._capture import FailureCapture
from .._engine import Engine, place
from .._errors import CheckpointError, StateMismatchError
from .._options import Options, resolve_options
from ..restore._sources import Agreement, Source
from ..restore._reshard import Fill, Piece, Source as SavedShard, byte_shape, close_sources, read_sources, source_of
from ..restore._shard_read import MemoryImage, ShardReader, open_shard
from ..memory._slot import HEADER_SIZE, Slot, SlotState
from ..torch._checkpointer import collective_for
from ..torch._tensors import DTYPE_NAMES, host_byte_array
from ._capture import StepBoundary, UpdateTensors, check_capturable, is_megatron_optimizer
from ._reader import BYTESIO, StepReader

__all__ = ["MegatronCheckpointer"]

log = logging.getLogger("flashckpt")


def _is_main(replica_id: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    return is_main_replica(replica_id)


def _piece(sh: Any) -> Piece:
    """A ``ShardedTensor``'s block in global coordinates (its prepended axes of extent 1)."""
    return Piece(tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))


def _packed(blocks: dict) -> dict:
    """The tree a save hands the engine, from :meth:`MegatronCheckpointer._blocks`."""
    # the blocks' places as one string, not a value per number: a save's fixed cost is
    # walking the tree, and thousands of small values cost milliseconds (format 2)
    layout = json.dumps(list(blocks["places"].values()), separators=(",", ":"))
    return {"megatron": {"format": 2, "layout": layout, "data": list(blocks["data"].values()),
                         "objects": blocks["objects"], "common": blocks["common"]}}


def _encode_object(data: Any) -> Any:
    if isinstance(data, io.BytesIO):  # Transformer Engine's extra state
        return {BYTESIO: torch.frombuffer(bytearray(data.getvalue()) or bytearray(1), dtype=torch.uint8)
                [:len(data.getvalue())]}
    return data


class MegatronCheckpointer(EngineCheckpointer):
    """Flash checkpoints of megatron-core sharded state dicts.

    ``save(step, model.sharded_state_dict())`` blocks only while this rank's main-replica
    blocks (``ShardedTensor`` with ``replica_id`` 0; factories applied) are copied into
    shared memory; their global offsets and shapes travel as plain values, sharded
    objects and (on rank 0) the common part with them. The node's saver persists them.
    ``load(model.sharded_state_dict())`` returns ``(state_dict, step)``: a plain state dict
    for ``model.load_state_dict``; tensors are read in place into the ``ShardedTensor``
    data where it is a CPU tensor of the right shape. A layout change (tensor- or
    data-parallel size) reads from the committed shards exactly the byte ranges each
    requested block needs; a restart with the same layout reads this node's memory (on
    node-local directories, a rank whose memory lacks the step reads its shard from its own
    node's directory straight into the tensors: one copy, never through its slot).
    Node-local directories on three nodes or more, where no node's directory holds every
    rank's shard, are a :class:`~flashckpt.CheckpointError` at construction.

    All ranks construct it and call ``save``/``load``/``wait``/``close``; every load is
    recorded (``last_load``, a new line after a rollback) by the engine. Takes
    :class:`flashckpt.Options`; never calls CUDA on CPU tensors. :meth:`save_on_failure`
    saves the last finished optimizer step at a failure.
    """

    def __init__(self, directory: str | os.PathLike, options: Options | None = None, *,
                 process_group: Any = None, **shorthands: Any) -> None:
        """``options`` (default: :class:`flashckpt.Options` ()) with ``shorthands`` laid
        over it: ``persist_every=``, ``keep_last=``, ``job_id=``, ``allow_pickle=``,
        ``memory_slots=``, ``replicas=`` (any other keyword is a TypeError)."""
        resolved = resolve_options(options, **shorthands)  # before the collective: a bad keyword fails alone
        collective = collective_for(process_group)
        self._engine = Engine(os.fspath(directory), resolved, place(collective, replicated=False), collective)
        self._refuse_partial_directories()

    def _refuse_partial_directories(self) -> None:
        """Node-local directories that do not each hold every rank's shard (three nodes or more)
        are a :class:`CheckpointError` on every rank, the engine closed: a load reads blocks from
        every rank's shard (replicated blocks are saved by one rank), from memory or storage."""
        engine = self._engine
        partial = engine.node_local.partial(engine.placement.storage_world) if engine.node_local else []
        if not partial:
            return
        engine.close()
        raise CheckpointError(
            f"MegatronCheckpointer cannot use node-local directories on {len(engine.node_local.scopes)} nodes: the "
            f"directory {self.directory} of node(s) {', '.join(partial)} holds only its own and its ring "
            f"predecessor's shards, but a megatron load reads blocks of every rank's shard (a replicated block is "
            f"saved once, by its data-parallel rank 0, and a load from storage opens every rank's shard); use a "
            f"directory every node shares, an object store, or node-local directories on two nodes")

    # -- save ---------------------------------------------------------------------

    def save(self, step: int, sharded_state_dict: dict, *, persist: bool | None = None) -> None:
        """Copy this rank's main-replica blocks into shared memory; persist if due."""
        blocks = self._blocks(sharded_state_dict)
        capture = self._capture
        with capture.saving(step, blocks) if capture is not None else nullcontext():
            self._engine.save(step, _packed(blocks), persist=persist)

    def _blocks(self, sharded_state_dict: dict) -> dict:
        """This rank's main-replica blocks by name (key and global offsets), their places, the
        sharded objects and (rank 0) the common part: what :func:`_packed` saves, and what a
        failure capture's ``state_fn`` is checked by."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

        if not isinstance(sharded_state_dict, dict):
            raise CheckpointError(f"expected a megatron sharded state dict, got {type(sharded_state_dict).__qualname__}")
        sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
        places, data, objects = {}, {}, {}
        for value in nested_values(sharded):
            if isinstance(value, ShardedTensor):
                if value.flattened_range is not None:
                    raise CheckpointError(f"{value.key}: flattened_range shards are not supported (megatron-core "
                                          "0.16 refuses them too; its distributed optimizer's 'dp_reshardable' "
                                          "format has none)")
                if value.data is None:
                    raise CheckpointError(f"{value.key}: ShardedTensor without data cannot be saved")
                if _is_main(value.replica_id):
                    piece = _piece(value)
                    name = f"{value.key}@{','.join(map(str, piece.offsets))}"
                    if name in data:
                        raise CheckpointError(f"{value.key}: two main-replica blocks at offsets {piece.offsets}")
                    places[name] = [value.key, list(piece.offsets), list(piece.lengths), list(value.global_shape)]
                    data[name] = value.data
            elif isinstance(value, ShardedObject):
                if _is_main(value.replica_id):
                    objects[value.unique_key] = _encode_object(value.data)
        keep_common = self._engine.collective.rank == 0
        return {"places": places, "data": data, "objects": objects, "common": common if keep_common else None}

    # -- failure capture ------------------------------------------------------------

    def save_on_failure(self, state_fn: Callable[[], dict], *, optimizer: Any,
                        boundary_state: Callable[[], dict] | None = None) -> FailureCapture:
        """On a failure, save the last finished optimizer step (see ``flashckpt._capture``).
        Every rank calls it once, from the main thread, after :meth:`load`.

        ``state_fn()`` returns the sharded state dict ``save`` takes (``{"model":
        model.sharded_state_dict(), "optimizer": optim.sharded_state_dict(...)}``); it is
        checked at the next save (raising, or other blocks, dtypes or shapes: an error
        there). ``optimizer`` is megatron-core's optimizer (``FP32Optimizer``, the fp16/bf16
        one, ``ChainedOptimizer``), or a torch optimizer where the loop steps one itself. The
        megatron wrappers have no step hooks and their torch optimizers' steps are not the
        whole update, so the boundary is the wrapper's: from ``step_with_ready_grads`` to the
        end of ``step`` (``flashckpt.megatron._capture``). On SIGTERM/SIGINT (also while the main
        thread is blocked in a collective, in forward or backward), an uncaught exception or
        ``capture()`` of the returned object, a rank outside that update calls ``state_fn()``
        on the thread that captures (in megatron-core 0.16, building the sharded state dicts of
        the model and of these optimizers is no collective and changes nothing) and writes its main-replica blocks
        as that step into its memory slot, persisted. The state is sharded: a restart loads a
        capture only where every rank captured it. The distributed optimizer is refused
        (:class:`~flashckpt.CheckpointError`: its sharded state dict is a collective).

        ``boundary_state()``: a partial sharded state dict of ``state_fn()``'s, called at the
        end of every update (see ``flashckpt._boundary``): its plain values (the common part),
        ``ShardedObject`` s and ``ShardedTensor`` blocks, copied, replace those of the same
        keys in a capture, e.g. ``{"data": {"consumed": n}, "rng_state": ShardedObject(...)}``.
        The tensors of the sharded state dict outside the update (module buffers) are found
        and copied at each boundary as with a torch optimizer (``flashckpt._boundary``), the
        wrapper's torch optimizers and fp16/bf16 model parameters counting as its own.
        """
        self._check_no_capture()
        if not callable(state_fn):
            raise TypeError(f"state_fn must be callable (returning the sharded state dict save takes), got "
                            f"{type(state_fn).__name__}")
        megatron = is_megatron_optimizer(optimizer)
        if megatron:
            check_capturable(optimizer)
        given = None if boundary_state is None else lambda: self._given_blocks(boundary_state())
        capture = self.engine_capture(lambda: self._blocks(state_fn()), None if megatron else optimizer, tree=_packed,
                                      boundary_state=given, owner=UpdateTensors(optimizer) if megatron else None)
        if megatron:
            capture.keep(StepBoundary(optimizer, capture))  # removed when the checkpointer closes
        return self.capture_with(capture, guard_saves=False)

    def _given_blocks(self, partial: dict) -> dict:
        """``boundary_state()``'s partial sharded state dict as the parts of :meth:`_blocks`
        it fills (none empty), laid over a capture's blocks."""
        return {part: value for part, value in self._blocks(partial).items() if value}

    # -- load ---------------------------------------------------------------------

    def load(self, sharded_state_dict: dict, *, step: int | None = None) -> tuple[dict | None, int | None]:
        """``(state_dict, step)`` of the agreed step, or ``(None, None)`` when there is none.

        The newest step every rank holds in memory, if not older than the newest
        committed one, else the newest committed step (or ``step``). All ranks call this.
        """
        start = time.perf_counter()
        self._engine.wait()
        direct = self._engine.agree(step, direct=True)  # _node_sources reads the own_disk shards in place
        try:
            agreement = self._in_memory_or_storage(direct, sharded_state_dict)
            state = self._load_on_all_ranks(sharded_state_dict, agreement)
        except StateMismatchError:
            raise
        except CheckpointError as exc:
            if not direct.own_disk:
                raise
            log.warning("step %d: reading shards straight from the node-local directories failed (%s); loading it "
                        "through its other copies", direct.step, exc)
            agreement = self._in_memory_or_storage(self._engine.agree(direct.step), sharded_state_dict)
            state = self._load_on_all_ranks(sharded_state_dict, agreement)
        self._engine.finish_load(agreement.step, agreement.source, start)
        return state, agreement.step

    def _load_on_all_ranks(self, sharded_state_dict: dict, agreement: Agreement) -> dict | None:
        if agreement.step is None:
            return None
        box: list[Any] = [None]

        def attempt() -> None:
            box[0] = self._load_step(sharded_state_dict, agreement)

        self._engine.on_all_ranks(attempt, f"loading step {agreement.step} of {self.directory}")
        return box[0]

    def _in_memory_or_storage(self, agreement: Agreement, sharded_state_dict: dict) -> Agreement:
        """The engine's agreement (memory on this node or a peer's replica, or a node-local
        directory's own shards read in place: ``Agreement.own_disk``) if every rank's node
        holds every block it asks for; else storage: another layout reads other ranks' blocks
        (made durable first)."""
        engine = self._engine
        chosen = agreement.step
        if chosen is None or agreement.source != Source.MEMORY:
            return agreement
        covered = engine.on_all_ranks(lambda: self._memory_covers(sharded_state_dict, agreement),
                                      f"looking for the blocks of step {chosen} in memory")
        if all(covered):
            return agreement
        if chosen != agreement.committed:
            engine.flush()  # another layout reads every rank's blocks: make them durable first
            engine.collective.all_gather(None)
        return agreement.from_storage()

    def _node_sources(self, agreement: Agreement) -> list[SavedShard]:
        """Every saved rank's copy of the agreed step on this node, one per rank: its slot,
        or -- a rank of this node named in ``agreement.own_disk`` (node-local directories) --
        its shard in this node's directory, read from there straight into the tensors."""
        nodes, step = self._engine.placement.nodes, agreement.step  # own state: storage rank = rank
        own = sorted(r for r in agreement.own_disk if nodes[r] == nodes[self._engine.collective.rank])
        found = self._memory_sources(step, skip=frozenset(own))
        try:
            for rank in own:
                found.append(source_of(rank, open_shard(self._engine.storage, step, rank), layout=False))
        except BaseException:
            close_sources(found)
            raise
        return sorted(found, key=lambda source: source.rank)

    def _memory_sources(self, step: int, skip: frozenset[int] = frozenset()) -> list[SavedShard]:
        """Every saved rank's image of ``step`` in this node's shared memory (one per rank),
        but the storage ranks in ``skip``.

        A rank reads the blocks it asks for from any local rank's slot: replicated blocks
        (written by replica 0 only) come from the slot of the rank that wrote them.
        """
        p = self._engine.placement
        found: dict[int, SavedShard] = {}
        try:
            for path in sorted(glob.glob(glob.escape(_names.job_prefix(self._engine.job_id)) + ".rank*.slot*")):
                slot = Slot.open(path, populate=False)  # read once: mapping every page up front costs more
                if slot is None:
                    continue
                h = slot.read_header()
                info = h.info
                if (h.state == SlotState.COMPLETE and h.step == step and info.get("storage_world") == p.storage_world
                        and info.get("directory") == self._engine.storage.root
                        and info.get("storage_rank") not in found and info.get("storage_rank") not in skip):
                    image = MemoryImage(memoryview(slot.mm)[HEADER_SIZE:HEADER_SIZE + h.image_len], path, slot.close)
                    found[info["storage_rank"]] = source_of(info["storage_rank"], ShardReader(image, None),
                                                            layout=False)
                else:
                    slot.close()
        except BaseException:
            close_sources(list(found.values()))
            raise
        return [found[r] for r in sorted(found)]

    def _memory_covers(self, sharded_state_dict: dict, agreement: Agreement) -> bool:
        """Whether this node's copies (:meth:`_node_sources`) hold every block this rank asks for."""
        sources = self._node_sources(agreement)
        try:
            reader = StepReader(sources, allow_pickle=self._engine.options.allow_pickle)
        except CheckpointError:
            close_sources(sources)
            return False
        try:
            requested = self._requested(sharded_state_dict)
            return (all(reader.covers(sh.key, _piece(sh)) for sh in requested["tensors"])
                    and all(o.unique_key in reader.objects for o in requested["objects"]))
        finally:
            reader.close()

    @staticmethod
    def _requested(sharded_state_dict: dict) -> dict[str, list]:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

        ssd, _, _ = load_preprocess(sharded_state_dict)
        values = list(nested_values(ssd))
        return {"tensors": [v for v in values if isinstance(v, ShardedTensor)],
                "objects": [v for v in values if isinstance(v, ShardedObject)]}

    def _reader(self, agreement: Agreement) -> StepReader:
        sources = (self._node_sources(agreement) if agreement.source == Source.MEMORY
                   else read_sources(self._engine.storage, agreement.step, layout=False))
        try:
            return StepReader(sources, allow_pickle=self._engine.options.allow_pickle)
        except BaseException:
            close_sources(sources)
            raise

    def _load_step(self, sharded_state_dict: dict, agreement: Agreement) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import merge
        from megatron.core.dist_checkpointing.mapping import apply_factory_merges
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        ssd, nonpersistent, factories = load_preprocess(sharded_state_dict)
        sharded, _ = extract_sharded_base(ssd)
        reader = self._reader(agreement)
        try:
            result = reader.common_state()
            merge(result, nonpersistent)
            merge(result, self.read_sharded(reader, sharded))
        finally:
            reader.close()
        return apply_factory_merges(result, factories)

    @staticmethod
    def read_sharded(reader: StepReader, sharded: Any) -> Any:
        """Replace every ShardedTensor / ShardedObject of ``sharded`` by its loaded value:
        the tensors' blocks read at once, in place into ``ShardedTensor`` data that is a
        contiguous CPU tensor of the block's shape, else into a new host tensor (copied
        into the data where it has that shape: a GPU parameter, one host-to-device copy)."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        problems: list[str] = []
        loaded: dict[int, torch.Tensor] = {}  # id(ShardedTensor) -> its tensor
        fills: list[Fill] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for value in nested_values(sharded):
            if not isinstance(value, ShardedTensor) or id(value) in loaded:
                continue
            piece, shape = _piece(value), tuple(value.local_shape)
            problem = reader.mismatch(value.key, piece, tuple(value.global_shape), value.dtype,
                                      value.allow_shape_mismatch)
            if problem is not None:
                problems.append(problem)
                continue
            data = value.data
            in_place = (data is not None and data.device.type == "cpu" and data.is_contiguous()
                        and data.dtype == value.dtype and tuple(data.shape) == shape)
            dest = data if in_place else torch.empty(shape, dtype=value.dtype)
            loaded[id(value)] = dest
            if data is not None and not in_place and tuple(data.shape) == shape:
                copies.append((data, dest))
                loaded[id(value)] = data
            if dest.numel():
                fills.append(Fill(host_byte_array(dest).reshape(byte_shape(piece.lengths, dest.element_size())),
                                  key=value.key, want=piece, dtype=DTYPE_NAMES[value.dtype],
                                  global_shape=tuple(value.global_shape)))
        if not problems:
            with torch.no_grad():
                reader.fill_many(fills)
                for data, dest in copies:
                    data.copy_(dest)

        def one(value: Any) -> Any:
            if isinstance(value, ShardedTensor):
                return loaded.get(id(value))
            if isinstance(value, ShardedObject):
                try:
                    return reader.sharded_object(value.unique_key)
                except StateMismatchError as exc:
                    problems.append(str(exc))
                    return None
            return value

        out = dict_list_map_outplace(one, sharded)
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise StateMismatchError(f"checkpoint does not match the model ({len(problems)} problems):\n  {shown}{more}")
        return out
