"""The Trainer's DeepSpeed integration on CPU, with or without the callback.

    torchrun --standalone --nproc_per_node=1 _deepspeed_hf.py OUT MODE VARIANT...

MODE "flash" trains with FlashCheckpointCallback, "stock" without; one Trainer per VARIANT
in turn (one launch: each costs seconds of imports), into OUT/VARIANT. A VARIANT is
``STAGE`` or ``STAGE-only-model``: ZeRO stage STAGE with AdamW, 4 steps, a save every 2;
"-only-model" sets ``save_only_model=True``.
"""

import logging
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from flashckpt.hf import FlashCheckpointCallback  # noqa: E402
from flashckpt.torch import init_process_group  # noqa: E402
from tests.hf._hf import make_trainer  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="LOG %(name)s %(levelname)s %(message)s")
out, mode = sys.argv[1], sys.argv[2]
init_process_group()
for variant in sys.argv[3:]:
    stage = int(variant.split("-")[0])
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
          "steps_per_print": 10**9}
    trainer = make_trainer(os.path.join(out, variant), [FlashCheckpointCallback()] if mode == "flash" else [],
                           deepspeed=DS, max_steps=4, save_steps=2, ddp_backend="gloo",
                           save_only_model=variant.endswith("-only-model"))
    trainer.train()
