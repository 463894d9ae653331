import glob
import os
import uuid

import pytest


@pytest.fixture
def job_id():
    """A fresh job id, with every shared-memory object of it removed afterwards."""
    job = "tf" + uuid.uuid4().hex[:12]
    yield job
    for path in glob.glob(f"/dev/shm/flashckpt.*.{job}.*"):
        if not path.endswith((".sock", ".saver.lock")):
            os.unlink(path)
