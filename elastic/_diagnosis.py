"""Failure diagnosis: which kind of failure an exception is, and what to do about it.

Pure functions over the exception (its type, its message, its chain of causes and the
modules in its traceback); no framework is imported. The rules are deliberately
textual for the errors that frameworks raise as a bare ``RuntimeError`` (NCCL, gloo,
CUDA), the same way DLRover and NVIDIA's resiliency extension classify them.

Kinds and their recommended action:

========== ================== =============================================================
kind       action             meaning
========== ================== =============================================================
oom        restart_process    CPU ``MemoryError`` or CUDA out of memory; a restart frees it
network    restart_process    collective timeout, connection reset, NCCL/gloo errors
hardware   replace_node       CUDA illegal address, ECC / Xid errors: this node is suspect
data       abort              the error came from the data path; a restart replays it
software   abort              everything else: a bug that a restart repeats
preempted  restart_process    SIGTERM from the scheduler or the launcher
hang       restart_process    no progress for longer than the hang timeout
========== ================== =============================================================
"""

from __future__ import annotations

import dataclasses
import enum
import re
from types import TracebackType

__all__ = ["Action", "Diagnosis", "Kind", "diagnose"]


class Kind(str, enum.Enum):
    OOM = "oom"
    NETWORK = "network"
    HARDWARE = "hardware"
    DATA = "data"
    SOFTWARE = "software"
    PREEMPTED = "preempted"
    HANG = "hang"


class Action(str, enum.Enum):
    RESTART_PROCESS = "restart_process"
    REPLACE_NODE = "replace_node"
    ABORT = "abort"


_ACTION = {
    Kind.OOM: Action.RESTART_PROCESS,
    Kind.NETWORK: Action.RESTART_PROCESS,
    Kind.HARDWARE: Action.REPLACE_NODE,
    Kind.DATA: Action.ABORT,
    Kind.SOFTWARE: Action.ABORT,
    Kind.PREEMPTED: Action.RESTART_PROCESS,
    Kind.HANG: Action.RESTART_PROCESS,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Diagnosis:
    """What failed and what to do: ``kind`` and ``action`` (string enums), ``reason`` (text)."""

    kind: Kind
    action: Action
    reason: str

    @classmethod
    def of(cls, kind: Kind, reason: str) -> "Diagnosis":
        return cls(kind=kind, action=_ACTION[kind], reason=reason)

    @property
    def retryable(self) -> bool:
        """True when restarting the process can fix it (``action == restart_process``)."""
        return self.action is Action.RESTART_PROCESS

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind.value, "action": self.action.value, "reason": self.reason}


# Order matters: hardware before oom before network (a CUDA error text can mention NCCL).
_HARDWARE = re.compile(
    r"illegal memory access|illegal address|uncorrectable ecc|ecc error|\bxid\b|"
    r"unspecified launch failure|hardware error|cuda error: (?:an illegal|misaligned|"
    r"uncorrectable)|nvlink error|gpu has fallen off the bus|device-side assert",
    re.IGNORECASE,
)
_OOM = re.compile(r"out of memory|cannot allocate memory|oom-kill|\boom\b", re.IGNORECASE)
_NETWORK = re.compile(
    r"\bnccl\b|\bgloo\b|timed out waiting|collective operation timeout|watchdog caught "
    r"collective|connection reset|connection refused|connection closed|broken pipe|"
    r"socket timeout|network is unreachable|no route to host|ncclRemoteError|"
    r"ncclSystemError|ProcessGroup.*(?:timeout|abort)|store.*timeout|"
    r"Timeout waiting for key|Connection timed out",
    re.IGNORECASE,
)
_NETWORK_TYPES = (ConnectionError, TimeoutError)
# Modules whose frames mark an error as coming from the data path.
_DATA_MODULES = re.compile(
    r"(?:^|[./])(?:torch/utils/data|torchdata|tensorflow/python/data|sharding|"
    r"elastic/_sampler|datasets)(?:[./]|$)"
)


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes/contexts, outermost first, without cycles."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not s for s in seen):
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _frames(tb: TracebackType | None) -> list[str]:
    files = []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    return files


def _type_names(exc: BaseException) -> list[str]:
    return [f"{t.__module__}.{t.__qualname__}" for t in type(exc).__mro__]


def _one(exc: BaseException) -> Diagnosis | None:
    text = f"{type(exc).__name__}: {exc}"
    names = _type_names(exc)
    short = text if len(text) <= 300 else text[:297] + "..."
    if _HARDWARE.search(text):
        return Diagnosis.of(Kind.HARDWARE, f"hardware error: {short}")
    if isinstance(exc, MemoryError) or any(n.endswith("OutOfMemoryError") for n in names) \
            or _OOM.search(text):
        return Diagnosis.of(Kind.OOM, f"out of memory: {short}")
    if isinstance(exc, _NETWORK_TYPES) or any(
            n.startswith("torch.distributed") or "DistNetworkError" in n or "DistBackendError" in n
            for n in names[:1]) or _NETWORK.search(text):
        return Diagnosis.of(Kind.NETWORK, f"network/collective error: {short}")
    if any(n.startswith("sharding.") for n in names[:1]) or "DataLoader worker" in text:
        return Diagnosis.of(Kind.DATA, f"data error: {short}")
    frames = [f for f in _frames(exc.__traceback__) if _DATA_MODULES.search(f)]
    if frames:
        return Diagnosis.of(Kind.DATA, f"data error (raised through {frames[-1]}): {short}")
    return None


def diagnose(exc: BaseException) -> Diagnosis:
    """Classify ``exc`` (walking its ``__cause__``/``__context__`` chain).

    The first exception in the chain that a specific rule matches decides; a chain that
    none matches is ``software`` with action ``abort``. Never raises.
    """
    if isinstance(exc, KeyboardInterrupt):
        return Diagnosis.of(Kind.PREEMPTED, "interrupted (KeyboardInterrupt)")
    try:
        for link in _chain(exc):
            found = _one(link)
            if found is not None:
                return found
    except Exception as err:  # a diagnosis must never raise on a strange exception
        return Diagnosis.of(Kind.SOFTWARE, f"{type(exc).__name__} (diagnosis failed: {err})")
    text = f"{type(exc).__name__}: {exc}"
    return Diagnosis.of(Kind.SOFTWARE, f"software error: {text[:300]}")
