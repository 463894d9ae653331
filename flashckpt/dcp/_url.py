"""``flashckpt://`` URLs: the checkpoint location a URL names, and clear errors for the
forms the protocol does not take.

``flashckpt:///abs/dir/step-100`` names the local folder ``/abs/dir/step-100``;
``flashckpt://rel/dir`` a folder relative to the current directory (as fsspec's ``file://``
reads it). The chained form puts a store behind the protocol:
``flashckpt::s3://bucket/run/step-100`` names the object-store URL ``s3://bucket/run/step-100``
(any scheme of :data:`~flashckpt.storage._location.OBJECT_SCHEMES`, checked as a checkpoint
location is), ``flashckpt::file:///abs/dir`` the local folder, as ``flashckpt:///abs/dir``.
Refused, each with its own message: user info (``user:pw@``), a host with a port, a query
or fragment, a URL that names no folder, and a chain with another store behind it.

The errors are :class:`~flashckpt.CheckpointError`, not ``ValueError``: DCP asks fsspec
whether it can open a checkpoint id and reads a ``ValueError`` as "no", which would turn
every message here into DCP's "Cannot detect which StorageWriter or StorageReader to use".
"""

from __future__ import annotations

import os
import re

from .._errors import CheckpointError
from ..storage._location import OBJECT_SCHEMES
from ._run import normalize_id

__all__ = ["CHAINED", "PROTOCOL", "chained_location", "folder_of", "local_path", "no_folder_error", "strip"]

PROTOCOL = "flashckpt"
_PREFIX = f"{PROTOCOL}://"
CHAINED = f"{PROTOCOL}::"
_LOCAL = ("file", "local")
_DCP_FILE = re.compile(r"\.metadata(\.tmp)?|__\d+_\d+\.distcp")


def no_folder_error(url: str) -> CheckpointError:
    return CheckpointError(f"{url!r} names no folder: write {PROTOCOL}:///abs/dir, or {PROTOCOL}::s3://bucket/dir "
                           "for an object store")


def strip(path: str) -> str:
    """What a URL names: a local path or a checked object-store URL for the protocol's forms
    (``""`` for ``flashckpt://``, which is also the outer part of a chain as fsspec splits
    it); any other path unchanged (a file system object reads it, see
    :meth:`flashckpt.dcp._fs.FlashFileSystem._path`)."""
    if path.startswith(CHAINED):
        return normalize_id(path[len(CHAINED):])
    if path == _PREFIX:
        return ""
    if path.startswith(_PREFIX):
        return local_path(path)
    return path


def folder_of(url: str) -> str:
    """The folder a ``flashckpt:`` URL names (:func:`strip`'s local path or object-store URL); a
    :class:`CheckpointError` where it names none (``flashckpt://``)."""
    found = strip(url)
    if not found:
        raise no_folder_error(url)
    return found


def local_path(path: str) -> str:
    """The absolute, normalized local path of a ``flashckpt://`` URL; a
    :class:`CheckpointError` for a form not taken."""
    rest = path[len(_PREFIX):]
    if "?" in rest or "#" in rest:
        raise CheckpointError(f"{path!r}: a {PROTOCOL}:// URL takes no query or fragment ('?', '#'); "
                              "give options through fsspec's config (fsspec.config.conf['flashckpt'])")
    authority = "" if rest.startswith("/") else rest.split("/", 1)[0]
    if "@" in authority:
        raise CheckpointError(f"{path!r}: a {PROTOCOL}:// URL takes no user info (user:password@); it names a "
                              f"local folder: {PROTOCOL}:///abs/dir")
    if ":" in authority:
        raise CheckpointError(f"{path!r}: a {PROTOCOL}:// URL names a local folder, not a host and port; "
                              f"write {PROTOCOL}:///abs/dir ({PROTOCOL}::s3://bucket/dir for an object store)")
    if not rest.strip("/") or _DCP_FILE.fullmatch(rest):  # the latter: what DCP joins to an id with no folder
        raise no_folder_error(path)
    return os.path.normpath(os.path.abspath(rest))


def chained_location(target_protocol: str, path: str) -> str | None:
    """The object-store URL a chain ``flashckpt::<target_protocol>://<path>`` names (``path``
    as fsspec strips it), checked; None for a local folder (``file://``)."""
    if target_protocol in _LOCAL:
        return None
    if target_protocol not in OBJECT_SCHEMES:
        raise CheckpointError(f"{CHAINED}{target_protocol}://{path}: a chain takes an object store "
                              f"({', '.join(f'{s}://' for s in OBJECT_SCHEMES)}) or a local folder (file://) behind "
                              f"{PROTOCOL}, not a {target_protocol}:// location")
    return normalize_id(f"{target_protocol}://{path}")
