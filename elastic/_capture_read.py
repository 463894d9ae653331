"""``ShardSampler``'s side of a flashckpt failure capture: whether one is running, and its
read of the coordinator as of the captured step."""

from __future__ import annotations

import sys
import threading
from typing import Any

import sharding

__all__ = ["CAPTURE_READ_SECONDS", "capturing", "read_as_of"]

CAPTURE_READ_SECONDS = 10.0
"""How long a failure capture on the training thread waits to read the coordinator."""


def capturing() -> bool:
    """Inside a flashckpt failure capture's ``state_fn`` (on whichever thread)."""
    capture = sys.modules.get("flashckpt._capture")
    return capture is not None and capture.capturing()


def read_as_of(ds: "sharding.Dataset", step: int, training_thread: int) -> dict[str, Any]:
    """``ds``'s state as of ``step``, for a capture. On the training thread (a signal handled
    there) that thread may be inside a call into the same store, whose lock it holds: the
    read goes on a thread of its own and gives up after :data:`CAPTURE_READ_SECONDS`."""
    if threading.get_ident() != training_thread:
        return ds.state_dict(as_of=step)  # the training thread goes on and frees the store
    got: list[Any] = []

    def read() -> None:
        try:
            got.append(ds.state_dict(as_of=step))
        except BaseException as exc:
            got.append(exc)

    reader = threading.Thread(target=read, name="shard-sampler-capture", daemon=True)
    reader.start()
    reader.join(CAPTURE_READ_SECONDS)
    if not got:
        raise sharding.CoordinatorError(
            f"{ds.name}: the coordinator's state could not be read within {CAPTURE_READ_SECONDS:.0f}s for the "
            "failure capture (the capture interrupted this thread inside a call into the same store?)")
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]
