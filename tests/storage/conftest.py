"""Fixtures of the storage contract: one location per storage kind, each with raw access
to damage it, the ranks a save of each run writes there, the moto S3 server of
``tests/objectstore``, and the test suite's own backend (``dirstore://``,
:mod:`tests.storage._dirstore`) registered in this process and declared as an entry
point for the saver's.

The ``node-local`` kind is one node's own directory in node-local mode (see
``flashckpt.replicas._node_local``): node :data:`NODE` of a ring of one rank per node,
whose directory commits the shards of its own rank and its ring predecessor's (they
arrive as peer replicas), as the scope each run records there says. A save to it writes
those ranks only; with three or more ranks, a strict part of the world."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable

import pytest

from flashckpt.replicas._node_local import write_scope
from flashckpt.storage import register
from flashckpt.storage._local import LocalStorage
from flashckpt.storage._url import open_storage
from tests.objectstore.conftest import bucket, moto_server, s3, url  # noqa: F401 (fixtures)

from ._dirstore import SCHEME, open_dirstore

KINDS = ("local", "memory", "s3", "dirstore", "node-local")
NODE = 1
"""The node whose directory the ``node-local`` kind is (its rank is ``NODE``)."""
_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def entry_points_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the distribution metadata that declares ``dirstore`` an entry
    point of group ``flashckpt.storage``: on a process's path, it finds the scheme."""
    top = tmp_path_factory.mktemp("entry-points")
    info = top / "flashckpt_test_dirstore-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashckpt-test-dirstore\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[flashckpt.storage]\n{SCHEME} = tests.storage._dirstore:open_dirstore\n")
    return top


@pytest.fixture
def dirstore(entry_points_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dirstore://`` known here (registered) and in subprocesses (the entry point on their path)."""
    register(SCHEME, open_dirstore)
    paths = [str(entry_points_dir), str(_REPO), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))


class Raw:
    """Bytes of a storage's objects by name, around its policy (to damage them)."""

    def __init__(self, storage) -> None:
        self.storage = storage

    def put(self, name: str, data: bytes) -> None:
        if isinstance(self.storage, LocalStorage):
            Path(self.storage.root, name).write_bytes(data)
        else:
            self.storage.backend.write(name, memoryview(data))

    def get(self, name: str) -> bytes:
        if isinstance(self.storage, LocalStorage):
            return Path(self.storage.root, name).read_bytes()
        return self.storage.backend.read_small(name, 1 << 30)


@pytest.fixture(params=KINDS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh checkpoint location of each storage kind."""
    kind = request.param
    if kind == "local":
        return str(tmp_path / "ckpt")
    if kind == "node-local":
        return str(tmp_path / f"node-{NODE}" / "ckpt")
    if kind == "memory":
        return f"memory://box-{uuid.uuid4().hex[:8]}/run"
    if kind == "s3":
        return request.getfixturevalue("url")
    request.getfixturevalue("dirstore")
    return f"{SCHEME}://{tmp_path}/ckpt"


@pytest.fixture
def storage(location: str):
    """The location's storage, proven writable (a local directory is created)."""
    opened = open_storage(location)
    opened.check_writable()
    return opened


@pytest.fixture
def raw(storage) -> Raw:
    return Raw(storage)


@pytest.fixture
def scope(request: pytest.FixtureRequest, storage) -> Callable[[str, int], list[int]]:
    """``scope(token, world)``: the ranks whose shards a save of run ``token`` with ``world``
    ranks commits in this location: every rank, or in a node-local directory those of its
    scope (recorded there first, as the engine does when the run starts)."""
    if request.node.callspec.params.get("location") != "node-local":
        return lambda token, world: list(range(world))

    def node_scope(token: str, world: int) -> list[int]:
        ranks = sorted({NODE % world, (NODE - 1) % world})
        write_scope(storage.root, token, ranks)
        return ranks
    return node_scope
