"""How a load reads a shard object on a real S3 server: each byte fetched once, in few GETs."""

from __future__ import annotations

import threading
import time

from flashckpt.restore._shard_read import CHUNK_BYTES, ShardReader

from .conftest import image, proxy_to, token, use_endpoint
from .test_object_storage import save, store

MiB = 1 << 20


def counting(storage, monkeypatch) -> list[tuple[int, int]]:
    """The ranges of every GetObject of a shard's bytes ``storage``'s S3 client sends from now on."""
    gets: list[tuple[int, int]] = []
    real = storage.backend.fs._call_s3

    async def call_s3(method, *args, **kw):
        if method == "get_object" and "Range" in kw:
            lo, hi = kw["Range"].removeprefix("bytes=").split("-")
            gets.append((int(lo), int(hi) + 1))
        return await real(method, *args, **kw)

    monkeypatch.setattr(storage.backend.fs, "_call_s3", call_s3)
    return gets


def test_whole_and_ranged_loads_fetch_each_byte_once(url, monkeypatch):
    """A whole load (header parsed, then every chunk): the header's GET is not repeated by
    the first chunk, and a chunk is one GET. A resharding source (header, its check, one
    range): the first block once, then only the range's block."""
    storage = store(url)
    run = token()
    body = CHUNK_BYTES + 3 * MiB
    images = save(storage, 1, run, [body, 3 * MiB])
    gets = counting(storage, monkeypatch)
    with ShardReader(*storage.open_shard(1, 0)) as reader:
        out = bytearray(reader.size)
        reader.read_all([(0, memoryview(out))])
    assert out == images[0]
    fetched = sum(b - a for a, b in gets)
    assert fetched == len(images[0]), (fetched, len(images[0]), gets)
    chunks = -(-len(images[0]) // CHUNK_BYTES)
    assert len(gets) == 1 + chunks, gets  # the first block with the header, then one GET per chunk
    gets.clear()
    with ShardReader(*storage.open_shard(1, 1)) as reader:  # a resharding source: header, check, one range
        reader.verify_header()
        piece = bytearray(1000)
        reader.readinto(piece, reader.body_start + MiB + 10)
        assert piece == images[1][reader.body_start + MiB + 10:][:1000]
    assert gets == [(0, MiB), (MiB, 2 * MiB)], gets  # the first block once, then the block of the range


def test_the_tail_chunk_comes_with_the_chunk_before(url, monkeypatch):
    """A shard of one chunk plus its header: the reader's second chunk is the last few
    hundred bytes, fetched with the first chunk's GET (two GETs in all, when the first
    chunk's read starts first: always on one thread)."""
    storage = store(url)
    images = save(storage, 1, token(), [CHUNK_BYTES])
    gets = counting(storage, monkeypatch)
    for threads in (1, 8):
        gets.clear()
        with ShardReader(*storage.open_shard(1, 0)) as reader:
            out = bytearray(reader.size)
            reader.read_all([(0, memoryview(out))], threads=threads)
        assert out == images[0]
        assert sum(b - a for a, b in gets) == len(images[0]), gets
        assert len(gets) == 2 if threads == 1 else len(gets) in (2, 3), gets



def test_a_read_cut_mid_body_resumes(moto_server, url, monkeypatch):
    """The connection dies while a GET's body streams in (the relay in front of the server
    killed and started again): the read resumes from the byte it reached, exact."""
    storage = store(url)
    images = save(storage, 1, token(), [48 * MiB])
    with proxy_to(moto_server) as proxy:
        use_endpoint(proxy.endpoint, monkeypatch)
        reading = store(url)
        shard, record = reading.open_shard(1, 0)
        gets = counting(reading, monkeypatch)
        out = bytearray(record["size"])
        failed: list[BaseException] = []

        def read() -> None:
            try:
                shard.pread_into(out, 0)
            except BaseException as exc:
                failed.append(exc)

        reader = threading.Thread(target=read)
        start = proxy.sent_down
        reader.start()
        deadline = time.monotonic() + 30
        while proxy.sent_down - start < 8 * MiB and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert reader.is_alive(), "the read ended before the cut"
        proxy.kill()
        proxy.start()
        reader.join(60)
        assert not reader.is_alive() and failed == [], failed
    assert out == images[0]
    assert len(gets) >= 2 and gets[0][0] == 0 and 0 < gets[-1][0] < len(out), gets  # resumed, not restarted


def test_a_whole_read_declared_comes_in_one_get_per_chunk(url, monkeypatch):
    """``read_whole()`` before the reader opens: the header's read brings the whole first
    chunk, so a shard of one chunk is one GET, and a larger one a GET per chunk."""
    storage = store(url)
    images = save(storage, 1, token(), [CHUNK_BYTES, CHUNK_BYTES + 3 * MiB])
    gets = counting(storage, monkeypatch)
    for rank, expected in ((0, 1), (1, 2)):
        gets.clear()
        shard, record = storage.open_shard(1, rank)
        shard.read_whole()
        with ShardReader(shard, record) as reader:
            out = bytearray(reader.size)
            reader.read_all([(0, memoryview(out))])
        assert out == images[rank]
        assert sum(b - a for a, b in gets) == len(out) and len(gets) == expected, gets
