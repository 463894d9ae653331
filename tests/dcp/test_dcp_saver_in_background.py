"""A fresh process's first flash DCP save copies into shared memory while the node's saver
starts (most of a second: a new interpreter), instead of after; a load through
``flashckpt://`` does not wait for the saver at all. The run links to the saver on a thread
of its own; a save still returns only once the saver heard of it, so a returned save
survives ``kill -9`` of its trainer as before.

Each test holds the saver's start (``_spawn_saver``) at a gate and checks the order of
events, never a duration: :data:`BOUND` only keeps a test that fails from hanging.
"""

from __future__ import annotations

import os
import signal
import threading

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from flashckpt.dcp import FlashStorageWriter, close
from flashckpt.dcp._run import run_for, store_of
from flashckpt.memory import _rank_slots
from flashckpt.saver import _client

from .._fork import Forked
from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import wait_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BOUND = 60.0
"""How long the gate holds the saver's start at most (then a test that fails goes on)."""


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 16, generator=g), "b": torch.randn(33, 7, generator=g), "epoch": seed}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["epoch"] == b["epoch"]


class Gate:
    """Holds this process's starts of a saver until ``release`` is set (at most
    :data:`BOUND`); ``released`` records whether it was set in time, ``started`` is set
    once a saver was started."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.released: list[bool] = []
        self.started = threading.Event()
        self._real = _client._spawn_saver

    def install(self) -> "Gate":
        _client._spawn_saver = self._spawn
        return self

    def _spawn(self, job_id: str):
        self.released.append(self.release.wait(BOUND))
        proc = self._real(job_id)
        self.started.set()
        return proc


def _copies_first() -> Gate:
    """A gate that holds the saver's start until a save has copied into its slot."""
    copied = threading.Event()
    real = _rank_slots.RankSlots.copy_in

    def copy_in(self, *args, **kwargs):
        real(self, *args, **kwargs)
        copied.set()

    _rank_slots.RankSlots.copy_in = copy_in
    return Gate(copied).install()


@pytest.fixture
def restored(monkeypatch):
    """The module attributes the gates replace, restored after the test (and the runs closed)."""
    monkeypatch.setattr(_client, "_spawn_saver", _client._spawn_saver)
    monkeypatch.setattr(_rank_slots.RankSlots, "copy_in", _rank_slots.RankSlots.copy_in)
    yield
    close()


def test_the_first_save_copies_while_the_saver_starts(tmp_path, restored):
    """The saver's start is held until the save has copied into its slot: the save copies
    anyway, returns once the saver is up and heard of it, and the stock files follow."""
    gate = _copies_first()
    state = _state(1)
    dcp.save(state, storage_writer=FlashStorageWriter(tmp_path / "step-1"))
    assert gate.released == [True], "the save waited for the saver's start before its copy"
    wait_for(str(tmp_path / "step-1" / ".metadata"))
    close()
    loaded = _state(0)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "step-1"))
    assert _equal(loaded, state)


def _save_then_die(folder: str) -> None:
    """A fresh process whose saver starts only once its first save copied: that save, then ``kill -9``."""
    gate = _copies_first()
    dcp.save(_state(1), storage_writer=FlashStorageWriter(f"{folder}/step-1"))
    print(f"saved {gate.released}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_first_save_that_returned_survives_kill_9_of_its_trainer(tmp_path):
    """The trainer dies right after its first save returned (its copy made before the saver
    started): the saver heard of the save, and persists and exports it."""
    child = Forked(_save_then_die, str(tmp_path))
    assert child.wait(BOUND + 60) == -signal.SIGKILL, child.stderr.read()
    assert "saved [True]" in child.stdout.read(), "the child's save did not copy before its saver started"
    wait_for(str(tmp_path / "step-1" / ".metadata"))
    loaded = _state(0)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "step-1"))
    assert _equal(loaded, _state(1))


def _save_then_exit_with_the_saver(folder: str) -> None:
    """A save persisted, then the process and its saver gone (``kill -9`` of the saver, an
    exit without close): the memory copy stays, and no saver runs for the next process."""
    dcp.save(_state(1), storage_writer=FlashStorageWriter(f"{folder}/step-1"))
    engine = run_for(store_of(f"{folder}/step-1", None), None).engine
    engine.wait()
    os.kill(engine._client.saver_pid, signal.SIGKILL)
    os._exit(0)


def test_a_protocol_load_from_memory_does_not_wait_for_the_saver(tmp_path, restored):
    """A new process loads through ``flashckpt://`` from memory while its saver's start is held."""
    child = Forked(_save_then_exit_with_the_saver, str(tmp_path))
    assert child.wait(BOUND + 60) == 0, child.stderr.read()
    release = threading.Event()
    gate = Gate(release).install()
    loaded = _state(0)
    url = f"flashckpt://{tmp_path}/step-1"
    dcp.load(loaded, checkpoint_id=url)
    assert not gate.started.is_set(), "the load waited for the saver's start"
    assert fsspec.filesystem("flashckpt").last_source(f"{url}/__0_0.distcp") == "memory"
    assert _equal(loaded, _state(1))
    release.set()
    close()
