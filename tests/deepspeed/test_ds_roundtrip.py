"""ZeRO-0 (plain data parallel, optimizer state inside the model file) through the flash
engine: memory and storage loads restore parameters and optimizer state exactly;
client_state or none; a step that only ever lived in memory loads.

(Losses are compared across processes in test_ds_restart.py; here the engines share one
process, and DeepSpeed's CPU FusedAdam carries state between engines of a process, so
the exact state is compared instead.)"""

import os

import pytest

from tests._fork import run_ranks

from . import _ds_train


def _snapshot(engine) -> dict:
    optim = engine.optimizer.state_dict()
    state = {f"optim/{k}/{n}": (v.clone() if hasattr(v, "clone") else v)
             for k, entry in optim["state"].items() for n, v in entry.items()}
    state.update({f"param/{k}": v for k, v in _ds_train.consolidated(engine).items()})
    state["groups"] = optim["param_groups"]
    state["global_steps"] = engine.global_steps
    return state


def _equal(a: dict, b: dict):
    import torch
    if sorted(a) != sorted(b):
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    bad = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    return bad or True


def _roundtrip(rank, world, directory, job):
    from flashckpt.deepspeed import DeepSpeedCheckpointer
    sources = _ds_train.join_group(rank)

    engine = _ds_train.make_engine(0)
    ck = DeepSpeedCheckpointer(engine, directory, job_id=job + "a", persist_every=2)
    _ds_train.train_step(engine, rank, 1)
    ck.save(1)  # no client state, memory only (persist_every=2)
    _ds_train.train_step(engine, rank, 2)
    ck.save(2, client_state={"sampler": {"epoch": 0, "seen": 16}})
    ck.wait()
    reference = _snapshot(engine)

    out = {}
    for name, suffix in (("memory", "a"), ("storage", "b")):  # "b": a new job, nothing in memory
        fresh = _ds_train.make_engine(0)
        other = DeepSpeedCheckpointer(fresh, directory, job_id=job + suffix)
        step = other.load()
        out[name] = {"step": step, "source": sources[-1], "client": other.client_state.get("sampler"),
                     "equal": _equal(_snapshot(fresh), reference)}
        if suffix == "b":
            other.close()
    out["memory_step_1"] = DeepSpeedCheckpointer(_ds_train.make_engine(0), directory, job_id=job + "a").load(step=1)
    ck.close()
    return out


@pytest.mark.timeout(240)
def test_zero0_round_trip_memory_and_storage(tmp_path, job_id):
    for out in run_ranks(_roundtrip, 2, str(tmp_path / "ckpt"), job_id, timeout=220):
        for name in ("memory", "storage"):
            assert out[name]["step"] == 2 and out[name]["source"] == name
            assert out[name]["client"] == {"epoch": 0, "seen": 16}
            assert out[name]["equal"] is True, out[name]["equal"]
        assert out["memory_step_1"] == 1
    assert sorted(os.listdir(tmp_path / "ckpt" / "global_step2")) == ["mp_rank_00_model_states.pt"]
