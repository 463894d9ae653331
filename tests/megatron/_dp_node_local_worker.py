"""One rank of the megatron data-parallel test on two node-local "nodes" (the rounds of
``tests/checkpoint/test_replica_node_local.py``: its own FLASHCKPT_SHM_DIR tmpfs and its own
directory bind-mounted at the checkpoint path).

    python _dp_node_local_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load [KIND, ignored]

The tiny GPTModel of ``_gpt`` (CPU initialisation) with TP=1, DP=2 (one rank per node) and
megatron's ``FP32Optimizer``: every block of the model and optimizer state is replicated
across the two data-parallel ranks and saved by rank 0 alone. ``save``: steps 1..3 (one
optimizer update each, the same on both ranks), ``persist_every=2`` (step 2 due for
storage, 3 only in memory); the rank's state after each step goes to OUT_JSON.step<N>.pt;
waits until this node holds the other node's replica of step 3 and its own directory
committed step 2, then waits to be killed. ``load``: a fresh model (another seed) loads;
its state goes to OUT_JSON.loaded.pt, the step and the load's source to OUT_JSON; then closes.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from flashckpt.storage._local import LocalStorage
from tests._exit import exit_now
from tests.checkpoint._replica_node import finish, wait_for_replica
from tests.megatron import _gpt


def train(model, opt, step: int) -> None:
    opt.zero_grad()
    _gpt.loss(model, step).backward()  # the same loss on both ranks: data-parallel replicas stay equal
    opt.step()


def main() -> None:
    rank, port, directory, replicas, out, mode = sys.argv[1:7]
    rank = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from flashckpt.megatron import MegatronCheckpointer
    model = _gpt.build(1, seed=0 if mode == "save" else 7)
    opt = _gpt.optimizer(model)
    kwargs = {} if replicas == "auto" else {"replicas": int(replicas)}
    ck = MegatronCheckpointer(directory, job_id="dp", persist_every=2, **kwargs)
    engine = ck.engine
    report = {"saver_pid": engine._client.saver_pid, "node_local": engine.node_local is not None}
    if mode == "save":
        for step in (1, 2, 3):
            train(model, opt, step)
            ck.save(step, _gpt.state_of(model, opt))
            torch.save(_gpt.local_state(model, opt), f"{out}.step{step}.pt")
        ck.wait()
        report["replicas_here"] = wait_for_replica(engine, "dp", 3)
        deadline = time.monotonic() + 60
        while 2 not in LocalStorage(engine.storage.root).committed_steps():  # rank 1's shard arrives as a replica
            assert time.monotonic() < deadline, f"step 2 never committed here: {os.listdir(engine.storage.root)}"
            time.sleep(0.05)
        dist.barrier()
    else:
        train(model, opt, 99)  # Adam's state exists (as after a restart that stepped once); all of it is replaced
        state, step = ck.load(_gpt.state_of(model, opt, loading=True))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.save(_gpt.local_state(model, opt), f"{out}.loaded.pt")
        report.update(step=step, source=ck.last_load.source)
        dist.barrier()
        ck.close()
    finish(report, out, mode)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
