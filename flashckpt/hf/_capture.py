"""What a Trainer save consists of, captured without writing a file.

The stock ``Trainer._save_checkpoint`` of transformers 5.x writes, for step N, into
``<run_dir>/checkpoint-N``: the model through ``save_pretrained`` (``model.safetensors``,
sharded with an index past 50GB; ``config.json``; ``generation_config.json``), the
processing class, ``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` (if any), ``rng_state.pth`` (``rng_state_<rank>.pth`` in distributed
runs) and ``trainer_state.json``. This module builds the same content as a flashckpt
state: tensors (views of the live ones, never copies) plus plain values, so that the
engine's one copy into shared memory is all a save costs. The exporter
(:mod:`flashckpt.hf._export`) turns it back into those files in the saver process.

Files that do not change while training (``training_args.bin``, the tokenizer) are
written once per ``train()`` into a content-named folder and copied by the exporter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError

__all__ = ["capture_rank_state", "capture_main_state", "peft_or_quantized", "write_static_files", "TRAINING_ARGS_NAME"]

log = logging.getLogger(__name__)

TRAINING_ARGS_NAME = "training_args.bin"


def _rng_state(distributed: bool) -> dict[str, Any]:
    """The RNG states ``Trainer._save_rng_state`` saves, in the same order."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def capture_rank_state(trainer: Any) -> dict[str, Any]:
    """What every rank saves for itself: its RNG states (``rng_state[_<rank>].pth``)."""
    from transformers.training_args import ParallelMode

    if trainer.args.save_only_model:
        return {}
    return {"rng": _rng_state(trainer.args.parallel_mode == ParallelMode.DISTRIBUTED)}


def peft_or_quantized(model: Any) -> bool:
    """A PEFT adapter or a quantized model (whose saves this module does not build)."""
    from transformers.utils import is_peft_available

    if is_peft_available():
        from peft import PeftModel
        if isinstance(model, PeftModel):
            return True
    return bool(getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None)


def _model_tensors(trainer: Any, state_dict: dict[str, Any] | None = None, keep_tied: bool = False
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors ``save_pretrained`` writes (tied copies removed unless ``keep_tied``,
    original names restored), and the plain facts the exporter needs to write the model
    files. ``state_dict``: the weights to write instead of the model's own (``{}``: none)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import PreTrainedModel, remove_tied_weights_from_state_dict

    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if not isinstance(model, PreTrainedModel):  # the Trainer saves a bare state dict
        return dict(trainer.model.state_dict() if state_dict is None else state_dict), {"pretrained": False}
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None:
        raise CheckpointError("FlashCheckpointCallback does not handle PEFT adapters or quantized models yet")
    # save_pretrained records these on the config before writing it; do the same
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [model.__class__.__name__.removeprefix("FSDP")]
    weights = state_dict is None or bool(state_dict)
    state_dict = model.state_dict() if state_dict is None else state_dict
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    if not keep_tied:
        state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    state_dict = revert_weight_conversion(model, state_dict)
    facts = {
        "pretrained": True,
        "config": model.config.to_json_string(use_diff=True),
        "generation_config": (model.generation_config.to_json_string(use_diff=True, keys_to_pop=["compile_config"])
                              if model.can_generate() and model.generation_config is not None else None),
        "num_parameters": model.num_parameters(),
        "weights": weights,
    }
    return dict(state_dict), facts


def capture_main_state(trainer: Any, model_state: dict[str, Any] | None = None, keep_tied: bool = False
                       ) -> dict[str, Any]:
    """What the saving rank (process 0) saves: model, optimizer, scheduler, scaler,
    trainer state. Call at the point where the stock Trainer would write them. Under
    DeepSpeed, ``model_state`` and ``keep_tied`` come from
    :func:`flashckpt.hf._deepspeed.model_state_dict`, and the optimizer (and a scheduler
    DeepSpeed owns) are in DeepSpeed's tag instead."""
    tensors, facts = _model_tensors(trainer, model_state, keep_tied)
    main: dict[str, Any] = {"model": tensors, **facts,
                            "trainer_state": json.dumps(asdict(trainer.state), indent=2, sort_keys=True) + "\n"}
    if not trainer.args.save_only_model:
        deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
        if not deepspeed:
            main["optimizer"] = trainer.optimizer.state_dict()
        from . import _deepspeed
        if not deepspeed or not _deepspeed.owns_scheduler(trainer):
            main["scheduler"] = trainer.lr_scheduler.state_dict()
        scaler = getattr(trainer.accelerator, "scaler", None)
        main["scaler"] = scaler.state_dict() if scaler is not None else None
    return main


def write_static_files(trainer: Any, root: str) -> str:
    """Write the files that stay the same for a whole ``train()`` (``training_args.bin``,
    the processing class) once, into ``<root>/static-<hash>``; returns that folder."""
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".static-tmp-", dir=root)
    try:
        torch.save(trainer.args, os.path.join(scratch, TRAINING_ARGS_NAME))
        processor = trainer.processing_class
        if processor is None and getattr(trainer.data_collator, "tokenizer", None) is not None:
            processor = trainer.data_collator.tokenizer
        if processor is not None:
            processor.save_pretrained(scratch)
        digest = hashlib.sha1()
        for name in sorted(os.listdir(scratch)):
            digest.update(name.encode())
            with open(os.path.join(scratch, name), "rb") as f:
                digest.update(f.read())
        final = os.path.join(root, f"static-{digest.hexdigest()[:16]}")
        if os.path.isdir(final):
            shutil.rmtree(scratch)
        else:
            os.replace(scratch, final)
        return final
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
