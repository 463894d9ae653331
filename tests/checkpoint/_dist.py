"""The names the checkpoint, framework and benchmark tests import for multi-process runs;
the helpers live in ``tests._fork`` (``run_ranks``) and ``tests._net`` (``free_port``)."""

from .._fork import run_ranks
from .._net import free_port

__all__ = ["free_port", "run_ranks"]
