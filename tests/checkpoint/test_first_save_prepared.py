"""The first save costs what a later one does: ``load`` (also of nothing) and ``prepare``
make the slots ready in the background, a save waits only for the slot it writes, and
a state that grows after that still saves."""

from __future__ import annotations

import threading

import pytest
import torch

from flashckpt._engine import Engine
from flashckpt.memory import _slot
from flashckpt.torch import Checkpointer

STATE_BYTES = 8 << 20


def _state(numel: int = STATE_BYTES // 4) -> dict:
    return {"w": torch.arange(numel, dtype=torch.float32), "step": 3}


def _save_maps_nothing(ck: Checkpointer, state: dict, populates: list[str]) -> None:
    slots = ck.engine.slots
    slots.prepared()
    need = _slot.HEADER_SIZE + STATE_BYTES
    assert all(slots.capacity(i) >= need for i in range(len(slots)))
    before = len(populates)
    ck.save(1, state)
    assert populates[before:] == [], "the first save populated fresh slot pages itself"


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
def test_the_first_save_after_a_load_of_nothing_maps_no_fresh_pages(tmp_path, job_id, populates):
    state = _state()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load(state) is None
        _save_maps_nothing(ck, state, populates)


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
def test_prepare_after_construction_makes_the_first_save_map_no_fresh_pages(tmp_path, job_id, populates):
    state = _state()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.prepare(state)
        _save_maps_nothing(ck, state, populates)


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
def test_a_save_right_after_load_waits_for_its_own_slot_only(tmp_path, job_id, monkeypatch):
    """The second slot's preparation is held; the first save (into the first slot) returns anyway."""
    release = threading.Event()
    prepared: list[int] = []
    real = _slot._populate_write

    def held(mm):
        if threading.current_thread().name == "flashckpt-prepare":
            prepared.append(len(mm))
            if len(prepared) == 2:  # the second slot's pages
                release.wait(120)
        return real(mm)

    monkeypatch.setattr(_slot, "_populate_write", held)
    state = _state()
    with Checkpointer(tmp_path, job_id=job_id, persist_every=100) as ck:
        ck.load(state)
        saved = threading.Thread(target=ck.save, args=(1, state), daemon=True)
        saved.start()
        saved.join(60)  # a bound for the failure only: the save does not wait for the held slot
        finished = not saved.is_alive()
        release.set()
        saved.join(60)
        assert finished, "the first save waited for the other slot's preparation"
        assert sorted(ck.engine.memory_steps()) == [1]


def test_a_state_that_grows_after_prepare_saves_and_loads(tmp_path, job_id):
    small, grown = _state(1 << 10), _state(1 << 21)
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        ck.prepare(small)
        ck.save(1, small)
        ck.save(2, grown)
        ck.save(3, grown)
    target = _state(1 << 21)
    target["w"].zero_()
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        assert ck.load(target) == 3
    assert torch.equal(target["w"], grown["w"])


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
def test_a_load_from_memory_prepares_the_slots_by_the_image_without_walking_the_state(tmp_path, job_id, monkeypatch,
                                                                                      populates):
    state = _state()
    walked: list[object] = []
    monkeypatch.setattr(Engine, "prepare_for", lambda self, state: walked.append(state))
    with Checkpointer(tmp_path, job_id=job_id, persist_every=100) as ck:
        ck.save(1, state)
        assert ck.load(_state()) == 1 and ck.last_load.source == "memory"
        assert walked == [], "the load walked the state again to size the slots"
        _save_maps_nothing(ck, state, populates)
