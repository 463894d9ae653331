import glob
import os
import uuid

import pytest


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it removed afterwards."""
    job = "t" + uuid.uuid4().hex[:12]
    yield job
    for path in glob.glob(f"/dev/shm/flashckpt.*.{job}.*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)


def shm_objects(job: str) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/flashckpt.*.{job}.*"))
