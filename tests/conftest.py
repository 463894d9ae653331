import os
import re
import subprocess
import threading
import time
import uuid

import pytest

# two xdist workers share two cores with every process their tests start: one OpenMP thread
# each (torch's default, one per core, made the suite's processes contend; about 10% of its CPU)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashckpt.cli import _job_alive, _segments  # noqa: E402
from flashckpt.memory import _slot  # noqa: E402

_STARTED = pytest.StashKey[float]()


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it (and of the ids ``<job>-*`` a
    test derives from it) removed afterwards, saver logs included."""
    job = "t" + uuid.uuid4().hex[:12]
    yield job
    for other, paths in _segments().items():
        if other == job or other.startswith(job + "-"):
            for path in paths:
                if not path.endswith((".sock", ".saver.lock")):
                    _unlink(path)


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = time.time()


def pytest_sessionfinish(session):
    """Remove the shared-memory objects of the jobs this run's tests left (processes they
    killed, jobs a test never closes, saver logs): every job first seen since the run began
    that no process serves any more. Once, in the process that ran the whole session (with
    xdist its controller, once every worker is done), after their savers exit (at most 10 s:
    a saver lingers a few seconds after its last trainer)."""
    started = session.config.stash.get(_STARTED, None)
    if started is None or hasattr(session.config, "workerinput"):
        return
    def jobs():
        return {job: paths for job, paths in _segments().items() if _first_seen(paths) >= started}

    deadline = time.monotonic() + 10
    while jobs().keys() & _saver_jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    for job, paths in jobs().items():
        if not _job_alive(job, paths):
            for path in paths:
                _unlink(path)


def _first_seen(paths):
    try:
        return min(os.stat(path).st_mtime for path in paths)
    except FileNotFoundError:
        return 0.0


def _saver_jobs():
    """The job ids of the savers running on this machine."""
    out = subprocess.run(["pgrep", "-af", "flashckpt.saver._saver"], capture_output=True, text=True).stdout
    return set(re.findall(r"--job-id (\S+)", out))


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
