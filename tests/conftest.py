import glob
import os
import threading
import uuid

import pytest

# two xdist workers share two cores with every process their tests start: one OpenMP thread
# each (torch's default, one per core, made the suite's processes contend; about 10% of its CPU)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashckpt._names import job_prefix  # noqa: E402
from flashckpt.memory import _slot  # noqa: E402


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it removed afterwards."""
    job = "t" + uuid.uuid4().hex[:12]
    yield job
    for path in glob.glob(job_prefix(job) + ".*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server of this test module (the sharding tests' ``RedisServer``)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharding"))
    from sharding_fixtures import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


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


def work_unit(nodeid: str, rootpath: str) -> str:
    """What one xdist worker runs whole: the test's file (its module fixtures run once), or
    its top directory if that is one of :data:`ONE_WORKER`."""
    path = os.path.join(rootpath, nodeid.split("::", 1)[0])
    rel = os.path.relpath(path, os.path.dirname(os.path.abspath(__file__)))
    top = rel.split(os.sep)[0]
    return top if top in ONE_WORKER else rel


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2 --dist loadfile`` (``make test``) with :func:`work_unit` as the unit.

    Not ``xdist_group`` marks with ``--dist loadgroup``: xdist 3.8 groups by rewriting node
    ids, which pytest 9.2 no longer lets it do, so every test was scheduled on its own
    (pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WorkUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, str(config.rootpath))

    return WorkUnitScheduling(config, log)
