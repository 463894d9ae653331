"""torchtitan's checkpoint manager (the real package) on flashckpt, FSDP2 on 2 gloo ranks:
saves only in memory, which torchtitan's folder listing cannot see, survive ``kill -9`` of
every rank and a new process resumes from memory through a new manager; the ``step-N``
folders are stock DCP checkpoints that stock torchtitan resumes from."""

from __future__ import annotations

import os

import pytest

from flashckpt.dcp import Latest

from .._fork import run_ranks
from ..dcp._common import killed_then_restarted, wait_for as _wait_for
from . import _ranks


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory):
    """2 ranks save steps 1-3 in memory only and are killed; 2 new ranks resume with
    flashckpt's manager, train and save step 4 and close."""
    root = str(tmp_path_factory.mktemp("titan"))
    return root, killed_then_restarted(root, _ranks.save_then_die, _ranks.resume)


def test_stock_torchtitan_finds_nothing_while_the_saves_are_in_memory_only(killed_then_resumed):
    _, results = killed_then_resumed
    assert all(r["stock_before"] == ([".flashckpt"], False) for r in results), results


def test_a_returned_save_survives_kill_9_and_resumes_from_memory(killed_then_resumed):
    root, results = killed_then_resumed
    assert all(r["latest"] == Latest(3, f"{root}/checkpoint/step-3", "memory") for r in results)
    assert [r["source"] for r in results] == ["memory", "memory"]
    assert all(r["loaded"] and r["step"] == 3 and r["same"] and r["same_batch"] for r in results), results


def test_folder_holds_stock_step_folders(killed_then_resumed):
    root, _ = killed_then_resumed
    _wait_for(f"{root}/checkpoint/step-4/.metadata")
    assert sorted(os.listdir(f"{root}/checkpoint/step-4")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_stock_torchtitan_resumes_from_the_step_folders(killed_then_resumed):
    """No flashckpt on the read side: torchtitan's own CheckpointManager finds step 4."""
    root, _ = killed_then_resumed
    _wait_for(f"{root}/checkpoint/step-4/.metadata")
    os.rename(f"{root}/checkpoint/.flashckpt", f"{root}/flashckpt-store")  # nothing of flashckpt in the folder
    results = run_ranks(_ranks.resume_stock, 2, root)
    assert all(r["loaded"] and r["step"] == 4 and r["same"] for r in results), results
