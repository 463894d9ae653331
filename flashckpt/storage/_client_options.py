"""fsspec client options of an object-store scheme that a caller gave flashckpt explicitly.

fsspec configures a store's client (``endpoint_url``, credentials, ``config_kwargs``) through
its configuration (``fsspec.config.conf["s3"]``, ``FSSPEC_S3``), which every object store of
flashckpt reads; a chained URL may also carry them per call
(``url_to_fs("flashckpt::s3://bucket/run", s3={"client_kwargs": {...}})``, see
:mod:`flashckpt.dcp._fs`). Those are kept here, per scheme, for the process's stores
(:func:`options_of`, explicit options winning over the configuration, as in fsspec) and
handed to the savers this process starts as the fsspec configuration of their environment
(:func:`saver_environment`): the saver persists into the same store. They never go into
a URL, shared memory, metadata or a log. A saver already running keeps the options it
started with.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from .._errors import CheckpointError

__all__ = ["options_of", "saver_environment", "use"]

log = logging.getLogger(__name__)

_OPTIONS: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


def use(scheme: str, options: Mapping[str, Any]) -> None:
    """The client options of ``scheme``'s stores in this process and the savers it starts
    from now on (they replace earlier ones); a :class:`CheckpointError` if they are not
    JSON (a saver receives them as text)."""
    try:
        text = json.dumps(dict(options), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the {scheme}:// client options given to flashckpt must be plain JSON values "
                              f"(the saver process receives them as text): {exc}") from None
    with _LOCK:
        before = _OPTIONS.get(scheme)
        _OPTIONS[scheme] = json.loads(text)
    if before is not None and before != _OPTIONS[scheme]:
        log.info("the %s:// client options of flashckpt's stores changed (stores opened before keep theirs)", scheme)


def options_of(scheme: str) -> dict[str, Any]:
    """The client options given for ``scheme`` (empty if none)."""
    with _LOCK:
        return json.loads(json.dumps(_OPTIONS.get(scheme, {})))


def saver_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` for a saver: ``FSSPEC_<SCHEME>`` of each scheme with
    options, the options over what ``env`` already configures there."""
    with _LOCK:
        given = dict(_OPTIONS)
    out: dict[str, str] = {}
    for scheme, options in given.items():
        name = f"FSSPEC_{scheme.upper()}"
        try:
            configured = json.loads(env.get(name) or "{}")
        except ValueError:
            configured = {}
        out[name] = json.dumps({**(configured if isinstance(configured, dict) else {}), **options})
    return out
