"""What every replica-test worker does around its checkpointer (see ``test_replica_restore``)."""

import json
import pathlib
import time

from flashckpt._replica_store import replica_index


def wait_for_replica(engine, job_id: str, step: int) -> list:
    """Wait (60 s at most) until this node holds the other node's replica of ``step``
    (when replicas are on); the (storage rank, step) of every replica here."""
    deadline = time.monotonic() + 60
    while engine.replicas.endpoints and not any(h.step == step for _, h in replica_index(job_id)):
        assert time.monotonic() < deadline, f"the other node's step {step} never arrived"
        time.sleep(0.05)
    return sorted((h.info["storage_rank"], h.step) for _, h in replica_index(job_id))


def finish(report: dict, out: str, mode: str) -> None:
    """Write the report whole; a saving worker then waits to be killed, as a lost node's processes are."""
    pathlib.Path(out).write_text(json.dumps(report))
    if mode == "save":
        time.sleep(600)
