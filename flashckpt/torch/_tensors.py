"""torch tensors as checkpoint tensors: dtype names, zero-copy views of shared memory,
batched copies, page-locked shared memory for CUDA copies.

Host copies of contiguous tensors go through :func:`flashckpt.memory._copy.copy_spans` as
plain bytes (streaming stores or ``memmove``, on a few threads), not through
``Tensor.copy_``: a slot packs
tensors back to back, as safetensors requires, so after AdamW's 4-byte ``step`` scalars
most tensors start off 64-byte alignment, and torch's vectorised copy then splits its
stores across cache lines (a 150 MB copy into an address 4 bytes off alignment took 25%
longer on two threads, ``memmove`` on one thread is as fast at any alignment). torch's
copy also forks and joins its OpenMP team once per tensor, which on a busy machine waits
for a descheduled thread again and again; the byte copy hands work to its threads once.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Hashable

import torch
from torch.autograd.graph import increment_version

from ..memory._copy import Span, copy_spans
from .._errors import CheckpointError
from ..memory._format import Entry
from ..memory._tree import register_kind

__all__ = ["TorchKind", "DTYPE_NAMES", "host_byte_array"]

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
        # a lazily conjugated or negated view holds other values than the tensor it views
        return (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), obj.stride(), obj.is_conj(), obj.is_neg())

    def empty(self, dtype: str, shape: tuple[int, ...]) -> Any:
        return torch.empty(shape, dtype=_DTYPES[dtype])

    def views(self, buffer: Any, base: int, entries: list[Entry]) -> list[Any]:
        if not entries:
            return []
        end = max(e.offset + e.nbytes for e in entries)
        body = _host_view(buffer)[base:base + end] if end else torch.empty(0, dtype=torch.uint8)
        return [body[e.offset:e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape) for e in entries]

    def copy(self, dsts: list[Any], srcs: list[Any]) -> None:
        spans: list[Span] = []
        written, rest_dsts, rest_srcs = [], [], []
        for dst, src in zip(dsts, srcs):
            span = _host_span(dst, src)
            if span is None:
                rest_dsts.append(dst)
                rest_srcs.append(src)
            elif span[2]:
                spans.append(span)
                written.append(dst)
        if spans:
            copy_spans(spans)  # dsts and srcs keep every tensor alive until it returns
            increment_version(written)  # an in-place write, as copy_ is, for autograd's checks
        if not rest_dsts:
            return
        gpus = {t.device for t in (*rest_dsts, *rest_srcs) if t.is_cuda}
        with torch.no_grad():
            lazy = [i for i, dst in enumerate(rest_dsts) if dst.is_conj() or dst.is_neg()]
            for i in reversed(lazy):  # _foreach_copy_ refuses lazily conjugated or negated targets
                rest_dsts.pop(i).copy_(rest_srcs.pop(i), non_blocking=bool(gpus))
            # GPU copies are queued on the current stream (after the work that produced
            # the values) and waited for once, not one by one
            if rest_dsts:
                torch._foreach_copy_(rest_dsts, rest_srcs, non_blocking=bool(gpus))
        for device in gpus:
            torch.cuda.current_stream(device).synchronize()

    def page_locker(self, objs: list[Any]) -> CudaPageLocker | None:
        return _CUDA_PAGES if any(t.is_cuda for t in objs) else None

    def host_bytes(self, obj: Any) -> memoryview | None:
        if obj.device.type != "cpu" or not obj.is_contiguous() or obj.is_conj() or obj.is_neg():
            return None  # a lazy conjugate or negation: its bytes are not its values
        flat = obj.detach().reshape(-1)
        if flat.numel() == 0:
            return memoryview(bytearray(0))
        return memoryview(flat.view(torch.uint8).numpy())


def host_byte_array(t: torch.Tensor) -> Any:
    """``t`` as a writable numpy uint8 array (last dimension in bytes: a target of the
    resharding reader), or None when it has no contiguous host bytes."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    shape = (*t.shape[:-1], t.shape[-1] * t.element_size()) if t.dim() else (t.element_size(),)
    # through the flat view: a contiguous tensor's axes of extent 1 may have any stride
    return t.detach().reshape(-1).view(torch.uint8).numpy().reshape(shape)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass (DTensor, ...) may mean more than its bytes


def _host_span(dst: torch.Tensor, src: torch.Tensor) -> Span | None:
    """The address span copying ``src`` into ``dst`` when copying their bytes is the copy
    (both plain, dense, contiguous, in host memory, of one dtype and shape, with no lazy
    conjugate or negation, each with memory behind it); else None."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        return None
    for t in (dst, src):
        if (type(t) not in _PLAIN or not t.is_cpu or t.layout != torch.strided or not t.is_contiguous()
                or t.is_conj() or t.is_neg() or not _has_storage(t)):
            return None
    return dst.data_ptr(), src.data_ptr(), dst.nbytes


def _has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has a storage of its own (a zero tensor or a functional wrapper has
    none: torch copies those); raises for a storage with no memory behind the tensor's
    bytes, such as a parameter FSDP freed by resizing its storage to 0, whose copy would
    read or write out of bounds (torch's own copy crashes the process on it)."""
    if not t.nbytes:
        return True
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    if storage.data_ptr() == 0 or storage.nbytes() < t.storage_offset() * t.element_size() + t.nbytes:
        raise CheckpointError(f"a {tuple(t.shape)} {t.dtype} tensor's storage holds {storage.nbytes()} bytes, "
                              f"fewer than the tensor spans (was its storage freed or resized?)")
    return True


register_kind(TorchKind())
