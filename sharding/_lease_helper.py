"""The lease helper process of :class:`sharding.LeaseProcess` (:func:`main` in a fresh interpreter).

Reads a greeting (protocol version, store URL, options, data set) and then one JSON
request per line from its standard input, answers each with one JSON line, and exits
when its input closes. Imports nothing but this package.
"""

from __future__ import annotations

import signal
import sys
from typing import IO

from ._connect import connect
from ._shard import Shard
from ._lease_process import PROTOCOL_VERSION, described, read_message, shard_fields, write_message


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    """The helper: a greeting, then one reply per request, until input ends."""
    try:
        hello = read_message(requests)
    except (EOFError, ValueError):
        return
    if hello.get("version") != PROTOCOL_VERSION:
        write_message(replies, {"error": ["CoordinatorError", f"lease helper: protocol {hello.get('version')!r}, "
                                                              f"expected {PROTOCOL_VERSION}"]})
        return
    try:
        dataset = connect(hello["url"], **hello["options"]).dataset(hello["dataset"])
    except Exception as exc:
        write_message(replies, {"error": described(exc)})
        return
    write_message(replies, {"ready": True})
    while True:
        try:
            request = read_message(requests)
        except EOFError:
            return
        except ValueError as exc:
            write_message(replies, {"error": described(exc)})
            continue
        try:
            shards, refused = dataset.complete_and_acquire_many(
                [Shard(*fields) for fields in request["done"]], request["worker"], request["count"],
                timeout=request["timeout"])
            write_message(replies, {"shards": [shard_fields(s) for s in shards],
                                    "refused": [described(exc) for exc in refused]})
        except Exception as exc:  # the caller raises it
            write_message(replies, {"error": described(exc)})


def main() -> None:
    """The helper's entry point: serve standard input until it closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the training process; we go when it does
    _serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
