"""The chained form of the ``flashckpt://`` protocol, an object store behind it
(``flashckpt::s3://bucket/run/step-N``), on moto's S3 server (the object-store tests'
fixtures): ``dcp.save`` / ``dcp.load`` with only that id, a listing that shows memory's
steps first, the stock DCP layout in the bucket once persisted (stock ``dcp.load`` of the
``s3://`` id reads it), 2 gloo ranks killed after a returned save then restarted from
memory, the inner protocol's storage options reaching the store and the saver, the
``file://`` chain as the local form, and bad input."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import fsspec.config
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import flashckpt
from flashckpt.dcp import close, prepare
from flashckpt.dcp._run import run_for
from flashckpt.memory import _slot
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3, s3_config, use_endpoint  # noqa: F401 -- fixtures

from . import _protocol  # noqa: F401  registers flashckpt://
from . import _protocol_ranks
from ._common import blank, equal, killed_then_restarted, object_names as _names, state, wait_for_object

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


def test_save_list_load_then_the_bucket_holds_stock_dcp(bucket, monkeypatch):
    """One process, persisting only at close: the listing of the run shows the steps memory
    holds before the bucket has them, a load reads memory; after close the bucket holds
    exactly the stock layout under the id, which stock ``dcp.load`` of the ``s3://`` id reads,
    and the protocol then reads the files from the bucket."""
    monkeypatch.setitem(fsspec.config.conf, "flashckpt", {"persist_every": 1000})
    run = f"s3://{bucket}/run"
    for step in (1, 2):
        dcp.save(state(step), checkpoint_id=f"flashckpt::{run}/step-{step}")
    fs, root = url_to_fs(f"flashckpt::{run}")
    listed = fs.ls(root, detail=False)
    assert [p for p in listed if "/step-" in p] == [f"{run}/step-1", f"{run}/step-2"], listed
    assert fs.info(f"{run}/step-2")["type"] == "directory" and fs.exists(f"flashckpt::{run}/step-2/.metadata")
    assert _names(raw_fs(), f"{run}/step-2") == []  # memory only: nothing in the bucket yet
    url = f"flashckpt::{run}/step-2"
    loaded = blank()
    dcp.load(loaded, checkpoint_id=url)
    assert equal(loaded, state(2))
    assert fs.last_source(f"{url}/.metadata") == fs.last_source(f"{url}/__0_0.distcp") == "memory"

    close()  # the newest step persisted and committed; the export follows
    wait_for_object(raw_fs(), f"{run}/step-2/.metadata")
    assert _names(raw_fs(), f"{run}/step-2") == [".metadata", "__0_0.distcp"]
    stock = blank()
    dcp.load(stock, checkpoint_id=f"{run}/step-2", no_dist=True)  # DCP's FsspecReader over s3fs, no flashckpt
    assert equal(stock, state(2))
    loaded = blank()
    dcp.load(loaded, checkpoint_id=url)  # memory freed: the files in the bucket
    assert equal(loaded, state(2)) and fs.last_source(f"{url}/__0_0.distcp") == "storage"


@pytest.fixture(scope="module")
def killed_then_restored(moto_server):
    """2 ranks save steps 1..3 through ``flashckpt::s3://<bucket>/run`` and are killed; 2 new
    ranks list the run, pick the newest step and load it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        conf = use_endpoint(moto_server.endpoint, monkeypatch)
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        fsspec.filesystem("s3", **conf).mkdir(name)
        run = f"s3://{name}/run"
        yield run, killed_then_restarted(f"flashckpt::{run}", _protocol_ranks.save_then_die, _protocol_ranks.restore)


def test_two_ranks_killed_after_a_returned_save_restart_from_memory(killed_then_restored):
    _protocol_ranks.check_restored(killed_then_restored[1])


def test_two_ranks_leave_stock_files_the_stock_reader_loads(killed_then_restored, s3):
    run, _ = killed_then_restored
    wait_for_object(raw_fs(), f"{run}/step-3/.metadata")  # the dead trainers' saver persisted and exported it
    assert _names(raw_fs(), f"{run}/step-3") == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = {"model": {"emb": torch.zeros(10, 6), "bias": torch.zeros(6)}, "step": 0}
    dcp.load(loaded, checkpoint_id=f"{run}/step-3", no_dist=True)
    want = _protocol_ranks.full(3)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["emb"], want["emb"])


def _given_per_call_only(moto_server, monkeypatch) -> tuple[dict, object]:
    """No fsspec configuration names the server: the ``s3={...}`` to give per call, the
    fsspec way for a chain, and an s3fs client of the server to look at the bucket."""
    from flashckpt.storage import _client_options

    monkeypatch.setattr(_client_options, "_OPTIONS", {})
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    monkeypatch.delenv("FSSPEC_S3", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fsspec.get_filesystem_class("flashckpt").clear_instance_cache()  # a cached one was given options already
    conf = s3_config(moto_server.endpoint)
    options = {"s3": {"client_kwargs": {"endpoint_url": conf.pop("endpoint_url")}, **conf}}
    return options, fsspec.filesystem("s3", skip_instance_cache=True, **options["s3"])


def test_storage_options_of_the_inner_protocol_reach_the_store(moto_server, monkeypatch):
    """Only ``storage_options={"s3": {...}}`` given to DCP's fsspec writer and reader reach
    this process's store and the saver, which persists and writes the stock files."""
    options, direct = _given_per_call_only(moto_server, monkeypatch)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    direct.mkdir(name)
    url = f"flashckpt::s3://{name}/run/step-5"
    dcp.save(state(5), storage_writer=FsspecWriter(url, **options))
    loaded = blank()
    dcp.load(loaded, storage_reader=FsspecReader(url, **options))
    assert equal(loaded, state(5))
    assert json.loads(os.environ.get("FSSPEC_S3", "{}")) == {}  # the process's configuration is left alone
    close()
    wait_for_object(direct, f"s3://{name}/run/step-5/.metadata")
    assert _names(direct, f"s3://{name}/run/step-5") == [".metadata", "__0_0.distcp"]
    loaded = blank()
    dcp.load(loaded, storage_reader=FsspecReader(url, **options))  # from the bucket, memory freed
    assert equal(loaded, state(5)) and fsspec.filesystem("flashckpt").last_source(f"{url}/.metadata") == "storage"


def test_a_file_chain_is_the_local_form(tmp_path):
    dcp.save(state(6), checkpoint_id=f"flashckpt::file://{tmp_path}/step-6")
    loaded = blank()
    dcp.load(loaded, checkpoint_id=f"flashckpt://{tmp_path}/step-6")
    assert equal(loaded, state(6))
    assert fsspec.filesystem("flashckpt").last_source(f"flashckpt://{tmp_path}/step-6/.metadata") == "memory"


@pytest.mark.parametrize("bad, says", [
    ("flashckpt::s3://key:secret@bucket-x/run/step-1", "credentials never go into the URL"),
    ("flashckpt::s3://bucket-x/run/step-1?versionId=3", "query"),
    ("flashckpt::ftp://host/run/step-1", "not a ftp:// location"),
    ("flashckpt::s3://Bad_Bucket/run/step-1", "not a valid bucket name"),
])
def test_a_bad_chained_url_is_a_clear_error(bad, says):
    """Refused when DCP first looks at the id, before anything is written."""
    for call in (lambda: dcp.save(state(1), checkpoint_id=bad), lambda: dcp.load(blank(), checkpoint_id=bad)):
        with pytest.raises(flashckpt.CheckpointError, match=says):
            call()


def test_an_inner_protocol_fsspec_does_not_know():
    """fsspec refuses ``flashckpt::nosuch://`` before flashckpt's file system is made (it
    looks up the inner protocol first; DCP reads its ValueError as "not mine"), so
    ``dcp.save`` says only what DCP says; flashckpt's own entry points name the scheme."""
    url = "flashckpt::nosuch://b/run"
    with pytest.raises(RuntimeError, match="Cannot detect which StorageReader or StorageWriter"):
        dcp.save(state(1), checkpoint_id=f"{url}/step-1")
    with pytest.raises(flashckpt.CheckpointError, match="unknown scheme 'nosuch'"):
        prepare(state(1), url)


def test_a_missing_bucket_is_a_clear_error(s3):
    url = "flashckpt::s3://no-such-bucket-chain/run/step-1"
    for call in (lambda: dcp.save(state(1), checkpoint_id=url), lambda: dcp.load(blank(), checkpoint_id=url)):
        with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
            call()
        assert "no-such-bucket-chain/run/" in str(failed.value), failed.value
        assert "its bucket does not exist" in str(failed.value), failed.value


@pytest.mark.skipif(not _slot._POPULATE_WRITE, reason="the kernel lacks MADV_POPULATE_WRITE")
@pytest.mark.parametrize("given", ["configured", "per call"])
def test_prepare_on_a_chained_folder_readies_the_first_save(given, moto_server, monkeypatch, populates):
    """``prepare(state, "flashckpt::s3://<bucket>/run")`` opens the run over the bucket's
    ``run/.flashckpt`` and sizes the slots: the first save through the chained id maps no
    fresh memory, and the saver exports it into the bucket. The client options come from
    fsspec's configuration, or only per call (``s3={...}``, as ``url_to_fs`` takes them)."""
    if given == "configured":
        options, direct = {}, fsspec.filesystem("s3", **use_endpoint(moto_server.endpoint, monkeypatch))
    else:
        options, direct = _given_per_call_only(moto_server, monkeypatch)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    direct.mkdir(name)
    folder = f"s3://{name}/run"
    prepare(state(1), f"flashckpt::{folder}", **options)
    run_for(f"{folder}/.flashckpt", None).engine.slots.prepared()  # training runs before the first save
    before = len(populates)
    dcp.save(state(1), storage_writer=FsspecWriter(f"flashckpt::{folder}/step-1", **options))
    assert populates[before:] == [], "the first save after prepare populated slot pages itself"
    close()
    wait_for_object(direct, f"{folder}/step-1/.metadata")
    assert _names(direct, f"{folder}/step-1") == [".metadata", "__0_0.distcp"]
