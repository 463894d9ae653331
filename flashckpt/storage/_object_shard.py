"""Reading one committed shard object: ranged GETs, few of them, each byte fetched once.

:class:`ObjectShard` is what :meth:`ObjectStorage.open_shard` returns and the one reader
(:class:`~flashckpt.restore._shard_read.ShardReader`) reads through ``preadv``. Every GET costs a
request's latency and, on some servers (moto reads the whole object for each ranged GET),
the object's size in server work, so:

- a range is one GET per :data:`READ_BYTES` (the reader's chunk), split into several
  only when larger (a direct read of a whole large object), several at once;
- the first read at offset 0 (the reader parsing the header) fetches the whole first
  checksum block (:data:`HEAD_BYTES`) and keeps it: the reader verifies that block
  next (a resharding load) or reads from offset 0 on (a whole load), and neither fetches
  those bytes again;
- a read that ends less than :data:`HEAD_BYTES` before the end of the object fetches the
  rest too and keeps it: the reader's last chunk of a whole load (often a few hundred
  bytes past a chunk boundary, the header's length) waits for those bytes instead of
  costing a GET; a resharding load fetches at most that much more of a source shard.

A whole load of a shard of one chunk is then two GETs (the first block, the rest), a
resharding load's header and its check one; every byte is fetched once. A caller that
will read every byte says so first (:meth:`ObjectShard.read_whole`): the header's read
then brings the whole first chunk, and a shard of one chunk is one GET.

Errors name the object's URL; the client's exceptions become flashckpt errors here
(:func:`_call`), for every object-store module.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["CONCURRENCY", "HEAD_BYTES", "READ_BYTES", "ObjectShard"]

CONCURRENCY = 16
"""Parts uploaded, or ranges fetched, at once for one object."""
READ_BYTES = 32 << 20
"""Bytes per ranged GET of a large read: the shard reader's chunk, so each of its reads is
one GET (its threads give the parallel streams); a longer range is split into GETs of at
least this size."""
HEAD_BYTES = 1 << 20
"""What the first read at offset 0 fetches and keeps: one checksum block of an object
store's shard, holding the header of all but the largest trees."""
_RESUMES = 3
"""Times a ranged GET whose body was cut is resumed from where it stopped."""
_T = TypeVar("_T")


def _azure_not_found(exc: Exception) -> bool:
    """Whether ``exc`` is azure-core's ``ResourceNotFoundError``, which adlfs lets through
    where a write meets a missing container (matched by name: azure is not imported here)."""
    return any(c.__name__ == "ResourceNotFoundError" and c.__module__.startswith("azure.")
               for c in type(exc).__mro__)


def _translate(exc: Exception, what: str) -> CheckpointError:
    """A flashckpt error for a storage client's exception; ``what`` names the action and object."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{what}: not found ({exc})")
    if _azure_not_found(exc):  # its text goes on with the request id and the service's XML reply
        reason = str(exc).split("\n", 1)[0]
        return CheckpointNotFoundError(f"{what}: not found ({reason} [{getattr(exc, 'error_code', None)}])")
    if isinstance(exc, PermissionError):
        return CheckpointError(f"{what}: access denied ({exc}); check the credentials the store's client reads "
                               "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, fsspec configuration)")
    return CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}")


def _call(what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise _translate(exc, what) from exc


def _flat(view: Any) -> memoryview:
    view = memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _run_all(job: Callable[[int], None], count: int, threads: int) -> None:
    """``job(0..count-1)`` on up to ``threads`` threads (inline for one); the first error raised."""
    if count <= 1:
        for k in range(count):
            job(k)
        return
    pool = ThreadPoolExecutor(min(threads, count), thread_name_prefix="flashckpt-object")
    try:
        for future in [pool.submit(job, k) for k in range(count)]:
            future.result()
    finally:
        pool.shutdown(cancel_futures=True)  # after an error, the jobs not yet started never start


class _Target:
    """Consecutive flat views seen as one byte range from ``offset``: filled by absolute position."""

    def __init__(self, views: list[memoryview], offset: int) -> None:
        self.views, self.starts = views, []
        for view in views:
            self.starts.append(offset)
            offset += len(view)
        self.end = offset

    def put(self, at: int, data: memoryview) -> None:
        """Copy ``data``, the object's bytes from ``at``, where it overlaps this range."""
        i = max(0, bisect.bisect_right(self.starts, at) - 1)
        stop = at + len(data)
        while i < len(self.views) and self.starts[i] < stop:
            pos, view = self.starts[i], self.views[i]
            lo, hi = max(at, pos), min(stop, pos + len(view))
            if lo < hi:
                view[lo - pos:hi - pos] = data[lo - at:hi - at]
            i += 1


class _Kept:
    """Bytes ``[lo, hi)`` of the object that one read fetches beyond its own range, for the
    reads that need them: ``data`` once ``ready`` (None if that fetch failed)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ready = threading.Event()
        self.data: bytearray | None = None


class ObjectShard:
    """One committed shard object opened for reading: ``name`` (its URL), ``size``,
    sequential :meth:`readinto` and positional :meth:`pread_into` / :meth:`preadv` (see the
    module docstring); exact, or an error naming the object. Thread safe for positional
    reads; a context manager."""

    def __init__(self, fs: Any, key: str, name: str, size: int, *, concurrency: int = CONCURRENCY) -> None:
        self._fs, self._key, self.name, self.size = fs, key, name, size
        self._concurrency = concurrency
        self._pos = 0
        self._head: _Kept | None = None  # the first block, fetched by the first read at offset 0
        self._tail: _Kept | None = None  # the last bytes, fetched by the read that ends within a block of them
        self._first = min(size, HEAD_BYTES)  # what the first read at offset 0 fetches
        self._guard = threading.Lock()

    def read_whole(self) -> None:
        """Declare, before the first read, that every byte will be read (a whole load):
        the first read at offset 0 then fetches the reader's whole first chunk (to the end
        when less than a block would remain), so the header and that chunk, or a whole
        shard of one chunk, come in one GET."""
        first = min(self.size, READ_BYTES)
        self._first = self.size if self.size - first < HEAD_BYTES else first

    def readinto(self, view: Any) -> int:
        """Fill ``view`` from the current position (less at the end of the object); the bytes read."""
        view = _flat(view)
        n = max(0, min(len(view), self.size - self._pos))
        self.preadv([view[:n]], self._pos)
        self._pos += n
        return n

    def pread_into(self, view: Any, offset: int) -> None:
        """Fill ``view`` with the object's bytes from ``offset``, exactly."""
        self.preadv([view], offset)

    def preadv(self, pieces: list[Any], offset: int) -> None:
        """Fill ``pieces`` (flat byte views) with consecutive bytes from ``offset``, exactly:
        the kept first block and last bytes, then one ranged GET per :data:`READ_BYTES` or
        so of the rest."""
        views = [_flat(p) for p in pieces]
        end = offset + sum(len(v) for v in views)
        if offset < 0 or end > self.size:
            raise CorruptCheckpointError(f"{self.name}: bytes {offset}-{end} lie outside its {self.size} bytes")
        if end == offset:
            return
        target = _Target(views, offset)
        new_head = new_tail = None
        with self._guard:
            if self._head is None and offset == 0 and end < self._first:
                self._head = new_head = _Kept(0, self._first)
            elif (self._tail is None and HEAD_BYTES <= end < self.size <= end + HEAD_BYTES
                  and (self._head is None or self._head.hi < self.size)):
                self._tail = new_tail = _Kept(end, self.size)  # the tail chunk's bytes: fetched with this range
            head, tail = self._head, self._tail
        if new_head is not None:
            self._keep(new_head, lambda: self._fetch(_Target([], 0), 0, 0, new_head.hi))
        if head is not None and offset < head.hi and self._served(head, target, offset, end):
            offset = min(end, head.hi)
        if new_tail is not None:
            self._keep(new_tail, lambda: self._fetch(target, offset, end, new_tail.hi))
        elif tail is not None and end > tail.lo and self._served(tail, target, offset, end):
            end = max(offset, tail.lo)
        if offset < end and new_tail is None:
            self._fetch(target, offset, end, end)

    def _served(self, kept: _Kept, target: _Target, offset: int, end: int) -> bool:
        """Copy what ``kept`` holds of ``[offset, end)`` into ``target`` once its fetch ended
        (a GET, bounded by the client's timeouts); False when that fetch failed (the caller
        fetches the bytes itself)."""
        kept.ready.wait()
        if kept.data is None:
            return False
        lo, hi = max(offset, kept.lo), min(end, kept.hi)
        target.put(lo, memoryview(kept.data)[lo - kept.lo:hi - kept.lo])
        return True

    @staticmethod
    def _keep(kept: _Kept, fetch: Callable[[], bytearray]) -> None:
        """Fill ``kept`` by ``fetch``; whatever happens, the readers waiting for it go on."""
        try:
            kept.data = fetch()
        finally:
            kept.ready.set()

    def _fetch(self, target: _Target, offset: int, end: int, stop: int) -> bytearray:
        """Fetch ``[offset, stop)`` (``stop >= end``), its bytes up to ``end`` into
        ``target``; the bytes ``[end, stop)``."""
        count = max(1, (stop - offset) // READ_BYTES)  # even ranges of READ_BYTES or more: no tiny last GET
        cuts = [offset + (stop - offset) * k // count for k in range(count + 1)]
        beyond = bytearray(stop - end)
        extra = _Target([memoryview(beyond)], end)

        def fetch(k: int) -> None:
            def put(at: int, data: memoryview) -> None:
                target.put(at, data)
                if at + len(data) > end:
                    extra.put(at, data)

            self._get(cuts[k], cuts[k + 1], put)

        _run_all(fetch, count, self._concurrency)
        return beyond

    def _get(self, start: int, stop: int, put: Callable[[int, memoryview], None]) -> None:
        """Bytes ``[start, stop)`` of the object in one ranged GET, exactly, given to
        ``put(at, data)`` as they arrive (S3) or at once."""
        what = f"reading bytes {start}-{stop} of {self.name}"
        try:
            if hasattr(self._fs, "_call_s3"):
                got = _call(what, _stream, self._fs, self._key, start, stop, put)
            else:
                data = _call(what, self._fs.cat_file, self._key, start=start, end=stop)
                put(start, memoryview(data)[:stop - start])
                got = start + len(data)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.name}: the shard object is gone from the store "
                                          f"(deleted after the commit?): {exc}") from exc
        if got < stop:
            raise CorruptCheckpointError(f"{self.name}: truncated at byte {got} (the commit recorded "
                                         f"{self.size} bytes)")
        if got > stop:
            raise CorruptCheckpointError(f"{self.name}: a GET of bytes {start}-{stop} returned more (the server "
                                         "ignored the range?)")

    def close(self) -> None:
        """Drops the kept bytes; nothing else is held between reads."""
        self._head = self._tail = None

    def __enter__(self) -> "ObjectShard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stream(fs: Any, key: str, start: int, stop: int, put: Callable[[int, memoryview], None]) -> int:
    """One S3 ranged GET of ``[start, stop)`` on s3fs's event loop, each received piece
    given to ``put`` as it comes (no joined copy of the whole range); where it ended. A
    body cut by an error s3fs retries is resumed from there, up to :data:`_RESUMES` times."""
    from fsspec.asyn import sync
    from s3fs.core import S3_RETRYABLE_ERRORS

    bucket, path, _ = fs.split_path(key)

    done = [start]  # the bytes given to ``put`` end here

    async def get() -> None:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=path, Range=f"bytes={done[0]}-{stop - 1}")
        body = resp["Body"]
        try:
            content = getattr(body.raw_stream, "content", None)
            if content is None or not hasattr(content, "iter_chunks"):  # not aiohttp: one read
                data = await body.read()
                put(done[0], memoryview(data)[:stop - done[0]])
                done[0] += len(data)
                return
            async for data, _ in content.iter_chunks():
                if done[0] + len(data) > stop:
                    done[0] += len(data)  # more than asked: the caller's error
                    return
                put(done[0], memoryview(data))
                done[0] += len(data)
        finally:
            body.close()

    async def resuming() -> int:
        for attempt in range(_RESUMES + 1):
            try:
                await get()
                break
            except S3_RETRYABLE_ERRORS:
                if attempt == _RESUMES:
                    raise
        return done[0]

    return sync(fs.loop, resuming)
