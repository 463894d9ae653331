"""The Trainer's DeepSpeed integration, saved through ``flashckpt.deepspeed``.

Under ``TrainingArguments(deepspeed=...)`` the stock ``Trainer._save_checkpoint`` has
the DeepSpeed engine (``trainer.model_wrapped``) write its own tag into the folder
(``model_wrapped.save_checkpoint(checkpoint-N)``: ``global_step<G>/*.pt``, ``latest``,
``zero_to_fp32.py``), writes the model files from ``accelerator.get_state_dict`` and
``scheduler.pt`` only for a scheduler DeepSpeed does not own; there is no
``optimizer.pt``. Here the same ``save_checkpoint`` runs with
:class:`flashckpt.deepspeed.FlashCheckpointEngine` installed for the length of the call,
so DeepSpeed hands its state dicts over by reference instead of writing them, and they
join the Trainer's snapshot (one copy into shared memory). DeepSpeed is pointed at a
scratch directory under ``.flashckpt`` (it writes only its recovery scripts there),
never at ``checkpoint-N``, which only the exporter creates, whole. The exporter writes
the tag with :func:`flashckpt.deepspeed._export.write_tag`, ``latest`` and the scripts.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = ["SCRIPTS", "capture_files", "model_state_dict", "owns_scheduler", "saves_tag", "write_files", "zero3"]

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""What DeepSpeed copies next to a ZeRO tag (``DeepSpeedEngine._copy_recovery_script``)."""


def zero3(trainer: Any) -> bool:
    """The Trainer's DeepSpeed runs ZeRO stage 3."""
    return trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def _gathers_weights(trainer: Any) -> bool:
    return bool(trainer.model_wrapped.zero_gather_16bit_weights_on_model_save())


def saves_tag(trainer: Any) -> bool:
    """Whether the stock save writes DeepSpeed's tag: always, except with
    ``save_only_model`` (then only ZeRO-3 without gathered weights does, in ``save_model``)."""
    return not trainer.args.save_only_model or (zero3(trainer) and not _gathers_weights(trainer))


def model_state_dict(trainer: Any, local: bool = False) -> tuple[dict[str, Any] | None, bool]:
    """The model weights the stock save writes to ``model.safetensors``, and whether tied
    weights stay (as separate tensors). ZeRO 0-2: None, the model's own state dict (no
    copy), with tied weights kept, since the stock save clones every tensor
    (``accelerator.get_state_dict``) so ``save_pretrained`` finds no shared storage.
    ZeRO-3: the gathered 16-bit weights (a collective: every rank calls this), or ``{}``
    when the config does not gather them (the stock save then writes no weight file) or
    ``local`` asks for no collective (a failure capture; the tag holds every rank's
    partition of the weights, which is what a ZeRO-3 resume loads)."""
    if not zero3(trainer):
        return None, True
    if local or not _gathers_weights(trainer):
        return {}, False
    return trainer.model_wrapped._zero3_consolidated_16bit_state_dict(), False


def owns_scheduler(trainer: Any) -> bool:
    """True when DeepSpeed saves the scheduler in its tag (no ``scheduler.pt``)."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    return isinstance(trainer.lr_scheduler, DeepSpeedSchedulerWrapper)


def capture_files(trainer: Any, scratch: str) -> dict[str, Any]:
    """All ranks: DeepSpeed's ``save_checkpoint`` into the flash checkpoint engine.

    Returns ``{"tag", "files", "scripts"}``: the tag DeepSpeed chose (``global_step<G>``,
    as in the stock save), this rank's state dicts by path relative to the save
    directory (tensors by reference), and on rank 0 of a ZeRO run the folder holding the
    recovery scripts DeepSpeed copied (else None).
    """
    from ..deepspeed import _objects
    from ..deepspeed._engine import FlashCheckpointEngine

    engine = trainer.model_wrapped
    got: dict[str, Any] = {}

    def on_commit(tag: str, save_dir: str, files: dict[str, Any], save_latest: bool) -> None:
        got["tag"] = tag
        got["files"] = {rel: _objects.encode(state) for rel, state in files.items()}

    previous = engine.checkpoint_engine
    engine.checkpoint_engine = FlashCheckpointEngine(on_commit)
    try:  # the exporter writes ``latest`` once the tag is on storage
        engine.save_checkpoint(scratch, save_latest=False)
    finally:
        engine.checkpoint_engine = previous
    scripts = engine.global_rank == 0 and engine.save_zero_checkpoint
    return {**got, "scripts": scratch if scripts else None}


def write_files(ranks: list[Any], folder: str) -> None:
    """Exporter side: the DeepSpeed tag, ``latest`` and recovery scripts into ``folder``."""
    parts = [tree["deepspeed"] for tree in ranks if "deepspeed" in tree]
    if not parts:
        return
    from ..deepspeed._export import write_tag

    tag = parts[0]["tag"]
    write_tag((part["files"] for part in parts), tag, os.path.join(folder, tag))
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write(tag)
    scripts = parts[0].get("scripts")
    if scripts:
        for name in SCRIPTS:
            if os.path.exists(os.path.join(scripts, name)):
                shutil.copy(os.path.join(scripts, name), os.path.join(folder, name))
