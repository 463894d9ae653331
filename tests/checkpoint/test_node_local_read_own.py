"""A node-local restore that reads a rank's shard from its own node's directory into its
memory slot gets the committed bytes, verified: a damaged shard is an error naming the file,
and nothing is marked complete."""

from types import SimpleNamespace

import pytest

from flashckpt._errors import CorruptCheckpointError
from flashckpt.restore._node_local import _read_own
from flashckpt.storage._local import LocalStorage

from .test_storage_lineage import commit, image, token

TOK = token(1_000)


def _sources(storage: LocalStorage, slot: bytearray, recorded: list) -> SimpleNamespace:
    """One rank whose slot writer fills ``slot`` and records what ``into`` and ``done`` saw."""
    def slot_writer(step: int):
        def into(size: int, info: dict) -> memoryview:
            recorded.append(("into", step, size, info["token"]))
            slot[:] = bytes(size)
            return memoryview(slot)

        return into, lambda: recorded.append(("done", step))
    return SimpleNamespace(storage=storage, placement=SimpleNamespace(storage_rank=0),
                           replicas=SimpleNamespace(slot_writer=slot_writer))


def test_reading_the_own_directory_fills_the_slot_with_the_committed_shard(tmp_path):
    storage = LocalStorage(str(tmp_path))
    assert commit(storage, 4, TOK, branch=-1)
    slot, recorded = bytearray(), []
    _read_own(_sources(storage, slot, recorded), 4)
    want = bytes(image(4, TOK))
    assert bytes(slot) == want and recorded == [("into", 4, len(want), TOK), ("done", 4)]


def test_a_damaged_shard_in_the_own_directory_is_an_error_naming_it_and_no_copy_completes(tmp_path):
    storage = LocalStorage(str(tmp_path))
    assert commit(storage, 4, TOK, branch=-1)
    path = tmp_path / "step-4" / "rank-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    recorded: list = []
    with pytest.raises(CorruptCheckpointError, match="rank-0.safetensors"):
        _read_own(_sources(storage, bytearray(), recorded), 4)
    assert ("done", 4) not in recorded
