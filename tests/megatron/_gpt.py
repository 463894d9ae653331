"""A small megatron-core GPTModel on CPU (local layer spec) and helpers for the tests."""

import torch


def build(tp: int, *, seed: int = 0, hidden: int = 32):
    """Initialise model parallelism (TP=tp, DP=world/tp) and build the model on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    # gated_linear_unit: fc1 holds two halves, saved through a ShardedTensorFactory
    config = TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, gated_linear_unit=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


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
