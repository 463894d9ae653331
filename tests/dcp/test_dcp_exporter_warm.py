"""The saver imports the DCP exporter (torch: seconds) at a run's first write, not at its
first export: saves in quick succession would otherwise wait for that import, their slots
held by exports queued behind it. A process that only reads never asks for it: the saver
would compete for CPU with the load."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flashckpt import _names
from flashckpt.dcp import FlashStorageReader, FlashStorageWriter, close
from flashckpt.saver._client import SaverClient

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def warmed(monkeypatch):
    """Exporters the trainers asked their saver to load ahead of an export."""
    names: list[str] = []
    real = SaverClient.warm_exporter

    def recorded(self, name):
        names.append(name)
        return real(self, name)

    monkeypatch.setattr(SaverClient, "warm_exporter", recorded)
    return names


def test_a_reader_does_not_have_the_saver_load_the_exporter(tmp_path, warmed):
    try:
        FlashStorageReader(tmp_path / "step-1")  # opens the run over tmp_path/.flashckpt
        assert warmed == []
    finally:
        close()


def test_the_saver_loads_the_dcp_exporter_at_the_first_write_before_any_export(tmp_path, warmed):
    log = _names.saver_log_path(_names.default_job_id(str(tmp_path / ".flashckpt")))
    try:
        # persist_every: the save stays in memory, so no export is due
        dcp.save({"w": torch.ones(4)}, storage_writer=FlashStorageWriter(tmp_path / "step-1", persist_every=100))
        assert warmed == ["dcp"]
        deadline = time.monotonic() + 90
        while True:
            text = open(log).read() if os.path.exists(log) else ""
            if "loaded the exporter flashckpt.dcp._export" in text:
                break
            assert time.monotonic() < deadline, f"the saver did not load the DCP exporter; its log:\n{text}"
            time.sleep(0.2)
    finally:
        close()
