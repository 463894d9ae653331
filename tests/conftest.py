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
