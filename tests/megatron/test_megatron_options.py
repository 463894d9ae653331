"""MegatronCheckpointer takes a flashckpt.Options (keyword shorthands laid over it, an
unknown keyword a TypeError), and every load it makes, whatever its path, is recorded
by the engine: ``last_load`` and one ``load`` event (one process, no process group)."""

import os

import pytest
import torch

from flashckpt import Options, _events

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from flashckpt.megatron import MegatronCheckpointer  # noqa: E402


def _steps(directory) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(directory) if n.startswith("step-") and n[5:].isdigit())


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 6), value))}


def test_options_take_effect_and_shorthands_override_them(tmp_path, job_id):
    options = Options(keep_last=1, persist_every=2)
    with MegatronCheckpointer(tmp_path / "a", options=options, job_id=job_id + "a") as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step))
        ck.wait()
        assert _steps(tmp_path / "a") == [2]  # persist_every=2: step 3 stays in memory
        ck.save(4, _state(4))
        ck.wait()
        assert _steps(tmp_path / "a") == [4]  # keep_last=1
    with MegatronCheckpointer(tmp_path / "b", options=options, persist_every=1, job_id=job_id + "b") as ck:
        assert (ck.engine.options.persist_every, ck.engine.options.keep_last) == (1, 1)
        ck.save(1, _state(1))
        ck.wait()
        assert _steps(tmp_path / "b") == [1]  # the shorthand won over options.persist_every
    assert (options.persist_every, options.keep_last) == (2, 1)  # the caller's options are left alone


def test_an_unknown_keyword_or_a_non_options_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="keep_lats"):
        MegatronCheckpointer(tmp_path, keep_lats=1)
    with pytest.raises(TypeError, match="flashckpt.Options"):
        MegatronCheckpointer(tmp_path, options={"keep_last": 1})


def test_every_load_path_is_recorded_by_the_engine(tmp_path, job_id):
    events: list[dict] = []

    def listen(event, **info):
        if event == "load":
            events.append(info)

    _events.subscribe(listen)
    try:
        with MegatronCheckpointer(tmp_path, job_id=job_id) as ck:
            paths = []
            for step, want in ((None, None), (None, 3), (1, 1)):  # fresh start, memory, storage
                if want == 3:
                    for saved in (1, 2, 3):  # two memory slots: step 1 is on storage only
                        ck.save(saved, _state(float(saved)))
                    ck.wait()
                state, got = ck.load(_state(0.0), step=step)
                assert got == want
                assert state is None or bool((state["w"] == want).all())
                paths.append((ck.last_load.step, ck.last_load.source))
    finally:
        _events.unsubscribe(listen)
    assert paths == [(None, None), (3, "memory"), (1, "storage")]
    assert [(e["step"], e["source"]) for e in events] == paths
