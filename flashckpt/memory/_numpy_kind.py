"""numpy arrays as checkpoint tensors (numpy is imported only when one is met)."""

from __future__ import annotations

import sys
from typing import Any, Hashable

from ._copy import copy_arrays
from .._errors import CheckpointError
from ._format import Entry
from ._tree import register_kind

__all__ = ["NumpyKind"]

_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
          "uint8": "U8", "bool": "BOOL", "complex64": "C64"}
_DTYPES = {v: k for k, v in _NAMES.items()}


class NumpyKind:
    name = "numpy"

    def matches(self, obj: Any) -> bool:
        np = sys.modules.get("numpy")
        return np is not None and type(obj) is np.ndarray

    def describe(self, obj: Any) -> tuple[str, tuple[int, ...]]:
        name = _NAMES.get(obj.dtype.name) if obj.dtype.isnative else None
        if name is None:
            raise CheckpointError(f"numpy dtype {obj.dtype} cannot be checkpointed")
        return name, tuple(obj.shape)

    def identity(self, obj: Any) -> Hashable | None:
        return None

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        import numpy as np
        return np.empty(shape, dtype=_DTYPES[dtype])

    def views(self, buffer: Any, base: int, entries: list[Entry]) -> list[Any]:
        import numpy as np
        return [np.frombuffer(buffer, dtype=_DTYPES[e.dtype], count=e.nbytes // max(np.dtype(_DTYPES[e.dtype]).itemsize, 1),
                              offset=base + e.offset).reshape(e.shape) for e in entries]

    def copy(self, dsts: list[Any], srcs: list[Any]) -> None:
        copy_arrays(dsts, srcs)

    def host_bytes(self, obj: Any) -> memoryview | None:
        if not obj.flags.c_contiguous or not obj.flags.writeable:
            return None
        return memoryview(obj.reshape(-1).view("u1"))


register_kind(NumpyKind())
