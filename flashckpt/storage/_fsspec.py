"""The object-store backend: the byte primitives of :class:`~flashckpt.storage._protocol.Backend`
over any fsspec URL (S3 through s3fs, ``memory://``, ``gs://``, ...).

**Uploads.** A shard below two parts is one PUT; a larger one is uploaded in ``part_bytes``
parts (grown to stay within the store's part count) where the store has parts
(:mod:`flashckpt.storage._uploads`: S3 multipart, Azure blocks), ``concurrency`` parts in
flight: enough parallel streams to fill a fast NIC (one S3 stream gives about 100 MB/s),
and at most ``concurrency * part_bytes`` (256 MiB) of part copies in memory (the HTTP
client needs ``bytes``, not the shared-memory view). A multipart upload a killed writer
left open is aborted by the next commit's :meth:`FsspecBackend.sweep`.

**Reads** are ranged GETs through :class:`~flashckpt.storage._object_shard.ObjectShard`;
small objects (metadata, markers, ``latest``, the lease) are read with a bounded range.
A missing bucket or object is a :class:`CheckpointNotFoundError`, denied access or an
unreachable endpoint a :class:`CheckpointError`.

**The run lease** is :mod:`flashckpt.storage._object_lease` (conditional writes on S3 and
Azure Blob, advisory elsewhere). fsspec and the scheme's package are imported only when a
backend is constructed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from . import _object_lease
from ._client_options import options_of
from ._object_shard import CONCURRENCY, ObjectShard, _call, _translate
from ._protocol import ObjectInfo
from ._uploads import Joined, part_upload
from .._errors import CheckpointError, CorruptCheckpointError

__all__ = ["MAX_CONNECTIONS", "PART_BYTES", "FsspecBackend"]

log = logging.getLogger(__name__)

PART_BYTES = 16 << 20
"""Bytes per multipart part and per ranged GET of a large read (S3's minimum part is 5 MiB)."""
MAX_CONNECTIONS = 64
"""Connections of an S3 client (botocore keeps 10 unless configured): several shards'
parts at once; a ``max_pool_connections`` in fsspec's configuration wins."""


class FsspecBackend:
    """Objects under ``url`` (normalized ``scheme://bucket/prefix``) of fsspec package ``package``."""

    def __init__(self, url: str, package: str, *, part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY,
                 lease_seconds: float = _object_lease.LEASE_SECONDS) -> None:
        if part_bytes < 5 << 20 or concurrency < 1 or lease_seconds <= 0:
            raise ValueError("part_bytes must be at least 5 MiB, concurrency at least 1, lease_seconds positive")
        self.root = url
        self.part_bytes, self.concurrency, self.lease_seconds = part_bytes, concurrency, lease_seconds
        self.fs, self.base = _filesystem(url, package)
        self._parts = part_upload(self.fs)

    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def _url(self, name: str) -> str:
        return f"{self.root}/{name}"

    # -- the primitives -----------------------------------------------------------

    def write(self, name: str, data: memoryview | Joined) -> None:
        size = len(data)
        part = max(self.part_bytes, -(-size // self._parts.max_parts)) if self._parts else size
        if self._parts is None or size < 2 * part:
            _call(f"writing {self._url(name)}", self.fs.pipe_file, self.key(name), bytes(data))
            return
        self._parts.send(self.fs, self.key(name), self._url(name), data, part, self.concurrency)

    def read_small(self, name: str, limit: int) -> bytes:
        data = _call(f"reading {self._url(name)}", self.fs.cat_file, self.key(name), start=0, end=limit + 1)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{self._url(name)} is larger than {limit} bytes; refusing to read it")
        return data

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        raw = _call(f"reading {len(names)} objects in {self.root}", self.fs.cat, [self.key(n) for n in names],
                    on_error="return")
        return {n: raw.get(self.key(n)) for n in names}

    def open_range(self, name: str, size: int) -> ObjectShard:
        return ObjectShard(self.fs, self.key(name), self._url(name), size, concurrency=self.concurrency)

    def size(self, name: str) -> int:
        self.fs.invalidate_cache(self.key(name))
        return _call(f"reading {self._url(name)}", self.fs.size, self.key(name))

    def list(self, under: str = "") -> dict[str, ObjectInfo]:
        top = self.key(under) if under else self.base
        self.fs.invalidate_cache(top)
        try:
            found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise _translate(exc, f"listing {self.root}") from exc
        cut = len(self.base) + 1
        return {key[cut:]: ObjectInfo(info.get("size"), info.get("ETag") or info.get("LastModified")
                                      or info.get("created")) for key, info in found.items()
                if key.startswith(f"{top}/") and info.get("type", "file") == "file"}

    def delete(self, names: list[str]) -> None:
        _call(f"deleting {len(names)} objects in {self.root}", self.fs.rm, [self.key(n) for n in names])

    def claim(self, token: str) -> None:
        _object_lease.claim(self, token, self.lease_seconds)

    def release(self) -> None:
        _object_lease.release(self)

    def sweep(self, stale: Callable[[str], bool]) -> None:
        """Abort S3 multipart uploads that a killed writer left open, where ``stale(name)``."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return
        bucket, prefix, _ = self.fs.split_path(self.base)
        try:
            uploads = self.fs.list_multipart_uploads(bucket)
        except Exception as exc:
            log.info("cannot list open multipart uploads in %s: %s", self.root, exc)
            return
        for upload in uploads:
            key = str(upload.get("Key", ""))
            if prefix and not key.startswith(f"{prefix}/"):
                continue
            if stale(key[len(prefix) + 1:] if prefix else key):
                try:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
                except Exception as exc:
                    log.info("cannot abort the stale multipart upload of %s: %s", upload["Key"], exc)


def _filesystem(url: str, package: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the root's path in it (imports fsspec and
    the scheme's backend only now)."""
    scheme = url.partition("://")[0]
    try:
        import fsspec.config
        from fsspec.core import url_to_fs

        options = options_of(scheme)  # given with a chained URL (flashckpt::s3://...), over fsspec's configuration
        if package == "s3fs":  # botocore's pool of 10 connections would cap the parts in flight
            config = dict(options.get("config_kwargs") or fsspec.config.conf.get("s3", {}).get("config_kwargs") or {})
            config.setdefault("max_pool_connections", MAX_CONNECTIONS)
            options["config_kwargs"] = config
        fs, path = url_to_fs(url, **options)
    except ImportError as exc:
        raise CheckpointError(f"{url}: {scheme}:// needs the {package} package "
                              f"(pip install 'flashckpt[s3]' for S3): {exc}") from exc
    except Exception as exc:
        raise _translate(exc, f"opening {url}") from exc
    return fs, path.rstrip("/")
