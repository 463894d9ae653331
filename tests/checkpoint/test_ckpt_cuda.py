"""GPU state: saves copy device tensors into page-locked shared memory, loads copy
them back, from memory in a new process and from storage. Needs a CUDA device (CI has
none; these run where one is, e.g. ``pytest tests/checkpoint/test_ckpt_cuda.py``)."""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from flashckpt.torch import Checkpointer

from tests._fork import run_ranks
from .test_ckpt_roundtrip import assert_same, rich_state, zeros_like_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(state):
    if isinstance(state, torch.Tensor):
        return state.cuda()
    if isinstance(state, dict):
        return {k: to_cuda(v) for k, v in state.items()}
    if isinstance(state, list):
        return [to_cuda(v) for v in state]
    if isinstance(state, tuple):
        return tuple(to_cuda(v) for v in state)
    return state


def cuda_state() -> dict:
    state = to_cuda(rich_state())
    state["big"] = torch.randn(3, 2**20, device="cuda")  # 12 MiB: several 4 MiB checksum blocks
    state["on_cpu"] = torch.arange(7)  # a host tensor beside the GPU ones
    state["noncontig_gpu"] = state["big"][:, ::3]
    return state


def test_cuda_state_round_trips_through_page_locked_memory(tmp_path, job_id, caplog):
    state = cuda_state()
    with caplog.at_level(logging.DEBUG, logger="flashckpt"):
        with Checkpointer(tmp_path, job_id=job_id) as ck:
            ck.save(1, state, persist=True)
            ck.wait()
            state["big"].add_(1)  # step 2 differs
            ck.save(2, state)
            target = zeros_like_state(state)  # on the same devices as the state
            assert ck.load(target) == 2 and ck.last_load.source == "memory"
            assert_same(state, target)
            assert target["big"].is_cuda and not target["on_cpu"].is_cuda
    assert "page-locked" in caplog.text  # the slots were registered with CUDA, not left pageable


def test_restarted_process_loads_cuda_state_from_memory_and_storage(tmp_path, job_id):
    code = textwrap.dedent(f"""
        import os
        import torch
        from flashckpt.torch import Checkpointer
        torch.manual_seed(0)
        state = {{"w": torch.randn(1 << 20, device="cuda"), "m": torch.randn(1000, 3, device="cuda").half()}}
        target = {{k: torch.zeros_like(v) for k, v in state.items()}}
        ck = Checkpointer({str(tmp_path)!r}, job_id={job_id!r})
        step = ck.load(target)
        print("loaded", step, ck.last_load.source if step is not None else None,
              all(torch.equal(target[k], state[k]) for k in state), flush=True)
        if step is None:
            ck.save(5, state, persist=True)
            ck.wait()
            os._exit(0)  # as a crash would: the copy stays in memory
        else:
            ck.close()
    """)

    def run() -> str:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run() == "loaded None None False"
    assert run() == "loaded 5 memory True"  # a new process reads the old one's slot
    assert run() == "loaded 5 storage True"  # the last one freed its memory: storage


def _fsdp_round_trip(rank: int, world: int, root: str, job: str) -> bool:
    from torch.distributed.fsdp import fully_shard

    from flashckpt.torch import FsdpCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3)).cuda()
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16, device="cuda")).square().mean().backward()
    opt.step()
    expect = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with FsdpCheckpointer(root, job_id=job) as ck:
        ck.save(1, model, opt, persist=True)
        ck.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert ck.load(model, opt) == 1 and ck.last_load.source == "memory"
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return all(torch.equal(expect[k], got[k]) for k in expect) and all(
        v.is_cuda for st in opt.state.values() for k, v in st.items() if k != "step")


def test_fsdp2_on_cuda_round_trips(tmp_path, job_id):
    assert run_ranks(_fsdp_round_trip, 1, str(tmp_path), job_id, backend="cpu:gloo,cuda:nccl") == [True]
