"""The flash DCP writer and reader on Azure (``az://``, Azurite) and GCS (``gs://``,
gcp-storage-emulator) checkpoint ids, as ``test_dcp_object_store.py`` does for S3: the save
loads from memory; once persisted the store holds the flash step under ``<parent>/.flashckpt``
and the stock files under the id, which stock ``dcp.load`` (DCP's FsspecReader over adlfs or
gcsfs, no flashckpt) reads; a new run reads the committed shards; DCP's process executor
saves to an ``az://`` id; ``prepare`` readies the first save into an ``az://`` folder."""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest
import torch.distributed.checkpoint as dcp

from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, Latest, close, latest_checkpoint, prepare
from flashckpt.dcp._run import run_for
from flashckpt.memory import _slot
from tests.objectstore._azurite import azurite, container  # noqa: F401 -- fixtures
from tests.objectstore.test_object_gcs import SETTINGS, gcs_server  # noqa: F401 -- fixture

from .._fork import run_ranks
from . import _ranks
from ._common import blank as _blank, equal as _equal, state as _state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def gs_bucket(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> str:  # noqa: F811
    """A new bucket on the GCS emulator, fsspec configured for it here (the saver finds it
    through the environment ``gcs_server`` set)."""
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "gs", dict(SETTINGS))
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs").mkdir(name)
    return name


@pytest.fixture(params=["az", "gs"])
def run(request: pytest.FixtureRequest) -> str:
    """A run's folder in a new Azure container or GCS bucket."""
    where = request.getfixturevalue("container" if request.param == "az" else "gs_bucket")
    return f"{request.param}://{where}/run"


def _names(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    try:
        return sorted(p.rsplit("/", 1)[1] for p in fs.find(path))
    except FileNotFoundError:
        return []


def _wait_for(url: str, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while name not in _names(url):
        assert time.monotonic() < deadline, f"{url}/{name} did not appear within {timeout:g}s"
        time.sleep(0.1)


def test_a_save_to_azure_or_gcs_is_stock_dcp_there(run):
    url = f"{run}/step-1"
    saved = _state(1)
    try:
        dcp.save(saved, storage_writer=FlashStorageWriter(url))
        assert latest_checkpoint(run) == Latest(1, url, "memory")
        loaded, reader = _blank(), FlashStorageReader(url)
        dcp.load(loaded, storage_reader=reader)
        assert (reader.last_load.source, reader.last_load.step) == ("memory", 1) and _equal(loaded, saved)
        close()  # persisted and committed; the export follows
        _wait_for(url, ".metadata")
        assert _names(url) == [".metadata", "__0_0.distcp"]
        assert "metadata.json" in _names(f"{run}/.flashckpt/step-1")
        stock = _blank()
        dcp.load(stock, checkpoint_id=url, no_dist=True)  # DCP's FsspecReader: adlfs or gcsfs, no flashckpt
        assert _equal(stock, saved)

        assert latest_checkpoint(run) == Latest(1, url, "storage")  # a new run: nothing in memory
        loaded, reader = _blank(), FlashStorageReader(url)
        dcp.load(loaded, storage_reader=reader)
        assert reader.last_load.source == "storage" and _equal(loaded, saved)
    finally:
        close()


def test_async_save_with_the_process_executor_on_azure(container):  # noqa: F811
    """DCP's checkpoint process holds the run on an ``az://`` id (it finds Azurite through
    ``FSSPEC_AZ``, as the saver does); a new process loads the save from memory."""
    root = f"az://{container}/run"
    saved = run_ranks(_ranks.async_save_in_a_process, 1, root)
    loaded = run_ranks(_ranks.load_step_4, 1, root)
    assert loaded == [{"w": saved[0], "epoch": 4, "source": "memory"}]


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
def test_prepare_on_an_object_store_folder_readies_the_first_save(container, populates):  # noqa: F811
    """``prepare(state, "az://...")`` opens the run over ``<folder>/.flashckpt`` and sizes the
    slots: the first save maps no fresh memory."""
    folder = f"az://{container}/run"
    state = _state(1)
    try:
        prepare(state, folder)
        run_for(f"{folder}/.flashckpt", None).engine.slots.prepared()  # training runs before the first save
        before = len(populates)
        dcp.save(state, storage_writer=FlashStorageWriter(f"{folder}/step-1"))
        assert populates[before:] == [], "the first save after prepare populated slot pages itself"
    finally:
        close()
    _wait_for(f"{folder}/step-1", ".metadata")
