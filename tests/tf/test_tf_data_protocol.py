"""``flashckpt`` never imports ``elastic``: the TF adapters take the data positions through
``flashckpt.tf.DataPositions``, a protocol that ``elastic.tf.ShardPositions`` satisfies."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_no_flashckpt_module_imports_elastic():
    found = []
    for path in sorted((ROOT / "flashckpt").rglob("*.py")):
        for name in _imported(ast.parse(path.read_text(), str(path))):
            if name == "elastic" or name.startswith("elastic."):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == []


def test_importing_every_tf_adapter_leaves_elastic_unimported():
    pytest.importorskip("tensorflow")
    code = ("import sys, flashckpt.tf._checkpointer, flashckpt.tf._callback, flashckpt.tf._hook\n"
            "print(sorted(m for m in sys.modules if m == 'elastic' or m.startswith('elastic.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_shard_positions_and_their_dataset_satisfy_the_protocol():
    pytest.importorskip("tensorflow")
    import sharding
    from elastic.tf import ShardPositions
    from flashckpt.tf import DataPositions
    from flashckpt.tf._common import positions_of

    ds = sharding.connect(f"memory://{uuid.uuid4().hex}").dataset("d", size=10, shard_size=5)
    positions = ShardPositions(ds, "w")
    assert isinstance(positions, DataPositions)
    assert positions_of(positions) is positions and positions.deferred
    with pytest.raises(TypeError, match="ShardDataset or ShardPositions"):
        positions_of(object())
