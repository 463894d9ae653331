"""Azure Blob Storage's emulator for the object-store tests: Azurite, Microsoft's own, an npm
package (``make test`` installs it into .venv/azurite), started once per session on a free
loopback port (the fixtures are imported into ``conftest.py``). Clients find it as a user's
would: fsspec's configuration (``FSSPEC_AZ`` in the environment of subprocesses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .._net import free_port, wait_for_http

AZURITE = Path(__file__).resolve().parents[2] / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account (published in its documentation)."""


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's blob service on a free loopback port; its connection string."""
    command = os.environ.get("AZURITE_BLOB", str(AZURITE))
    if shutil.which(command) is None:
        pytest.fail(f"Azurite is missing ({command}): `make test` installs it (make .venv/azurite/node_modules/"
                    ".bin/azurite-blob), or set AZURITE_BLOB to an azurite-blob command")
    port = free_port()
    proc = subprocess.Popen([command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent", "--loose",
                             "--skipApiVersionCheck", "--disableTelemetry", "--location", str(tmp_path_factory.mktemp("azurite"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    wait_for_http(proc, f"{endpoint}?comp=list", "Azurite")  # up when it refuses an unsigned request
    try:
        yield f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={endpoint};"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def container(azurite: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new container, with fsspec configured for Azurite here and in subprocesses (the saver)."""
    import fsspec
    import fsspec.config

    conf = {"connection_string": azurite}
    monkeypatch.setitem(fsspec.config.conf, "az", conf)
    monkeypatch.setenv("FSSPEC_AZ", json.dumps(conf))
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("az").mkdir(name)
    return name
