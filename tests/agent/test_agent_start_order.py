"""The agent's figures do not depend on whether it starts before or after ``ckpt.load()``.

A run trains 30 steps and saves; the next run restores step 30 and trains 10 more. The
agent must count 40 steps, no rollback, and put the second run's steps at 31..40,
whichever of ``start_agent`` and ``load`` comes first -- and also when the checkpointer
is not given to ``start_agent``.
"""

from __future__ import annotations

import time

import pytest
import torch

import elastic
from elastic._goodput import read_records, summarize
from flashckpt.torch import Checkpointer

STEP_SECONDS = 0.01


def _train(agent, ckpt, state, first, last):
    for step in range(first, last + 1):
        time.sleep(STEP_SECONDS)
        state["w"] += 1
        agent.step()
        if step % 10 == 0:
            ckpt.save(step, state)


def _run(directory, metrics, job, order):
    """The second run, ``order`` one of "agent-first", "load-first", "load-first-unnamed"."""
    state = {"w": torch.zeros(4)}
    with Checkpointer(directory, job_id=job) as ckpt:
        if order == "agent-first":
            agent = elastic.start_agent(checkpointer=ckpt, metrics_dir=metrics, handle_failures=False)
            restored = ckpt.load(state)
        else:
            restored = ckpt.load(state)
            named = ckpt if order == "load-first" else None
            agent = elastic.start_agent(checkpointer=named, metrics_dir=metrics, handle_failures=False,
                                        job_id=job)
        try:
            assert restored == 30 and agent.current_step == 30
            _train(agent, ckpt, state, 31, 40)
            assert agent.current_step == 40
            return agent.metrics()
        finally:
            agent.stop()


@pytest.mark.parametrize("order", ["agent-first", "load-first", "load-first-unnamed"])
def test_goodput_is_the_same_in_either_start_order(tmp_path, job_id, order):  # noqa: F811
    directory, metrics = tmp_path / "ckpt", str(tmp_path / "metrics")
    state = {"w": torch.zeros(4)}
    with Checkpointer(directory, job_id=job_id) as ckpt:
        agent = elastic.start_agent(checkpointer=ckpt, metrics_dir=metrics, handle_failures=False)
        try:
            assert ckpt.load(state) is None and agent.current_step == 0
            _train(agent, ckpt, state, 1, 30)
        finally:
            agent.stop()
    job = _run(directory, metrics, job_id, order)["job"]
    assert job["rollback_steps"] == 0, job
    assert job["last_step"] == 40, job
    assert job["useful_seconds"] >= 40 * STEP_SECONDS, job
    rank = summarize(read_records(metrics))["ranks"][0]
    assert rank["steps"] == 40 and rank["rollback_seconds"] == 0.0, rank


def test_an_agent_started_after_another_stopped_learns_only_newer_events(tmp_path, job_id):  # noqa: F811
    with Checkpointer(tmp_path / "ckpt", job_id=job_id) as ckpt:
        ckpt.save(7, {"w": torch.zeros(4)})
        agent = elastic.start_agent(handle_failures=False, job_id=job_id)
        try:
            assert agent.current_step == 7  # the save before it started
            agent.step(3)
        finally:
            agent.stop()
        agent = elastic.start_agent(handle_failures=False, job_id=job_id)
        try:
            assert agent.current_step == 0  # nothing since the first agent stopped
        finally:
            agent.stop()
        assert ckpt.load({"w": torch.zeros(4)}) == 7
        agent = elastic.start_agent(handle_failures=False, job_id=job_id)
        try:
            assert agent.current_step == 7 and [e["type"] for e in agent.events()] == ["start", "load"]
        finally:
            agent.stop()
