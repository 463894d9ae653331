"""Where checkpoints live: a local directory or a storage URL, parsed and checked.

A location is one of:

- a local path (``/ckpt``, ``runs/a``, ``./odd:name``): :class:`~flashckpt.storage._local.LocalStorage`;
- a ``file://`` URL of an absolute local path (``file:///ckpt``, ``file://localhost/ckpt``):
  the same local directory;
- an object-store URL ``<scheme>://<bucket>[/<prefix>]`` with a scheme of
  :data:`OBJECT_SCHEMES` (``s3://bucket/run1``, ``gs://``, ``memory://`` for tests):
  :class:`~flashckpt.storage._object.ObjectStorage` through fsspec;
- ``<scheme>://<path>`` of a scheme registered with :func:`flashckpt.storage.register`
  (or declared as an entry point, see :mod:`flashckpt.storage._registry`).

Anything else that starts like a URL (``word:``) is an error that names the input and
what is accepted, so ``s3:/x`` or ``s3:bucket`` never becomes a local directory named
``s3:``; a local directory whose name has a colon is written ``./name:x``.

Credentials and endpoints are never part of a location: they come as fsspec and its
backends take them (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``~/.aws``, or fsspec's configuration such as ``FSSPEC_S3='{"endpoint_url": ...}'``). A URL
with user info (``s3://key:secret@bucket``), a query or a fragment is refused, so no
secret is ever logged, stored in shared memory or written into metadata.

Parsing imports nothing; only :func:`~flashckpt.storage._url.open_storage` of a URL imports
fsspec (and its backend, e.g. s3fs from the ``flashckpt[s3]`` extra).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import unquote

from .._errors import CheckpointError
from . import _registry

__all__ = ["OBJECT_SCHEMES", "Location", "is_url", "parse_location"]

OBJECT_SCHEMES: dict[str, str] = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "oss": "ossfs", "memory": "fsspec",
}
"""Object-store schemes accepted, and the package that serves each (with fsspec)."""

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT_RE = re.compile(r"^[^\x00-\x1f\x7f\\]+$")
_ACCEPTED = ("a local path (write ./name for a local name with a colon), file:///absolute/path, or "
             + ", ".join(f"{s}://bucket/prefix" for s in OBJECT_SCHEMES))


@dataclass(frozen=True, slots=True)
class Location:
    """A checked checkpoint location."""

    scheme: str
    """``""`` for a local directory, else one of :data:`OBJECT_SCHEMES` or a registered scheme."""
    path: str
    """The absolute local path, or ``bucket[/prefix]`` of the URL (a registered scheme's: what follows ``//``)."""

    @property
    def url(self) -> str | None:
        """The normalized URL (``s3://bucket/prefix``), None for a local directory."""
        return f"{self.scheme}://{self.path}" if self.scheme else None


def _bad(location: str, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint location {location[:200]!r}: {why}; accepted: {_ACCEPTED}")


def parse_location(location: str | os.PathLike) -> Location:
    """Check ``location`` and say what it is; a :class:`CheckpointError` naming the input
    and what is accepted for an unknown scheme, a malformed URL, or a local path that
    looks like a URL."""
    text = os.fspath(location)
    if not isinstance(text, str):
        raise CheckpointError(f"checkpoint location {text!r} is not text; accepted: {_ACCEPTED}")
    if not text or "\x00" in text:
        raise _bad(text, "empty or holds a NUL byte")
    m = _SCHEME_RE.match(text)
    if m is None:
        return Location("", os.path.abspath(text))
    scheme, rest = m.group(1).lower(), text[m.end():]
    if scheme == "file":
        return Location("", _file_path(text, rest))
    registered = scheme not in OBJECT_SCHEMES and _registry.factory(scheme) is not None
    if scheme not in OBJECT_SCHEMES and not registered:
        raise _bad(text, f"unknown scheme {scheme!r} (a local path may not start with '<word>:')")
    if not rest.startswith("//"):
        raise _bad(text, f"a {scheme} URL is written {scheme}://bucket/prefix")
    if "?" in rest or "#" in rest:
        raise _bad(text, "a query or fragment is not part of a checkpoint location")
    if any(c in rest for c in "*[]"):  # the fsspec clients expand them, deleting other prefixes' objects
        raise _bad(text, "'*', '[' and ']' are not allowed: object-store clients read them as patterns")
    bucket, _, prefix = rest[2:].partition("/")
    if registered and not bucket:  # scheme:///absolute/path
        return Location(scheme, "/" + "/".join(_segments(text, prefix)))
    if "@" in bucket:
        raise _bad(text, "credentials never go into the URL; give them as the storage's client takes them "
                         "(environment, fsspec configuration)")
    if not bucket:
        raise _bad(text, "the URL names no bucket")
    if not (_S3_BUCKET_RE if scheme in ("s3", "s3a") else _BUCKET_RE).match(bucket):
        raise _bad(text, f"{bucket[:80]!r} is not a valid bucket name")
    return Location(scheme, "/".join([bucket, *_segments(text, prefix)]))


def _segments(text: str, prefix: str) -> list[str]:
    """The checked segments of a URL's path after its bucket."""
    segments = prefix.split("/") if prefix else []
    if segments and not segments[-1]:
        segments.pop()  # one trailing slash
    if any(s in ("", ".", "..") or not _SEGMENT_RE.match(s) for s in segments):
        raise _bad(text, "the prefix has an empty, '.', '..' or control-character segment")
    return segments


def _file_path(text: str, rest: str) -> str:
    """The local path of a ``file://`` URL (empty host or ``localhost``, absolute path)."""
    if not rest.startswith("//"):
        raise _bad(text, "a file URL is written file:///absolute/path")
    host, slash, path = rest[2:].partition("/")
    if host not in ("", "localhost") or not slash:
        raise _bad(text, f"a file URL names no host but this machine (got {host[:80]!r})")
    if "?" in path or "#" in path:
        raise _bad(text, "a query or fragment is not part of a checkpoint location")
    return os.path.abspath("/" + unquote(path))


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` is an object-store URL (checked: a bad location raises)."""
    return bool(parse_location(location).scheme)
