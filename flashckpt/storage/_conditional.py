"""Conditional writes of one small object, each store its own way (chosen by the fsspec filesystem).

A :class:`ConditionalObject` reads the object with its version, creates it only if it is
absent, and replaces or deletes it only while it is still the version read; the store
refuses the others atomically (:class:`PreconditionFailed`). The run lease
(:mod:`flashckpt.storage._object_lease`) is exclusive through them.

- **S3** (s3fs): ``If-None-Match: *`` and ``If-Match: <ETag>`` on PUT and DELETE (AWS S3,
  MinIO, moto); a server answering ``NotImplemented`` raises :class:`NotImplementedError`.
- **Azure Blob** (adlfs): the same headers through azure-storage-blob (Azurite honours them).

Other stores have none here (:func:`conditional_object` returns None). GCS has them
(``ifGenerationMatch``), but gcp-storage-emulator, the only GCS server the tests can start,
ignores them (it stores every write), so GCS's could not be tested and are not written.
"""

from __future__ import annotations

import errno
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from ._object_shard import _call, _translate

__all__ = ["ConditionalObject", "PreconditionFailed", "conditional_object"]

_T = TypeVar("_T")
_AZURE_FILE = {"is_directory": "false"}
"""A blob's metadata by which adlfs tells files from folders (as its own ``pipe_file`` writes it)."""


class PreconditionFailed(Exception):
    """A conditional write or delete refused: the object is not the version read."""


class ConditionalObject(Protocol):
    """One object's conditional writes; a version is the store's ETag."""

    def read(self, limit: int) -> tuple[bytes, str | None]:
        """Up to ``limit + 1`` bytes of the object and their version (CheckpointNotFoundError if absent)."""

    def create(self, body: bytes) -> str | None:
        """Write ``body`` only if the object is absent; its new version."""

    def replace(self, body: bytes, version: str) -> str | None:
        """Write ``body`` only if the object is at ``version``; its new version."""

    def delete(self, version: str) -> None:
        """Delete the object only if it is at ``version``."""


def conditional_object(fs: Any, key: str, url: str) -> ConditionalObject | None:
    """The conditional writes of object ``key`` (``url``, for errors) in ``fs``'s store, or None."""
    if hasattr(fs, "call_s3"):
        return _S3Object(fs, key, url)
    if type(fs).__module__.startswith("adlfs") and hasattr(fs, "service_client"):
        return _AzureObject(fs, key, url)
    return None


def _refused(exc: BaseException, *codes: str) -> bool:
    """Whether an S3 client error (or one it caused) carries one of the error ``codes`` or HTTP statuses."""
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = str((response.get("ResponseMetadata") or {}).get("HTTPStatusCode", ""))
            if error.get("Code") in codes or status in codes:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


class _S3Object:
    def __init__(self, fs: Any, key: str, url: str) -> None:
        self.fs, self.url = fs, url
        self.bucket, self.key, _ = fs.split_path(key)

    def read(self, limit: int) -> tuple[bytes, str | None]:
        from fsspec.asyn import sync

        async def get() -> tuple[bytes, str | None]:  # one GET: the ETag of the very bytes read
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key, Range=f"bytes=0-{limit}")
            try:
                return await resp["Body"].read(), resp.get("ETag")
            finally:
                resp["Body"].close()

        return _call(f"reading {self.url}", sync, self.fs.loop, get)

    def create(self, body: bytes) -> str | None:
        return self._call("writing", "put_object", Body=body, IfNoneMatch="*").get("ETag")

    def replace(self, body: bytes, version: str) -> str | None:
        return self._call("writing", "put_object", Body=body, IfMatch=version).get("ETag")

    def delete(self, version: str) -> None:
        self._call("deleting", "delete_object", IfMatch=version)

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        except FileExistsError as exc:  # s3fs's translation of a refused If-None-Match
            raise PreconditionFailed() from exc
        except Exception as exc:
            if _refused(exc, "PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise PreconditionFailed() from exc
            if (isinstance(exc, OSError) and exc.errno == errno.ENOSYS) or _refused(exc, "NotImplemented", "501"):
                raise NotImplementedError(str(exc)) from exc
            raise _translate(exc, f"{what} {self.url}") from exc


class _AzureObject:
    def __init__(self, fs: Any, key: str, url: str) -> None:
        self.fs, self.url = fs, url
        self.container, self.path, _ = fs.split_path(key)

    def read(self, limit: int) -> tuple[bytes, str | None]:
        async def get(blob: Any) -> tuple[bytes, str | None]:
            download = await blob.download_blob(offset=0, length=limit + 1)
            return await download.readall(), download.properties.etag

        return self._call("reading", get)

    def create(self, body: bytes) -> str | None:
        return self._call("writing", lambda blob: blob.upload_blob(
            body, overwrite=False, metadata=_AZURE_FILE))["etag"]

    def replace(self, body: bytes, version: str) -> str | None:
        from azure.core import MatchConditions

        return self._call("writing", lambda blob: blob.upload_blob(
            body, overwrite=True, metadata=_AZURE_FILE, etag=version,
            match_condition=MatchConditions.IfNotModified))["etag"]

    def delete(self, version: str) -> None:
        from azure.core import MatchConditions

        self._call("deleting", lambda blob: blob.delete_blob(etag=version,
                                                             match_condition=MatchConditions.IfNotModified))

    def _call(self, what: str, job: Callable[[Any], Awaitable[_T]]) -> _T:
        """``job(blob client)`` on adlfs's loop; a refused precondition as :class:`PreconditionFailed`."""
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError
        from fsspec.asyn import sync

        async def run() -> _T:
            async with self.fs.service_client.get_blob_client(container=self.container, blob=self.path) as blob:
                return await job(blob)

        try:
            return sync(self.fs.loop, run)
        except (ResourceExistsError, ResourceModifiedError) as exc:  # 409 to If-None-Match, 412 to If-Match
            raise PreconditionFailed() from exc
        except Exception as exc:  # a missing blob or container too (ResourceNotFoundError: not found)
            raise _translate(exc, f"{what} {self.url}") from exc
