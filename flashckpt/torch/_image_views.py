"""State trees whose tensors view a step's image in place, for the saver's exporters.

An exporter writes a committed step as a framework's own files (``torch.save``,
safetensors) without copying the state: from the image the saver just persisted, still
held in shared memory, or from a committed shard mapped from storage (a shard in an
object store, which has no file to map, is read whole into memory). Every tensor is
built over exactly its own bytes (a storage of its own, as the saved tensor had), so
``torch.save`` and safetensors write those bytes and no more. The views are read-only:
only ever read.
"""

from __future__ import annotations

import base64
import contextlib
import mmap
import pickle
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .._errors import CheckpointError
from ..memory._format import Entry, Image, parse_header
from ..memory._numpy_kind import _DTYPES as _NUMPY_DTYPES
from ..restore._shard_read import ShardReader, open_shard, unflatten
from ._tensors import _DTYPES as _TORCH_DTYPES

if TYPE_CHECKING:
    from ..saver._exporters import ImageHold
    from ..storage._protocol import Storage

__all__ = ["image_tree", "memory_tree", "read_shard", "step_trees", "unpickler"]

Unpickle = Callable[[str], Any]
"""Turns a pickled entry (base64) of the tree into its object, or raises."""


def unpickler(allow_pickle: bool, refusal: str) -> Unpickle:
    """Unpickles an entry when ``allow_pickle``; else raises ``CheckpointError(refusal)``."""
    def unpickle(blob: str) -> Any:
        if not allow_pickle:
            raise CheckpointError(refusal)
        return pickle.loads(base64.b64decode(blob))
    return unpickle


def image_tree(buf: Any, image: Image, base: int, unpickle: Unpickle, within: tuple[Any, ...] = ()) -> Any:
    """The state tree of the image whose body starts at byte ``base`` of ``buf``, its
    tensors viewing ``buf`` (each with a storage of its own over exactly its bytes);
    ``within``: the keys (of nested dicts) of the one subtree wanted, only its tensors built."""
    kinds = image.meta["kinds"]
    entries = {e.name: e for e in image.entries}
    leaves: dict[str, Any] = {}

    def leaf(name: str) -> Any:
        if name not in leaves:
            leaves[name] = _view(buf, entries[name], kinds[name], base)
        return leaves[name]

    node = image.meta["tree"]
    for key in within:
        node = next(child for k, child in node["d"] if k == key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only views: only ever read
        return unflatten(node, leaf, unpickle)


def _view(buf: Any, e: Entry, kind: str, base: int) -> Any:
    count = 1
    for d in e.shape:
        count *= d
    if kind == "numpy":
        return np.frombuffer(buf, dtype=_NUMPY_DTYPES[e.dtype], count=count, offset=base + e.offset).reshape(e.shape)
    if count == 0:
        return torch.empty(e.shape, dtype=_TORCH_DTYPES[e.dtype])
    # its own storage over exactly these bytes, as the saved tensor had
    return torch.frombuffer(buf, dtype=_TORCH_DTYPES[e.dtype], count=count, offset=base + e.offset).view(e.shape)


def memory_tree(memory: ImageHold, unpickle: Unpickle) -> Any:
    """The state tree of the image ``memory`` holds, its tensors viewing that memory: the
    same bytes as its shard on storage, which the persist just wrote from it."""
    view = memory.image()
    image = parse_header(view, f"the image of rank {memory.rank} in shared memory", len(view))
    return image_tree(view, image, len(image.header), unpickle)


def read_shard(reader: ShardReader, unpickle: Unpickle) -> tuple[Any, mmap.mmap | bytearray]:
    """The state tree of one committed shard, once every block verified, its tensors
    viewing the mapped file (keep the map open while they are used), or the bytes read
    into memory when the shard is not a local file (an object in a bucket)."""
    whole = reader.verified_whole()
    return image_tree(whole, reader.image, reader.body_start, unpickle), whole


@contextlib.contextmanager
def step_trees(storage: Storage, step: int, world_size: int, memory: ImageHold | None,
               unpickle: Unpickle) -> Iterator[list[Any]]:
    """Every rank's state tree of committed ``step`` for the ``with`` block: rank
    ``memory.rank``'s viewing the held image, the others' their shards (each verified,
    see :func:`read_shard`). On leaving, the list is emptied, the maps close and the image is let go
    (a save may write into its slot again): no view may be used after the block."""
    trees: list[Any] = []
    maps: list[mmap.mmap] = []
    try:
        for rank in range(world_size):
            if memory is not None and memory.rank == rank:
                trees.append(memory_tree(memory, unpickle))
                continue
            with open_shard(storage, step, rank, whole=True) as reader:
                tree, buf = read_shard(reader, unpickle)
            trees.append(tree)
            if isinstance(buf, mmap.mmap):
                maps.append(buf)
            tree = buf = None
        yield trees
    finally:
        trees.clear()  # the views must go before their maps can close and the slot be let go
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a view still alive somewhere: the map closes with it
                pass
        if memory is not None:
            memory.release()
