"""Write a committed flashckpt.tf step as a stock TensorFlow checkpoint.

Runs in the trainer (``Checkpointer.export``, to a local prefix: TF writes its files
itself) or in the node's saver process after a step commits (``save(..., export=True)``;
registered as "tf" in ``flashckpt.saver._exporters``), which writes the checkpoint into a
staging directory and publishes its folder whole through the storage layer's folders
(:mod:`flashckpt.storage._folders`: renamed into place locally, uploaded to a bucket), so
``step-<N>/tf/`` lands beside the step in a local directory or an object store alike.
Reads the image the saver just persisted, still held in shared memory, or else the
committed safetensors shard (checksum verified; from a bucket read into memory), and writes its
variables under their own checkpoint keys with ``SaveV2`` plus the object graph proto that
``tf.train.Checkpoint.restore`` matches objects by, and the ``checkpoint`` state file that
``tf.train.latest_checkpoint`` and estimators read.
Checkpoints of the estimator hook have no object graph: they export as name-based
(TF1) checkpoints, which ``tf.compat.v1.train.Saver`` and estimators restore.
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CheckpointError
from ..memory._format import Image, parse_header
from ..memory._numpy_kind import _DTYPES
from ..restore._shard_read import ShardReader, open_shard
from ..storage._folders import folders_at
from ..storage._location import is_url
from ..storage._url import open_storage

if TYPE_CHECKING:
    from ..saver._exporters import ImageHold

__all__ = ["export", "read_step", "write_tf_checkpoint"]

log = logging.getLogger("flashckpt.tf")

_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_MANIFEST = ".flashckpt-tf-exports.json"
"""Beside the steps: ``[[step, token], ...]``, the ``step-<N>/tf`` folders the saver wrote."""
_MAX_MANIFEST = 1 << 20



def _children(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.get("d", [])}


def read_step(directory: str, step: int) -> tuple[dict[str, np.ndarray], dict[str, Any], Any]:
    """``({checkpoint key: array}, the "tf" leaves (object graph in base64 or None, ...),
    buffer)`` of a committed step, every block verified first; the arrays view the buffer:
    the mapped file (close it when done), or the bytes of a shard in an object store
    (bfloat16 variables come as ``uint16``)."""
    with open_shard(open_storage(directory), step, 0, whole=True) as reader:
        buf = reader.verified_whole()
        path, image = reader.path, reader.image
    try:
        arrays, tf_node = _variables(image, buf, path)
    except CheckpointError:
        _close(buf)
        raise
    return arrays, tf_node, buf


def _close(buf: Any) -> None:
    """Let the buffer the arrays viewed go: release a view, close a map."""
    if isinstance(buf, memoryview):
        buf.release()
    elif isinstance(buf, mmap.mmap):
        buf.close()


def _variables(image: Image, buf: Any, where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays (viewing ``buf``, which holds the image from its header on) and the "tf"
    leaves of a flashckpt.tf image."""
    root = _children(image.meta["tree"])
    tf_node = {k: v.get("v") for k, v in _children(root.get("tf", {})).items()}
    if "variables" not in root or not tf_node.get("format", "").startswith("flashckpt.tf/"):
        raise CheckpointError(f"{where}: not a flashckpt.tf checkpoint")
    entries = {e.name: e for e in image.entries}
    base = len(image.header)
    arrays: dict[str, np.ndarray] = {}
    for key, node in _children(root["variables"]).items():
        e = entries[node["t"]]
        dtype = np.dtype(_DTYPES[e.dtype])
        arrays[key] = np.frombuffer(buf, dtype=dtype, count=e.nbytes // dtype.itemsize, offset=base + e.offset).reshape(e.shape)
    return arrays, tf_node


def write_tf_checkpoint(directory: str, step: int, prefix: str, *, memory: ImageHold | None = None) -> str:
    """Write committed ``step`` of ``directory`` as a TF checkpoint at ``prefix`` (a local
    path): from ``memory``, the image of its shard held in shared memory, when given (and
    let go after)."""
    import tensorflow as tf

    if is_url(prefix):
        raise CheckpointError(f"a TF checkpoint is written at a local prefix, not {prefix}: TF writes its files "
                              "itself (save(..., export=True) puts step-<N>/tf/ into the checkpoint's bucket)")

    if memory is not None:
        buf: Any = memory.image()
        try:
            arrays, tf_node = _variables(parse_header(buf, "the image in shared memory", len(buf)), buf,
                                         f"the image of step {step} in shared memory")
        except CheckpointError:
            buf.release()
            raise
        source = "memory"
    else:
        arrays, tf_node, buf = read_step(directory, step)
        source = "its shard"
    graph = tf_node.get("object_graph")
    try:
        for name in json.loads(tf_node.get("bfloat16") or "[]"):
            arrays[name] = arrays[name].view(tf.bfloat16.as_numpy_dtype)
        names = sorted(arrays)
        tensors: list[Any] = [arrays[name] for name in names]
        if graph is not None:
            names.append(_OBJECT_GRAPH_KEY)
            tensors.append(tf.constant(base64.b64decode(graph), dtype=tf.string))
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        with tf.device("/cpu:0"):
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
        from tensorflow.python.checkpoint import checkpoint_management

        checkpoint_management.update_checkpoint_state_internal(
            os.path.dirname(os.path.abspath(prefix)), os.path.abspath(prefix), [os.path.abspath(prefix)],
            save_relative_paths=True)
    finally:
        del arrays
        tensors = []
        try:
            _close(buf)
        except BufferError:  # a view is still referenced somewhere; the mapping goes with it
            log.debug("export mapping of step %d still referenced", step)
    log.info("exported step %d of %s as TF checkpoint %s (read from %s)", step, directory, prefix, source)
    return prefix


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Saver-process entry point: the prefix ``params["path"]`` or ``<dir>/step-<N>/tf/ckpt``
    (a local path or a URL), written from ``memory`` (rank 0's image, held in shared
    memory) when given; the prefix's folder (``tf``) is staged and published whole,
    replacing one of that name. The default folders of steps no longer committed go (see
    :func:`_retain`)."""
    beside_step = not params.get("path")
    prefix = params.get("path") or f"{directory.rstrip('/')}/step-{step}/tf/ckpt"
    if not is_url(prefix):
        prefix = os.path.abspath(prefix)
    parent, name, base = prefix.rsplit("/", 2)
    folders = folders_at(parent or "/")
    try:
        pending = folders.stage(name)
        try:
            write_tf_checkpoint(directory, step, os.path.join(pending, base),
                                memory=memory if memory is not None and memory.rank == 0 else None)
            folders.publish(name, pending)
        except BaseException:
            folders.discard(pending)
            raise
    finally:
        if memory is not None:
            memory.release()
    log.info("published the TF checkpoint of step %d as %s", step, prefix)
    if beside_step:
        _retain(directory, step)


def _retain(directory: str, step: int) -> None:
    """Delete the ``step-<K>/tf`` folders this exporter wrote whose step is no longer
    committed as written (an object store's retention deletes only a step's own objects;
    a local one removes the whole step directory, and this finds nothing left), and record
    ``step``'s in the manifest."""
    storage = open_storage(directory)
    folders = folders_at(directory)
    try:
        entries = [e for e in json.loads(folders.read_small(_MANIFEST, _MAX_MANIFEST) or b"[]")
                   if isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and e[0] != step]
    except (ValueError, TypeError):
        entries = []
    committed = set(storage.committed_steps())

    def still_committed(at: int, token: Any) -> bool:
        try:
            return at in committed and storage.metadata(at).get("token") == token
        except CheckpointError:
            return False

    try:
        mine = [[step, storage.metadata(step).get("token")]]
    except CheckpointError:  # retired by a newer commit while it was exported
        mine, entries = [], [*entries, [step, None]]
    keep = []
    for at, token in entries:
        if still_committed(at, token):
            keep.append([at, token])
        else:
            folders_at(f"{directory.rstrip('/')}/step-{at}").remove("tf")
    folders.write_atomic(_MANIFEST, json.dumps(keep + mine).encode())
