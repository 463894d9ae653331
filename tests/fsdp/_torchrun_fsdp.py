"""FSDP2 training under torchrun for the restart test.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 _torchrun_fsdp.py CKPT OUT STEPS KILL_AT

The loss history travels in the checkpoint's ``extra``. On the first attempt rank 1
kills itself with SIGKILL right after saving step KILL_AT (persist_every is large, so
nothing reached storage); torchrun restarts both ranks, which resume from memory. The
restarted ranks then train a second model from scratch, uninterrupted, as the
reference, and write both loss curves and whether the final states are bit-identical.
"""

import json
import os
import signal
import sys

import torch.distributed as dist
from flashckpt.torch import init_process_group

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from tests.fsdp._fsdp_common import local_state, make, train_step  # noqa: E402
from tests._exit import exit_now  # noqa: E402


def main() -> None:
    from flashckpt.torch import FsdpCheckpointer
    directory, out, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group()
    rank = dist.get_rank()
    model, opt = make(0)
    ck = FsdpCheckpointer(directory, persist_every=1000)
    start = ck.load(model, opt) or 0
    loaded = ck.last_load
    losses = list(ck.extra["losses"]) if start else []
    for step in range(start + 1, steps + 1):
        losses.append(train_step(model, opt, rank, step))
        ck.save(step, model, opt, extra={"losses": losses})
        if restart == 0 and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    reference, reference_opt = make(0)
    reference_losses = [train_step(reference, reference_opt, rank, step) for step in range(1, steps + 1)]
    mine, theirs = local_state(model, opt), local_state(reference, reference_opt)
    identical = all(torch_equal(mine[p][k], theirs[p][k]) for p in mine for k in mine[p])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"restart": restart, "loaded_step": loaded.step, "source": loaded.source, "losses": losses,
                   "reference_losses": reference_losses, "identical": identical}, f)
    dist.destroy_process_group()


def torch_equal(a, b) -> bool:
    import torch
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
