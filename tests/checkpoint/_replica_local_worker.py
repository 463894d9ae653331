"""One rank of the node-local directory tests: its own "node" (FLASHCKPT_SHM_DIR tmpfs, and
its own directory bind-mounted at the checkpoint path), one rank each.

    python _replica_local_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load [own|ddp]

``save``: a ``Checkpointer`` of a tensor whose value is 10 * rank + step, steps 1..3 with
``persist_every=2`` (step 2 due for storage, 3 only in memory); waits until this node holds
the other node's replica of step 3 and its own directory committed step 2, reports what the
directory holds, then waits to be killed. ``load``: a fresh process loads and reports the
step, its source and the values. ``ddp``: a ``DdpCheckpointer`` (one copy per node,
rank 0 alone persists), every rank's value 7 + step.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from flashckpt import CheckpointError
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer, DdpCheckpointer
from tests.checkpoint._replica_node import finish, load_and_report, wait_for_replica
from tests._exit import exit_now


def main() -> None:
    rank, port, directory, replicas, out, mode = sys.argv[1:7]
    ddp = len(sys.argv) > 7 and sys.argv[7] == "ddp"
    rank, replicas = int(rank), None if replicas == "auto" else int(replicas)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ck = (DdpCheckpointer if ddp else Checkpointer)(directory, job_id="replica", persist_every=2, replicas=replicas)
    report = {"saver_pid": ck.engine._client.saver_pid, "node_local": ck.engine.node_local is not None}
    if mode == "save":
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1 << 18,), (7.0 if ddp else 10.0 * rank) + step)})
        ck.wait()
        report["replicas_here"] = wait_for_replica(ck.engine, "replica", 3)
        storage = LocalStorage(directory)
        deadline = time.monotonic() + 60
        while 2 not in storage.committed_steps():  # the other rank's shard arrives as a replica
            assert time.monotonic() < deadline, f"step 2 never committed here: {os.listdir(directory)}"
            time.sleep(0.05)
        meta = storage.metadata(2)
        report.update(committed=storage.committed_steps(), ranks=meta.get("ranks"), shards=sorted(meta["shards"]),
                      problems=storage.verify(2), latest=ck.latest_step())
        dist.barrier()
    else:
        try:
            load_and_report(ck, report)
        except CheckpointError as exc:  # the same error on every rank
            report["error"] = f"{type(exc).__name__}: {exc}"
    finish(report, out, mode)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
