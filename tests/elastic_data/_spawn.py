"""The elastic-data and agent tests' old names for the suite's spawn helper
(``tests._fork.run_ranks``) and ``free_port`` (``tests._net``).

``run_group(fn, world_size, *args)`` is ``run_ranks`` with each result as JSON carries it
(tuples become lists, keys strings), as this helper returned them when it spawned
interpreters of its own and read their results from JSON files.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .._fork import run_ranks
from .._net import free_port

__all__ = ["free_port", "run_group"]


def run_group(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    return json.loads(json.dumps(run_ranks(fn, world_size, *args)))
