"""A trainer's last messages are handled even when the saver sees it exit first.

The saver watches each trainer's socket and, through a pidfd, its process. When a trainer
sends ``saved`` (persist this step) and dies a moment later, both turn readable; if the
exit is handled first, the messages still in the socket must be read, or a save that had
returned to the trainer is never written (a lost ``checkpoint-N`` folder under the
Trainer). The test holds the saver's loop still and hands it the exit before the socket.
"""

import glob
import os
import subprocess
import sys
import time

import pytest

from flashckpt import _names
from flashckpt.saver._saver import PROTOCOL, Saver
from flashckpt.memory._slot import pid_alive
from flashckpt.storage._local import LocalStorage

_TRAINER = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
send = lambda msg: sock.sendall(json.dumps(msg).encode() + b"\\n")
send({"op": "hello", "v": int(sys.argv[2]), "slots": [sys.argv[3]], "info": {}})
sock.recv(4096)  # welcome
send({"op": "saved", "slot": sys.argv[3], "generation": 7, "step": 6, "persist": True,
      "info": {"directory": sys.argv[4], "token": "t", "persist": True}})
if sys.argv[5] == "flush":  # as close() does: the saver then reaps this trainer while reading this
    send({"op": "flush", "id": 1})
sys.stdin.read()  # exits when the test closes its stdin
"""


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("last", ["saved", "flush"])
def test_a_trainer_that_exits_right_after_saved_still_has_that_save_persisted(tmp_path, last):
    job_id = f"exit-order-{os.getpid()}"
    saver = Saver(job_id, linger_seconds=0.0)
    saver._listen()
    slot = _names.slot_path(job_id, 0, 0)
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, saver.sock_path, str(PROTOCOL), slot,
                                str(tmp_path), last], stdin=subprocess.PIPE)
    try:
        _until(lambda: saver.sel.select(0.1) and (saver._accept(saver._listener) or saver.clients),
               "the trainer connects")
        (client,) = saver.clients.values()
        _until(lambda: saver._read(client) or client.slots, "hello is handled")
        time.sleep(0.2)  # ``saved`` is in the socket now, unread
        trainer.stdin.close()
        trainer.wait(30)
        saver._drop(client, "process exited")  # the pidfd's event, handled before the socket's
        queued = [(job.slot, job.generation) for job in saver.jobs._queue if job.reply is None]
        assert queued == [(slot, 7)], "the save the trainer reported before it died is persisted"
    finally:
        trainer.kill()
        os.unlink(saver.sock_path)


_UNHEARD = """
import os, signal, sys
import torch
from flashckpt.torch import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep_last=0, job_id=sys.argv[2])
os.kill(ckpt._engine._client.saver_pid, signal.SIGSTOP)  # its saver hears nothing more
ckpt.save(6, {"w": torch.full((1024,), 6.0)}, persist=True)
ckpt.save(8, {"w": torch.full((1024,), 8.0)}, persist=False)
print(ckpt._engine._client.saver_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_save_asked_to_persist_that_no_saver_heard_of_is_persisted_beside_a_newer_snapshot(tmp_path):
    """The saver dies with the ``saved`` messages unread; the next saver finds the slots
    (their headers are the only record) and writes the step that was asked to persist,
    not only the newest snapshot."""
    job_id = f"unheard-{os.getpid()}"
    run = subprocess.run([sys.executable, "-c", _UNHEARD, str(tmp_path), job_id], capture_output=True, text=True,
                         timeout=120)
    old_saver = int(run.stdout.split()[0])
    os.kill(old_saver, 9)
    _until(lambda: not pid_alive(old_saver), "the old saver is gone")
    try:
        subprocess.run([sys.executable, "-m", "flashckpt.saver._saver", "--job-id", job_id, "--linger-seconds", "0.5"],
                       timeout=120, check=True)
        assert LocalStorage(str(tmp_path)).committed_steps() == [6, 8]
    finally:
        for path in glob.glob(_names.job_prefix(job_id) + "*"):
            os.unlink(path)
