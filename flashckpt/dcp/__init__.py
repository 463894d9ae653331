"""Flash checkpoints for callers of ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state, storage_writer=FlashStorageWriter(path))`` blocks only for one copy of
this rank's items into shared memory; flashckpt's saver writes stock DCP files into
``path`` in the background (any DCP reader reads them), and
``dcp.load(state, storage_reader=FlashStorageReader(path))`` reads from memory when a
restarted process finds the save there. :func:`prepare`, before the first save of a fresh
run, starts the run and sizes its memory, so that save too blocks only for its copy.
:func:`close` persists and frees the runs (also at exit).
:func:`latest_checkpoint` answers the newest save of a folder of per-step ids, memory
included (a listing of the folder misses a save not yet on storage).
``flashckpt.dcp.torchtitan.FlashCheckpointManager`` is torchtitan's checkpoint manager on them.
"""

from ._latest import Latest, latest_checkpoint
from ._prepare import prepare
from ._reader import FlashStorageReader
from ._run import close_all as close
from ._writer import FlashStorageWriter

__all__ = ["FlashStorageReader", "FlashStorageWriter", "Latest", "close", "latest_checkpoint", "prepare"]
