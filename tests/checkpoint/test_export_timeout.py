"""A stuck exporter is bounded (``FLASHCKPT_EXPORT_TIMEOUT``): its step's ``wait`` gets an
error naming the exporter and the step, and later persists of its directory commit
without waiting for it. The exporter is a real registered one, stopped on a FIFO."""

import os

import pytest
import torch

from flashckpt import CheckpointError
from flashckpt._engine import Engine, Options, Placement, new_token
from flashckpt.storage._local import LocalStorage
from flashckpt.torch import _tensors  # noqa: F401  (registers torch tensors as leaves)

from .test_exporter_registry import _dist_info

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def stuck_exporter(tmp_path, monkeypatch):
    """The exporter ``stuck`` registered for the saver this test starts; yields its params.
    A bound of 2 s on exports, of 30 s on waits (a wait that would hang fails instead)."""
    site = _dist_info(tmp_path / "site", "flashckpt-test-stuck",
                      "[flashckpt.exporters]\nstuck = tests.checkpoint._stuck_exporter\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FLASHCKPT_EXPORT_TIMEOUT", "2")
    monkeypatch.setenv("FLASHCKPT_SAVER_TIMEOUT", "30")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    yield {"fifo": str(fifo), "started": str(tmp_path / "started")}
    release(fifo)


def release(fifo) -> None:
    """Let an exporter blocked on ``fifo`` go on (if one is)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # nobody reads it
        return
    os.close(fd)


def _state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step))}


def test_a_stuck_export_times_out_naming_it_and_later_commits_go_on(tmp_path, job_id, stuck_exporter):
    placement = Placement(local_rank=0, memory_rank=0, writes_memory=True, storage_rank=0, storage_world=1,
                          persists=True, token=new_token())
    engine = Engine(str(tmp_path / "ck"), Options(persist_every=1, keep_last=1, job_id=job_id), placement)
    try:
        engine.save(1, _state(1), export={"name": "stuck", "params": stuck_exporter})
        with pytest.raises(CheckpointError, match=r"exporter 'stuck' of step 1 .*still running after 2s"):
            engine.wait(timeout=20)
        assert os.path.exists(stuck_exporter["started"])  # it is stuck, not failed to start
        engine.save(2, _state(2)).wait(timeout=60)  # its commit does not wait for the stuck export
        storage = LocalStorage(engine.storage.root)
        assert storage.latest_step() == 2
        assert storage.committed_steps() == [1, 2]  # step 1 stays held while its exporter reads it
        engine.save(3, _state(3)).wait(timeout=60)  # the trainer still has a slot to save into
        release(stuck_exporter["fifo"])
        engine.flush()
    finally:
        engine.close()


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan"])
def test_a_bad_export_timeout_is_a_clear_error(monkeypatch, raw):
    from flashckpt.saver._exporters import export_timeout

    monkeypatch.setenv("FLASHCKPT_EXPORT_TIMEOUT", raw)
    with pytest.raises(ValueError, match="FLASHCKPT_EXPORT_TIMEOUT must be"):
        export_timeout()


def test_a_bad_export_timeout_fails_the_checkpointer_not_its_saver(monkeypatch, tmp_path, job_id):
    """The saver reads the bound from the environment of the trainer that starts it: a bad
    value is the trainer's clear error at construction, not a saver that dies unseen."""
    from flashckpt.torch import Checkpointer

    monkeypatch.setenv("FLASHCKPT_EXPORT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FLASHCKPT_EXPORT_TIMEOUT must be"):
        Checkpointer(tmp_path, job_id=job_id)
