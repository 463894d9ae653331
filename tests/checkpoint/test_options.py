"""One ``flashckpt.Options`` through the torch checkpointers: ``options=`` is taken as
is, keyword shorthands are laid over it, and a keyword that is no option is a TypeError."""

import fractions

import pytest
import torch

from flashckpt import CheckpointError, Options
from flashckpt.torch import Checkpointer, DdpCheckpointer, FsdpCheckpointer

from .conftest import shm_objects

CLASSES = [Checkpointer, DdpCheckpointer, FsdpCheckpointer]


@pytest.mark.parametrize("cls", CLASSES)
def test_an_options_object_reaches_the_engine_whole(tmp_path, job_id, cls):
    options = Options(persist_every=2, keep_last=1, job_id=job_id, allow_pickle=True, memory_slots=1, replicas=0)
    with cls(tmp_path, options=options) as ck:
        assert ck.engine.options == options and ck.job_id == job_id


@pytest.mark.parametrize("cls", CLASSES)
def test_keyword_shorthands_are_laid_over_the_options(tmp_path, job_id, cls):
    with cls(tmp_path, options=Options(keep_last=1, memory_slots=1), job_id=job_id, keep_last=5) as ck:
        assert ck.engine.options == Options(keep_last=5, memory_slots=1, job_id=job_id)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_keyword_that_is_no_option_is_a_type_error_naming_it(tmp_path, cls):
    with pytest.raises(TypeError, match="persist_evry"):
        cls(tmp_path, persist_evry=2)
    with pytest.raises(TypeError, match="flashckpt.Options"):
        cls(tmp_path, options={"keep_last": 2})


def test_options_take_effect_job_id_names_the_memory_and_allow_pickle_round_trips(tmp_path, job_id):
    state = {"w": torch.arange(4.0), "ratio": fractions.Fraction(1, 3)}
    with Checkpointer(tmp_path, options=Options(job_id=job_id, allow_pickle=True, memory_slots=1)) as ck:
        ck.save(1, state)
        assert [p.rsplit(".", 1)[-1] for p in shm_objects(job_id) if ".slot" in p] == ["slot0"]
        target = {"w": torch.zeros(4), "ratio": None}
        assert ck.load(target) == 1 and target["ratio"] == fractions.Fraction(1, 3)
    with Checkpointer(tmp_path / "strict", job_id=job_id + "s") as ck, pytest.raises(CheckpointError,
                                                                                     match="allow_pickle"):
        ck.save(1, state)
