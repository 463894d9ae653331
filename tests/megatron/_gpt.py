"""A small megatron-core GPTModel on CPU (local layer spec) and helpers for the tests."""

import contextlib
from typing import Iterator

import torch


def build(tp: int, *, seed: int = 0, hidden: int = 32, dtype=torch.float32):
    """Initialise model parallelism (TP=tp, DP=world/tp) and build the model on CPU, its
    parameters in ``dtype`` (bf16/fp16: converted as megatron's ``Float16Module`` does)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    # gated_linear_unit: fc1 holds two halves, saved through a ShardedTensorFactory
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gated_linear_unit=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    return model.to(dtype)


def perturb(model, seed: int) -> None:
    """Stand-in for training (attention forward needs CUDA): a deterministic update of
    every parameter, different on every tensor-parallel rank."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def main_blocks(sharded_state_dict) -> list:
    """(key, global offset with prepended axes, global shape, block) of this rank's main
    replicas, with factories applied (as saved)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    apply_factories(sharded_state_dict)
    out = []
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id):
            shape = (1,) * v.prepend_axis_num + tuple(v.local_shape)
            out.append((v.key, tuple(v.global_offset), tuple(v.global_shape), v.data.detach().clone().reshape(shape)))
    return out


def consolidate(blocks_by_rank) -> dict:
    """Global tensors assembled from every rank's main-replica blocks."""
    full: dict = {}
    for blocks in blocks_by_rank:
        for key, offset, global_shape, block in blocks:
            t = full.setdefault(key, torch.full(global_shape, float("nan"), dtype=block.dtype))
            t[tuple(slice(o, o + n) for o, n in zip(offset, block.shape))] = block
    return full


def expected_blocks(sharded_state_dict, full: dict) -> list:
    """(state dict path, expected local value) for every ShardedTensor or factory of a (new)
    layout, cut from the consolidated tensors ``full`` (factories merged as megatron does)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def block(v):
        if not isinstance(v, ShardedTensor):
            return v
        shape = (1,) * v.prepend_axis_num + tuple(v.local_shape)
        return full[v.key][tuple(slice(o, o + n) for o, n in zip(v.global_offset, shape))].reshape(v.local_shape)

    out = []

    def walk(node, prefix):
        for k, v in node.items():
            path = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, path + ".")
            elif isinstance(v, ShardedTensor):
                out.append((path, block(v)))
            elif isinstance(v, ShardedTensorFactory):
                out.append((path, v.merge_fn(dict_list_map_outplace(block, v.build()))))

    walk(sharded_state_dict, "")
    return out


def optimizer(model, lr: float = 0.01, params: list | None = None):
    """megatron-core's optimizer over torch Adam (of ``params``, by default the model's), as
    ``get_megatron_optimizer`` picks it by the model's dtype without the distributed optimizer
    (which needs the DDP wrapper): fp32, ``FP32Optimizer``; bf16,
    ``Float16OptimizerWithFloat16Params`` with no grad scaler; fp16, that one with a
    ``ConstantGradScaler`` (a ``DynamicGradScaler`` steps on CPU too, but its
    ``load_state_dict`` calls ``.cuda()``). No clipping: ``get_grad_norm_fp32`` makes a CUDA
    tensor. Built with two CUDA-only spots replaced by their CPU equivalents, nothing else
    patched: the constructors' scalar tensors (the loss scale, ``found_inf``, the overflow
    buffer) made with ``torch.tensor(..., device='cuda')``, built on the CPU (:func:`on_cpu`);
    and the fp16/bf16 optimizer's check of ``param.type()`` against
    ``'torch.cuda.BFloat16Tensor'`` (and the Half and Float names), which sees a CPU
    parameter's type under its CUDA name."""
    from unittest import mock

    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, OptimizerConfig
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    stock_type = torch.Tensor.type

    def cuda_name(tensor, *args, **kwargs):
        name = stock_type(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) and tensor.device.type == "cpu" else name

    # the keys megatron's load_state_dict matches groups by
    group = {"params": list(model.parameters()) if params is None else params, "wd_mult": 1.0, "lr_mult": 1.0,
             "is_expert_parallel": False, "is_decoupled_lr": False}
    inner = torch.optim.Adam([group], lr=lr)

    def init_state(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    dtype = group["params"][0].dtype
    with on_cpu(), mock.patch.object(torch.Tensor, "type", cuda_name):
        if dtype == torch.float32:
            return FP32Optimizer(inner, OptimizerConfig(lr=lr, clip_grad=0.0), init_state)
        fp16 = dtype == torch.float16
        config = OptimizerConfig(lr=lr, clip_grad=0.0, bf16=not fp16, fp16=fp16, loss_scale=1024.0 if fp16 else None)
        return Float16OptimizerWithFloat16Params(inner, config, ConstantGradScaler(1024.0) if fp16 else None,
                                                 init_state)


def chained(model):
    """A ``ChainedOptimizer`` of two bf16 (or fp32, by the model's dtype) optimizers of
    :func:`optimizer`, one for the embedding's parameters and one for the rest, as
    ``get_megatron_optimizer`` chains one per set of parameter groups (dense, experts). Its
    ``step`` computes the gradient norm (no clipping) with two CUDA tensors: step it in
    :func:`on_cpu`."""
    from megatron.core.optimizer import ChainedOptimizer

    params = dict(model.named_parameters())
    embedding = [p for name, p in params.items() if name.startswith("embedding.")]
    rest = [p for name, p in params.items() if not name.startswith("embedding.")]
    return ChainedOptimizer([optimizer(model, params=embedding), optimizer(model, params=rest)])


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """``torch.tensor`` and ``torch.zeros`` ignore ``device`` (megatron-core's ``device='cuda'``)."""
    from unittest import mock

    stock_tensor, stock_zeros = torch.tensor, torch.zeros

    def tensor(*args, **kwargs):
        kwargs.pop("device", None)
        return stock_tensor(*args, **kwargs)

    def zeros(*args, **kwargs):
        kwargs.pop("device", None)
        return stock_zeros(*args, **kwargs)

    with mock.patch.object(torch, "tensor", tensor), mock.patch.object(torch, "zeros", zeros):
        yield


def loss(model, step: int):
    """Stand-in for forward (attention needs CUDA): a loss of every parameter, the same
    function on every rank (tensor-parallel duplicates stay equal)."""
    total = torch.zeros(())
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        total = total + (p * torch.randn(p.shape, generator=g)).sum() + (p * p).sum() * 0.01
    return total


def state_of(model, opt, *, loading: bool = False) -> dict:
    """The sharded state dict a megatron training loop saves: model and optimizer."""
    model_ssd = model.sharded_state_dict()
    return {"model": model_ssd, "optimizer": opt.sharded_state_dict(model.sharded_state_dict(), is_loading=loading)}


def local_state(model, opt) -> dict:
    """Copies of this rank's parameters, their fp32 main copies (bf16/fp16) and Adam moments
    (of the main copies there), by parameter name."""
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        main = getattr(p, "main_param", p)
        if main is not p:
            out[f"main.{n}"] = main.detach().clone()
        for k, v in opt.optimizer.state.get(main, {}).items():
            out[f"{k}.{n}"] = v.detach().clone()
    return out
