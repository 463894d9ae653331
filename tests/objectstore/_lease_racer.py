"""A process that claims run leases in step with its peers (the exclusive-lease race test).

Run in workers of ``tests._fork``'s fork server: :func:`race` waits at ``barrier`` before each
claim so that every racer's claim lands in the same instant, and reports each outcome.
"""

from __future__ import annotations

from flashckpt import JobConflictError
from flashckpt._engine import new_token
from flashckpt.storage._object import ObjectStorage

from .._fork import Inherit


def race(inherit: Inherit, urls: list[str], barrier, results) -> None:
    """Claim each of ``urls`` in turn at the barrier; put ("won"|"conflict"|"error", url, detail) on ``results``."""
    inherit.apply()  # the test's environment: fsspec's configuration of its servers
    stores = [ObjectStorage(url) for url in urls]
    for storage in stores:
        storage.committed_steps()  # the client connected before the race
    for storage in stores:
        barrier.wait(60)
        try:
            storage.claim_run(new_token())
            results.put(("won", storage.root, ""))
        except JobConflictError as exc:
            results.put(("conflict", storage.root, str(exc)))
        except Exception as exc:  # reported, not hidden: the test fails on it
            results.put(("error", storage.root, f"{type(exc).__name__}: {exc}"))
    barrier.wait(60)  # hold the leases until every racer is done
