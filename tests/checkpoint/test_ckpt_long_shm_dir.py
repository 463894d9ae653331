"""A deep ``FLASHCKPT_SHM_DIR`` (a socket path past AF_UNIX's 107 bytes): the saver still
listens and the trainer still connects (through a descriptor of the directory)."""

import os
import subprocess
import sys

import flashckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flashckpt.__file__)))

SCRIPT = r"""
import sys, torch
from flashckpt import _names
from flashckpt.torch import Checkpointer
assert len(_names.socket_path(sys.argv[2])) > 108, _names.socket_path(sys.argv[2])
with Checkpointer(sys.argv[1], job_id=sys.argv[2], persist_every=1) as ck:
    ck.save(1, {"w": torch.full((64,), 3.0)})
    ck.wait()
    target = {"w": torch.zeros(64)}
    assert ck.load(target) == 1 and target["w"].tolist() == [3.0] * 64
print("ok", ck.latest_step())
"""


def test_a_socket_path_longer_than_af_unix_takes_still_works(tmp_path, job_id):
    shm = tmp_path / ("deep-" + "d" * 60) / ("er-" + "e" * 40)
    shm.mkdir(parents=True)
    env = dict(os.environ, FLASHCKPT_SHM_DIR=str(shm), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt"), job_id], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok", "1"], proc.stderr[-3000:]
    cli = subprocess.run([sys.executable, "-m", "flashckpt.cli", "gc"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert cli.returncode == 0, cli.stderr[-2000:]
