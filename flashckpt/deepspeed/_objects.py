"""DeepSpeed's own non-tensor objects in a flashckpt tree, and back.

DeepSpeed's checkpoint state dicts hold, besides tensors and plain values, a few
objects of its own: the fp16 ``LossScaler``, ``ZeroStageEnum``, the
``fragment_address`` named tuples of ``param_slice_mappings``, ``torch.Size`` in
``param_shapes`` and ``OrderedDict`` containers. flashckpt's tree keeps only plain
JSON leaves, so :func:`encode` rewrites those into tagged dicts (new containers; the
tensors are the caller's, never copied) and :func:`decode` rebuilds them.

Trade-off, stated plainly: DeepSpeed's objects are stored pickled (base64 inside the
JSON metadata) and unpickled through an allow-list that admits only classes from
``deepspeed.*`` plus ``torch.Size``, ``OrderedDict``, ``set``/``frozenset`` and
``argparse.Namespace``. That is the one exception to "loading never unpickles", and it
does not widen to user objects: anything else raises unless the caller passed
``allow_pickle=True`` (then the core stores it pickled, as for any checkpointer).
"""

from __future__ import annotations

import base64
import io
import pickle
from collections import OrderedDict
from typing import Any

from .._errors import CorruptCheckpointError

__all__ = ["TAG", "encode", "decode", "is_deepspeed_object"]

TAG = "__flashckpt_ds__"
_PLAIN = (int, float, str, bool, type(None))
_ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
            ("builtins", "frozenset"), ("argparse", "Namespace")}


def is_deepspeed_object(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return module == "deepspeed" or module.startswith("deepspeed.")


def _is_tensor(obj: Any) -> bool:
    import torch
    return isinstance(obj, torch.Tensor)


def encode(obj: Any) -> Any:
    """A tree flashckpt can store: the same tensors, DeepSpeed's objects as tagged dicts."""
    if type(obj) in _PLAIN or _is_tensor(obj):
        return obj
    if type(obj) is dict:
        return {k: encode(v) for k, v in obj.items()}
    if type(obj) is OrderedDict:
        return {TAG: "odict", "keys": list(obj.keys()),
                "values": [encode(v) for v in obj.values()]}
    if type(obj) is list:
        return [encode(v) for v in obj]
    if type(obj) is tuple:
        return tuple(encode(v) for v in obj)
    import torch
    if type(obj) is torch.Size:
        return {TAG: "size", "dims": list(obj)}
    if type(obj) in (set, frozenset) and all(type(v) in _PLAIN for v in obj):
        return {TAG: type(obj).__name__, "items": sorted(obj, key=repr)}
    if is_deepspeed_object(obj) or type(obj).__name__ == "Namespace":
        return {TAG: "pickle", "b64": base64.b64encode(pickle.dumps(obj, protocol=4)).decode("ascii")}
    return obj  # the core stores it pickled if allow_pickle, else names it in a clear error


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed.") or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CorruptCheckpointError(f"refusing to unpickle {module}.{name} from a DeepSpeed checkpoint "
                                     "(only DeepSpeed's own objects are allowed)")


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`; rebuilds containers, keeps the tensors as they are."""
    if type(obj) is dict:
        kind = obj.get(TAG)
        if kind is None:
            return {k: decode(v) for k, v in obj.items()}
        if kind == "odict":
            return OrderedDict(zip(obj["keys"], (decode(v) for v in obj["values"])))
        if kind == "size":
            import torch
            return torch.Size(obj["dims"])
        if kind in ("set", "frozenset"):
            return (set if kind == "set" else frozenset)(obj["items"])
        if kind == "pickle":
            return _AllowListUnpickler(io.BytesIO(base64.b64decode(obj["b64"]))).load()
        raise CorruptCheckpointError(f"unknown DeepSpeed object tag {kind!r}")
    if type(obj) is list:
        return [decode(v) for v in obj]
    if type(obj) is tuple:
        return tuple(decode(v) for v in obj)
    return obj
