"""Exporters register themselves under the entry-point group ``flashckpt.exporters``: the
saver runs one by its registered name only, a package (here the test suite) adds one with
no change to flashckpt, and missing registrations say to reinstall."""

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from flashckpt import CheckpointError
from flashckpt.saver import _exporters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as _f:
    OWN = sorted(tomllib.load(_f)["project"]["entry-points"][_exporters.GROUP])
"""flashckpt's own exporters, as its pyproject.toml registers them."""


def _dist_info(where, name: str, entry_points: str | None) -> str:
    """A distribution's metadata in ``where`` (what an install leaves), found on ``sys.path``."""
    info = where / f"{name.replace('-', '_')}-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)
    return str(where)


def _saver_side(code: str, where, *first_on_path: str) -> subprocess.CompletedProcess:
    """``code`` in a new process (as the saver is) in directory ``where``, ``first_on_path``
    ahead of the usual path (and the repository, for ``tests``, after it)."""
    path = os.pathsep.join([*first_on_path, os.environ.get("PYTHONPATH", ""), ROOT])
    return subprocess.run([sys.executable, "-c", "from flashckpt.saver import _exporters\n" + code], cwd=where,
                          env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True, timeout=120)


def test_an_exporter_a_package_registers_runs_by_its_name(tmp_path):
    tests_package = _dist_info(tmp_path / "site", "flashckpt-test-exporters",
                               "[flashckpt.exporters]\nprobe = tests.checkpoint._probe_exporter\n")
    out = tmp_path / "called.json"
    proc = _saver_side(f"print(sorted(_exporters.registered()))\n"
                       f"_exporters.run_exporter({{'name': 'probe', 'params': {{'out': {str(out)!r}}}}}, '/ckpt', 5)",
                       tmp_path, tests_package)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == str(sorted(OWN + ["probe"]))
    assert json.loads(out.read_text()) == {"directory": "/ckpt", "step": 5, "memory": False,
                                           "params": {"out": str(out), "allow_pickle": False}}


@pytest.mark.parametrize("name", ["flashckpt.deepspeed._export", "os", "nope", None])
def test_only_a_registered_name_runs_never_a_module_path(name):
    with pytest.raises(CheckpointError, match=r"unknown exporter .*registered: " + re.escape(str(OWN)) + ".*reinstall"):
        _exporters.run_exporter({"name": name}, "/ckpt", 1)
    assert not _exporters.reads_memory({"name": name})


def test_metadata_without_the_registrations_says_to_reinstall(tmp_path):
    stale = _dist_info(tmp_path / "stale", "flashckpt", None)  # an install older than the entry points
    proc = _saver_side("_exporters.run_exporter({'name': 'deepspeed', 'params': {}}, '/ckpt', 1)", tmp_path, stale)
    assert proc.returncode != 0
    assert "unknown exporter 'deepspeed'; registered: []" in proc.stderr and "reinstall" in proc.stderr, \
        proc.stderr[-3000:]
