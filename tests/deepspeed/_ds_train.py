"""Deterministic DeepSpeed (ZeRO on CPU, gloo) training for the tests.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 _ds_train.py STAGES CKPT OUT STEPS KILL_AT

One launch trains one engine per ZeRO stage of STAGES (e.g. "1,2,3"), side by side, STEPS
steps, flash-saving every step in memory only (persist_every is large) to CKPT/stage<S>
(job FLASHCKPT_TEST_JOB + S); on the first attempt rank 1 kills itself with SIGKILL right
after every engine saved KILL_AT (-1: never). The restarted ranks resume from memory. Into
OUT/stage<S>: losses to losses-<rank>-<attempt>.json, the load's step and source to
load-<rank>-<attempt>.json, the consolidated fp32 parameters at the end to final.pt.
"""

import json
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from flashckpt.torch import init_process_group  # noqa: E402
from tests._exit import exit_now  # noqa: E402

MICRO_BATCH = 4


def join_group(rank: int) -> list:
    """In a ``run_ranks`` worker: DeepSpeed on the rank's gloo group; returns the list the
    source of each flashckpt load is appended to."""
    import deepspeed
    from flashckpt import _events
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed("gloo")
    sources: list = []
    _events.subscribe(lambda event, **info: sources.append(info["source"]) if event == "load" else None)
    return sources


def make_engine(stage: int, hidden: int = 16, batchnorm: bool = False, bf16: bool = False):
    """``batchnorm``: a BatchNorm after the first layer (its forward moves the running statistics);
    ``bf16``: DeepSpeed's bf16 mode (fp32 master weights), the module in bf16, buffers too (DeepSpeed
    casts the parameters alone, and CPU BatchNorm takes no bf16 input with fp32 statistics)."""
    import deepspeed
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(hidden)] if batchnorm else []
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), *norm, torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    model = model.to(torch.bfloat16) if bf16 else model
    # torch's Adam: DeepSpeed's FusedAdam would be JIT-compiled first (about 70 s on a clean CI machine)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def forward(engine, rank: int, step: int) -> torch.Tensor:
    """The loss of step ``step``'s batch (its forward only), the batch in the module's dtype."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(MICRO_BATCH, 8, generator=g), torch.randn(MICRO_BATCH, 1, generator=g)
    dtype = next(engine.module.parameters()).dtype
    return torch.nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))


def train_step(engine, rank: int, step: int) -> float:
    loss = forward(engine, rank, step)
    engine.backward(loss)
    engine.step()
    return loss.item()


def train_to_5(ck, engine, rank: int) -> None:
    """Steps 1-2, a save of step 2 (client state ``gs-2``), steps 3-5."""
    for step in (1, 2):
        train_step(engine, rank, step)
    ck.save(2, client_state={"marker": "gs-2"})
    for step in (3, 4, 5):
        train_step(engine, rank, step)


def buffers(engine) -> dict:
    """Copies of the module's buffers (BatchNorm's running statistics)."""
    return {name: b.detach().clone() for name, b in engine.module.named_buffers()}


def live(engine) -> dict:
    """The rank's training state by name: its parameters (a ZeRO-3 partition), ZeRO's fp32
    partitions, the optimizer's state of each (Adam's moments), the engine's step count."""
    zero = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        tensors = {f"param/{n}": p.ds_tensor for n, p in engine.module.named_parameters()}
        parts = zero.fp32_partitioned_groups_flat
    else:
        tensors = {f"param/{n}": p.data for n, p in engine.module.named_parameters()}
        parts = zero.single_partition_of_fp32_groups
    for i, part in enumerate(parts):
        tensors[f"fp32/{i}"] = part.data
        for name, moment in zero.optimizer.state[part].items():
            if isinstance(moment, torch.Tensor):
                tensors[f"adam/{i}/{name}"] = moment
    tensors["global_steps"] = torch.tensor(engine.global_steps)
    return tensors


def consolidated(engine) -> dict:
    """Full fp32 parameters (gathered under ZeRO-3); all ranks call it."""
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _train(stage: int, directory: str, out: str, steps: int, rank: int, attempt: int, loads: list):
    """Stage ``stage``'s engine and its checkpointer, resumed; yields after saving each step."""
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    os.makedirs(out, exist_ok=True)
    engine = make_engine(stage)
    ck = DeepSpeedCheckpointer(engine, directory, persist_every=1000,
                               job_id=os.environ["FLASHCKPT_TEST_JOB"] + str(stage))
    start = ck.load() or 0
    with open(os.path.join(out, f"load-{rank}-{attempt}.json"), "w") as f:
        json.dump({"step": start, "source": loads[-1]["source"] if loads else None,
                   "client": (getattr(ck, "client_state", None) or {}).get("marker")}, f)
    loads.clear()
    losses = {}
    for step in range(start + 1, steps + 1):
        losses[step] = train_step(engine, rank, step)
        ck.save(step, client_state={"marker": f"step-{step}"})
        yield step
    with open(os.path.join(out, f"losses-{rank}-{attempt}.json"), "w") as f:
        json.dump(losses, f)
    final = consolidated(engine)
    ck.close()  # persists the newest step and exports the DeepSpeed tag
    if rank == 0:
        torch.save(final, os.path.join(out, "final.pt"))


def main() -> None:
    import deepspeed
    from flashckpt import _events
    stages, directory, out, steps, kill_at = (sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                              int(sys.argv[5]))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group()
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    loads = []
    _events.subscribe(lambda event, **info: loads.append(info) if event == "load" else None)
    runs = [_train(int(s), os.path.join(directory, f"stage{s}"), os.path.join(out, f"stage{s}"), steps, rank,
                   attempt, loads) for s in stages]
    for steps_done in zip(*runs):  # one step of every engine at a time
        if attempt == 0 and rank == 1 and steps_done[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    for run in runs:  # past its last step: writes its losses and final state, closes
        next(run, None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # gloo groups still referenced can abort interpreter teardown
