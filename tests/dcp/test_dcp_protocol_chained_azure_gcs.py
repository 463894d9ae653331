"""The chained ``flashckpt://`` protocol with Azure (``flashckpt::az://``, Azurite) and GCS
(``flashckpt::gs://``, gcp-storage-emulator) behind it, as ``test_dcp_protocol_chained.py``
does for S3, and ``dcp.async_save`` on a chained S3 id.

On Azure and GCS the store's client options are given only per call (``az={...}``,
``gs={...}`` to DCP's stock ``FsspecWriter`` / ``FsspecReader``; no fsspec configuration or
``FSSPEC_*`` variable names the emulator): a process saves, loads from memory and is killed;
a new process loads from memory; the saver, which got the options from the process that
started it, persists and exports the stock files, which stock DCP over adlfs or gcsfs reads,
and the chain reads them once memory is freed. A missing container or bucket is a clear
error."""

from __future__ import annotations

import uuid
from typing import Any

import fsspec
import fsspec.config
import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from flashckpt.dcp import close
from tests.objectstore._azurite import azurite  # noqa: F401 -- fixture
from tests.objectstore.conftest import bucket, moto_server, raw_fs, s3  # noqa: F401 -- fixtures
from tests.objectstore.test_object_gcs import SETTINGS, gcs_server  # noqa: F401 -- fixture

from . import _chained_ranks
from . import _protocol  # noqa: F401  registers flashckpt://
from ._common import blank, equal, killed_then_restarted, object_names, state, wait_for_object

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _closed():
    yield
    close()


@pytest.fixture
def per_call(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """``(scheme, options)``: a new Azure container or GCS bucket, its client's options, and
    nothing else that names the emulator (fsspec's configuration, ``FSSPEC_AZ``/``FSSPEC_GS``,
    ``STORAGE_EMULATOR_HOST``, options flashckpt kept from earlier tests)."""
    from flashckpt.storage import _client_options

    scheme = request.param
    if scheme == "az":
        options = {"connection_string": request.getfixturevalue("azurite")}
    else:
        options = {**SETTINGS, "endpoint_url": request.getfixturevalue("gcs_server")}
    monkeypatch.setattr(_client_options, "_OPTIONS", {})
    for name in ("az", "gs"):
        monkeypatch.delitem(fsspec.config.conf, name, raising=False)
    for var in ("FSSPEC_AZ", "FSSPEC_GS", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(var, raising=False)
    where = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem(scheme, skip_instance_cache=True, **options).mkdir(where)
    return f"{scheme}://{where}/run", {scheme: options}


@pytest.mark.parametrize("per_call", ["az", "gs"], indirect=True)
def test_saved_loaded_from_memory_then_stock_files_with_options_per_call(per_call):
    run, options = per_call
    scheme = run.partition("://")[0]
    url = f"flashckpt::{run}/step-1"
    results = killed_then_restarted(url, _chained_ranks.save_load_then_die, _chained_ranks.load, world=1,
                                    args=(options,))
    assert results == [{"listed": [f"{run}/step-1"], "same": True, "sources": ["memory", "memory"]}]

    direct = fsspec.filesystem(scheme, skip_instance_cache=True, **options[scheme])
    wait_for_object(direct, f"{run}/step-1/.metadata")  # the saver's export, with the options it was given
    assert object_names(direct, f"{run}/step-1") == [".metadata", "__0_0.distcp"]
    stock = blank()
    dcp.load(stock, storage_reader=FsspecReader(f"{run}/step-1", **options[scheme]), no_dist=True)  # no flashckpt
    assert equal(stock, state(1))
    loaded = blank()
    dcp.load(loaded, storage_reader=FsspecReader(url, **options))  # through the chain: memory freed, the files
    assert equal(loaded, state(1)) and fsspec.filesystem("flashckpt").last_source(f"{url}/.metadata") == "storage"


@pytest.mark.parametrize("per_call", ["az", "gs"], indirect=True)
def test_a_missing_container_or_bucket_is_a_clear_error(per_call):
    """As for S3: the message says the container or bucket is missing (inside DCP's
    ``CheckpointException``, a BaseException), without the service's XML reply."""
    _, options = per_call
    url = f"flashckpt::{next(iter(options))}://no-such-bucket-chain/run/step-1"
    for call in (lambda: dcp.save(state(1), storage_writer=FsspecWriter(url, **options)),
                 lambda: dcp.load(blank(), storage_reader=FsspecReader(url, **options))):
        with pytest.raises(BaseException) as failed:
            call()
        message = str(failed.value)
        assert "no-such-bucket-chain/run/" in message and "its bucket does not exist" in message, message
        assert "<?xml" not in message, message


def test_async_save_to_a_chained_s3_id_then_load(bucket):
    """DCP's thread executor: its stager's copy, then the flash save in DCP's thread; training
    changing the state once ``async_save`` returned changes nothing saved."""
    url = f"flashckpt::s3://{bucket}/run/step-7"
    training = state(7)
    saving = dcp.async_save(training, checkpoint_id=url, async_checkpointer_type=AsyncCheckpointerType.THREAD)
    training["w"].add_(1.0)
    saving.result()
    loaded = blank()
    dcp.load(loaded, checkpoint_id=url)
    assert equal(loaded, state(7))
    assert fsspec.filesystem("flashckpt").last_source(f"{url}/__0_0.distcp") == "memory"
    close()
    wait_for_object(raw_fs(), f"s3://{bucket}/run/step-7/.metadata")
    assert object_names(raw_fs(), f"s3://{bucket}/run/step-7") == [".metadata", "__0_0.distcp"]

