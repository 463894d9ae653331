"""A committed step's export is never lost to a newer commit's retention: the step is held
from the moment its export is queued, and the saver queues it before that rank's next
save may start (so before any newer step of it can commit)."""

import glob
import json
import os
import subprocess
import sys
import threading

from flashckpt.saver import _exporters, _persist, _saver
from flashckpt import _names
from flashckpt.saver._exporters import Export, ExportQueue
from flashckpt.saver._persist import PersistResult
from flashckpt.saver._saver import Saver
from flashckpt.saver._jobs import Job
from flashckpt.memory._slot import Slot, SlotState, mark_writing
from flashckpt.storage._local import LocalStorage

from .test_storage_lineage import commit, image, token

_BOUND = 30.0


def test_a_queued_export_keeps_its_step_from_a_newer_commits_retention(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    tok = token()
    first_runs = threading.Event()
    go_on = threading.Event()
    ran: list[tuple[int, bool]] = []

    def exporter(spec, directory, step, *, allow_pickle=False, memory=None):
        ran.append((step, storage.step_dir(step) in {storage.step_dir(s) for s in storage.committed_steps()}))
        if step == 2:
            first_runs.set()
            assert go_on.wait(_BOUND)

    monkeypatch.setattr(_exporters, "run_exporter", exporter)
    queue = ExportQueue()
    errors: list[Exception | None] = []
    for step in (2, 4):
        assert commit(storage, step, tok, branch=-1, keep_last=1)
        queue.submit(Export({"name": "hf"}, storage.root, step), errors.append)
    assert first_runs.wait(_BOUND)  # step 2's export runs; step 4's waits behind it
    assert commit(storage, 6, tok, branch=-1, keep_last=1)  # keeps 1 step: would retire 2 and 4
    go_on.set()
    queue.close()
    assert ran == [(2, True), (4, True)]  # both exported, each while its step was still committed
    assert errors == [None, None]
    assert commit(storage, 8, tok, branch=-1, keep_last=1)  # held steps go at the next commit
    assert storage.committed_steps() == [8]


def test_a_step_held_past_the_last_commit_is_retired_once_its_export_ran(tmp_path, monkeypatch):
    """The job's last commit leaves the step being exported; its export's end applies
    the retention that commit could not, so exactly ``keep_last`` steps remain."""
    storage = LocalStorage(str(tmp_path))
    tok = token()
    go_on = threading.Event()
    monkeypatch.setattr(_exporters, "run_exporter", lambda *a, **k: go_on.wait(_BOUND))
    queue = ExportQueue()
    assert commit(storage, 2, tok, branch=-1, keep_last=1)
    queue.submit(Export({"name": "hf"}, storage.root, 2, keep_last=1, token=tok), lambda error: None)
    assert commit(storage, 4, tok, branch=-1, keep_last=1)  # the last commit of the job
    assert storage.committed_steps() == [2, 4]  # step 2 is being exported: held
    go_on.set()
    queue.close()
    assert storage.committed_steps() == [4]


def test_an_export_of_an_older_line_applies_no_retention_to_a_newer_one(tmp_path, monkeypatch):
    """Its end re-applies its own line's retention only: a newer run (a restart that
    keeps 3 steps) is not cut down to the older run's ``keep_last``."""
    storage = LocalStorage(str(tmp_path))
    old, new = token(1), token(2)
    go_on = threading.Event()
    monkeypatch.setattr(_exporters, "run_exporter", lambda *a, **k: go_on.wait(_BOUND))
    queue = ExportQueue()
    assert commit(storage, 2, old, branch=-1, keep_last=1)
    queue.submit(Export({"name": "hf"}, storage.root, 2, keep_last=1, token=old), lambda error: None)
    for step in (3, 4, 5):
        assert commit(storage, step, new, branch=2, keep_last=3)
    go_on.set()
    queue.close()
    assert storage.committed_steps() == [2, 3, 4, 5]  # the newer run's next commit retires step 2


def test_the_saver_queues_a_commits_export_before_that_ranks_next_save_may_start(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    assert commit(storage, 3, token(), branch=-1)
    saver = Saver("export-order-test", linger_seconds=0.0)
    events: list[str] = []
    export = Export({"name": "hf"}, storage.root, 3)
    monkeypatch.setattr(_saver, "persist_slot", lambda *a, **k: PersistResult(3, True, export=export))
    monkeypatch.setattr(saver.exports, "submit", lambda export, done: (events.append("export queued"), done(None)))
    release = saver.jobs.release
    monkeypatch.setattr(saver.jobs, "release", lambda job: (events.append("rank released"), release(job)))
    job = Job(str(tmp_path / "slot"), 1, None, {"directory": storage.root})
    saver.jobs.put(job)
    assert saver.jobs.take() is job
    saver._run(job)
    assert events == ["export queued", "rank released"]


def test_a_stuck_export_delays_the_next_commit_by_the_bound_only(tmp_path, monkeypatch):
    """A commit waits for the exports queued before it (retention stays exact while they
    keep up), but not for ever: past the bound it commits, the step being exported held."""
    storage = LocalStorage(str(tmp_path))
    tok = token()
    go_on = threading.Event()
    monkeypatch.setattr(_exporters, "run_exporter", lambda *a, **k: go_on.wait(_BOUND))
    monkeypatch.setattr(_persist, "EXPORT_WAIT_SECONDS", 0.5)
    queue = ExportQueue()
    assert commit(storage, 2, tok, branch=-1, keep_last=1)
    queue.submit(Export({"name": "hf"}, storage.root, 2), lambda error: None)
    slot = _one_slot(tmp_path, 4, tok)
    try:
        result = _persist.persist_slot(slot, info={"directory": storage.root, "storage_rank": 0, "storage_world": 1,
                                                  "token": tok, "keep_last": 1, "branch": -1}, exports=queue)
        assert result.committed
        assert storage.committed_steps() == [2, 4]  # step 2 is still being exported: kept
    finally:
        go_on.set()
        queue.close()
        for path in glob.glob(_names.job_prefix(f"export-hold-{os.getpid()}") + ".*"):
            os.unlink(path)


def _one_slot(tmp_path, step: int, tok: str) -> str:
    """A complete shared-memory slot holding a small image of ``step``."""
    return write_slot(step, image(step, tok))


def export_held(path: str, info: dict) -> list:
    """Persist the slot at ``path`` as ``info`` says and run its export as the saver does (on
    an export queue's thread, after ``persist_slot`` returned); what the export reported."""
    queue = ExportQueue()
    result = _persist.persist_slot(path, info=info, exports=queue)
    errors: list[Exception | None] = []
    queue.submit(result.export, errors.append)
    queue.close()
    return errors


def write_slot(step: int, data: bytes) -> str:
    """A complete shared-memory slot of this test process's job whose image is ``data``
    (``step``'s); the caller removes it."""
    path = _names.slot_path(f"export-hold-{os.getpid()}", 0, 0)
    slot = Slot.open(path, writable=True, create=True)
    try:
        slot.ensure_capacity(len(data))
        header = mark_writing(slot, step, len(data), {})
        slot.image(len(data))[:] = data
        header.state = SlotState.COMPLETE
        slot.write_header(header)
    finally:
        slot.close()
    return path


_KILLED_MID_EXPORT = """
import json, os, signal, sys
from flashckpt.saver import _persist
from flashckpt.saver._exporters import ExportQueue
def die_mid_file(path):
    with open(path, "wb") as f:
        f.write(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
{patch}
queue = ExportQueue()
queue.submit(_persist.persist_slot(sys.argv[1], info=json.loads(sys.argv[2]), exports=queue).export, print)
queue.close()
"""


def killed_mid_export(patch: str, slot: str, info: dict, **env: str) -> subprocess.CompletedProcess:
    """A new saver process persists ``slot`` as ``info`` says and runs its export, whose
    writer ``patch`` replaces with one that calls ``die_mid_file(path)``: the process
    SIGKILLs itself in the middle of a file."""
    return subprocess.run([sys.executable, "-c", _KILLED_MID_EXPORT.format(patch=patch), slot, json.dumps(info)],
                          timeout=_BOUND * 2, capture_output=True, text=True, env=dict(os.environ, **env))


def test_one_commit_exports_once_per_exporter_spec(tmp_path, monkeypatch):
    """Two ranks' persists both submit a commit's export: it runs once. The same step saved
    again with other exporter parameters (Lightning's ``last.ckpt`` after ``step=6.ckpt``),
    whose shards are committed already and so make no new commit, still exports."""
    storage = LocalStorage(str(tmp_path))
    tok = token()
    ran: list[dict] = []
    monkeypatch.setattr(_exporters, "run_exporter", lambda spec, *a, **k: ran.append(spec))
    queue = ExportQueue()
    assert commit(storage, 6, tok, branch=-1)
    named = [{"name": "lightning", "params": {"file": f}} for f in ("step=6.ckpt", "step=6.ckpt", "last.ckpt")]
    for spec in named:
        queue.submit(Export(spec, storage.root, 6), lambda error: None)
    queue.close()
    assert ran == [named[0], named[2]]
