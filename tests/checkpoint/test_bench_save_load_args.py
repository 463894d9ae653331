"""benchmarks/save_load.py --dir: a directory that does not exist yet is made; one that
cannot be made is a usage error naming it (not a traceback from deep in the run)."""

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_save_load", os.path.join(REPO, "benchmarks", "save_load.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_a_missing_dir_is_made(bench, tmp_path):
    missing = tmp_path / "not" / "yet"
    args = bench.parse_args(["--dir", str(missing), "--json", str(tmp_path / "out.json")])
    assert missing.is_dir() and args.dir == str(missing)


def test_a_dir_that_cannot_be_made_is_a_usage_error(bench, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--dir", str(tmp_path / "file" / "sub")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--dir" in err and str(tmp_path / "file" / "sub") in err
