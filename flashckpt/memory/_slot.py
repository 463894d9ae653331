"""A slot: one shared-memory file holding a 4 KiB header and a safetensors image.

Each rank that keeps a copy in memory owns two slots (by default), so that a save never
overwrites the newest complete copy while the saver may be reading it. The header
says whether the image is WRITING or COMPLETE, with a generation counter bumped on
every write; a reader trusts an image only if it saw COMPLETE with the same
generation before and after reading. Header updates happen under an ``flock`` on the
rank's lock file, which the kernel releases when a holder dies (a POSIX semaphore
would stay taken by a process killed inside its critical section).

The header names one reader (``reader_pid``), not a count of readers, because one holder
is all the design has: the trainer hands a slot due for storage to its saver (the saver's
pid, set with COMPLETE), and the saver persists a rank's slots one job at a time (its
threads take different ranks, see ``flashckpt.saver._jobs``), so at most one persist
reads a slot at once; a persist whose step the saver exports from memory keeps its hold
until that export has read the image (``flashckpt.saver._persist.SlotHold``). Peer
replication never holds a slot: it reads seqlock-style (COMPLETE and the same
generation before and after), and a save that overwrites the slot meanwhile just
withdraws that copy. A pid also survives its holder's death honestly
(``pid_alive``), where a count left raised by a killed reader would pin the slot.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Iterator, Protocol

from .._errors import SharedMemoryError, UnsafeFileError

__all__ = ["HEADER_SIZE", "SlotState", "SlotHeader", "Slot", "PageLocker", "RankLock", "mark_writing",
           "open_private", "shm_free_bytes", "pid_alive", "being_read"]

HEADER_SIZE = 4096
_MAGIC = b"FCKSLOT1"
_FMT = "<8sIIQqQIIdI"  # magic, state, pad, generation, step, image_len, writer, reader, saved_at, info_len
_FIXED = struct.calcsize(_FMT)
_GROW_HEADROOM = 1 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_THREADS = 8
_POPULATE_MIN_PART = 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _populate_write(mm: mmap.mmap) -> None:
    """``madvise(MADV_POPULATE_WRITE)`` over the whole mapping, through ctypes: Python's
    ``mmap.madvise`` holds the GIL for the whole call (a second per GB), which would stall
    the training thread while a background thread prepares a slot. Large mappings are
    populated by several threads at once: the kernel's page allocation is the cost, and
    it runs in parallel."""
    buf = (ctypes.c_char * len(mm)).from_buffer(mm)
    try:
        base = ctypes.addressof(buf)
        parts = max(1, min(os.cpu_count() or 1, _POPULATE_THREADS, len(mm) // _POPULATE_MIN_PART))
        step = -(-len(mm) // parts // mmap.PAGESIZE) * mmap.PAGESIZE
        errors: list[int] = []

        def populate(start: int) -> None:
            if _libc.madvise(base + start, min(step, len(mm) - start), _MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())

        helpers = [threading.Thread(target=populate, args=(start,), name="flashckpt-populate")
                   for start in range(step, len(mm), step)]
        for thread in helpers:
            thread.start()
        populate(0)
        for thread in helpers:
            thread.join()
        if errors:
            raise OSError(errors[0], os.strerror(errors[0]))
    finally:
        del buf  # releases the buffer export, so the mapping can be closed


def _probe_populate_write() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14+)."""
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as mm:
            _populate_write(mm)
        return True
    except (OSError, ValueError):
        return False


_POPULATE_WRITE = _probe_populate_write()


class PageLocker(Protocol):
    """Page-locks host memory for an accelerator's copies (CUDA's ``cudaHostRegister``):
    device copies to and from locked pages run by DMA at full bus speed, with no
    staging through the driver's own buffers."""

    def lock(self, buffer: Any, *, read_only: bool) -> Any:
        """Lock the pages of ``buffer``; a handle for :meth:`unlock`, or None if they
        could not be locked (copies then still work, slower)."""

    def unlock(self, handle: Any) -> None: ...


class SlotState(IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2


@dataclass(slots=True)
class SlotHeader:
    state: SlotState = SlotState.EMPTY
    generation: int = 0
    step: int = -1
    image_len: int = 0
    writer_pid: int = 0
    reader_pid: int = 0
    saved_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    """Who wrote the image and where it belongs on storage (rank, world, directory, ...)."""

    @property
    def persist_asked(self) -> bool:
        """A persist of this image was asked and has not finished: a save that asks names
        the saver as its reader, and the saver clears the reader once it is written."""
        return self.reader_pid != 0


def shm_free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by its parent) does not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return state not in (b"Z", b"X")


def being_read(h: SlotHeader) -> bool:
    """A live process reads the slot of header ``h`` (a saver persisting or exporting it)."""
    return bool(h.reader_pid and pid_alive(h.reader_pid))


def open_private(path: str, flags: int) -> int | None:
    """Open a shared-memory object of this user (None if missing and not created):
    never through a symlink, never a FIFO or device, never a file of another user or one
    open to others (:class:`UnsafeFileError`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symlink; refusing to use it") from exc
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    if problem is not None:
        os.close(fd)
        raise UnsafeFileError(f"{path} {problem}; refusing to use it")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


class RankLock:
    """An exclusive ``flock`` guarding the slot headers of one rank, from other processes
    and, through a thread lock, from this process's other threads (an ``flock`` is held by
    the open file, which every thread of the process shares; an overlapped save completes
    its slot on a copy thread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        """Opened (and the file created) on first use: a rank that never holds slots leaves no file."""
        self._threads = threading.RLock()
        self._held = False
        """The flock is taken (by the thread holding ``_threads``): a nested hold keeps it."""

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._threads:
            if self._fd < 0:
                self._fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            outer = self._held
            if not outer:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._held = True
            try:
                yield
            finally:
                if not outer:
                    self._held = False
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Slot:
    """One mapped shared-memory slot file."""

    def __init__(self, path: str, fd: int, writable: bool, populate: bool, image_size: int = 0) -> None:
        self.path = path
        self._fd = fd
        self._writable = writable
        self._populate = populate
        self.mm: mmap.mmap | None = None
        self.capacity = 0
        self._locker: PageLocker | None = None
        self._lock_handle: Any = None
        self._persist_fd = -1
        try:
            if image_size:
                self._grow_file(image_size)
            self._map()
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, path: str, *, writable: bool = False, create: bool = False,
             populate: bool = True, image_size: int = 0) -> "Slot | None":
        """Map an existing slot (None if there is none); ``create`` makes an empty one.

        ``populate`` sets up every page-table entry at once, which pays off for a slot
        that is written again and again; a slot read once is cheaper unpopulated (reads
        fault 16 pages at a time). ``image_size`` (writable slots): grown first to hold an
        image that large, so that it is mapped once.
        """
        fd = open_private(path, (os.O_RDWR if writable else os.O_RDONLY) | (os.O_CREAT if create else 0))
        return None if fd is None else cls(path, fd, writable, populate, image_size)

    def lock_for_persist(self, seconds: float) -> bool:
        """Take this slot's persist lock, an ``flock`` on its file (two processes never
        write one slot to storage at once), waiting up to ``seconds``; False if another
        holder kept it that long. Closing the slot releases it.

        The lock is taken through a descriptor of its own: the mapping holds a copy of the
        slot's (Python's ``mmap`` duplicates it), which would keep the lock for as long as
        any view of the slot lives on."""
        if self._persist_fd < 0:
            self._persist_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(self._persist_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)

    def _map(self) -> None:
        size = os.fstat(self._fd).st_size
        self._unlock_pages()
        self.mm = None  # views into an old mapping keep it alive until they go
        self.capacity = size
        if size < HEADER_SIZE:
            return
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self._writable else 0)
        write_populate = self._populate and self._writable and _POPULATE_WRITE
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self._populate and not write_populate else 0)
        self.mm = mmap.mmap(self._fd, size, flags=flags, prot=prot)
        if write_populate:
            # allocates missing pages, zeroes and maps them in one pass; a full /dev/shm is
            # ENOMEM here instead of SIGBUS later
            try:
                _populate_write(self.mm)
            except OSError as exc:
                raise SharedMemoryError(f"shared memory in {os.path.dirname(self.path)} ran out while "
                                        f"reserving {size / 2**20:.1f} MiB for {self.path}: {exc}") from exc
        if self._locker is not None:
            self.lock_pages(self._locker)

    def lock_pages(self, locker: PageLocker) -> None:
        """Keep this mapping page-locked by ``locker`` (a grown slot's new mapping is
        locked again); unlocked before it is unmapped."""
        if self.mm is None or self.locked_by(locker):
            return
        self._unlock_pages()
        self._locker = locker
        self._lock_handle = locker.lock(self.mm, read_only=not self._writable)

    def locked_by(self, locker: PageLocker) -> bool:
        """This mapping is page-locked by ``locker``."""
        return self._locker is locker and self._lock_handle is not None

    def _unlock_pages(self) -> None:
        if self._lock_handle is not None:
            self._locker.unlock(self._lock_handle)
            self._lock_handle = None

    def ensure_capacity(self, image_size: int) -> bool:
        """Grow the file to hold ``image_size`` bytes of image; True if it was remapped.

        Checks free space first and reserves the pages with ``fallocate``, so a full
        ``/dev/shm`` is a clear :class:`SharedMemoryError`, never a SIGBUS mid-copy.
        """
        if HEADER_SIZE + image_size <= self.capacity:
            return False
        self._grow_file(image_size)  # another mapping of the file may have grown it already
        self._map()
        return True

    def _grow_file(self, image_size: int) -> None:
        """Grow the file (not the mapping) to hold ``image_size`` bytes of image, if it does not."""
        need = HEADER_SIZE + image_size
        current = os.fstat(self._fd).st_size
        if need <= current:
            return
        new = need + min(_GROW_HEADROOM, image_size // 16 + 4096)
        new += -new % mmap.PAGESIZE
        directory = os.path.dirname(self.path)
        free = shm_free_bytes(directory)
        if new - current > free:
            raise SharedMemoryError(
                f"the state needs {new / 2**20:.1f} MiB of shared memory in {directory} for {self.path}, "
                f"but only {free / 2**20:.1f} MiB are free; enlarge it (docker run --shm-size=..., "
                f"or mount -o remount,size=... {directory}) or set FLASHCKPT_SHM_DIR to a larger tmpfs")
        if _POPULATE_WRITE and self._writable and self._populate:
            os.ftruncate(self._fd, new)  # pages are reserved by populating the mapping
        else:
            try:
                os.posix_fallocate(self._fd, 0, new)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise SharedMemoryError(f"shared memory in {directory} ran out while reserving "
                                            f"{new / 2**20:.1f} MiB for {self.path}: {exc}") from exc
                raise

    # -- header ---------------------------------------------------------------------

    def read_header(self) -> SlotHeader:
        return _parse_header(self.mm) if self.mm is not None else SlotHeader()

    @staticmethod
    def peek_header(path: str) -> SlotHeader | None:
        """The header of the slot at ``path`` without mapping it (None if there is none):
        mapping a slot populates its page tables, which costs more than reading it."""
        fd = open_private(path, os.O_RDONLY)
        if fd is None:
            return None
        try:
            return _parse_header(os.pread(fd, HEADER_SIZE, 0))
        finally:
            os.close(fd)

    def write_header(self, h: SlotHeader) -> None:
        info = json.dumps(h.info, separators=(",", ":")).encode()
        if _FIXED + len(info) > HEADER_SIZE:
            raise SharedMemoryError(f"slot info too large for the header of {self.path}")
        self.mm[_FIXED:_FIXED + len(info)] = info
        struct.pack_into(_FMT, self.mm, 0, _MAGIC, int(h.state), 0, h.generation, h.step, h.image_len,
                         h.writer_pid, h.reader_pid, h.saved_at, len(info))

    def set_reader(self, pid: int) -> None:
        h = self.read_header()
        h.reader_pid = pid
        self.write_header(h)

    def image(self, length: int) -> memoryview:
        return memoryview(self.mm)[HEADER_SIZE:HEADER_SIZE + length]

    def close(self) -> None:
        self._unlock_pages()
        self._locker = None
        self.mm = None
        for fd in (self._fd, self._persist_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._persist_fd = -1


def _parse_header(buf: Any) -> SlotHeader:
    if len(buf) < HEADER_SIZE:
        return SlotHeader()
    magic, state, _, gen, step, image_len, writer, reader, saved_at, info_len = struct.unpack_from(_FMT, buf, 0)
    if magic != _MAGIC:
        return SlotHeader()
    try:  # a header torn by a crash mid-write reads as empty, never as an error
        info = json.loads(bytes(buf[_FIXED:_FIXED + min(info_len, HEADER_SIZE - _FIXED)])) if info_len else {}
        return SlotHeader(SlotState(state), gen, step, image_len, writer, reader, saved_at,
                          info if isinstance(info, dict) else {})
    except ValueError:
        return SlotHeader()


def mark_writing(slot: Slot, step: int, image_len: int, info: dict[str, Any]) -> SlotHeader:
    """Claim ``slot`` for a new image (caller holds the rank lock).

    Generations are unique across re-created slots and restarts (the clock in ns, or one
    more than the last), so a saver that outlives a trainer never mistakes a new save
    for one it already persisted."""
    h = slot.read_header()
    generation = max(h.generation + 1, time.time_ns())
    h = SlotHeader(SlotState.WRITING, generation, step, image_len, os.getpid(), 0, time.time(), info)
    slot.write_header(h)
    return h
