"""Lightning's ``.ckpt`` files in the IO's directory, as flashckpt keeps them.

Shared by the training process (:mod:`flashckpt.lightning._io`) and the saver's exporter
(:mod:`flashckpt.lightning._export`); imports neither torch nor Lightning.

- flashckpt's own steps live in ``<dirpath>/.flashckpt`` (:func:`flash_dir`).
- A save whose ``.ckpt`` file does not exist yet leaves a small **placeholder** there at
  once (:func:`write_placeholder`): Lightning's ``ckpt_path="last"`` looks for a
  ``last*.ckpt`` file, which must exist before the exporter has written the real one.
  The exporter replaces it with the stock file; only :class:`FlashCheckpointIO` reads a
  placeholder (the step it names, from memory or flashckpt's storage).
- The exporter publishes a file only while its path still exists, under an ``flock``
  that :func:`remove` takes too: a file Lightning removed (top-k) is never written back.
- A manifest (``.flashckpt-lightning.json``) records which step each exported file holds,
  so a new process loads that step from memory when it can.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator

from .._errors import CheckpointError
from ..storage._files import write_atomic

__all__ = ["MANIFEST", "PLACEHOLDER", "check_name", "exported_steps", "flash_dir", "is_last", "locked",
           "placeholder_step", "record_export", "remove", "write_placeholder"]

FLASH_SUBDIR = ".flashckpt"
MANIFEST = ".flashckpt-lightning.json"
LOCK = ".flashckpt-lightning.lock"
PLACEHOLDER = b"flashckpt-lightning placeholder\n"
"""The first bytes of a placeholder; a JSON object with the step follows."""
_SMALL = 1 << 16
_MAX_MANIFEST = 1 << 20


def flash_dir(dirpath: str) -> str:
    """Where flashckpt keeps its steps for the Lightning directory ``dirpath``."""
    return os.path.join(dirpath, FLASH_SUBDIR)


def check_name(name: str, dirpath: str) -> str:
    """``name`` if it is a plain file name for inside ``dirpath``, else a CheckpointError."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name or name.startswith(FLASH_SUBDIR):
        raise CheckpointError(f"{name!r} is not a plain checkpoint file name inside {dirpath}")
    return name


def is_last(name: str) -> bool:
    """A name Lightning's ``ckpt_path="last"`` picks (``last.ckpt``, ``last-v1.ckpt``): it
    always stands for the newest step, as Lightning overwrites it with each save."""
    return name.endswith(".ckpt") and name.startswith("last")


@contextlib.contextmanager
def locked(dirpath: str) -> Iterator[None]:
    """The directory's ``flock``: a file's existence check and its publication (or removal) are one step."""
    fd = os.open(os.path.join(dirpath, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_placeholder(path: str, step: int) -> bool:
    """Create the placeholder of ``step`` at ``path`` unless a file is there (an older
    ``last.ckpt`` stays readable until its replacement is written); whether it did."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(PLACEHOLDER + json.dumps({"step": step}).encode())
    return True


def placeholder_step(path: str) -> int | None:
    """The step a placeholder at ``path`` names; None for any other file (or none)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SMALL)
    except OSError:
        return None
    if not head.startswith(PLACEHOLDER):
        return None
    try:
        step = json.loads(head[len(PLACEHOLDER):])["step"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} is a damaged flashckpt placeholder") from None
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path} is a damaged flashckpt placeholder (step {step!r})")
    return step


def exported_steps(dirpath: str) -> dict[str, int]:
    """File name -> the step the exporter wrote there (the manifest; empty if none or unreadable)."""
    try:
        with open(os.path.join(dirpath, MANIFEST), "rb") as f:
            entries = json.loads(f.read(_MAX_MANIFEST))
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, int)}


def record_export(dirpath: str, name: str, step: int) -> None:
    """Note that ``name`` now holds ``step``, dropping names no longer there (call under :func:`locked`)."""
    entries = {k: v for k, v in exported_steps(dirpath).items() if os.path.exists(os.path.join(dirpath, k))}
    entries[name] = step
    write_atomic(os.path.join(dirpath, MANIFEST), json.dumps(entries).encode())


def remove(dirpath: str, name: str) -> None:
    """Remove the file ``name`` (a placeholder or the stock file), so that an export still
    to come for it writes nothing; flashckpt's steps are left to its own retention."""
    with locked(dirpath):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dirpath, check_name(name, dirpath)))
