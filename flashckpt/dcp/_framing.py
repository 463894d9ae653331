"""The bytes ``torch.save`` writes around a tensor's data, so a tensor's record in a
``.distcp`` file is ``prefix + raw bytes + suffix`` and its data goes in with one copy.

DCP's ``FileSystemWriter`` writes every tensor item as a ``torch.save`` archive and its
reader ``torch.load``s each one back, so stock DCP files need that framing. The framing
depends only on the dtype and the shape (a contiguous tensor with a storage of its own),
so it is computed once per (dtype, shape) by saving an empty tensor of that kind and
recording everything ``torch.save`` writes except the data. The CRC32 fields are left 0
(``torch.serialization.set_crc32_options(False)``'s archives), which ``torch.load`` reads.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.serialization import config as _serialization_config

__all__ = ["Framing", "framing"]

Framing = tuple[bytes, bytes]
"""(prefix, suffix) around a tensor's raw bytes."""

_LOCK = threading.Lock()


class _Recorder:
    """A write-only stream keeping what is written, except the write of the tensor's data
    (``torch.save`` hands over a view of the tensor's own memory), which it marks with None."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.parts: list[bytes | None] = []
        self._data = (tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def write(self, b: Any) -> int:
        view = memoryview(b)
        if view.nbytes and (np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes) == self._data:
            self.parts.append(None)
        else:
            self.parts.append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def framing(dtype: torch.dtype, shape: tuple[int, ...]) -> Framing:
    """``torch.save``'s bytes before and after the data of a contiguous ``dtype`` tensor of ``shape``."""
    template = torch.empty(shape, dtype=dtype)
    recorder = _Recorder(template)
    with _LOCK:  # the option is process-wide: set it only around this save
        crc = _serialization_config.save.compute_crc32
        _serialization_config.save.compute_crc32 = False
        try:
            torch.save(template, recorder)
        finally:
            _serialization_config.save.compute_crc32 = crc
    parts = recorder.parts
    if template.numel() and parts.count(None) != 1:
        raise RuntimeError(f"torch.save wrote the data of a {dtype} tensor of shape {shape} "
                           f"{parts.count(None)} times; this torch's archive layout is not supported")
    at = parts.index(None) if None in parts else len(parts)
    return b"".join(p for p in parts[:at] if p is not None), b"".join(p for p in parts[at + 1:] if p is not None)
