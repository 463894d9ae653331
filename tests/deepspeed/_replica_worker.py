"""One rank of the DeepSpeed replica test's two "nodes" (its own FLASHCKPT_SHM_DIR tmpfs, one rank each).

    python _replica_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load [KIND, ignored]

A ZeRO-1 engine (torch's Adam) on CPU (gloo) through ``DeepSpeedCheckpointer``. ``save``: trains and
saves steps 1..3 (step 2 committed, 3 only in memory), waits until this node holds the
other node's replica of step 3 (when replicas are on), reports the parameters' sum
after each step, then waits to be killed. ``load``: a fresh process loads and reports
the step, its source (the ``load`` event) and the parameters' sum. Same protocol as
``tests/checkpoint/_replica_worker.py``, so ``test_replica_restore``'s rounds drive it.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch.distributed as dist  # noqa: E402

from flashckpt import _events  # noqa: E402
from tests.checkpoint._replica_node import finish, wait_for_replica  # noqa: E402
from tests.deepspeed._ds_train import MICRO_BATCH, train_step  # noqa: E402
from tests._exit import exit_now  # noqa: E402


def make_engine():
    """ZeRO-1 with torch's Adam handed in (no JIT-built fused Adam, so no compile and no
    build lock shared with other test processes)."""
    import deepspeed
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                                           config=config)
    return engine


def digest(engine) -> float:
    return float(sum(p.detach().double().sum() for p in engine.module.parameters()))


def join(rank: str, port: str) -> int:
    """Rank ``rank`` in a gloo group DeepSpeed takes; returns the rank. Two ranks, one per node,
    unless the round set ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``."""
    world = os.environ.get("WORLD_SIZE", "2")
    os.environ.update(RANK=rank, LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"), WORLD_SIZE=world,
                      LOCAL_WORLD_SIZE=os.environ.get("LOCAL_WORLD_SIZE", "1"), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world))
    import deepspeed
    # no JIT build of DeepSpeed's shm all-reduce for the ranks of one node (minutes on 2 cores): gloo does all
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    return int(rank)


def main() -> None:
    rank, port, directory, replicas, out, mode = sys.argv[1:7]
    rank = join(rank, port)
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    engine = make_engine()
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    ck = DeepSpeedCheckpointer(engine, directory, job_id="replica", persist_every=2, **kwargs)
    flash = ck._flash
    report = {"saver_pid": flash._client.saver_pid, "endpoints": sorted(map(list, flash.replicas.endpoints.values()))}
    if mode == "save":
        for step in (1, 2, 3):
            train_step(engine, rank, step)
            ck.save(step)
            report[f"digest{step}"] = digest(engine)
        ck.wait()
        report["replicas_here"] = wait_for_replica(flash, "replica", 3)
        dist.barrier()
    else:
        events = []
        _events.subscribe(lambda event, **info: events.append(info) if event == "load" else None)
        step = ck.load()
        report.update(step=step, source=events[-1]["source"], digest=digest(engine))
        dist.barrier()
        ck.close()
    finish(report, out, mode)

if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
