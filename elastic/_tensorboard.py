"""TensorBoard scalars without importing TensorBoard (or TensorFlow).

``torch.utils.tensorboard`` imports TensorFlow when it is installed -- 5 to 20 seconds
and hundreds of MB per process, paid again at every restart, which is exactly what
the agent must not add. A scalar event file is simple enough to write directly: a
sequence of records ``u64 length, u32 masked crc32c(length), data, u32 masked
crc32c(data)``, each ``data`` a serialized ``tensorboard.Event`` protobuf; the first
event carries ``file_version = "brain.Event:2"``. Only the fields the agent needs are
encoded (wall_time, step, file_version, summary.value{tag, simple_value}).
"""

from __future__ import annotations

import os
import socket
import struct
import time

__all__ = ["ScalarWriter", "crc32c", "encode_event"]

_POLY = 0x82F63B78  # Castagnoli, reflected


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``; records are small, so table-driven Python will do."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: two's complement, as protobuf does
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(*, wall_time: float, step: int = 0, file_version: str | None = None,
                 scalars: dict[str, float] | None = None) -> bytes:
    """A serialized ``Event`` (fields 1 wall_time, 2 step, 3 file_version, 5 summary)."""
    out = bytearray(b"\x09" + struct.pack("<d", wall_time))
    if step:
        out += b"\x10" + _varint(int(step))
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value)))
            for tag, value in scalars.items())
        out += _field_bytes(5, summary)
    return bytes(out)


class ScalarWriter:
    """Appends scalar events to ``<logdir>/events.out.tfevents.<time>.<host>.<pid>``."""

    def __init__(self, logdir: str) -> None:
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(
            logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}")
        self._file = open(self.path, "ab")
        self._write(encode_event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        head = struct.pack("<Q", len(data))
        self._file.write(head + struct.pack("<I", _masked(crc32c(head))) + data
                         + struct.pack("<I", _masked(crc32c(data))))
        self._file.flush()

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        self._write(encode_event(wall_time=time.time() if wall_time is None else wall_time,
                                 step=step, scalars=scalars))

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
