"""One saver serves a job on a node, even after its lock file and socket were removed.

The saver holding the ``flock`` on the file at ``<job>.saver.lock`` is the one that
listens and rescues orphaned slots. When someone removes that file and the socket (a
wiped ``/dev/shm``, a cleanup script) while the saver lingers, the next trainer starts
a second saver. The first one must step down: no longer take the socket back, no longer
adopt slots, and leave once the trainers still connected to it are done. Two savers that
both listen take the socket from each other every tick and persist the same orphaned
slot at once, writing into one pending directory.
"""

import os
import signal
import time

from flashckpt import _names
from flashckpt.saver._client import SaverClient
from flashckpt.saver._lock import lock_holder
from flashckpt.memory._slot import pid_alive


def _until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_saver_whose_lock_file_was_removed_steps_down_for_the_next(job_id):
    lock = _names.job_prefix(job_id) + ".saver.lock"
    sock = _names.socket_path(job_id)
    first = SaverClient(job_id, [], {})
    old = first.saver_pid
    assert lock_holder(job_id) == old
    os.kill(old, signal.SIGSTOP)  # held still, so the next saver starts before it looks again
    try:
        os.unlink(lock)  # a wiped /dev/shm, while the old saver still serves a trainer
        os.unlink(sock)
        second = SaverClient(job_id, [], {})
        new = second.saver_pid  # linked (a client links in the background) before the old saver runs again
    finally:
        os.kill(old, signal.SIGCONT)
    try:
        assert new != old and lock_holder(job_id) == new
        bound = os.stat(sock).st_ino
        time.sleep(4 * 0.5)  # several ticks of both savers
        assert os.stat(sock).st_ino == bound, "the old saver took the socket back"
        assert lock_holder(job_id) == new
        assert pid_alive(old), "the old saver still serves the trainer connected to it"
        first.close()
        _until(lambda: not pid_alive(old), "the old saver leaves once its trainers are done", seconds=3)
        third = SaverClient(job_id, [], {})
        assert third.saver_pid == new
        third.close()
    finally:
        first.close()
        second.close()
    _until(lambda: not pid_alive(new), "the saver leaves after its linger")
    assert not os.path.exists(lock) and not os.path.exists(sock)


def test_a_saver_whose_lock_file_was_removed_takes_it_again_when_no_other_did(job_id):
    lock = _names.job_prefix(job_id) + ".saver.lock"
    client = SaverClient(job_id, [], {})
    pid = client.saver_pid
    try:
        os.unlink(lock)
        _until(lambda: lock_holder(job_id) == pid, "the saver takes its lock path again", seconds=5)
        again = SaverClient(job_id, [], {})
        assert again.saver_pid == pid
        again.close()
    finally:
        client.close()
    _until(lambda: not pid_alive(pid), "the saver leaves after its linger")
    assert not os.path.exists(lock)
