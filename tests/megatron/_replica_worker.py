"""One rank of the megatron replica test's two "nodes" (its own FLASHCKPT_SHM_DIR tmpfs, one rank each).

    python _replica_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load [KIND, ignored]

Each rank holds one row of a (2, N) ``ShardedTensor`` ``w`` (value 10 * rank + step).
``save``: steps 1..3 (step 2 committed, 3 only in memory), wait until this node holds the
other node's replica of step 3 (when replicas are on), report, then wait to be killed.
``load``: a fresh process loads through ``MegatronCheckpointer`` and reports the step, its
source (from the ``load`` event), the values and the steps its slots hold after the load. Same protocol as
``tests/checkpoint/_replica_worker.py``, so ``test_replica_restore``'s rounds drive it.
"""

import sys

import torch
import torch.distributed as dist

from flashckpt import _events
from tests.checkpoint._replica_node import finish, wait_for_replica
from flashckpt.megatron import MegatronCheckpointer
from tests._exit import exit_now

N = 1 << 18


def sharded(rank: int, value: float) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    data = torch.full((1, N), value)
    return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, 2))}


def main() -> None:
    rank, port, directory, replicas, out, mode = sys.argv[1:7]
    rank = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    ck = MegatronCheckpointer(directory, job_id="replica", persist_every=2, **kwargs)
    engine = ck.engine
    report = {"saver_pid": engine._client.saver_pid, "endpoints": sorted(map(list, engine.replicas.endpoints.values()))}
    if mode == "save":
        for step in (1, 2, 3):
            ck.save(step, sharded(rank, 10.0 * rank + step))
        ck.wait()
        report["replicas_here"] = wait_for_replica(engine, "replica", 3)
        dist.barrier()
    else:
        events = []
        _events.subscribe(lambda event, **info: events.append(info) if event == "load" else None)
        state, step = ck.load(sharded(rank, 0.0))
        w = state["w"]
        report.update(step=step, source=events[-1]["source"], w=w[0, 0].item(), uniform=bool((w == w[0, 0]).all()),
                      held=sorted(engine.memory_steps()))
        dist.barrier()
        ck.close()
    finish(report, out, mode)

if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
