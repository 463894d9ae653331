"""Hugging Face Trainer with flash checkpoints: copy this into your training script.

    python examples/hf_trainer.py /tmp/hf-run
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 examples/hf_trainer.py /tmp/hf-run
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py /tmp/hf-ds --deepspeed

A tiny Llama built from a config (no download) trains for 60 steps. Every 20 steps the
Trainer's checkpoint costs one copy into shared memory and ``checkpoint-<N>`` is written
in the background; every 5 steps a snapshot stays in memory only. Kill the job at any
moment and start it again: it resumes from the newest snapshot, in memory or on disk.
With ``--deepspeed`` the Trainer runs DeepSpeed ZeRO-2; the callback then saves through
DeepSpeed's own ``save_checkpoint`` and each folder holds DeepSpeed's tag, as the stock
save writes it.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback  # noqa: E402
from flashckpt.torch import init_process_group  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    output_dir = positional[0] if positional else "/tmp/flashckpt-hf-example"
    extra = {}
    if "--deepspeed" in sys.argv:
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
        extra["ddp_backend"] = "gloo"
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # under torchrun: the group comes first (accelerate keeps it)
        init_process_group()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    args = TrainingArguments(output_dir, max_steps=60, save_steps=20, save_total_limit=2, logging_steps=10,
                             per_device_train_batch_size=8, learning_rate=1e-3, use_cpu=True, report_to=[], **extra)
    flash = FlashCheckpointCallback(memory_every=5)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[flash])
    # look for folders after building the Trainer: its constructor writes out a newer step held in memory
    resume = get_last_checkpoint(output_dir) is not None
    if flash.resumed_from:
        print(f"resuming from step {flash.resumed_from['step']} held in memory")
    trainer.train(resume_from_checkpoint=True if resume else None)
    print(f"done at step {trainer.state.global_step}; folders: "
          f"{sorted(n for n in os.listdir(output_dir) if n.startswith('checkpoint-'))}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
