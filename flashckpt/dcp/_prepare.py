"""``prepare``: the first flash DCP save of a fresh run made as cheap as the ones after it.

A save copies into the rank's shared-memory slots, through the node's saver. In a fresh
process the first save would also open the run and touch the slots' fresh pages (more than
the copy itself; the saver's start, most of a second, overlaps the copy: see
``flashckpt.saver._client``), and nothing a
``StorageWriter`` hears from DCP comes early enough to hide that: DCP calls
``set_up_storage_writer``, ``prepare_local_plan`` and ``write_data`` within one ``dcp.save``,
milliseconds apart, and torchtitan makes the writer just before. So :func:`prepare`, called
once the state exists and before training (a resume's load does the same itself, see
:class:`~flashckpt.dcp.FlashStorageReader`), opens the run and sizes the slots from the
rank's own DCP plan of the state, in the background.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from .._options import Options
from ..storage import _client_options
from ..storage._location import OBJECT_SCHEMES
from ._run import check_store_free, normalize_id, run_for, store_of
from ._url import CHAINED, PROTOCOL, folder_of
from ._writer import rank_tree

__all__ = ["prepare"]

_ITEM_METADATA = 512
"""Bound on what an item adds to the pickled ``.metadata`` (its storage entry and chunk)."""


def prepare(state_dict: dict[str, Any], folder: str | os.PathLike, *, store: str | os.PathLike | None = None,
            options: Options | None = None, process_group: Any = None, planner: SavePlanner | None = None,
            **shorthands: Any) -> None:
    """Ready the flash DCP saves of ``state_dict`` into ``folder`` (the folder the
    checkpoint ids are in, ``<folder>/step-N``; ``flashckpt://...`` or ``flashckpt::s3://...`` for
    saves through the protocol): open the run over the folder's store (its saver starts), and size this rank's
    shared-memory slots for the save in the background, so that the first ``dcp.save``
    blocks only for its copy, as the later ones do. Nothing is saved. A chained folder takes
    its store's client options as ``url_to_fs`` does (``prepare(state, "flashckpt::s3://b/run",
    s3={...})``): they become this process's and its saver's, as a save's through the protocol.

    Call it once the state exists (model and optimizer built, their state dict as it will
    be saved) and before the first save; a load through :class:`FlashStorageReader` does
    this itself. ``store``, ``options``, ``process_group`` and shorthands: as the writer's
    (the run must be opened with the writer's options; through the protocol, fsspec's
    storage options are taken when none are given); ``planner``: the save's, if not DCP's
    default. A collective: all ranks must call this, each with its state dict. Not with
    ``dcp.async_save``'s process executor: its checkpoint process saves and holds the run, so
    the trainer must not (as after a load there, call :func:`~flashckpt.dcp.close` first).
    """
    text = os.fspath(folder)
    if text.startswith(f"{PROTOCOL}:"):
        text = folder_of(text)
        _use_client_options(os.fspath(folder), shorthands)
        if options is None and not shorthands:
            import fsspec

            options = fsspec.filesystem(PROTOCOL).options
    checkpoint_id = normalize_id(os.path.join(text, "_"))  # the store of every id in folder
    run_store = store_of(checkpoint_id, store)
    check_store_free(run_store)
    run = run_for(run_store, options, process_group, **shorthands)
    run.writing()
    coordinator = run.rank == 0
    planner = planner or DefaultSavePlanner()
    planner.set_up_planner(_plain(state_dict), None, coordinator)
    plan = planner.create_local_plan()
    tree, _ = rank_tree(checkpoint_id, run.rank, plan, planner)
    if coordinator:  # the .metadata the coordinator's save also holds
        tree["dcp"]["metadata"] = torch.empty(_metadata_bound(plan, run.world_size), dtype=torch.uint8)
    run.engine.prepare_for(tree)


def _use_client_options(url: str, shorthands: dict[str, Any]) -> None:
    """Take a chain's client options (``s3={...}`` for ``flashckpt::s3://...``) out of
    ``shorthands`` and give them to the store's client; any other keyword stays, to be
    refused as an unknown option (a local folder takes no client options)."""
    if not url.startswith(CHAINED):
        return
    scheme = url[len(CHAINED):].split("://", 1)[0]
    if scheme in OBJECT_SCHEMES and scheme in shorthands:
        _client_options.use(scheme, shorthands.pop(scheme))


def _plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict as ``dcp.save`` plans it: each ``Stateful`` value as its state dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _metadata_bound(plan: Any, world_size: int) -> int:
    """About the bytes (rather more than fewer) of the pickled ``.metadata`` of a save whose
    every rank plans what this one does."""
    return (len(pickle.dumps([item.index.fqn for item in plan.items])) + len(plan.items) * _ITEM_METADATA) * \
        max(world_size, 1) + (64 << 10)
