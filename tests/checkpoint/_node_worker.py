"""One rank on its own "node" (a private /dev/shm), for the multi-node test.

    python _node_worker.py RANK WORLD PORT DIR own|ddp|megatron OUT_JSON [REPLICAS]

``megatron``: only constructs a ``MegatronCheckpointer`` (reports its error, or None).
"""

import glob
import json
import socket
import sys

import torch
import torch.distributed as dist

from flashckpt import CheckpointError
from flashckpt.torch import Checkpointer, DdpCheckpointer
from flashckpt._names import job_prefix
from tests._exit import exit_now


def main() -> None:
    rank, world, port, directory, mode, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                               sys.argv[5], sys.argv[6])
    socket.sethostname(f"node{rank}")  # its own mount namespace; the hostname names the node in errors
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    replicas = int(sys.argv[7]) if len(sys.argv) > 7 else None
    cls = {"own": Checkpointer, "ddp": DdpCheckpointer, "megatron": _megatron}[mode]
    value = float(rank) if mode == "own" else 7.0
    try:
        ck = cls(directory, job_id="nodes", replicas=replicas)
    except CheckpointError as exc:
        with open(out, "w") as f:
            json.dump({"error": str(exc)}, f)
        dist.destroy_process_group()  # left to interpreter exit, gloo's teardown sometimes aborts (SIGABRT)
        return
    if mode == "megatron":
        ck.close()
        with open(out, "w") as f:
            json.dump({"error": None}, f)
        dist.destroy_process_group()
        return
    for step in (1, 2):
        ck.save(step, {"w": torch.full((100,), value + step)})
    ck.wait()
    slots = sorted(p.rsplit("/", 1)[1] for p in glob.glob(job_prefix("nodes") + ".*.slot*"))
    target = {"w": torch.zeros(100)}
    step = ck.load(target)
    report = {"slots": slots, "step": step, "source": ck.last_load.source, "w": target["w"][0].item(),
              "local_rank": ck._engine.placement.local_rank}
    dist.barrier()
    ck.close()
    with open(out, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def _megatron(directory: str, **options):
    from flashckpt.megatron import MegatronCheckpointer
    return MegatronCheckpointer(directory, **options)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
