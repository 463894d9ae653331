import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any test imports deepspeed

from tests.checkpoint.conftest import job_id, shm_objects  # noqa: E402,F401  (fixture and helper)
