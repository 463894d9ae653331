"""Test-only: a saver started with this directory in its PYTHONPATH writes each received peer
replica to its node-local directory ``FLASHCKPT_TEST_REPLICA_DELAY`` seconds late, so that
this node's commit of a step (and its DeepSpeed tag) comes after this rank's own persist
was done (``tests/deepspeed/_node_local_tag_worker.py``). Python imports it at start-up."""

import os
import time

_DELAY = float(os.environ.get("FLASHCKPT_TEST_REPLICA_DELAY", "0") or 0)

if _DELAY > 0:
    from flashckpt.saver import _node_local

    _real = _node_local.persist_slot

    def _late(*args, **kwargs):  # the replica persister's only call of persist_slot
        time.sleep(_DELAY)
        return _real(*args, **kwargs)

    _node_local.persist_slot = _late
