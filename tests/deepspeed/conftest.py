import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any test imports deepspeed
