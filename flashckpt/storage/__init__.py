"""Storage of committed steps: a protocol of byte primitives, local and object-store
backends, and the policy written once above them.

- :class:`Storage`: what the rest of flashckpt calls (write, commit, order, open, verify);
- :class:`Backend`: the byte primitives a new backend implements, :class:`ObjectInfo` what
  it lists, and :class:`CommittedStore` the policy over one;
- :func:`open_storage`: the one constructor from a location (a path or a URL);
- :func:`register`: a factory for a new URL scheme (see :mod:`flashckpt.storage._registry`).

The names load on first use: modules that the backends import (the shard reader, the
memory format) import this package's small modules without loading every backend.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Backend", "CommittedStore", "ObjectInfo", "Storage", "open_storage", "register"]

_HOMES = {"Backend": "_protocol", "ObjectInfo": "_protocol", "Storage": "_protocol",
          "CommittedStore": "_committed", "open_storage": "_url", "register": "_registry"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
