"""DeepSpeedCheckpointer takes ``flashckpt.Options``, keywords laid over it."""

import types

import pytest

from flashckpt import Options
from flashckpt.deepspeed import DeepSpeedCheckpointer


def _engine() -> types.SimpleNamespace:
    """What the checkpointer needs of a DeepSpeed engine to construct."""
    return types.SimpleNamespace(save_checkpoint=None, checkpoint_engine="stock")


def test_options_take_effect_and_keywords_override_them(tmp_path, job_id):
    engine = _engine()
    ck = DeepSpeedCheckpointer(engine, tmp_path / "ckpt", Options(keep_last=7, persist_every=3, memory_slots=1),
                               job_id=job_id, keep_last=2)
    try:
        got = ck._flash.options
        assert (got.keep_last, got.persist_every, got.memory_slots, got.job_id) == (2, 3, 1, job_id)
        assert engine.checkpoint_engine is ck.checkpoint_engine
    finally:
        ck.close()
    assert engine.checkpoint_engine == "stock"


def test_an_unknown_keyword_is_a_type_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="unknown option keep_lats"):
        DeepSpeedCheckpointer(_engine(), tmp_path / "ckpt", keep_lats=2)
