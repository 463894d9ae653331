"""Suite-wide: the shared memory of test jobs whose processes were killed stays behind by
design (a crash's copy must survive for the restart). Once the suite ends, the objects
it created for jobs nothing serves any more are removed; what existed before is kept."""

from __future__ import annotations

import os

import pytest

from flashckpt import cli

_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_BEFORE] = {path for paths in cli._segments().values() for path in paths}


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.stash.get(_BEFORE, set())
    for job, paths in cli._segments().items():
        if any(path in before for path in paths) or cli._job_alive(job, paths):
            continue
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
