"""Deterministic training under torchrun for the restart test.

    torchrun --nproc_per_node=2 --max-restarts=1 _torchrun_train.py CKPT OUT STEPS KILL_AT

On the first attempt rank 1 kills itself with SIGKILL right after saving step
KILL_AT (persist_every is large, so nothing reached storage); torchrun restarts
both ranks, which must resume from memory at KILL_AT.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from flashckpt.torch import init_process_group


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def make(rank: int):
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def train_reference(rank: int, steps: int) -> dict:
    model, opt = make(rank)
    for step in range(1, steps + 1):
        train_step(model, opt, rank, step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    from flashckpt import _events
    from flashckpt.torch import Checkpointer
    directory, out, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group()
    rank = dist.get_rank()
    loads = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    model, opt = make(rank)
    ck = Checkpointer(directory, persist_every=1000)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    start = ck.load(state) or 0
    opt.load_state_dict(state["optim"])
    for step in range(start + 1, steps + 1):
        train_step(model, opt, rank, step)
        dist.all_reduce(torch.ones(1))  # a collective each step, as gradient averaging would be
        ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
        if restart == 0 and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    ck.close()
    torch.save(model.state_dict(), os.path.join(out, f"final{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"restart": restart, "loaded_step": loads[0]["step"], "source": loads[0]["source"]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # no finalization, where torch's gloo teardown can abort (see tests/_exit.py)
