"""``connect(url)``: pick a backend from a URL."""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any

from ._coordinator import Coordinator
from ._options import Options
from ._errors import CoordinatorError, InvalidArgument

__all__ = ["connect", "mask_url"]

# scheme://user:PASSWORD@ (the user may be empty; the password runs to the last @ of the authority)
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/?#@]*:)[^/?#]*@")


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``****``."""
    return _PASSWORD.sub(r"\1****@", url)


def connect(url: str, **options: Any) -> Coordinator:
    """Open the coordinator store named by ``url``.

    ``memory://NAME`` (this process; same URL, same store), ``sqlite:///abs/path`` (also
    ``sqlite:////abs/path``), ``redis://[:password@]host:port/db``. ``options`` are the
    fields of :class:`Options`. Raises :class:`CoordinatorError` naming the URL (password
    masked) on an unknown scheme, a malformed URL or an unreachable server.
    """
    if not isinstance(url, str):
        raise InvalidArgument(f"url must be a str, got {url!r}")
    shown = mask_url(url)
    try:
        opts = Options(**options)
    except TypeError as exc:
        raise InvalidArgument(f"connect({shown!r}): {exc}") from exc
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise CoordinatorError(f"malformed coordinator URL {shown!r}: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme == "memory":
        from ._memory import memory_store

        if parts.path not in ("", "/") or parts.query:
            raise CoordinatorError(f"malformed coordinator URL {shown!r}: expected memory://NAME")
        return Coordinator(memory_store(parts.netloc), url=shown, options=opts)
    if scheme == "sqlite":
        from ._sqlite import SQLiteStore

        path = parts.path[1:] if parts.path.startswith("//") else parts.path
        if parts.netloc or not path.startswith("/") or path.endswith("/") or parts.query:
            raise CoordinatorError(f"malformed coordinator URL {shown!r}: expected sqlite:///absolute/path")
        if not os.path.isdir(os.path.dirname(path)):
            raise CoordinatorError(f"cannot open {shown}: directory {os.path.dirname(path)!r} does not exist")
        return Coordinator(SQLiteStore(path, url=shown, busy_timeout=opts.busy_timeout_seconds), url=shown, options=opts,
                           shared_url=url)
    if scheme == "redis":
        from ._redis import RedisStore

        db_text = parts.path.strip("/") or "0"
        if not parts.hostname or not db_text.isdigit() or parts.query:
            raise CoordinatorError(f"malformed coordinator URL {shown!r}: expected redis://[:password@]host:port/db")
        store = RedisStore(
            url=shown,
            host=parts.hostname,
            port=port or 6379,
            db=int(db_text),
            password=urllib.parse.unquote(parts.password) if parts.password is not None else None,
            key_prefix=opts.key_prefix,
            retry_seconds=opts.retry_seconds,
            socket_timeout=opts.socket_timeout_seconds,
        )
        return Coordinator(store, url=shown, options=opts, shared_url=url)
    raise CoordinatorError(f"unknown coordinator URL scheme in {shown!r}: use memory://, sqlite:/// or redis://")
