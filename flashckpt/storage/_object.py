"""Committed checkpoints in an object store (S3 and any fsspec URL), committed without rename.

Layout under the URL ``<scheme>://<bucket>/<prefix>``::

    step-<N>/rank-<R>.<token>.safetensors  one shard per rank, the writing run's token in its name
    step-<N>/rank-<R>.<token>.done         its done marker (size, block crc32s, token), after the shard
    step-<N>/metadata.json                 world size, every shard's file, size, block crc32s, token,
                                           branch; written last: present = committed
    latest                                 a hint: the newest committed step
    .flashckpt-run.json                    the run lease (see :mod:`flashckpt.storage._object_lease`)

**Commit without rename**, retention and stale uploads are
:mod:`flashckpt.storage._committed`'s (the step's ``metadata.json``, written last in one
PUT, is the commit); lines, ``keep_last`` and late commits :mod:`flashckpt.storage._policy`'s.

**Uploads and reads** are :mod:`flashckpt.storage._fsspec`'s: multipart uploads of
:data:`PART_BYTES` parts, :data:`CONCURRENCY` in flight; ranged GETs through
:class:`ObjectShard`. Errors name the object's URL.

**Stores.** Everything is plain fsspec (``pipe_file``, ``cat_file``, ``find``, ``rm``), so
any fsspec URL works; S3 (s3fs) adds multipart uploads and the abort of stale multipart
uploads, Azure (``az://``, adlfs) block uploads, GCS (``gs://``, gcsfs) resumable uploads in
chunks (:mod:`flashckpt.storage._uploads`); the run lease is exclusive on S3 and Azure
(conditional writes, :mod:`flashckpt.storage._conditional`), advisory on GCS. Tested against
an S3 server (moto), Azure's emulator (Azurite), gcp-storage-emulator and ``memory://``. OSS
(``oss://``, ossfs) is untested here (no server of its own installs in the test
environment): a shard in one ``pipe_file``.
"""

from __future__ import annotations

from . import _object_lease
from ._committed import BLOCK_BYTES, CommittedStore
from ._fsspec import MAX_CONNECTIONS, PART_BYTES, FsspecBackend
from ._location import OBJECT_SCHEMES, parse_location
from ._object_shard import CONCURRENCY, ObjectShard
from .._errors import CheckpointError

__all__ = ["BLOCK_BYTES", "CONCURRENCY", "MAX_CONNECTIONS", "PART_BYTES", "ObjectShard", "ObjectStorage",
           "object_backend"]


def object_backend(url: str, **settings: object) -> FsspecBackend:
    """The byte primitives under object-store ``url`` (no I/O yet): what :class:`ObjectStorage`
    commits over, and what an exporter writes a framework's files into a bucket with
    (uploads in parts, ``settings`` as :class:`FsspecBackend` takes them)."""
    location = parse_location(url)
    if location.url is None or location.scheme not in OBJECT_SCHEMES:
        raise CheckpointError(f"{url!r} is not an object-store URL; use LocalStorage or open_storage")
    return FsspecBackend(location.url, OBJECT_SCHEMES[location.scheme], **settings)


class ObjectStorage(CommittedStore):
    """Committed steps under one object-store URL: the one policy
    (:class:`~flashckpt.storage._committed.CommittedStore`) over an
    :class:`~flashckpt.storage._fsspec.FsspecBackend`. Construction does no I/O."""

    def __init__(self, url: str, *, part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY,
                 lease_seconds: float = _object_lease.LEASE_SECONDS) -> None:
        super().__init__(object_backend(url, part_bytes=part_bytes, concurrency=concurrency,
                                        lease_seconds=lease_seconds))
