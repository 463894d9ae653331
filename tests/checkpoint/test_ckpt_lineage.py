"""Lineage through the torch checkpointers (issue 24, item 1): a run that loads an older
step and saves starts a new line; it commits, becomes the newest, the abandoned line's
newer steps go, retention keeps the newest ``keep_last`` of the current line; and a
memory slot of the abandoned line is never loaded after the new line saved."""

import os

import pytest
import torch

from flashckpt.storage._local import LocalStorage
from flashckpt.torch import Checkpointer, DdpCheckpointer


def steps_on_disk(directory) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.iterdir() if p.is_dir() and p.name[5:].isdigit()
                  and p.name.startswith("step-"))


def crash(ck) -> None:
    """Leave as a killed trainer would: no flush, shared memory kept, the directory's claim
    given up (a dead process's lock goes with it)."""
    ck.engine._client.close()
    release = getattr(ck.engine.storage, "release_run", None)
    if release is not None:
        release()


@pytest.mark.parametrize("cls", [Checkpointer, DdpCheckpointer])
def test_rollback_to_step_3_starts_a_line_that_commits_and_retains_by_line(tmp_path, job_id, cls):
    w = torch.zeros(8)
    with cls(tmp_path, job_id=job_id, persist_every=1, keep_last=0) as ck:  # keeps 1..6 to roll back to
        for step in range(1, 7):
            w.fill_(step)
            ck.save(step, {"w": w})
            ck.wait()
    storage = LocalStorage(str(tmp_path))
    assert storage.committed_steps() == [1, 2, 3, 4, 5, 6]

    with cls(tmp_path, job_id=job_id, persist_every=1, keep_last=3) as ck:  # a loss spike: back to 3
        assert ck.load({"w": w}, step=3) == 3 and w.tolist() == [3.0] * 8
        w.fill_(40.0)
        ck.save(4, {"w": w})
        ck.wait()
        assert ck.latest_step() == 4 and storage.latest_step() == 4
        assert steps_on_disk(tmp_path) == [2, 3, 4]  # old 4..6 gone, the new 4 kept, newest 3 by line
        assert storage.metadata(4)["branch"] == 3
        w.fill_(50.0)
        ck.save(5, {"w": w})
        ck.wait()
        assert ck.latest_step() == 5
        assert steps_on_disk(tmp_path) == [3, 4, 5] and storage.steps_in_order() == [3, 4, 5]
    assert (tmp_path / "latest").read_text().strip() == "5"

    with cls(tmp_path, job_id=job_id, persist_every=1, keep_last=3) as ck:  # a third run sees the new line
        target = {"w": torch.zeros(8)}
        assert ck.load(target) == 5 and target["w"].tolist() == [50.0] * 8
        assert ck.load(target, step=4) == 4 and target["w"].tolist() == [40.0] * 8
        target["w"].fill_(60.0)
        ck.save(5, target)
        ck.save(6, target)
        ck.wait()
        assert ck.latest_step() == 6 and steps_on_disk(tmp_path) == [4, 5, 6]


def test_rerun_from_scratch_into_a_used_directory_starts_a_line(tmp_path, job_id):
    """A script rerun without loading: its first save (step 1, branch 0) is the newest."""
    w = torch.zeros(4)
    with Checkpointer(tmp_path, job_id=job_id, keep_last=3) as ck:
        for step in range(1, 7):
            w.fill_(step)
            ck.save(step, {"w": w})
        ck.wait()
    with Checkpointer(tmp_path, job_id=job_id, keep_last=3) as ck:
        for step in (1, 2):
            w.fill_(10.0 * step)
            ck.save(step, {"w": w})
            ck.wait()
            assert ck.latest_step() == step
        assert steps_on_disk(tmp_path) == [1, 2]  # the old 4..6 descend from no step of this line
    with Checkpointer(tmp_path, job_id=job_id) as ck:
        target = {"w": torch.zeros(4)}
        assert ck.load(target) == 2 and target["w"].tolist() == [20.0] * 4


def _memory_rollback(tmp_path, job_id, *, abandoned_on_storage: bool):
    """Runs that end as if trainer and saver were both killed (nothing flushed)."""
    w = torch.zeros(8)
    first = Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=3)
    for step in range(1, 7):
        w.fill_(step)
        first.save(step, {"w": w}, persist=step == 3 or (abandoned_on_storage and step == 6))
    first.wait()
    crash(first)  # memory holds 5 and 6 of the first line

    second = Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=3)
    assert second.load({"w": w}, step=3) == 3 and w.tolist() == [3.0] * 8
    w.fill_(40.0)
    second.save(4, {"w": w})  # memory only
    crash(second)

    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=3) as third:
        target = {"w": torch.zeros(8)}
        assert third.load(target) == 4, f"restored {third.last_load}, not the new line's 4"
        assert target["w"].tolist() == [40.0] * 8 and third.last_load.source == "memory"
        target["w"].fill_(50.0)
        third.save(5, target)  # close() persists it
    storage = LocalStorage(str(tmp_path))
    assert storage.latest_step() == 5 and 6 not in storage.committed_steps()
    with Checkpointer(tmp_path, job_id=job_id) as fourth:
        target = {"w": torch.zeros(8)}
        assert fourth.load(target) == 5 and target["w"].tolist() == [50.0] * 8


def test_a_memory_slot_of_the_abandoned_line_is_never_loaded(tmp_path, job_id):
    """Saves 1..6 in memory (3 persisted), a second run loads 3 and saves 4 in memory: the
    restart loads that 4, never the abandoned 6 its slot held."""
    _memory_rollback(tmp_path, job_id, abandoned_on_storage=False)


def test_a_committed_step_of_the_abandoned_line_never_beats_the_new_lines_memory(tmp_path, job_id):
    """As above, but the abandoned 6 was persisted too (and no saver is left to write the
    new 4 out): the new line's 4, in memory only, is still what the restart loads."""
    _memory_rollback(tmp_path, job_id, abandoned_on_storage=True)


KILLED_RUN = r"""
import os, signal, sys, torch
from flashckpt.torch import Checkpointer
directory, job, load_step, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ck = Checkpointer(directory, job_id=job, persist_every=1000, keep_last=3)
w = torch.zeros(8)
if load_step >= 0:
    assert ck.load({"w": w}, step=load_step) == load_step and w.tolist() == [float(load_step)] * 8, w
for step in range(first, last + 1):
    w.fill_(step * (10.0 if load_step >= 0 else 1.0))
    ck.save(step, {"w": w}, persist=step == 3 and load_step < 0)
ck.wait()
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_run(directory, job, load_step: int, first: int, last: int) -> None:
    import subprocess
    import sys

    import flashckpt
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashckpt.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(directory), job, str(load_step), str(first),
                           str(last)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.startswith("saved"), proc.stderr


def test_killed_runs_in_memory_the_restart_loads_the_new_line(tmp_path, job_id):
    """Real kills: the saver writes each killed trainer's newest slot out (the first run's
    6, then the second's 4 of the line from 3); the restart loads the new 4 from memory."""
    killed_run(tmp_path, job_id, -1, 1, 6)  # 1..6 in memory, 3 persisted, killed
    killed_run(tmp_path, job_id, 3, 4, 4)   # loads 3, saves 4 = 40 in memory, killed
    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000, keep_last=3) as ck:
        target = {"w": torch.zeros(8)}
        assert ck.load(target) == 4, f"restored {ck.last_load}, not the new line's 4"
        assert target["w"].tolist() == [40.0] * 8
        assert ck.last_load.source == "memory"
        ck.wait()  # a load from memory does not wait for the saver's write-out of the killed run's 4
        assert ck.latest_step() == 4
    storage = LocalStorage(str(tmp_path))
    assert storage.latest_step() == 4 and storage.committed_steps() == [3, 4]


@pytest.mark.parametrize("cls", [Checkpointer, DdpCheckpointer])
def test_a_rollback_within_one_run_starts_a_line_that_wins_over_the_runs_own_newer_steps(tmp_path, job_id, cls):
    """A loss spike handled in the same process: ``load(step=20)`` on the checkpointer that
    saved 30. The steps saved next (25, 26) are the newest, not the abandoned 30."""
    w = torch.zeros(8)
    with cls(tmp_path, job_id=job_id, persist_every=1, keep_last=2) as ck:
        for step in (10, 20, 30):
            w.fill_(step)
            ck.save(step, {"w": w})
            ck.wait()
        assert ck.load({"w": w}, step=20) == 20 and w.tolist() == [20.0] * 8
        for step in (25, 26):
            w.fill_(step)
            ck.save(step, {"w": w})
            ck.wait()
            assert ck.latest_step() == step
        assert steps_on_disk(tmp_path) == [25, 26]
    assert (tmp_path / "latest").read_text().strip() == "26"
    with cls(tmp_path, job_id=job_id) as ck:
        target = {"w": torch.zeros(8)}
        assert ck.load(target) == 26 and target["w"].tolist() == [26.0] * 8
