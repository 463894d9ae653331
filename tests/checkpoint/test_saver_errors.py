"""A persist job that fails in an unexpected place still reports its failure: the trainer's
``wait``/``flush`` must never take a save that was not written for a durable one."""

import threading

from flashckpt.saver._saver import Saver
from flashckpt.saver._jobs import Job


class _Trainer:
    """What the saver sends to a trainer's socket."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def send(self, msg: dict) -> None:
        self.messages.append(msg)


def test_a_job_that_fails_outside_the_write_is_reported_as_failed(tmp_path, monkeypatch):
    def fails(self, job):
        raise ConnectionError("the export queue or a storage check failed")

    monkeypatch.setattr(Saver, "_run", fails)
    saver = Saver("errors-test", linger_seconds=0.0)
    trainer = _Trainer()
    saver.jobs.put(Job(str(tmp_path / "slot"), 1, trainer, {"step": 3}))
    worker = threading.Thread(target=saver._work)
    worker.start()
    try:
        for _ in range(500):
            if saver.jobs.idle():
                break
            threading.Event().wait(0.01)
    finally:
        saver.jobs.stop()
        worker.join(10)
    assert [m.get("op") for m in trainer.messages] == ["persisted"]
    assert "error" in trainer.messages[0] and trainer.messages[0]["slot"] == str(tmp_path / "slot")
