"""Framework layouts written by the saver after a step commits.

An adapter that must leave its framework's own files on storage (Hugging Face
``checkpoint-N`` folders, DeepSpeed tags) names an exporter in its saves; the saver
runs it in the background once the step is committed, reading the committed
safetensors shards. Exporters are looked up in this allow-list of flashckpt's own
modules, never by a module path taken from a message. Each module defines
``export(directory: str, step: int, params: dict) -> None``.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from ._errors import CheckpointError

__all__ = ["EXPORTERS", "run_exporter"]

log = logging.getLogger(__name__)

EXPORTERS = {
    "hf": "flashckpt.hf._export",
    "deepspeed": "flashckpt.deepspeed._export",
    "tf": "flashckpt.tf._export",
}


def run_exporter(spec: dict[str, Any], directory: str, step: int, *, allow_pickle: bool = False) -> None:
    """Run the exporter ``spec["name"]`` with ``spec.get("params", {})`` for a committed step.

    ``allow_pickle`` is the job's own option: the exporter may unpickle only when the job
    passed ``allow_pickle=True``, whatever its params say."""
    name = spec.get("name")
    if name not in EXPORTERS:
        raise CheckpointError(f"unknown exporter {name!r}; known: {sorted(EXPORTERS)}")
    params = dict(spec.get("params") or {})
    params["allow_pickle"] = allow_pickle and bool(params.get("allow_pickle", True))
    start = time.perf_counter()
    importlib.import_module(EXPORTERS[name]).export(directory, step, params)
    log.info("exported step %d of %s as %s in %.2fs", step, directory, name, time.perf_counter() - start)
