"""What each rank of the DCP tests runs (forked workers of ``tests._fork.run_ranks``)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close

from ..fsdp._fsdp_common import full_state, make, train_step


def _state(model, opt, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def save_then_die(rank: int, world: int, root: str) -> None:
    """FSDP2: train 3 steps, ``dcp.save`` after steps 2 and 3 through the flash writer, leave
    step 3's consolidated state in ``expected.pt``, then die by ``kill -9``."""
    model, opt = make(seed=0)
    for step in (1, 2):
        train_step(model, opt, rank, step)
    dcp.save(_state(model, opt, 2), storage_writer=FlashStorageWriter(f"{root}/step-2"))
    train_step(model, opt, rank, 3)
    dcp.save(_state(model, opt, 3), storage_writer=FlashStorageWriter(f"{root}/step-3"))
    expected = full_state(model, opt)
    if rank == 0:
        torch.save(expected, f"{root}/expected.pt")
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def restore(rank: int, world: int, root: str) -> dict:
    """A new FSDP2 model (other initial weights) loads step 3 through the flash reader;
    returns where it came from and whether the state equals the saved one."""
    model, opt = make(seed=1)
    state = _state(model, opt, 0)
    reader = FlashStorageReader(f"{root}/step-3")
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got, want = full_state(model, opt), torch.load(f"{root}/expected.pt", weights_only=True)
    same = all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and \
        all(torch.equal(got["optim"][p][k], want["optim"][p][k]) for p in want["optim"] for k in want["optim"][p])
    info = reader.last_load
    close()  # persists the newest step if it is not yet, and frees the memory
    return {"source": info.source, "step": info.step, "same": same, "saved_step": state["step"]}


def async_save_in_a_process(rank: int, world: int, root: str) -> list[float]:
    """``dcp.async_save`` with DCP's process executor: its checkpoint process opens the run
    and copies into shared memory; returns the saved tensor's values."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": torch.arange(12.0).reshape(3, 4) * (rank + 1), "epoch": 4}
    dcp.async_save(state, storage_writer=FlashStorageWriter(f"{root}/step-4"),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    return state["w"].flatten().tolist()


def load_step_4(rank: int, world: int, root: str) -> dict:
    state = {"w": torch.zeros(3, 4), "epoch": 0}
    reader = FlashStorageReader(f"{root}/step-4")
    dcp.load(state, storage_reader=reader)
    info = reader.last_load
    close()
    return {"w": state["w"].flatten().tolist(), "epoch": state["epoch"], "source": info.source}


def _halves(value: float) -> dict:
    return {f"k{i}": torch.full((256,), value) for i in range(8)}


def resave_dies_before_finish(rank: int, world: int, root: str, name: str) -> None:
    """Save ``name`` (all 1.0), let it persist, then save it again (all 2.0) and die by
    ``kill -9`` after rank 1 copied its items but before rank 0's ``finish`` (rank 0 copies there)."""
    import threading

    from flashckpt.dcp import _writer
    from ._common import wait_for

    dcp.save(_halves(1.0), storage_writer=FlashStorageWriter(f"{root}/{name}"))
    dist.barrier()
    wait_for(f"{root}/{name}/.metadata")
    dist.barrier()
    if rank == 0:
        _writer.FlashStorageWriter.finish = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    else:  # waits for rank 0's finish in DCP's collectives: dies there
        threading.Timer(5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    dcp.save(_halves(2.0), storage_writer=FlashStorageWriter(f"{root}/{name}"))


def load_halves(rank: int, world: int, root: str, name: str) -> list[float]:
    """Load ``name`` through the flash reader; the value of each of its items."""
    state = _halves(0.0)
    dcp.load(state, storage_reader=FlashStorageReader(f"{root}/{name}"))
    close()
    return [float(t[0]) for t in state.values()]
