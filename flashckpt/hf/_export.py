"""The Hugging Face exporter: a committed flashckpt step -> ``checkpoint-<N>``.

Runs in the saver process (``flashckpt.saver._exporters`` calls :func:`export` after the
step commits), never in the trainer. It reads the state without copying it (every
tensor is a view with a storage of its own, so ``torch.save`` and ``safetensors``
write exactly the original bytes): the image the saver just persisted, still held in
shared memory (a single-rank job's whole state; the committing rank's otherwise),
and the other ranks' committed safetensors shards (opened and verified by the one
shard reader, mapped). It writes
the stock Trainer files into ``<run_dir>/.checkpoint-<N>.tmp-<pid>``, fsyncs them and
renames the folder to ``checkpoint-<N>``, then rotates folders the way the Trainer
does (``save_total_limit``, the best checkpoint kept). A crash leaves only a hidden
temporary folder, which ``get_last_checkpoint`` and the rotation never see.

``params`` (JSON, from the trainer): ``run_dir``, ``static`` (the folder of
``training_args.bin`` and tokenizer files), ``limit`` (folders to keep, or None).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import torch

from .._errors import CheckpointError
from ..saver._exporters import ImageHold
from ..storage._files import fsync_dir
from ..storage._local import LocalStorage
from ..torch._image_views import step_trees, unpickler
from . import _deepspeed

__all__ = ["export", "warm", "write_folder", "folder_name"]

log = logging.getLogger(__name__)

_NO_PICKLE = unpickler(False, "the Hugging Face exporter does not unpickle state entries")


def warm() -> None:
    """Import what an export needs beyond this module (the saver runs this ahead of its
    first export, see ``ExportQueue.warm``): the model file writers and the Trainer's
    checkpoint rotation, half a second of a first export otherwise."""
    from huggingface_hub import split_torch_state_dict_into_shards  # noqa: F401
    from safetensors.torch import save_file  # noqa: F401
    from transformers.trainer_utils import rotate_checkpoints  # noqa: F401


def folder_name(step: int) -> str:
    return f"checkpoint-{step}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unalias(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights the stock save writes twice (DeepSpeed clones them apart) are one
    entry in flashckpt's copy; safetensors refuses aliases, so later names get a copy."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.data_ptr() if t.numel() else None
        out[name] = t.clone() if ptr is not None and ptr in seen else t
        if ptr is not None:
            seen.add(ptr)
    return out


def _write_model(main: dict[str, Any], folder: str) -> list[str]:
    """Write the model's files (as ``save_pretrained`` does); their names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = _unalias(main["model"])
    if not main.get("pretrained"):
        if not tensors:  # ZeRO-3 without gathered weights: the stock save leaves none
            return []
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    written = ["config.json"]
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        f.write(main["config"])
    if main.get("generation_config") is not None:
        written.append("generation_config.json")
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            f.write(main["generation_config"])
    if not main.get("weights", True):  # ZeRO-3 without gathered weights: the stock save writes none
        return written
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size="50GB")  # what the Trainer's save_pretrained uses
    for filename, names in split.filename_to_tensors.items():
        written.append(filename)
        save_file({name: tensors[name] for name in names}, os.path.join(folder, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_parameters": main["num_parameters"], **split.metadata},
                 "weight_map": split.tensor_to_filename}
        written.append("model.safetensors.index.json")
        with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


class _ModelWriter(threading.Thread):
    """Writes the model's files and then fsyncs them, while the caller writes the
    optimizer's and the rest: safetensors and ``torch.save`` both write without the GIL,
    and the disk takes the model's bytes while the optimizer's are still being copied
    (a 1.49 GB state: model 0.5 GB, optimizer 1 GB)."""

    def __init__(self, main: dict[str, Any], folder: str) -> None:
        super().__init__(name="flashckpt-export-model", daemon=True)
        self._main, self._folder = main, folder
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for name in _write_model(self._main, self._folder):
                _fsync(os.path.join(self._folder, name))
        except BaseException as exc:  # noqa: BLE001 -- raised by write_folder on the caller's thread
            self.error = exc
        finally:
            self._main = None


def write_folder(ranks: list[Any], folder: str, static: str | None) -> None:
    """Write the stock Trainer files of one step into ``folder`` (which must exist).
    ``ranks[r]`` is rank r's state tree; rank 0's holds the model and the rest.
    Returns once every file is written (the model's fsynced already, see :class:`_ModelWriter`)."""
    main = ranks[0]["hf"]
    model = _ModelWriter(main, folder)
    model.start()
    try:
        _write_rest(ranks, main, folder, static)
    finally:
        model.join()  # nothing writes into the folder once this returns or raises
    if model.error is not None:
        raise model.error


def _write_rest(ranks: list[Any], main: dict[str, Any], folder: str, static: str | None) -> None:
    """Every file of :func:`write_folder` but the model's."""
    if static is not None:
        for name in sorted(os.listdir(static)):
            shutil.copyfile(os.path.join(static, name), os.path.join(folder, name))
    _deepspeed.write_files(ranks, folder)
    if "optimizer" in main:
        torch.save(main["optimizer"], os.path.join(folder, "optimizer.pt"))
    if "scheduler" in main:
        torch.save(main["scheduler"], os.path.join(folder, "scheduler.pt"))
    if main.get("scaler") is not None:
        torch.save(main["scaler"], os.path.join(folder, "scaler.pt"))
    for rank, tree in enumerate(ranks):
        if "rng" in tree:
            name = "rng_state.pth" if len(ranks) == 1 else f"rng_state_{rank}.pth"
            torch.save(tree["rng"], os.path.join(folder, name))
    with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(main["trainer_state"])


def _write_pending(storage: LocalStorage, step: int, pending: str, static: str | None,
                   memory: ImageHold | None) -> str | None:
    """Write the step's folder into ``pending``, rank ``memory.rank``'s state read from
    the held image (let go once the files are written, before they are durable), the
    other ranks' from their shards; returns the best checkpoint it records."""
    world_size = storage.metadata(step)["world_size"]
    with step_trees(storage, step, world_size, memory, _NO_PICKLE) as ranks:
        if not isinstance(ranks[0], dict) or "hf" not in ranks[0]:
            raise CheckpointError(f"step {step} in {storage.root} holds no Trainer state on rank 0")
        write_folder(ranks, pending, static)
        return json.loads(ranks[0]["hf"]["trainer_state"]).get("best_model_checkpoint")


def export(directory: str, step: int, params: dict[str, Any], *, memory: ImageHold | None = None) -> None:
    """Write ``<run_dir>/checkpoint-<step>`` from the committed flashckpt ``step``; rank
    ``memory.rank``'s state from ``memory``, the image the saver just persisted (held in
    shared memory, let go once read), instead of reading its shard back from storage."""
    from transformers.trainer_utils import rotate_checkpoints

    storage = LocalStorage(directory)
    run_dir = params["run_dir"]
    final = os.path.join(run_dir, folder_name(step))
    pending = os.path.join(run_dir, f".{folder_name(step)}.tmp-{os.getpid()}")
    shutil.rmtree(pending, ignore_errors=True)
    os.makedirs(pending)
    start = time.perf_counter()
    try:
        best = _write_pending(storage, step, pending, params.get("static"), memory)
        written = time.perf_counter()
        for name in os.listdir(pending):
            _fsync(os.path.join(pending, name))
        fsync_dir(pending)
    except BaseException as exc:
        shutil.rmtree(pending, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"writing {final} failed: {type(exc).__name__}: {exc}") from exc
        raise
    synced = time.perf_counter()
    aside = None
    if os.path.exists(final):  # the same step saved again after a rollback
        aside = os.path.join(run_dir, f".{folder_name(step)}.old-{os.getpid()}")
        os.replace(final, aside)
    os.replace(pending, final)
    fsync_dir(run_dir)
    source = "shards read back" if memory is None else f"rank {memory.rank} read from memory"
    log.info("wrote %s in %.2fs (state read and files written %.2fs, %s; fsync %.2fs)", final,
             time.perf_counter() - start, written - start, source, synced - written)
    if aside is not None:  # hidden: neither the Trainer nor the rotation sees it
        shutil.rmtree(aside, ignore_errors=True)
    rotate_checkpoints(output_dir=run_dir, save_total_limit=params.get("limit"), best_model_checkpoint=best,
                       use_mtime=True)
