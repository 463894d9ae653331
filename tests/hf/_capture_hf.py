"""A Trainer run with ``FlashCheckpointCallback(save_on_failure=True)`` that fails on purpose.

    python _capture_hf.py OUT REPORT ATTEMPT [KIND:STEP]

10 steps, folders every 3 (the conftest's ``reference_10`` set-up). KIND ``term``: SIGTERM
to itself once STEP finished (at the next step's ``on_step_begin``); ``raise``: a
RuntimeError there. The run resumes from ``last_checkpoint(OUT)``; REPORT/attempt<A>.json
says where (``global_step`` at ``on_train_begin``) and REPORT/final.pt holds the weights
of a run that reached the end.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback, last_checkpoint  # noqa: E402
from tests.hf._hf import make_trainer  # noqa: E402


class Fault(TrainerCallback):
    def __init__(self, kind: str, step: int, report: dict) -> None:
        self.kind, self.step, self.report = kind, step, report

    def on_train_begin(self, args, state, control, **kwargs):
        self.report["resumed_at"] = state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        if self.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "raise":
            raise RuntimeError(f"injected failure after step {self.step}")


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    out, report_dir, attempt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kind, step = sys.argv[4].split(":") if len(sys.argv) > 4 else ("none", "-1")
    report: dict = {}
    flash = FlashCheckpointCallback(save_on_failure=True)
    trainer = make_trainer(out, [flash, Fault(kind, int(step), report)], max_steps=10)
    report["resumed_from"] = flash.resumed_from

    def write() -> None:
        with open(os.path.join(report_dir, f"attempt{attempt}.json"), "w") as f:
            json.dump(report, f)

    try:
        trainer.train(resume_from_checkpoint=last_checkpoint(out))
    finally:
        write()
    torch.save([p.detach().clone() for p in trainer.model.parameters()], os.path.join(report_dir, "final.pt"))


if __name__ == "__main__":
    main()
