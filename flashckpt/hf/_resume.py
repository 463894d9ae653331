"""Resuming a Trainer that used :class:`~flashckpt.hf.FlashCheckpointCallback`: the newest
step in memory (or committed but never written out) becomes the ``checkpoint-<N>`` folder
the stock Trainer resumes from.

``Trainer.train(resume_from_checkpoint=True)`` picks the newest ``checkpoint-<N>``
folder before any training callback runs, and derives the data position from it,
so memory cannot be swapped in later. Instead, at ``on_init_end`` (the Trainer's
constructor, on every rank) the callback runs the one load agreement every adapter
uses (``flashckpt.restore._agreement.agree``: memory on this node or a peer node's replica,
else the newest committed step; one answer on every rank, any rank's error raised on
all) and compares its step with the newest folder; when the agreed step is newer it
writes that step's folder now, so the folder the stock Trainer then picks is that
state. This works with stock transformers and under torchrun restarts: the shared
memory and the saver outlive the killed processes, and the restarted ones find them
by the output directory. (After a crash the saver usually writes that folder by
itself before the restart gets there.) Then the memory is freed; ``train()`` starts a
fresh engine. If writing it out fails, the memory is kept and the constructor raises
:class:`flashckpt.CheckpointError` on every rank.

How the folders map onto the agreement: the agreement's storage is the callback's
scratch (``<output_dir>/.flashckpt``, see :mod:`flashckpt.hf._callback`), where each step commits before the exporter makes
its ``checkpoint-<N>`` folder out of it; so a folder is a committed step written out,
and the folders are what the Trainer resumes from. The scratch knows lines (a save
after a rollback starts a new one) and keeps the newest step only; the folders carry
no line and the Trainer picks among them by number. Hence the rule, on the
agreement's answer: a step in memory (this node's, or fetched from a peer's replica
for a node that was lost whole) wins when no folder has a higher number, and is then
persisted and exported; a committed step whose folder is missing (its exporter died
with its node) is exported from the scratch; a folder with a higher number than the
agreed step (one the user resumed from, or copied in) wins, as the Trainer would pick
it. Under replicas (two or more nodes, see ``replicas``), a node lost whole thus
resumes from the survivor's memory, 0 steps lost once the snapshot had replicated.

Under torchrun with gloo, call :func:`flashckpt.torch.init_process_group` before
building the Trainer (accelerate keeps an existing group), or a restarted group may
dial the dead attempt's addresses; see ``examples/hf_trainer.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from .._engine import Engine
from ..restore._sources import Source
from . import _export

__all__ = ["PARAMS_FILE", "last_checkpoint", "newest_folder", "recover"]

log = logging.getLogger("flashckpt.hf")

_FOLDER_RE = re.compile(r"^checkpoint-(\d+)$")
PARAMS_FILE = "export.json"
"""Under the callback's scratch: the exporter's parameters of the current ``train()``, to write a
committed step's folder when no copy in memory recorded them."""


def newest_folder(run_dir: str) -> int | None:
    """The highest step of a ``checkpoint-<N>`` folder in ``run_dir``, or None."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return None
    steps = [int(m.group(1)) for n in names if (m := _FOLDER_RE.match(n)) and os.path.isdir(os.path.join(run_dir, n))]
    return max(steps, default=None)


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-<N>`` folder in ``output_dir`` (by step, as the stock
    ``resume_from_checkpoint=True`` picks it), or None when there is none or
    ``output_dir`` does not exist yet. Call it after building the Trainer (which writes a
    newer step held in memory out as its folder) and pass it on, so the same script
    starts fresh on its first run and resumes on the next::

        trainer = Trainer(..., callbacks=[FlashCheckpointCallback()])
        trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))
    """
    run_dir = os.fspath(output_dir)
    step = newest_folder(run_dir)
    return None if step is None else os.path.join(run_dir, _export.folder_name(step))


def _export_params(engine: Engine) -> dict[str, Any] | None:
    """The exporter's parameters recorded with this rank's newest own copy in memory (a
    copy fetched from a peer's replica records none), else those of the run's
    :data:`PARAMS_FILE`, or None."""
    for step in sorted(engine.memory_steps(), reverse=True):
        params = engine.memory_info(step).get("export", {}).get("params")
        if params is not None:
            return params
    try:
        with open(os.path.join(engine.storage.root, PARAMS_FILE), encoding="utf-8") as f:
            params = json.load(f)
    except (OSError, ValueError):
        return None
    return params if isinstance(params, dict) else None


def recover(engine: Engine, run_dir: str) -> dict[str, Any] | None:
    """All ranks: agree on the newest step (this node's memory, a peer's replica, or
    the scratch's committed step) and, if no folder is as new, write its folder now.
    Returns ``{"step": N, "source": ...}`` when the folder of the agreed step is what a
    resume reads, else None (the Trainer reads the folders as usual)."""
    start = time.perf_counter()
    agreement = engine.agree()  # fetches the step from a peer's replica where a node lost it
    step, source = agreement.step, agreement.source
    views = engine.on_all_ranks(lambda: (newest_folder(run_dir) if engine.collective.rank == 0 else None,
                                         _export_params(engine)), "looking for checkpoint folders")
    newest = views[0][0]
    if step is None or (source == Source.STORAGE and step == newest):
        return None  # nothing newer than the folders: the Trainer reads them as usual
    if newest is not None and step < newest:
        log.info("%s holds step %d, older than %s/checkpoint-%d: a resume reads the folder", source, step,
                 run_dir, newest)
        return None
    if newest != step:
        log.info("step %d (%s) is newer than the newest folder (%s): writing checkpoint-%d", step, source,
                 newest, step)
        params = next((p for _, p in views if p is not None), None) or {"run_dir": run_dir}
        _write_folder(engine, run_dir, step, source, params)
    log.info("step %d from %s is %s/checkpoint-%d: resume_from_checkpoint=True resumes there", step, source,
             run_dir, step)
    engine.finish_load(step, source, start)
    return {"step": step, "source": str(source)}


def _write_folder(engine: Engine, run_dir: str, step: int, source: Source, params: dict[str, Any]) -> None:
    """All ranks: ``checkpoint-<step>`` from memory (persisted, which exports it) or,
    when the exporter did not write it (it died, or the copy came from a peer's
    replica, which records no exporter), from the committed step by process 0."""

    def persist() -> None:
        engine.persist(step)  # the saver that commits it exports it
        engine.wait()

    def export() -> None:
        if engine.collective.rank == 0 and not os.path.isdir(os.path.join(run_dir, _export.folder_name(step))):
            _export.export(engine.storage.root, step, params)

    what = f"writing step {step} from {source} to {run_dir}/checkpoint-{step}"
    if source == Source.MEMORY:
        engine.on_all_ranks(persist, what)  # after it, every rank's shard is committed
    engine.on_all_ranks(export, what)
