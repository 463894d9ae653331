"""The root exception of the ``elastic`` package.

Every error the package raises on purpose derives from :class:`ElasticError`, so a
caller can catch the package's errors with one clause.
"""

from __future__ import annotations

__all__ = ["ElasticError"]


class ElasticError(Exception):
    """Root of every error raised on purpose by ``elastic``."""
