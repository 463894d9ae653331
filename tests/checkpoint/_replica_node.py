"""What every replica-test worker does around its checkpointer (see ``test_replica_restore``)."""

import json
import pathlib
import subprocess
import time

import pytest

from flashckpt.replicas._store import replica_index


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


def load_and_report(ck, report: dict) -> None:
    """Load a ``{"w": tensor}`` state (2**18 floats) and report the step, its source and the values."""
    import torch
    import torch.distributed as dist

    target = {"w": torch.zeros(1 << 18)}
    step = ck.load(target)
    report.update(step=step, source=ck.last_load.source, w=target["w"][0].item(),
                  uniform=bool((target["w"] == target["w"][0]).all()))
    dist.barrier()
    ck.close()


def reports(procs: list[subprocess.Popen], outs: list[pathlib.Path], mode: str) -> list[dict]:
    """Every worker's report once all are written (120 s at most); a worker that failed first fails the test."""
    deadline = time.monotonic() + 120
    while not all(o.exists() for o in outs):
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                pytest.fail(f"a {mode} worker failed: {p.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"the {mode} round did not finish"
        time.sleep(0.1)
    time.sleep(0.2)  # the json is written whole before the file is closed
    return [json.loads(o.read_text()) for o in outs]
