"""torch tensors as checkpoint tensors: dtype names, zero-copy views of shared memory,
batched copies."""

from __future__ import annotations

import warnings
from typing import Any, Hashable

import torch

from .._errors import CheckpointError
from .._format import Entry
from .._tree import register_kind

__all__ = ["TorchKind", "DTYPE_NAMES"]

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


class TorchKind:
    name = "torch"

    def matches(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    def describe(self, obj: Any) -> tuple[str, tuple[int, ...]]:
        name = DTYPE_NAMES.get(obj.dtype)
        if name is None:
            raise CheckpointError(f"torch dtype {obj.dtype} cannot be checkpointed")
        if obj.layout != torch.strided:
            raise CheckpointError(f"only dense tensors can be checkpointed, got layout {obj.layout}")
        return name, tuple(obj.shape)

    def identity(self, obj: Any) -> Hashable | None:
        if obj.numel() == 0:
            return None
        return (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride())

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        return torch.empty(shape, dtype=_DTYPES[dtype])

    def views(self, buffer: Any, base: int, entries: list[Entry]) -> list[Any]:
        if not entries:
            return []
        end = max(e.offset + e.nbytes for e in entries)
        if end == 0:
            body = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffers are only ever read from
                body = torch.frombuffer(buffer, dtype=torch.uint8, count=end, offset=base)
        return [body[e.offset:e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape) for e in entries]

    def copy(self, dsts: list[Any], srcs: list[Any]) -> None:
        if not dsts:
            return
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
        if any(t.is_cuda for t in srcs) or any(t.is_cuda for t in dsts):
            torch.cuda.synchronize()

    def host_bytes(self, obj: Any) -> memoryview | None:
        if obj.device.type != "cpu" or not obj.is_contiguous():
            return None
        flat = obj.detach().reshape(-1)
        if flat.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(flat.view(torch.uint8).numpy())


register_kind(TorchKind())
