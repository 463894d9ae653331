"""torch tensors as checkpoint tensors: dtype names, zero-copy views of shared memory,
batched copies, page-locked shared memory for CUDA copies."""

from __future__ import annotations

import logging
import threading
import time
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

log = logging.getLogger("flashckpt")


def _host_view(buffer: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are only ever read from
        return torch.frombuffer(buffer, dtype=torch.uint8)


class CudaPageLocker:
    """Page-locks shared memory with ``cudaHostRegister``, so that copies between a GPU
    and a slot are single DMA transfers at full bus speed (into pageable memory the
    driver stages every copy through its own buffer, at a fraction of that speed).

    A slot is locked once, when it is first written or read from a GPU (or in the
    background, when it is prepared); if the driver refuses, copies stay pageable and
    one warning says so.
    """

    _REGISTER_PORTABLE = 1  # locked for every CUDA context of the process
    _REGISTER_READ_ONLY = 8  # the mapping is read-only (cudaHostRegisterReadOnly)

    def __init__(self) -> None:
        self._failed = False
        self._lock = threading.Lock()

    def lock(self, buffer: Any, *, read_only: bool) -> Any:
        if self._failed or len(buffer) == 0:
            return None
        address = _host_view(buffer).data_ptr()
        flags = self._REGISTER_PORTABLE | (self._REGISTER_READ_ONLY if read_only else 0)
        start = time.perf_counter()
        rt = torch.cuda.cudart()
        error = rt.cudaHostRegister(address, len(buffer), flags)
        if error != rt.cudaError.success:
            with self._lock:
                if not self._failed:
                    self._failed = True
                    log.warning("could not page-lock %.1f MiB of shared memory for GPU copies (%s); copies "
                                "between GPU and shared memory go through the driver's staging buffers (slower)",
                                len(buffer) / 2**20, error)
            return None
        log.debug("page-locked %.1f MiB of shared memory in %.3fs", len(buffer) / 2**20, time.perf_counter() - start)
        return address

    def unlock(self, handle: Any) -> None:
        rt = torch.cuda.cudart()
        rt.cudaHostUnregister(handle)


_CUDA_PAGES = CudaPageLocker()


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
        body = _host_view(buffer)[base:base + end] if end else torch.empty(0, dtype=torch.uint8)
        return [body[e.offset:e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape) for e in entries]

    def copy(self, dsts: list[Any], srcs: list[Any]) -> None:
        if not dsts:
            return
        gpus = {t.device for t in (*dsts, *srcs) if t.is_cuda}
        with torch.no_grad():
            # GPU copies are queued on the current stream (after the work that produced
            # the values) and waited for once, not one by one
            torch._foreach_copy_(dsts, srcs, non_blocking=bool(gpus))
        for device in gpus:
            torch.cuda.current_stream(device).synchronize()

    def page_locker(self, objs: list[Any]) -> CudaPageLocker | None:
        return _CUDA_PAGES if any(t.is_cuda for t in objs) else None

    def host_bytes(self, obj: Any) -> memoryview | None:
        if obj.device.type != "cpu" or not obj.is_contiguous():
            return None
        flat = obj.detach().reshape(-1)
        if flat.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(flat.view(torch.uint8).numpy())


register_kind(TorchKind())
