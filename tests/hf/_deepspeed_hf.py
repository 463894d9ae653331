"""The Trainer's DeepSpeed integration (ZeRO-2 on CPU) with the callback: stock save kept.

    torchrun --standalone --nproc_per_node=1 _deepspeed_hf.py OUT
"""

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flashckpt.hf import FlashCheckpointCallback  # noqa: E402
from tests.hf._hf import make_trainer  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")
DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      "steps_per_print": 10**9}
trainer = make_trainer(sys.argv[1], [FlashCheckpointCallback()], deepspeed=DS, max_steps=4, save_steps=2,
                       ddp_backend="gloo")
trainer.train()
