"""The command line every peer driver shares, and the one ``RESULT {json}`` line it prints.

A peer driver (``_dlrover_peer.py``, ``_lmres_peer.py``, ``_tckpt_peer.py``) runs in its
peer's venv (benchmarks/setup_peer_venv.sh), imports only torch, the standard library,
_state, this module and its peer, and is run by benchmarks/save_load.py as

    PEER_VENV/bin/python benchmarks/_<peer>_peer.py save|load --size S --dir D [--saves N]

``save`` builds the state and times the peer's saves; its result carries ``stall_first``
and ``stall_steady`` (a list), ``durable_first`` and ``durable_steady`` where the peer
writes storage, ``load_same_process`` where it loads from its memory, and the state's
``fingerprint``; any other number or list of numbers is one more metric of that peer.
``load`` is a NEW process that loads in place; its result is ``load`` (seconds), ``source``
(memory, storage or none), ``loaded_step`` and ``fingerprint``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

from _state import SPECS

__all__ = ["RESULT_PREFIX", "main", "stopwatch"]

RESULT_PREFIX = "RESULT "

Command = Callable[[argparse.Namespace], dict[str, Any]]


def stopwatch() -> Callable[[], float]:
    """Collect garbage, start a clock; the returned function reads the seconds since."""
    gc.collect()
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def main(
    doc: str,
    commands: dict[str, Command],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("command", choices=sorted(commands))
    parser.add_argument("--size", choices=sorted(SPECS), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--saves", type=int, default=4, help="first save + steady saves")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    result = commands[args.command](args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
