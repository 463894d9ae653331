"""Storage schemes beyond the built-in ones: ``register(scheme, factory)``.

A factory takes the normalized URL (``scheme://rest``) and returns a
:class:`~flashckpt.storage._protocol.Storage`, usually
``CommittedStore(MyBackend(url))``: the backend's byte primitives under the one policy.

The saver is a process of its own, so a scheme registered only in the training process
would be unknown there. A package makes its scheme known to every process by declaring a
factory as an entry point of group :data:`ENTRY_POINTS` named by the scheme
(``[project.entry-points."flashckpt.storage"] mystore = "mypkg.store:open_store"``); an
unknown scheme is looked up there once, then registered. Configuration never travels in
the URL or between processes as code: the factory reads it as its library does.
"""

from __future__ import annotations

import logging
import re
import threading
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ._protocol import Storage

__all__ = ["ENTRY_POINTS", "Factory", "factory", "register"]

log = logging.getLogger(__name__)

ENTRY_POINTS = "flashckpt.storage"
Factory = Callable[[str], "Storage"]
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")
_RESERVED = ("file",)
_FACTORIES: dict[str, Factory] = {}
_GUARD = threading.Lock()


def register(scheme: str, factory: Factory) -> None:
    """Open ``scheme://...`` locations with ``factory(url)`` in this process (replacing an
    earlier registration of that scheme). ``file`` and the built-in object-store schemes
    may be registered again only to replace their backend."""
    if not isinstance(scheme, str) or not _SCHEME_RE.match(scheme) or scheme in _RESERVED:
        raise ValueError(f"{scheme!r} is not a scheme flashckpt can register (lowercase letters, digits, +.-; "
                         "not 'file')")
    if not callable(factory):
        raise TypeError(f"the factory of {scheme}:// must be callable, got {type(factory).__name__}")
    with _GUARD:
        _FACTORIES[scheme] = factory


def factory(scheme: str, *, discover: bool = True) -> Factory | None:
    """The factory registered for ``scheme``, else (with ``discover``) the entry point of
    that name (loaded and registered now), else None."""
    with _GUARD:
        found = _FACTORIES.get(scheme)
    if found is not None or not discover:
        return found
    for point in entry_points(group=ENTRY_POINTS, name=scheme):
        loaded = point.load()
        log.debug("storage scheme %s:// from entry point %s", scheme, point.value)
        register(scheme, loaded)
        return loaded
    return None
