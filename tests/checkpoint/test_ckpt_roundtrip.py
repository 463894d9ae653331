"""One process, no process group: exact round trips through memory and storage."""

import json

import pytest
import torch
from safetensors import safe_open

from flashckpt import CheckpointError
from flashckpt.torch import Checkpointer

from .conftest import shm_objects


def rich_state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, 4, generator=g).half(),
        "bf16": torch.randn(9, generator=g).bfloat16(),
        "i64": torch.randint(-2**40, 2**40, (11,), generator=g),
        "i32": torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int32),
        "i8": torch.randint(-100, 100, (13,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "noncontig": base.t(),
        "strided": base[::2, 1::3],
        "empty": torch.empty(0, 4),
        "tied": {"a": base, "b": base},
        "nested": [1, 2.5, "three", None, True, (4, {"five": torch.arange(5)})],
        "int_keys": {0: torch.ones(2), 1: "one"},
        "step": 7,
    }


def zeros_like_state(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state).contiguous() if state.numel() else torch.empty_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(zeros_like_state(v) for v in state)
    return None if isinstance(state, str) else type(state)() if state is not None else None


def assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8) if b.dtype == torch.bool else b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b and type(a) is type(b), f"{path}: {a!r} != {b!r}"


def test_round_trip_from_memory_is_exact(tmp_path, job_id):
    state = rich_state()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(7, state)
        target = zeros_like_state(state)
        target["tied"]["b"] = target["tied"]["a"]
        assert ck.load(target) == 7
        assert_same(state, target)


def test_round_trip_from_storage_is_exact_and_a_valid_safetensors_file(tmp_path, job_id):
    state = rich_state()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(3, state)
    assert shm_objects(job_id) == [] or all(p.endswith((".sock", ".saver.lock")) for p in shm_objects(job_id))
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        target = zeros_like_state(state)
        assert ck.load(target) == 3  # memory is gone after close: this came from storage
    assert_same(state, target)
    path = tmp_path / "step-3" / "rank-0.safetensors"
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("f32"), state["f32"])
        assert torch.equal(f.get_tensor("bf16"), state["bf16"])
        assert torch.equal(f.get_tensor("noncontig"), state["noncontig"])
        meta = json.loads(f.metadata()["flashckpt"])
    assert meta["step"] == 3
    assert (tmp_path / "latest").read_text().strip() == "3"


def test_shared_storage_is_stored_once(tmp_path, job_id):
    w = torch.randn(100, 100)
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"embed": w, "lm_head": w})
    with safe_open(str(tmp_path / "step-1" / "rank-0.safetensors"), "pt") as f:
        assert list(f.keys()) == ["embed"]


def test_optimizer_state_fills_an_optimizer_that_has_not_stepped(tmp_path, job_id):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        fresh = torch.nn.Linear(8, 4)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        assert ck.load(state) == 1
    fresh_opt.load_state_dict(state["optim"])
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_persist_every_and_keep_last(tmp_path, job_id):
    state = {"w": torch.zeros(10)}
    with Checkpointer(tmp_path, job_id=job_id, persist_every=3, keep_last=2) as ck:
        for step in range(1, 11):
            state["w"].fill_(step)
            ck.save(step, state)
        ck.wait()
        assert ck.latest_step() == 9  # saves 3, 6, 9 were persisted
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-6", "step-9"]
        target = {"w": torch.zeros(10)}
        assert ck.load(target) == 10  # memory is newer than storage
        assert target["w"][0] == 10
    assert (tmp_path / "latest").read_text().strip() == "10"  # close() flushed the newest


def test_load_with_nothing_saved_returns_none(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load({"w": torch.zeros(3)}) is None
        assert ck.latest_step() is None


def test_explicit_older_step_loads_from_storage(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id, keep_last=0) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((4,), float(step))})
        ck.wait()
        target = {"w": torch.zeros(4)}
        assert ck.load(target, step=1) == 1
        assert target["w"].tolist() == [1.0] * 4


def test_pickle_is_opt_in(tmp_path, job_id):
    class Custom:
        def __init__(self, x):
            self.x = x
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        with pytest.raises(CheckpointError, match="allow_pickle"):
            ck.save(1, {"obj": object()})
        with pytest.raises(CheckpointError, match="allow_pickle"):
            ck.save(1, {"lock": __import__("threading").Lock()})
    with Checkpointer(tmp_path, job_id=job_id, allow_pickle=True) as ck:
        with pytest.raises(CheckpointError, match="cannot be pickled"):
            ck.save(1, {"lock": __import__("threading").Lock()})
        ck.save(2, {"obj": {1, 2, 3}})
    with Checkpointer(tmp_path, job_id=job_id) as ck:  # loading does not unpickle by default
        with pytest.raises(CheckpointError, match="allow_pickle"):
            ck.load({"obj": None})
    with Checkpointer(tmp_path, job_id=job_id, allow_pickle=True) as ck:
        target = {"obj": None}
        assert ck.load(target) == 2 and target["obj"] == {1, 2, 3}


def test_layout_change_between_saves(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"w": torch.ones(10)})
        ck.save(2, {"w": torch.ones(10), "v": torch.full((5_000_000,), 2.0)})  # grows the slots
        ck.save(3, {"w": torch.full((10,), 3.0)})
        target = {"w": torch.zeros(10)}
        assert ck.load(target) == 3 and target["w"][0] == 3
        target = {"w": torch.zeros(10), "v": torch.zeros(5_000_000)}
        assert ck.load(target, step=2) == 2 and target["v"][-1] == 2


def test_numpy_arrays_are_leaves(tmp_path, job_id):
    import numpy as np
    rng = np.random.RandomState(0).get_state()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"rng": list(rng), "a": np.arange(6, dtype=np.int32).reshape(2, 3)})
        target = {"rng": [None, np.zeros(624, dtype=np.uint32), 0, 0, 0.0], "a": np.zeros((2, 3), dtype=np.int32)}
        assert ck.load(target) == 1
    assert np.array_equal(target["rng"][1], rng[1]) and target["rng"][2] == rng[2]
    assert target["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_close_frees_shared_memory_and_saver_exits(tmp_path, job_id):
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, {"w": torch.ones(1000)})
        ck.save(2, {"w": torch.ones(1000)})
        assert any(".slot" in p for p in shm_objects(job_id))
    assert not any(".slot" in p or p.endswith(".lock") and "saver" not in p for p in shm_objects(job_id))


def test_one_memory_slot_halves_shared_memory_and_still_round_trips(tmp_path, job_id):
    """memory_slots=1: one slot file per rank; a save whose slot storage is still writing
    waits for it, so every step persisted is the one saved."""
    saver = Checkpointer(tmp_path, job_id=job_id, persist_every=1, keep_last=0, memory_slots=1)
    state = {"w": torch.zeros(1 << 18)}
    for step in range(1, 6):
        state["w"].fill_(step)
        saver.save(step, state)
    saver.wait()
    assert [p.rsplit(".", 2)[1:] for p in shm_objects(job_id) if ".slot" in p] == [["rank0", "slot0"]]
    assert sorted(int(p.name[5:]) for p in tmp_path.glob("step-*")) == [1, 2, 3, 4, 5]
    for step in (1, 3, 5):  # every committed step holds what was saved at that step
        target = {"w": torch.zeros(1 << 18)}
        with Checkpointer(tmp_path, job_id=job_id + "x", memory_slots=1) as reader:
            assert reader.load(target, step=step) == step and bool((target["w"] == step).all())
    target = {"w": torch.zeros(1 << 18)}
    with Checkpointer(tmp_path, job_id=job_id, memory_slots=1) as restarted:  # a restart reads memory
        assert restarted.load(target) == 5 and restarted.last_load.source == "memory"
    assert bool((target["w"] == 5).all())
    saver.close()
    with pytest.raises(ValueError, match="memory_slots"):
        Checkpointer(tmp_path, job_id=job_id, memory_slots=3)


def test_a_key_named_like_the_safetensors_header_and_a_lazy_conjugate_round_trip(tmp_path, job_id):
    """A top-level ``__metadata__`` key took the header's own name (every step of it
    unloadable: 'not a flashckpt safetensors header'); ``c.conj()`` beside ``c`` was
    stored once, as ``c`` (restored without its conjugation)."""
    c = torch.tensor([7 + 14j, 21 - 28j], dtype=torch.complex64)
    state = {"__metadata__": torch.arange(4.0), "c": c, "conj": c.conj(), "neg": c.conj()._neg_view()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.save(1, state)
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        assert ck.load(target) == 1
        assert_same(expected, target)
    with Checkpointer(tmp_path, job_id=job_id) as ck:  # from storage
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        assert ck.load(target) == 1
        assert_same(expected, target)
        live = {"__metadata__": torch.zeros(4), "c": torch.zeros_like(c)}  # the views, as the saved state had
        live.update(conj=live["c"].conj(), neg=live["c"].conj()._neg_view())
        assert ck.load(live, step=1) == 1
        assert_same(expected, {k: v.resolve_conj().resolve_neg() for k, v in live.items()})
