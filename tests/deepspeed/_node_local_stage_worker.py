"""One rank of the DeepSpeed stage test on two node-local "nodes" (``tests/checkpoint/test_replica_node_local.py``'s
rounds: a FLASHCKPT_SHM_DIR tmpfs and a directory bind-mounted at the checkpoint path per node, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE set by the round).

    python _node_local_stage_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load STAGE

A ZeRO-``STAGE`` engine (torch's Adam) through ``DeepSpeedCheckpointer``, ``persist_every=2``.
``save``: steps 1..3 each saved (step 2 due for storage, 3 only in memory), reports the digest of
the rank's training state after each, waits until this node holds every other-node rank's replica
of step 3 and its directory committed step 2, then waits to be killed. ``load``: a fresh engine
loads (reports the step, its source and the digest), trains and saves step 4, ``close()``; then
reports what the directory holds, the flash steps committed there and the digest of a fresh engine
that DeepSpeed's own ``engine.load_checkpoint(DIR)`` loads (its stock checkpoint engine, as a user
without flashckpt would). A load that raises a ``CheckpointError`` reports it (``error``) and closes.
"""

import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashckpt import CheckpointError, _events  # noqa: E402
from flashckpt.replicas._store import replica_index  # noqa: E402
from flashckpt.storage._local import LocalStorage  # noqa: E402
from tests.checkpoint._replica_node import finish  # noqa: E402
from tests.deepspeed._ds_train import live, make_engine, train_step  # noqa: E402
from tests.deepspeed._node_local_tag_worker import holds  # noqa: E402
from tests.deepspeed._replica_worker import join  # noqa: E402
from tests.nodes._frameworks import digest  # noqa: E402
from tests._exit import exit_now  # noqa: E402

JOB = "stages"


def wait_for_peers_replicas(step: int, per_node: int) -> list:
    """Wait (60 s at most) until this node holds the replica of ``step`` of every rank of the other node."""
    node = dist.get_rank() // per_node
    others = {r for r in range(dist.get_world_size()) if r // per_node != node}
    deadline = time.monotonic() + 60
    while True:
        here = sorted((h.info["storage_rank"], h.step) for _, h in replica_index(JOB))
        if others <= {r for r, s in here if s == step}:
            return here
        assert time.monotonic() < deadline, f"step {step} of ranks {sorted(others)} never arrived: {here}"
        time.sleep(0.05)


def main() -> None:
    rank, port, directory, replicas, out, mode, stage = sys.argv[1:8]
    rank, stage = join(rank, port), int(stage)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    engine = make_engine(stage)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=JOB, persist_every=2, **kwargs)
    report: dict = {"saver_pid": ck._flash._client.saver_pid, "node_local": ck._flash.node_local is not None}
    if mode == "save":
        for step in (1, 2, 3):
            train_step(engine, rank, step)
            ck.save(step)
            report[f"digest{step}"] = digest(live(engine))
        ck.wait()  # this rank's own persists; the other node's shards of step 2 come as replicas
        report["replicas_here"] = wait_for_peers_replicas(3, per_node)
        storage, deadline = LocalStorage(os.path.join(directory, "flashckpt")), time.monotonic() + 60
        while 2 not in storage.committed_steps():
            assert time.monotonic() < deadline, f"step 2 never committed here: {os.listdir(storage.root)}"
            time.sleep(0.05)
        dist.barrier()
        finish(report, out, mode)  # waits to be killed
    events: list = []
    _events.subscribe(lambda event, **info: events.append(info) if event == "load" else None)
    try:
        step = ck.load()
    except CheckpointError as exc:  # the same error on every rank
        report["error"] = f"{type(exc).__name__}: {exc}"
        ck.close()
        finish(report, out, mode)
        return
    report.update(step=step, source=events[-1]["source"], loaded=digest(live(engine)))
    train_step(engine, rank, 4)
    ck.save(4)
    report["digest4"] = digest(live(engine))
    ck.close()
    dist.barrier()  # every rank's close returned
    report["after_close"] = holds(directory)
    report["committed"] = LocalStorage(os.path.join(directory, "flashckpt")).committed_steps()
    stock = make_engine(stage)  # DeepSpeed's own checkpoint engine
    path, _ = stock.load_checkpoint(directory)
    report["stock"] = {"path": path, "digest": digest(live(stock))}
    dist.barrier()
    finish(report, out, mode)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
