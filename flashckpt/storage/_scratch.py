"""Private local scratch directories for a checkpoint location that is a URL, held while used.

A framework writes through local file calls even when flashckpt stores its checkpoints
in a bucket (DeepSpeed's ``save_checkpoint`` makes directories and copies a script into
its ``save_dir``), so its adapter gives it a private directory under the temporary
directory: ``flashckpt-<kind>-<random>``. :func:`make_scratch` makes one and holds it with
a shared ``flock``, which the kernel drops when the process dies; :meth:`Scratch.close`
removes it. The directories a crashed process left (not held, owned by this user) are
removed by the next :func:`make_scratch` and by ``flashckpt gc``
(:func:`remove_dead_scratch`), which take the lock exclusively before removing, so a live
process's directory is never touched, and one being made is made again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile

from ._pending import DIR_FLAGS

__all__ = ["KINDS", "Scratch", "make_scratch", "remove_dead_scratch"]

log = logging.getLogger(__name__)

KINDS = ("deepspeed",)
"""The adapters that make scratch directories (their names are ``flashckpt-<kind>-*``)."""
_NAME_RE = re.compile(rf"^flashckpt-({'|'.join(KINDS)})-[a-z0-9_]+$")


class Scratch:
    """A held scratch directory (``path``); :meth:`close` removes it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


def make_scratch(kind: str) -> Scratch:
    """A new scratch directory of adapter ``kind`` (one of :data:`KINDS`), held by this
    process; first removes what dead processes of this user left (best effort)."""
    if kind not in KINDS:
        raise ValueError(f"unknown scratch kind {kind!r}; known: {', '.join(KINDS)}")
    try:
        gone, _ = remove_dead_scratch()
        if gone:
            log.info("removed %d scratch director%s left by dead processes: %s", len(gone),
                     "y" if len(gone) == 1 else "ies", ", ".join(gone))
    except OSError as exc:
        log.debug("cannot look for dead scratch directories: %s", exc)
    while True:
        path = tempfile.mkdtemp(prefix=f"flashckpt-{kind}-")
        fd = os.open(path, DIR_FLAGS)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                return Scratch(path, fd)
        except FileNotFoundError:
            pass
        os.close(fd)  # a cleanup took it between the mkdtemp and the hold: make another


def remove_dead_scratch(*, dry_run: bool = False) -> tuple[list[str], list[str]]:
    """(removed, or would be with ``dry_run``; kept because a live process holds them): the
    scratch directories of this user under the temporary directory."""
    top = tempfile.gettempdir()
    dead, live = [], []
    for name in sorted(os.listdir(top)):
        if not _NAME_RE.match(name):
            continue
        path = os.path.join(top, name)
        try:
            fd = os.open(path, DIR_FLAGS)
        except OSError:  # gone, a link, or not a directory: not ours
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(path)
                continue
            dead.append(path)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
    return dead, live
