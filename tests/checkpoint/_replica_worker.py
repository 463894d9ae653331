"""One rank of the replica tests' two "nodes" (its own FLASHCKPT_SHM_DIR tmpfs, one rank each).

    python _replica_worker.py RANK PORT DIR REPLICAS OUT_JSON save|load [own|fsdp]

``save``: steps 1..3 (step 2 committed, 3 only in memory), wait until this node holds the
other node's replica of step 3 (when replicas are on), report, then wait to be killed.
``load``: a fresh process loads and reports the step, its source and the values. ``own``
(default): a ``Checkpointer`` of a tensor whose value is 10 * rank + step; ``fsdp``: an
FSDP2 model and AdamW through ``FsdpCheckpointer``, reporting a digest of this rank's shards.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from flashckpt.replicas._store import replica_index
from flashckpt.torch import Checkpointer
from tests.checkpoint._replica_node import load_and_report
from tests._exit import exit_now


def digest(model) -> float:
    """A sum over this rank's local shards of the model's parameters."""
    return float(sum(p.to_local().double().sum() for p in model.parameters()))


def main() -> None:
    rank, port, directory, replicas, out, mode = sys.argv[1:7]
    kind = sys.argv[7] if len(sys.argv) > 7 else "own"
    rank, replicas = int(rank), None if replicas == "auto" else int(replicas)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if kind == "fsdp":
        from flashckpt.torch import FsdpCheckpointer
        from tests.fsdp._fsdp_common import make, train_step
        model, opt = make()
        ck = FsdpCheckpointer(directory, job_id="replica", persist_every=2, replicas=replicas)
    else:
        ck = Checkpointer(directory, job_id="replica", persist_every=2, replicas=replicas)
    report = {"saver_pid": ck.engine._client.saver_pid,
              "endpoints": sorted(map(list, ck.engine.replicas.endpoints.values()))}
    if mode == "save" and kind == "fsdp":
        for step in (1, 2, 3):
            train_step(model, opt, rank, step)
            ck.save(step, model, opt)
            report[f"digest{step}"] = digest(model)
        ck.wait()
    elif mode == "save":
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((1 << 18,), 10.0 * rank + step)})
        ck.wait()
    if mode == "save":
        deadline = time.monotonic() + 60
        while replicas != 0 and not any(h.step == 3 for _, h in replica_index("replica")):
            assert time.monotonic() < deadline, "the other node's step 3 never arrived"
            time.sleep(0.05)
        report["replicas_here"] = sorted((h.info["storage_rank"], h.step) for _, h in replica_index("replica"))
        dist.barrier()
    elif kind == "fsdp":
        step = ck.load(model, opt)
        report.update(step=step, source=ck.last_load.source, digest=digest(model))
        dist.barrier()
        ck.close()
    else:
        load_and_report(ck, report)
    with open(out, "w") as f:
        json.dump(report, f)
    if mode == "save":
        time.sleep(600)  # killed by the test, as a lost node's processes are


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
