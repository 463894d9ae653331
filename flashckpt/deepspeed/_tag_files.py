"""Which files of a DeepSpeed tag a rank reads, and the parameter shapes they hold.

DeepSpeed writes some files once for several ranks and reads them on each rank that needs
them, as from a shared directory: the model states of data-parallel rank 0, a pipeline
stage's layer files (``layer_XX-*model_states.pt``) and each expert of an MoE layer
(``layer_L_expert_E_mp_rank_XX_model_states.pt``, written by expert-data-parallel rank 0).
A flash step holds a file only on the rank that wrote it, so a load hands these to the
ranks that read them, and checks their shapes against the engine before DeepSpeed writes
anything.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from typing import Any

__all__ = ["model_states", "read_patterns", "shapes"]

_EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."

Shapes = dict[str, tuple[int, ...]]


def read_patterns(engine: Any, save_dir: str, tag: str) -> list[str]:
    """Patterns (``fnmatch``) of the files of ``tag`` this rank's load reads that another
    rank may have written: model states, the stage's layer files, the rank's experts and,
    without ZeRO, its expert-parallel rank's optimizer states."""
    save_dir, tag = glob.escape(save_dir), glob.escape(tag)  # the names DeepSpeed makes, as patterns
    patterns = [engine._get_ckpt_name(save_dir, tag, mp_placeholder="*")]
    if _is_pipeline(engine):
        start = engine.module._local_start
        patterns += [os.path.join(save_dir, tag, f"layer_{start + idx:02d}-*model_states.pt")
                     for idx in range(len(engine.module.forward_funcs))]
    patterns += [path for path, _, _ in _expert_files(engine, save_dir, tag)]
    if getattr(engine, "has_moe_layers", False) and not engine.zero_optimization():
        from deepspeed.utils import groups  # the optimizer file of the rank's expert-parallel rank
        patterns.append(engine._get_optimizer_ckpt_name(
            save_dir, tag, groups._get_expert_parallel_rank(groups._get_max_expert_size_name())))
    return patterns


def model_states(engine: Any, files: dict[str, Any], save_dir: str, tag: str) -> dict[str, Any] | None:
    """The model states this rank loads: its own file, else the first of the tag's; None
    when the tag has none."""
    pattern = engine._get_ckpt_name(glob.escape(save_dir), glob.escape(tag), mp_placeholder="*")
    models = [sd for path, sd in sorted(files.items()) if fnmatch.fnmatch(path, pattern)]
    return files.get(engine._get_ckpt_name(save_dir, tag), models[0]) if models else None


def shapes(engine: Any, model: dict[str, Any], files: dict[str, Any], save_dir: str, tag: str) -> tuple[Shapes, Shapes]:
    """Parameter name -> shape in the files this rank loads (``model``, its model states,
    then its layer or expert files), and the same of the live engine."""
    if engine.zero_optimization() and model.get("param_shapes") is not None:
        return ({k: tuple(v) for group in model["param_shapes"] for k, v in group.items()},
                {k: tuple(v) for group in engine._get_zero_param_shapes() for k, v in group.items()})
    if model.get("module") is None and _is_pipeline(engine):
        saved: Shapes = {}
        for idx, _ in _stateful_layers(engine):
            layer = files.get(engine.module.ckpt_layer_path(os.path.join(save_dir, tag), idx)) or {}
            saved.update({f"{idx}.{k}": tuple(v.shape) for k, v in layer.items()})
        return saved, {f"{idx}.{k}": tuple(v.shape) for idx, layer in _stateful_layers(engine)
                       for k, v in layer.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in model["module"].items()}
    for path, global_id, local_id in _expert_files(engine, save_dir, tag):
        for k, v in (files.get(path) or {}).items():
            saved[k.replace(f"{_EXPERTS}{global_id}", f"{_EXPERTS}{local_id}")] = tuple(v.shape)
    return saved, {k: tuple(v.shape) for k, v in engine.module_state_dict().items()}


def _is_pipeline(engine: Any) -> bool:
    return hasattr(engine.module, "ckpt_layer_path") and hasattr(engine.module, "forward_funcs")


def _stateful_layers(engine: Any) -> list[tuple[int, Any]]:
    """The stage's layers DeepSpeed saves a file for, by local index."""
    return [(idx, layer) for idx, layer in enumerate(engine.module.forward_funcs) if hasattr(layer, "state_dict")]


def _expert_files(engine: Any, save_dir: str, tag: str) -> list[tuple[str, int, int]]:
    """(path, global expert id, local expert id) of each expert file this rank loads, in
    DeepSpeed's order (MoE layers numbered as they come in ``named_modules``)."""
    if not getattr(engine, "has_moe_layers", False):
        return []
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups
    files = []
    layers = (module for _, module in engine.module.named_modules() if isinstance(module, MoE))
    for layer_id, module in enumerate(layers):
        first = groups._get_expert_parallel_rank(module.expert_group_name) * module.num_local_experts
        for local_id in range(module.num_local_experts):
            path = engine._get_expert_ckpt_name(save_dir, layer_id, first + local_id, tag,
                                                checkpoint_mp_rank=engine.checkpoint_mp_rank)
            files.append((path, first + local_id, local_id))
    return files
