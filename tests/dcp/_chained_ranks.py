"""What the processes of the chained-protocol tests on Azure and GCS run (forked workers of
``tests._fork``): DCP's stock fsspec writer and reader on a ``flashckpt::az://`` or
``flashckpt::gs://`` id, the store's client options given only per call (``az={...}``,
``gs={...}``, the fsspec way for a chain)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import blank, equal, state


def _source(url: str, name: str) -> str | None:
    import fsspec

    return fsspec.filesystem("flashckpt").last_source(f"{url}/{name}")


def save_load_then_die(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    """Save step 1 to ``url``, load it back from memory in this process, then ``kill -9``
    (the saver persists and exports the step in the background)."""
    dcp.save(state(1), storage_writer=FsspecWriter(url, **options))
    loaded = blank()
    dcp.load(loaded, storage_reader=FsspecReader(url, **options))
    assert equal(loaded, state(1)), "the load in the saving process read other values"
    sources = [_source(url, name) for name in (".metadata", "__0_0.distcp")]
    assert sources == ["memory", "memory"], sources
    os.kill(os.getpid(), signal.SIGKILL)


def load(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """A new process lists the run of ``url`` (memory's steps first) and loads ``url``;
    what it listed, whether the values are right and where they came from."""
    from fsspec.core import url_to_fs

    from flashckpt.dcp import close

    fs, root = url_to_fs(url.rsplit("/", 1)[0], **options)
    listed = [p for p in fs.ls(root, detail=False) if "/step-" in p]
    loaded = blank()
    dcp.load(loaded, storage_reader=FsspecReader(url, **options))
    found = {"listed": listed, "same": equal(loaded, state(1)),
             "sources": [_source(url, name) for name in (".metadata", "__0_0.distcp")]}
    close()
    return found

