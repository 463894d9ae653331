"""A Trainer run with ``FlashCheckpointCallback(save_on_failure=True)`` that fails on purpose.

    python _capture_hf.py OUT REPORT ATTEMPT [FAULT ...]
    torchrun --nproc-per-node=2 --max-restarts=2 _capture_hf.py OUT REPORT - [FAULT ...]

10 steps, folders every 3 (the conftest's ``reference_10`` set-up); under torchrun
(``WORLD_SIZE`` set) DDP over gloo and the attempt is torchrun's restart count. A FAULT is
``KIND:RANK:STEP:ATTEMPT``, done by that rank once STEP finished (at the next step's
``on_step_begin``) in that attempt: ``term`` SIGTERM to itself, ``raise`` a RuntimeError,
``kill9`` SIGKILL to itself, ``fwdterm`` SIGTERM once the next step's forward ran, while
the main thread waits in C++ (the watcher thread captures). The run resumes from ``last_checkpoint(OUT)``;
REPORT/attempt<A>-rank<R>.json says where (``global_step`` at ``on_train_begin``) and
REPORT/final<R>.pt holds the weights of a run that reached the end (gathered under ZeRO-3).
With ``FLASHCKPT_TEST_HF_DS=1`` under torchrun: the Trainer's DeepSpeed integration (ZeRO-2);
``=3``: ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save`` (the saves write ``model.safetensors``).
With ``FLASHCKPT_TEST_HF_BN=1``: a model with a BatchNorm (``_hf.BatchNormModel``), whose buffers
go to REPORT/buffers<A>-<STEP>.pt at each ``on_step_end`` and, at a ``fwdterm``, after the
forward to REPORT/buffers<A>-moved.pt.
"""

import contextlib
import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback, last_checkpoint  # noqa: E402
from tests.hf._hf import BatchNormModel, make_trainer  # noqa: E402


def buffers(model: torch.nn.Module) -> dict:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def term_after_forward(model: torch.nn.Module, path: str) -> None:
    """Once the model's next forward ran: its buffers to ``path``, then SIGTERM while this
    thread waits in C++."""
    from tests.capture._train import _blocked_in_cpp

    def hook(module, args, output):
        torch.save(buffers(module), path)
        _blocked_in_cpp()

    model.register_forward_hook(hook)


class Fault(TrainerCallback):
    def __init__(self, faults: dict, report: dict, path: str, record: str | None = None) -> None:
        self.faults, self.report, self.path = faults, report, path
        self.record = record
        """With a BatchNorm model: REPORT/buffers<A>, the prefix of the buffers' files."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.report["resumed_at"] = state.global_step
        with open(self.path, "w") as f:  # now: a signal may end this attempt
            json.dump(self.report, f)

    def on_step_begin(self, args, state, control, **kwargs):
        kind = self.faults.get(state.global_step)
        if kind in ("term", "kill9"):
            os.kill(os.getpid(), signal.SIGTERM if kind == "term" else signal.SIGKILL)
        elif kind == "raise":
            raise RuntimeError(f"injected failure after step {state.global_step}")
        elif kind == "fwdterm":
            term_after_forward(kwargs["model"], f"{self.record}-moved.pt")

    def on_step_end(self, args, state, control, **kwargs):
        if self.record is not None:
            torch.save(buffers(kwargs["model"]), f"{self.record}-{state.global_step}.pt")


def main() -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    out, report_dir = sys.argv[1], sys.argv[2]
    extra, rank = {}, 0
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        from flashckpt.torch import init_process_group
        init_process_group("gloo")
        attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_rank()
        extra = {"ddp_backend": "gloo", "per_device_train_batch_size": 2, "dataloader_num_workers": 0}
        if os.environ.get("FLASHCKPT_TEST_HF_DS") in ("1", "3"):
            from tests.hf._torchrun_hf import DEEPSPEED
            extra["deepspeed"] = DEEPSPEED
            if os.environ["FLASHCKPT_TEST_HF_DS"] == "3":
                zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
                extra["deepspeed"] = dict(DEEPSPEED, zero_optimization=zero)
    else:
        attempt = int(sys.argv[3])
    faults = {}
    for spec in sys.argv[4:]:
        kind, f_rank, f_step, f_attempt = spec.split(":")
        if int(f_rank) == rank and int(f_attempt) == attempt:
            faults[int(f_step)] = kind
    report: dict = {}
    flash = FlashCheckpointCallback(save_on_failure=True)
    batchnorm = os.environ.get("FLASHCKPT_TEST_HF_BN") == "1"
    record = os.path.join(report_dir, f"buffers{attempt}") if batchnorm else None
    fault = Fault(faults, report, os.path.join(report_dir, f"attempt{attempt}-rank{rank}.json"), record)
    trainer = make_trainer(out, [flash, fault], max_steps=10, model=BatchNormModel() if batchnorm else None, **extra)
    report["resumed_from"] = flash.resumed_from
    trainer.train(resume_from_checkpoint=last_checkpoint(out))
    params, gathered = list(trainer.model.parameters()), contextlib.nullcontext()
    if os.environ.get("FLASHCKPT_TEST_HF_DS") == "3":  # every rank holds its partition: gather (all ranks)
        import deepspeed
        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        torch.save([p.detach().clone() for p in params], os.path.join(report_dir, f"final{rank}.pt"))


if __name__ == "__main__":
    main()
    if "WORLD_SIZE" in os.environ:
        from tests._exit import exit_now
        exit_now()
