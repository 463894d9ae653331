"""FSDP2 failure capture (issue 42) on 2 gloo ranks, each run a new process pair.

Both ranks: load (a fresh start), arm ``save_on_failure``, save step 2 (persisted), three
updates; at step 6, inside backward (FSDP2's root parameters unsharded), the main thread
blocks in a C++ wait and the process gets SIGTERM: the watcher thread captures step 5 from
the local shards. The restart (a new pair) loads step 5 from memory, bit-exact, with its
``extra``. Where only rank 1 captures (rank 0 died first), the restart loads step 2 exactly
and rank 0 logs why the capture is not loaded. Bad input (no model known yet, another
optimizer, FSDP1) is ``_fsdp_ranks.capture_bad_input`` in the shared 2-rank run.

With gradient accumulation (``steps_per_update=4``, steps counted in micro-batches, saves at
8 and 16) SIGTERM inside micro-batch 22's backward captures update 20 on both ranks; the
restart loads it exactly, saves 24 (fitting the count), and rank 0 is SIGKILLed inside
micro-batch 30's backward: rank 1's collective fails and it captures 28, which rank 0 lacks,
so the next restart loads 24 exactly and rank 0 logs why.
"""

from __future__ import annotations

import pytest

from tests._fork import run_ranks
from tests.capture._blocked import SigtermWhileBlocked, logged

from .conftest import assert_ok


def _pack(state: dict) -> bytes:
    """Tensors as bytes: a worker's tensors pickled through the queue would be shared memory
    that is gone once it ends."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> dict:
    import io

    import torch

    return torch.load(io.BytesIO(data))


def _train_to_5(rank: int, directory: str, job: str):
    """Fresh start, armed capture (``extra``: the data position), step 0 saved before the
    optimizer's first step, step 2 saved and persisted, steps 3-5 trained. Returns (checkpointer, model, optimizer, capture, the
    local state of step 2)."""
    from flashckpt.torch import FsdpCheckpointer

    from ._fsdp_common import local_state, make, train_step

    model, opt = make(0)
    ckpt = FsdpCheckpointer(directory, job_id=job, persist_every=100)
    assert ckpt.load(model, opt) is None
    position = {"step": 0}
    capture = ckpt.save_on_failure(lambda: {"position": position["step"] * 8 + rank}, optimizer=opt)
    ckpt.save(0, model, opt, extra={"position": rank})  # a fresh optimizer: get_state_dict steps it inside
    for step in range(1, 6):
        train_step(model, opt, rank, step)
        position["step"] = step
        if step == 2:
            ckpt.save(2, model, opt, extra={"position": 16 + rank}, persist=True)
            ckpt.wait()
            at2 = local_state(model, opt)
    return ckpt, model, opt, capture, at2


def _sigterm_in_backward(rank: int, world: int, directory: str, job: str) -> dict:
    """Step 6's backward: SIGTERM while the main thread waits in C++ until the watcher
    thread has captured (a launcher's SIGTERM while a rank waits in a collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    from ._fsdp_common import batch, local_state

    term = SigtermWhileBlocked()
    ckpt, model, opt, capture, _ = _train_to_5(rank, directory, job)
    at5 = local_state(model, opt)
    seen: dict = {}

    def in_backward(grad: torch.Tensor) -> torch.Tensor:
        seen["unsharded"] = not isinstance(model.emb.weight, DTensor)  # the root's parameters, all-gathered
        term.block()
        return grad

    x, y = batch(rank, 6)
    opt.zero_grad()
    out = model(x)
    out.register_hook(in_backward)
    torch.nn.functional.mse_loss(out, y).backward()
    assert seen == {"unsharded": True}, seen
    term.assert_captured(5, capture)
    return _pack(at5)  # the process ends unclosed, as one that a launcher stops does


def _rank_1_captures(rank: int, world: int, directory: str, job: str) -> dict:
    """Rank 0 ends without capturing (it died); rank 1 captures step 5."""
    _, _, _, capture, at2 = _train_to_5(rank, directory, job)
    if rank == 1:
        assert capture.capture("test") == 5
    return _pack(at2)


def _restart(rank: int, world: int, directory: str, job: str) -> tuple:
    from flashckpt.torch import FsdpCheckpointer

    from ._fsdp_common import local_state, make

    lines: list[str] = []
    logged(lines)
    model, opt = make(3, lr=0.5)  # other weights, other learning rate
    with FsdpCheckpointer(directory, job_id=job) as ckpt:
        step = ckpt.load(model, opt)
        loaded = ckpt.last_load
        captured = bool(ckpt.engine.memory_info(step).get("captured")) if loaded.source == "memory" else False
        return step, loaded.source, captured, ckpt.extra, _pack(local_state(model, opt)), opt.param_groups[0]["lr"], \
            lines


def test_sigterm_in_backward_captures_the_last_step_and_the_restart_loads_it(tmp_path, job_id):
    from ._fsdp_common import assert_equal_states

    directory = str(tmp_path / "ckpt")
    at5 = run_ranks(_sigterm_in_backward, 2, directory, job_id)
    results = run_ranks(_restart, 2, directory, job_id)
    for rank, (step, source, captured, extra, state, lr, lines) in enumerate(results):
        assert (step, source, captured) == (5, "memory", True), (rank, lines)
        assert extra == {"position": 5 * 8 + rank}
        assert lr == 0.01
        assert_equal_states(_unpack(state), _unpack(at5[rank]), f"rank {rank}: ")


def test_a_capture_one_rank_lacks_falls_back_to_the_newest_save(tmp_path, job_id):
    from ._fsdp_common import assert_equal_states

    directory = str(tmp_path / "ckpt")
    at2 = run_ranks(_rank_1_captures, 2, directory, job_id)
    results = run_ranks(_restart, 2, directory, job_id)
    for rank, (step, source, captured, extra, state, _, _) in enumerate(results):
        assert (step, captured, extra) == (2, False, {"position": 16 + rank}), rank
        assert_equal_states(_unpack(state), _unpack(at2[rank]), f"rank {rank}: ")
    said = [line for line in results[0][6] if "captured" in line]
    assert len(said) == 1, results[0][6]
    assert "step 5" in said[0] and "rank(s) 1" in said[0] and "loading step 2 from memory" in said[0] \
        and "rank(s) 0 hold no copy" in said[0], said
    assert not any("captured" in line for line in results[1][6]), results[1][6]


PER = 4
"""Micro-batches per optimizer update in the accumulation tests."""


def _in_backward(model, act) -> None:
    """``act()`` at the start of the next backward (once the output's gradient is computed)."""
    def hook(_module, _inputs, out) -> None:
        out.register_hook(lambda grad: act())
    model.register_forward_hook(hook)


def _accumulate_to_sigterm(rank: int, world: int, directory: str, job: str) -> bytes:
    """Micro-batches 1-21 (updates at 4, 8, ..., 20; saves at 8, persisted, and 16), then
    SIGTERM inside micro-batch 22's backward, no update begun: the watcher captures 20 (not
    the last save plus one update, 17). The data position is written as of update 20."""
    from flashckpt.torch import FsdpCheckpointer

    from ._fsdp_common import local_state, make, micro_batch

    term = SigtermWhileBlocked()
    model, opt = make(0)
    ckpt = FsdpCheckpointer(directory, job_id=job, persist_every=100)
    assert ckpt.load(model, opt) is None
    now = {"step": 0}

    def state() -> dict:
        return {"position": now["step"] * 8 + rank}
    capture = ckpt.save_on_failure(state, optimizer=opt, boundary_state=state, steps_per_update=PER)
    ckpt.save(0, model, opt, extra=state())
    for step in range(1, 23):
        now["step"] = step
        if step == 22:
            _in_backward(model, term.block)
        micro_batch(model, opt, rank, step, PER)
        if step % 8 == 0:
            ckpt.save(step, model, opt, extra=state(), persist=step == 8)
        if step == 20:
            at20 = local_state(model, opt)
    term.assert_captured(20, capture)
    return _pack(at20)


def _restart_then_kill_rank_0(rank: int, world: int, directory: str, job: str, out: str) -> None:
    """Load (the captured 20), train micro-batches 21-29 (save 24, persisted), then SIGKILL
    rank 0 inside micro-batch 30's backward; rank 1's collective fails and it captures 28.
    Each rank's report goes to ``out`` (rank 0's before it dies)."""
    import os
    import signal

    import torch

    from flashckpt.torch import FsdpCheckpointer

    from ._fsdp_common import local_state, make, micro_batch

    lines: list[str] = []
    logged(lines)
    model, opt = make(3, lr=0.5)
    ckpt = FsdpCheckpointer(directory, job_id=job, persist_every=100)
    step = ckpt.load(model, opt)
    captured = ckpt.last_load.source == "memory" and bool(ckpt.engine.memory_info(step).get("captured"))
    report = {"loaded": (step, ckpt.last_load.source, captured), "extra": ckpt.extra,
              "lr": opt.param_groups[0]["lr"], "state": local_state(model, opt), "lines": lines}
    now = {"step": step}

    def state() -> dict:
        return {"position": now["step"] * 8 + rank}
    capture = ckpt.save_on_failure(state, optimizer=opt, boundary_state=state, steps_per_update=PER)
    for step in range(step + 1, 30):
        now["step"] = step
        micro_batch(model, opt, rank, step, PER)
        if step == 24:
            ckpt.save(24, model, opt, extra=state(), persist=True)
            report["at24"] = local_state(model, opt)
    if rank == 0:
        torch.save(report, os.path.join(out, "rank0.pt"))
        _in_backward(model, lambda: os.kill(os.getpid(), signal.SIGKILL))
    try:
        for step in (30, 31, 32):
            now["step"] = step
            micro_batch(model, opt, rank, step, PER)
    except Exception as exc:  # a peer died: gloo's "Connection closed by peer"
        report["failed"] = step
        report["captured"] = capture.capture(f"{type(exc).__name__} in a collective")
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))


def test_accumulation_restarts_at_the_captured_update_or_the_newest_save(tmp_path, job_id):
    import torch

    from ._fsdp_common import assert_equal_states

    directory, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    at20 = run_ranks(_accumulate_to_sigterm, 2, directory, job_id)
    with pytest.raises(AssertionError) as died:
        run_ranks(_restart_then_kill_rank_0, 2, directory, job_id, str(out))
    assert "rank 0: exited with code -9 and no result" in str(died.value) and "rank 1" not in str(died.value), \
        str(died.value)
    reports = [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["loaded"] == (20, "memory", True), (rank, report["lines"])
        assert report["extra"] == {"position": 20 * 8 + rank} and report["lr"] == 0.01, (rank, report)
        assert_equal_states(report["state"], _unpack(at20[rank]), f"rank {rank} at 20: ")
        assert not any("steps_per_update" in line for line in report["lines"]), report["lines"]
    assert (reports[1]["failed"], reports[1]["captured"]) == (30, 28), reports[1]["lines"]
    results = run_ranks(_restart, 2, directory, job_id)
    for rank, (step, source, captured, extra, state, _, _) in enumerate(results):
        assert (step, source, captured, extra) == (24, "memory", False, {"position": 24 * 8 + rank}), rank
        assert_equal_states(_unpack(state), reports[rank]["at24"], f"rank {rank} at 24: ")
    said = [line for line in results[0][6] if "captured" in line]
    assert len(said) == 1 and "step 28" in said[0] and "rank(s) 1" in said[0] \
        and "loading step 24 from memory" in said[0] and "rank(s) 0 hold no copy" in said[0], said


def test_bad_input(ran2):
    assert_ok(ran2, "capture_bad_input")


def test_steps_per_update_counts_micro_batches(ran2):
    assert_ok(ran2, "capture_accumulate")
