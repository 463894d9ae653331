"""Every kind of DeepSpeed engine restores what it saved, from memory (into the engine's own
tensors), from storage and through DeepSpeed's own load of the exported tag: pipeline
stages, MoE experts, bf16, CPU optimizer offload.

DeepSpeed writes some files once for several ranks (a stage's layer files, an expert and
its optimizer states, on data-parallel rank 0) and reads them on every rank of the group;
a flash step must hand them to those ranks."""

import pytest
import torch

from tests._fork import run_ranks

from . import _ds_train

ADAM = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}

KINDS = {
    "pipeline, 2 stages, ZeRO 0": {"pipeline": 2, "config": {"zero_optimization": {"stage": 0}}},
    "pipeline, 1 stage x 2 data-parallel, ZeRO 1": {"pipeline": 1, "config": {"zero_optimization": {"stage": 1}}},
    "MoE, expert-parallel 1, ZeRO 0": {"experts": 1, "config": {"zero_optimization": {"stage": 0}}},
    "MoE, expert-parallel 1, ZeRO 2": {"experts": 1, "config": {"zero_optimization": {"stage": 2}}},
    "bf16, ZeRO 2": {"config": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}},
    "CPU optimizer offload, ZeRO 3": {"config": {"zero_force_ds_cpu_optimizer": False, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}},
}


class _MoENet(torch.nn.Module):
    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.moe = MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=2, ep_size=ep_size, k=1)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(self.moe(torch.relu(self.a(x)))[0])


def _engine(kind: dict):
    import deepspeed
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": ADAM, "steps_per_print": 10**9, **kind["config"]}
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)]
    if "pipeline" in kind:
        from deepspeed.pipe import PipelineModule
        model = PipelineModule(layers=layers, num_stages=kind["pipeline"], loss_fn=torch.nn.functional.mse_loss)
        params = model.parameters()
    elif "experts" in kind:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        model = _MoENet(kind["experts"])
        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    else:
        model = torch.nn.Sequential(*layers)
        params = model.parameters()
    return deepspeed.initialize(model=model, model_parameters=params, config=config)[0]


def _train(engine, rank: int, step: int) -> float:
    from deepspeed.runtime.pipe.engine import PipelineEngine
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    if isinstance(engine, PipelineEngine):
        return engine.train_batch(iter([(x, y)])).item()
    dtype = next(engine.module.parameters()).dtype
    loss = torch.nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _state(engine) -> dict:
    """Module and optimizer state by path, cloned."""
    out = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}/{i}")

    walk(engine.module.state_dict(), "module")
    walk(engine.optimizer.state_dict(), "optimizer")
    return out


def _restores(rank, world, directory, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)
    results = {}
    for n, (name, kind) in enumerate(KINDS.items()):
        where, tag = f"{directory}/{n}", f"{job}-{n}"
        engine = _engine(kind)
        ck = DeepSpeedCheckpointer(engine, where, job_id=tag, persist_every=1)
        for step in (1, 2):
            _train(engine, rank, step)
        ck.save(2)
        saved = _state(engine)
        expected = [_train(engine, rank, 3), _train(engine, rank, 4)]
        ck.wait()
        outcome = {}
        for source in ("memory", "storage", "stock"):
            if source == "storage":
                ck.close()  # frees the node's copy: the next load reads the committed step
            restarted = _engine(kind)
            _train(restarted, rank, 7)  # other values in every tensor
            try:
                if source == "stock":  # DeepSpeed's own load of the tag the saver exported
                    restarted.load_checkpoint(where, tag="global_step2")
                    got = int(restarted.global_steps)
                    sources.append("stock")
                else:
                    got = DeepSpeedCheckpointer(restarted, where, job_id=tag).load()
            except Exception as exc:  # noqa: BLE001 - reported per kind, the other kinds still run
                outcome[source] = f"{type(exc).__name__}: {exc}"[:400]
                continue
            state = _state(restarted)
            wrong = sorted(k for k in saved if k not in state or not torch.equal(state[k], saved[k]))
            outcome[source] = {"step": got, "source": sources[-1], "wrong": wrong[:6] or None,
                               "losses_equal": [_train(restarted, rank, 3), _train(restarted, rank, 4)] == expected}
        results[name] = outcome
    return results


@pytest.mark.timeout(300)
def test_each_kind_of_engine_restores_from_memory_storage_and_its_exported_tag(tmp_path, job_id):
    wrong = [(rank, name, source, got)
             for rank, results in enumerate(run_ranks(_restores, 2, str(tmp_path / "ckpt"), job_id, timeout=280))
             for name, outcome in results.items() for source, got in outcome.items()
             if got != {"step": 2, "source": source, "wrong": None, "losses_equal": True}]
    assert not wrong, "\n".join(map(str, wrong))
