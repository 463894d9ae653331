"""Checkpoint locations: local paths, file:// and object-store URLs; bad ones are clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flashckpt import CheckpointError
from flashckpt.storage._local import LocalStorage
from flashckpt.storage._location import is_url, parse_location
from flashckpt.storage._url import open_storage


@pytest.mark.parametrize("text, scheme, path", [
    ("s3://bucket-1/run/a", "s3", "bucket-1/run/a"),
    ("s3://bucket-1/run/a/", "s3", "bucket-1/run/a"),
    ("S3://bucket-1", "s3", "bucket-1"),
    ("gs://my_bucket/x", "gs", "my_bucket/x"),
    ("memory://box/run", "memory", "box/run"),
])
def test_object_urls(text, scheme, path):
    where = parse_location(text)
    assert (where.scheme, where.path, where.url) == (scheme, path, f"{scheme}://{path}")
    assert is_url(text)


@pytest.mark.parametrize("text, path", [
    ("/ckpt/run", "/ckpt/run"),
    ("file:///ckpt/run", "/ckpt/run"),
    ("file://localhost/ckpt/a%20b", "/ckpt/a b"),
])
def test_local_locations(text, path):
    where = parse_location(text)
    assert (where.scheme, where.path, where.url) == ("", path, None)
    assert isinstance(open_storage(text), LocalStorage) and open_storage(text).root == path


def test_relative_and_colon_paths_are_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_location("runs/a").path == str(tmp_path / "runs/a")
    assert parse_location("./odd:name").path == str(tmp_path / "odd:name")


@pytest.mark.parametrize("text, says", [
    ("s3:/bucket/x", "s3://bucket/prefix"),
    ("s3:bucket", "s3://bucket/prefix"),
    ("s3://", "no bucket"),
    ("s3:///x", "no bucket"),
    ("s3://Bad_Bucket/x", "not a valid bucket"),
    ("s3://b/x", "not a valid bucket"),
    ("s3://bucket//x", "empty"),
    ("s3://bucket/../x", "'..'"),
    ("s3://key:secret@bucket/x", "credentials never go into the URL"),
    ("s3://bucket/x?versionId=1", "query"),
    ("s3://bucket/run*", "patterns"),  # s3fs expanded it: retention deleted run-a's steps too
    ("s3://bucket/r[1]", "patterns"),
    ("hdfs2://bucket/x", "unknown scheme 'hdfs2'"),
    ("ckpt:v1", "unknown scheme 'ckpt'"),
    ("file://otherhost/x", "no host but this machine"),
    ("file:relative", "file:///absolute/path"),
    ("", "empty"),
])
def test_bad_locations_name_the_input_and_what_is_accepted(text, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as err:
        open_storage(text)
    assert says in str(err.value) and repr(text) in str(err.value) and "accepted:" in str(err.value)
    assert "s3://bucket/prefix" in str(err.value)
    assert os.listdir(tmp_path) == []  # never a local directory named after the URL


def test_a_pathlike_that_looks_like_a_url_is_refused(tmp_path, monkeypatch):
    import pathlib

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="s3://bucket/prefix"):
        open_storage(pathlib.Path("s3://bucket/x"))  # pathlib collapses it to 's3:/bucket/x'
    assert os.listdir(tmp_path) == []


def test_parsing_imports_no_fsspec():
    code = "import sys, flashckpt.storage._url as u, flashckpt.storage._location as loc; " \
           "loc.parse_location('s3://bucket/x'); u.open_storage('/tmp/x'); " \
           "print(sorted(m for m in ('fsspec', 's3fs', 'botocore') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_checkpointer_refuses_a_malformed_url(tmp_path):
    code = textwrap.dedent("""
        import os, flashckpt
        from flashckpt.torch import Checkpointer
        try:
            Checkpointer("s3:/bucket/run", job_id="urltest").close()
        except flashckpt.CheckpointError as exc:
            print("refused:", exc)
        print("created:", sorted(os.listdir(".")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "FLASHCKPT_SHM_DIR": str(tmp_path)}).stdout
    assert "refused:" in out and "s3://bucket/prefix" in out
    assert not (tmp_path / "s3:").exists()
