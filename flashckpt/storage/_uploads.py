"""A large object uploaded in parts, each store its own way (chosen by the fsspec filesystem).

- **S3** (s3fs): a multipart upload; the object appears whole at ``complete_multipart_upload``.
  An upload a killed writer left open is aborted by the next commit's sweep
  (:meth:`~flashckpt.storage._fsspec.FsspecBackend.sweep`).
- **Azure Blob** (adlfs): blocks staged with ``stage_block``, then one ``commit_block_list``;
  the blob appears whole at the commit. Blocks a killed writer staged are never part of a
  blob, and Azure discards uncommitted blocks after a week.
- **GCS** (gcsfs): one resumable upload, its chunks sent in order (the protocol allows no
  other), from the shared-memory view without a copy of the whole shard; the object appears
  at the last chunk. A failed chunk cancels the upload; one a killed writer left open
  expires after a week and is never an object.

Parts go ``concurrency`` at a time; each is copied out of the shared-memory view only when
it is sent (the HTTP clients need ``bytes``), so at most ``concurrency`` parts are in memory.
Other stores (OSS, ``memory://``) take one ``pipe_file``.

An object need not be one buffer: :class:`Joined` reads several as one (a DCP rank file is
its framing and its tensors' bytes in the image, interleaved), copying only the part sent.
"""

from __future__ import annotations

import base64
import bisect
import itertools
import logging
from typing import Any, Callable, NamedTuple, Sequence

from ._object_shard import _call, _run_all

__all__ = ["Joined", "PartUpload", "part_upload"]

log = logging.getLogger(__name__)


class Joined:
    """Buffers read as one object, without joining them: ``len()``, slices (``bytes``, only
    the bytes sliced copied) and ``bytes()``, which is what an upload takes of its data
    (:meth:`~flashckpt.storage._fsspec.FsspecBackend.write`: one PUT or a part at a time)."""

    def __init__(self, pieces: Sequence[Any]) -> None:
        self._pieces = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
        self._starts = list(itertools.accumulate((v.nbytes for v in self._pieces), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Joined takes plain slices")
        start, stop, _ = key.indices(len(self))
        out: list[memoryview] = []
        at = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            piece = self._pieces[at]
            part = piece[start - self._starts[at]:stop - self._starts[at]]
            out.append(part)
            start += part.nbytes
            at += 1
        return b"".join(out)

    def __bytes__(self) -> bytes:
        return self[:]


class PartUpload(NamedTuple):
    """How one store uploads in parts: ``send(fs, key, url, image, part, concurrency)``."""

    send: Callable[[Any, str, str, memoryview, int, int], None]
    max_parts: int


def part_upload(fs: Any) -> PartUpload | None:
    """The part upload of ``fs``'s store, or None (one ``pipe_file``)."""
    if hasattr(fs, "call_s3"):
        return PartUpload(_s3_multipart, 10_000)
    if type(fs).__module__.startswith("adlfs") and hasattr(fs, "service_client"):
        return PartUpload(_azure_blocks, 50_000)
    if type(fs).__module__.startswith("gcsfs"):
        return PartUpload(_gcs_resumable, 10_000)
    return None


def _s3_multipart(fs: Any, key: str, url: str, image: memoryview, part: int, concurrency: int) -> None:
    bucket, path, _ = fs.split_path(key)
    what = f"uploading {url}"
    upload = _call(what, fs.call_s3, "create_multipart_upload", Bucket=bucket, Key=path)["UploadId"]
    count = -(-len(image) // part)
    etags: list[str] = [""] * count

    def send(k: int) -> None:
        out = _call(f"{what} (part {k + 1} of {count})", fs.call_s3, "upload_part", Bucket=bucket, Key=path,
                    UploadId=upload, PartNumber=k + 1, Body=bytes(image[k * part:(k + 1) * part]))
        etags[k] = out["ETag"]

    try:
        _run_all(send, count, concurrency)
        _call(what, fs.call_s3, "complete_multipart_upload", Bucket=bucket, Key=path, UploadId=upload,
              MultipartUpload={"Parts": [{"PartNumber": k + 1, "ETag": e} for k, e in enumerate(etags)]})
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=path, UploadId=upload)
        except Exception as exc:  # the next commit's sweep aborts it
            log.warning("could not abort the multipart upload of %s: %s", url, exc)
        raise
    finally:
        fs.invalidate_cache(key)


def _azure_blocks(fs: Any, key: str, url: str, image: memoryview, part: int, concurrency: int) -> None:
    from fsspec.asyn import sync

    container, path, _ = fs.split_path(key)
    what = f"uploading {url}"
    count = -(-len(image) // part)
    # block ids: base64, all of one length within a blob
    ids = [base64.b64encode(f"flashckpt-{k:08d}".encode()).decode() for k in range(count)]
    blob = fs.service_client.get_blob_client(container=container, blob=path)

    def send(k: int) -> None:
        _call(f"{what} (block {k + 1} of {count})", sync, fs.loop, blob.stage_block, ids[k],
              bytes(image[k * part:(k + 1) * part]))

    try:
        _run_all(send, count, concurrency)
        # adlfs tells files from folders by this metadata (as its own pipe_file writes it)
        _call(what, sync, fs.loop, blob.commit_block_list, ids, metadata={"is_directory": "false"})
    finally:
        fs.invalidate_cache(key)


GCS_CHUNK_ALIGN = 256 << 10
"""A resumable upload's chunks (but its last) are multiples of 256 KiB."""


def _gcs_resumable(fs: Any, key: str, url: str, image: memoryview, part: int, concurrency: int) -> None:
    from fsspec.asyn import sync
    from gcsfs.core import initiate_upload, upload_chunk

    bucket, path, _ = fs.split_path(key)
    what = f"uploading {url}"
    chunk = -(-part // GCS_CHUNK_ALIGN) * GCS_CHUNK_ALIGN
    count = -(-len(image) // chunk)
    session = _call(what, sync, fs.loop, initiate_upload, fs, bucket, path)
    try:
        for k in range(count):
            _call(f"{what} (chunk {k + 1} of {count})", sync, fs.loop, upload_chunk, fs, session,
                  image[k * chunk:(k + 1) * chunk], k * chunk, len(image), "application/octet-stream")
    except BaseException:
        _cancel_gcs_upload(session, url)
        raise
    finally:
        fs.invalidate_cache(key)


def _cancel_gcs_upload(session: str, url: str) -> None:
    """Cancel a resumable upload (its session URI needs no credentials): one try, since an
    upload never finished is never an object and GCS drops it after a week anyway."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(session, method="DELETE"), timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code != 499:  # GCS's answer to a cancelled upload
            log.debug("cancelling the upload of %s: HTTP %d", url, exc.code)
    except OSError as exc:
        log.debug("cancelling the upload of %s: %s", url, exc)
