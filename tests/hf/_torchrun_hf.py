"""The Trainer under torchrun (DDP on CPU, gloo) for the kill -9 restart test.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 _torchrun_hf.py OUT REPORT MODE

MODE "flash": FlashCheckpointCallback(memory_every=2), save_steps=6, 12 steps; on the
first attempt rank 1 kills itself with SIGKILL at the end of step 9, after the memory
snapshot of step 8 (no folder holds step 8). The restarted attempt calls
``train(resume_from_checkpoint=True)``. MODE "stock": the same training, uninterrupted,
without the callback (the reference). "ds-flash" / "ds-stock": the same under the
Trainer's DeepSpeed integration (ZeRO-2, AdamW, ``DS_ACCELERATOR=cpu``).
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from flashckpt.torch import init_process_group  # noqa: E402

from tests.hf._hf import make_trainer  # noqa: E402
from tests._exit import exit_now  # noqa: E402

KILL_AT = 9
DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
             "steps_per_print": 10**9}


class KillRank1(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, report, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group()
    callbacks = []
    flash = None
    if mode.endswith("flash"):
        from flashckpt.hf import FlashCheckpointCallback
        flash = FlashCheckpointCallback(memory_every=2)
        callbacks = [flash] + ([KillRank1()] if attempt == 0 else [])
    extra = {"deepspeed": DEEPSPEED} if mode.startswith("ds-") else {}
    trainer = make_trainer(out, callbacks, max_steps=12, save_steps=6, per_device_train_batch_size=2,
                           ddp_backend="gloo", dataloader_num_workers=0, **extra)
    trainer.train(resume_from_checkpoint=True if attempt > 0 else None)
    rank = dist.get_rank()
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, os.path.join(report, f"final{rank}.pt"))
    with open(os.path.join(report, f"rank{rank}.json"), "w") as f:
        json.dump({"attempt": attempt, "resumed_from": flash and flash.resumed_from,
                   "global_step": trainer.state.global_step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
