"""``flashckpt://`` URLs: the local folder a URL names, and clear errors for the forms the
protocol does not take.

``flashckpt:///abs/dir/step-100`` names ``/abs/dir/step-100``; ``flashckpt://rel/dir`` a
folder relative to the current directory (as fsspec's ``file://`` reads it). Refused, each
with its own message: user info (``user:pw@``), a host with a port, a query or fragment,
an empty path and chained forms (``flashckpt::s3://...``: an object store behind the
protocol is not supported yet).

The errors are :class:`~flashckpt.CheckpointError`, not ``ValueError``: DCP asks fsspec
whether it can open a checkpoint id and reads a ``ValueError`` as "no", which would turn
every message here into DCP's "Cannot detect which StorageWriter or StorageReader to use".
"""

from __future__ import annotations

import os

from .._errors import CheckpointError

__all__ = ["PROTOCOL", "chained_error", "local_path"]

PROTOCOL = "flashckpt"
_PREFIX = f"{PROTOCOL}://"
_CHAINED = f"{PROTOCOL}::"


def chained_error(url: str) -> CheckpointError:
    return CheckpointError(
        f"{url!r}: chained forms ({PROTOCOL}::s3://..., {PROTOCOL}::file://...) are not supported yet; "
        f"use {PROTOCOL}:///abs/dir for a local or mounted folder")


def local_path(path: str) -> str:
    """The absolute, normalized local path of a ``flashckpt://`` URL or of a path fsspec
    already stripped of the protocol; a :class:`CheckpointError` for a form not taken."""
    if path.startswith(_CHAINED):
        raise chained_error(path)
    if not path.startswith(_PREFIX):
        if not path:
            raise CheckpointError(f"a {PROTOCOL}:// URL with no folder; write {PROTOCOL}:///abs/dir")
        return os.path.normpath(os.path.abspath(path))
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
                              f"write {PROTOCOL}:///abs/dir")
    if not rest.strip("/"):  # also what fsspec passes of a chained URL (flashckpt::s3://... -> "flashckpt://")
        raise CheckpointError(f"{path!r} names no folder: write {PROTOCOL}:///abs/dir (chained forms, "
                              f"{PROTOCOL}::s3://..., are not supported yet)")
    return os.path.normpath(os.path.abspath(rest))
