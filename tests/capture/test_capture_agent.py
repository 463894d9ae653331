"""The elastic agent's failure path captures the last finished step before its flush."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from elastic._diagnosis import Diagnosis, Kind
from elastic._failures import Failures
from elastic._options import AgentOptions
from flashckpt.torch import Checkpointer


def test_the_agents_flush_persists_the_captured_step(tmp_path, job_id):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()

    with Checkpointer(tmp_path, job_id=job_id, persist_every=1000) as ckpt:
        ckpt.save_on_failure(state, optimizer=opt)
        step(), step()
        ckpt.save(2, state())
        step(), step(), step()
        clock = SimpleNamespace(step=5, write_steps=lambda: None, stalled=lambda now: 0.0,
                                hang=SimpleNamespace(current=lambda: 10.0))
        failures = Failures(AgentOptions(wait_for_storage="always"), rank=0, clock=clock, stacks=None, link=None,
                            log_=SimpleNamespace(write=lambda *a, **k: None), checkpointer=lambda: ckpt)
        assert failures.fail(Diagnosis.of(Kind.HANG, "no progress"))
        assert ckpt.latest_step() == 5
        assert ckpt.engine.memory_info(5).get("captured") is True
