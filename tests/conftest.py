import glob
import os
import threading
import uuid

import pytest
from flashckpt._names import job_prefix
from flashckpt.memory import _slot


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it removed afterwards."""
    job = "t" + uuid.uuid4().hex[:12]
    yield job
    for path in glob.glob(job_prefix(job) + ".*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


@pytest.fixture
def populates(monkeypatch):
    """Every population of slot pages (fresh shared memory), by the thread that did it."""
    calls: list[str] = []
    real = _slot._populate_write

    def counted(mm):
        calls.append(threading.current_thread().name)
        return real(mm)

    monkeypatch.setattr(_slot, "_populate_write", counted)
    return calls


ONE_WORKER = {"fsdp", "objectstore"}
"""Directories whose session fixtures are runs every test there shares (FSDP's gloo jobs, the
S3 server with its buckets): under xdist they stay on one worker, so they run once."""


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2`` (``make test``): each file is a unit of work, but the directories
    of :data:`ONE_WORKER` are one unit each."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), root)
        top = rel.split(os.sep)[0]
        item.add_marker(pytest.mark.xdist_group(top if top in ONE_WORKER else rel))
