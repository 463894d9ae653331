"""A committed step's export is never lost to a newer commit's retention: the step is held
from the moment its export is queued, and the saver queues it before that rank's next
save may start (so before any newer step of it can commit)."""

import threading

from flashckpt import _exporters, _saver
from flashckpt._exporters import Export, ExportQueue
from flashckpt._persist import PersistResult
from flashckpt._saver import Saver
from flashckpt._saver_jobs import Job
from flashckpt._storage import LocalStorage

from .test_storage_lineage import commit, token

_BOUND = 30.0


def test_a_queued_export_keeps_its_step_from_a_newer_commits_retention(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    tok = token()
    first_runs = threading.Event()
    go_on = threading.Event()
    ran: list[tuple[int, bool]] = []

    def exporter(spec, directory, step, *, allow_pickle=False):
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
