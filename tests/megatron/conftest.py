from tests.checkpoint.conftest import job_id, shm_objects  # noqa: F401  (fixture and helper)
