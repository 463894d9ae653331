"""One ``flashckpt.Options`` through the Hugging Face callback: ``job_id`` and every other
option reach the engine (``job_id`` names the shared memory), keyword shorthands are laid
over ``options=``, the callback's own ``persist_every``/``keep_last`` (steps and folders)
are not confused with the options' ones, and a URL ``output_dir`` is refused at once."""

import glob
import os

import pytest
from transformers import TrainerCallback

from flashckpt import CheckpointError, Options
from flashckpt._names import job_prefix
from flashckpt.hf import FlashCheckpointCallback

from ._hf import make_trainer, shm_left


class SeeEngine(TrainerCallback):
    """At each save: the flash callback's engine options and the job's slots in shared memory."""

    def __init__(self, flash: FlashCheckpointCallback, job: str) -> None:
        self.flash, self.job, self.seen = flash, job, []

    def on_save(self, args, state, control, **kwargs):
        self.seen.append((self.flash._ckpt.engine.options, sorted(glob.glob(job_prefix(self.job) + ".rank0.slot*")),
                          shm_left(args.output_dir)))


def test_job_id_names_the_shared_memory(tmp_path, job_id):
    flash = FlashCheckpointCallback(job_id=job_id)
    see = SeeEngine(flash, job_id)
    make_trainer(str(tmp_path), [flash, see], max_steps=3, save_steps=3).train()
    [(options, slots, default_named)] = see.seen
    assert options.job_id == job_id and slots and not default_named
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-3"]


def test_an_options_object_reaches_the_engine_with_shorthands_over_it(tmp_path, job_id):
    flash = FlashCheckpointCallback(options=Options(memory_slots=1, allow_pickle=True, replicas=1), replicas=0,
                                    job_id=job_id)
    see = SeeEngine(flash, job_id)
    make_trainer(str(tmp_path), [flash, see], max_steps=3, save_steps=3).train()
    [(options, slots, _)] = see.seen
    assert (options.job_id, options.memory_slots, options.allow_pickle, options.replicas) == (job_id, 1, True, 0)
    assert [s.rsplit(".", 1)[-1] for s in slots] == ["slot0"]


def test_a_keyword_that_is_no_option_is_a_type_error():
    with pytest.raises(TypeError, match="job_idd"):
        FlashCheckpointCallback(job_idd="x")
    with pytest.raises(TypeError, match="flashckpt.Options"):
        FlashCheckpointCallback(options={"job_id": "x"})


@pytest.mark.parametrize("options", [Options(persist_every=2), Options(keep_last=5)])
def test_folder_counts_in_the_options_are_refused_for_the_callbacks_own(options):
    name = "persist_every" if options.persist_every != 1 else "keep_last"
    with pytest.raises(ValueError, match=f"FlashCheckpointCallback\\({name}="):
        FlashCheckpointCallback(options=options)


@pytest.mark.parametrize("scheme", ["s3", "memory", "file"])
def test_a_url_output_dir_is_refused_at_construction(tmp_path, monkeypatch, scheme):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the stock Trainer makes a local directory named like the URL
    output_dir = f"file://{tmp_path}/elsewhere/run" if scheme == "file" else f"{scheme}://bucket/run"
    with pytest.raises(CheckpointError, match=r"output_dir .* is a URL.*checkpoint-N folders"):
        make_trainer(output_dir, [FlashCheckpointCallback()])
    assert not os.path.exists(tmp_path / "elsewhere")
    assert not [d for d, subdirs, _ in os.walk(tmp_path) if ".flashckpt" in subdirs]
