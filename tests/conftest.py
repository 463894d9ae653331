import glob
import os
import uuid

import pytest
from flashckpt._names import job_prefix


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it removed afterwards."""
    job = "t" + uuid.uuid4().hex[:12]
    yield job
    for path in glob.glob(job_prefix(job) + ".*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2`` (``make test``): a directory whose conftest starts something once
    per session (a server, a shared launch) runs on one worker; elsewhere each file is its
    own unit of work."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), root)
        top = rel.split(os.sep)[0]
        item.add_marker(pytest.mark.xdist_group(top if _starts_once_per_session(os.path.join(root, top)) else rel))


def _starts_once_per_session(directory: str) -> bool:
    conftest = os.path.join(directory, "conftest.py")
    return os.path.exists(conftest) and 'scope="session"' in open(conftest).read()
