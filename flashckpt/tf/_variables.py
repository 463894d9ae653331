"""TF variables as checkpoint leaves: naming them, reading them with one copy, writing back.

Names are the keys a stock ``tf.train.Checkpoint`` gives the variables
(``model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE``), taken from TF's own
object-graph serialisation, so an export is a byte copy under the same keys plus the
object graph proto.

One copy on save: ``var.value()._numpy()`` of a CPU variable is a numpy view of the
variable's own buffer (no copy), and the engine copies that view into shared memory.
bfloat16 variables travel as ``uint16`` views of the same bytes; the state lists their
keys (``bfloat16_keys``), so loads and exports give them back as bfloat16. String
variables and lookup tables are refused.
In-place load: when two reads give the same buffer (the variable is not in TF's
copy-on-read mode), the engine copies straight into that buffer; otherwise the value
is loaded into a host array and ``assign``-ed (one more copy, measured in
``benchmarks/tf_save.py``).
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import numpy as np
import tensorflow as tf

from ..memory._copy import overlapping
from .._errors import CheckpointError

__all__ = ["BFLOAT16", "as_checkpoint", "as_stored", "bfloat16_keys", "build_optimizers", "check_bfloat16", "collect",
           "host_array", "read_alias", "writable_alias"]

log = logging.getLogger(__name__)

BFLOAT16 = tf.bfloat16.as_numpy_dtype


def as_checkpoint(obj: Any) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint``; a Keras model is wrapped with its optimizer. Its
    ``save_counter`` is created, as ``Checkpoint.save`` does, so that an export restores
    with ``assert_consumed()``."""
    if isinstance(obj, tf.train.Checkpoint):
        root = obj
    elif isinstance(obj, tf.keras.Model):
        optimizer = getattr(obj, "optimizer", None)
        root = tf.train.Checkpoint(model=obj, optimizer=optimizer) if optimizer is not None else tf.train.Checkpoint(model=obj)
    elif isinstance(obj, dict) and obj:
        root = tf.train.Checkpoint(**obj)
    else:
        raise TypeError("checkpoint must be a tf.train.Checkpoint, a Keras model or a dict of trackables, "
                        f"got {type(obj).__name__}")
    root._maybe_create_save_counter()
    return root


def collect(root: tf.train.Checkpoint) -> tuple[dict[str, tf.Variable], str]:
    """``{checkpoint key: variable}`` and the object graph proto (base64), as TF's own
    ``Checkpoint.write`` would name them. Raises for state that is not a variable."""
    from tensorflow.python.checkpoint import graph_view, save_util

    serialized, _, registered, proto = save_util.serialize_graph_view(graph_view.ObjectGraphView(root))
    if registered:
        raise CheckpointError(f"flashckpt.tf cannot checkpoint objects with registered savers: {sorted(registered)}")
    variables: dict[str, tf.Variable] = {}
    unsupported: list[str] = []
    for trackable, tensors in serialized.items():
        for key in tensors:
            if isinstance(trackable, tf.Variable):
                variables[key] = trackable
            else:
                unsupported.append(f"{key} ({type(trackable).__name__})")
    if unsupported:
        raise CheckpointError("flashckpt.tf checkpoints variables only; these entries are not variables: "
                              + ", ".join(unsupported[:10]))
    return variables, base64.b64encode(proto.SerializeToString()).decode("ascii")


def build_optimizers(root: tf.train.Checkpoint) -> list[str]:
    """Create the slot variables of Keras optimizers that have not taken a step yet, so
    that a load before the first step finds every variable of the checkpoint: a model's
    compiled optimizer for its trainable variables, one beside a single model for that
    model's. Returns the names of the optimizers beside the models that had not taken a
    step (built so, or, beside several models, not built: which variables each trains is
    not known)."""
    children = dict(root._trackable_children())
    models = [c for c in children.values() if isinstance(c, tf.keras.Model)]
    for model in models:
        if getattr(model, "optimizer", None) is not None:
            _build(model.optimizer, model.trainable_variables)
    fresh = [name for name, child in children.items() if _unbuilt(child)]
    if len(models) == 1:
        for name in fresh:
            _build(children[name], models[0].trainable_variables)
    return fresh


def _unbuilt(optimizer: Any) -> bool:
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        return not getattr(optimizer, "_built", False)
    # a legacy optimizer makes its step counter when it is read: its slots tell whether it stepped
    return isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer) and not optimizer._slots


def _build(optimizer: Any, var_list: list[tf.Variable]) -> None:
    if not var_list:
        return
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        if not getattr(optimizer, "_built", False):
            optimizer.build(var_list)
    elif isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):
        optimizer._create_all_weights(var_list)


def _on_host(var: tf.Variable) -> bool:
    return "GPU" not in (var.device or "").upper() and "TPU" not in (var.device or "").upper()


def as_stored(array: Any) -> np.ndarray:
    """A numpy value as the engine stores it: bfloat16 as a ``uint16`` view (no copy)."""
    array = array if isinstance(array, np.ndarray) else np.asarray(array)  # a 0-d value comes as a scalar
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def read_alias(var: tf.Variable) -> np.ndarray:
    """The variable's value as numpy: a view of its buffer on CPU (no copy)."""
    value = var.value()
    if value.dtype == tf.string:
        raise CheckpointError(f"variable {var.name}: string variables are not supported by flashckpt.tf")
    return as_stored(value._numpy())


def host_array(var: tf.Variable) -> np.ndarray:
    """A fresh array to load ``var`` into (bfloat16 as ``uint16``); ``assign`` it with
    ``.view(var.dtype.as_numpy_dtype)``."""
    dtype = var.dtype.base_dtype
    return np.empty(var.shape, dtype=np.uint16 if dtype == tf.bfloat16 else dtype.as_numpy_dtype)


def writable_alias(var: tf.Variable) -> np.ndarray | None:
    """A writable numpy view of the variable's own buffer, or None where TF hands out
    copies (copy-on-read mode, device memory): then load must ``assign``."""
    if not _on_host(var):
        return None
    first, second = var.value()._numpy(), var.value()._numpy()
    if not isinstance(first, np.ndarray) or not isinstance(second, np.ndarray):
        return None  # 0-d values come as numpy scalars (copies)
    same = first.ctypes.data == second.ctypes.data and first.nbytes > 0
    del second
    if same and first.flags.writeable and first.flags.c_contiguous:
        return as_stored(first)
    return None


def without_shared_bytes(aliases: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """``aliases`` (variable views, or None) with None for each view whose bytes another view
    shares, in whole or in part: a load into one would write the other's values (TF backs
    a variable made from another, Keras' EMA copies and freshly initialised variables with
    one buffer until a write); those load through ``assign``, which copies on write."""
    shared = overlapping((a.ctypes.data, a.ctypes.data + a.nbytes, key) for key, a in aliases.items() if a is not None)
    return {key: None if key in shared else a for key, a in aliases.items()}


def bfloat16_keys(dtypes: dict[str, Any]) -> str:
    """The keys of bfloat16 variables (``{key: tf dtype}``), as the JSON leaf the state keeps."""
    return json.dumps(sorted(key for key, dtype in dtypes.items() if dtype.base_dtype == tf.bfloat16))


def check_bfloat16(saved: Any, dtypes: dict[str, Any], where: str) -> None:
    """Refuse a load whose bfloat16 variables are not those saved (both travel as uint16)."""
    was = set(json.loads(saved or "[]"))
    now = set(json.loads(bfloat16_keys(dtypes)))
    if was != now:
        raise CheckpointError(f"{where}: bfloat16 here and not in the checkpoint, or the other way round: "
                              + ", ".join(sorted(was ^ now)[:10]))
