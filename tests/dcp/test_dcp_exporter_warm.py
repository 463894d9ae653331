"""The saver imports the DCP exporter (torch: seconds) when a run opens, not at its first
export: saves in quick succession would otherwise wait for that import, their slots held
by exports queued behind it."""

from __future__ import annotations

import os
import time

import pytest

from flashckpt import _names
from flashckpt.dcp import FlashStorageReader, close

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_the_saver_loads_the_dcp_exporter_before_any_save(tmp_path):
    FlashStorageReader(tmp_path / "step-1")  # opens the run over tmp_path/.flashckpt (a writer: at its first write)
    log = _names.saver_log_path(_names.default_job_id(str(tmp_path / ".flashckpt")))
    try:
        deadline = time.monotonic() + 90
        while True:
            text = open(log).read() if os.path.exists(log) else ""
            if "loaded the exporter flashckpt.dcp._export" in text:
                break
            assert time.monotonic() < deadline, f"the saver did not load the DCP exporter; its log:\n{text}"
            time.sleep(0.2)
    finally:
        close()
