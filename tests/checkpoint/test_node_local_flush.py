"""A node-local flush compares lines, not bare step numbers: an older run's committed step of
the same number is not this run's step (issue 22, node-local directories)."""

from types import SimpleNamespace

from flashckpt.replicas._link import Copies
from flashckpt.replicas._node_local import NodeLocal, write_scope
from flashckpt.storage._step_meta import line_key
from flashckpt.storage._local import LocalStorage

from .test_storage_lineage import commit, token

OLD, NEW = token(1_000), token(2_000)


class _Engine:
    """The engine surface a node-local flush uses: one rank whose memory holds ``step`` of
    run ``tok``; its persist commits that step, as its saver and the peer's replica would."""

    def __init__(self, storage: LocalStorage, step: int, tok: str) -> None:
        self.storage, self.step, self.tok = storage, step, tok
        self.placement = SimpleNamespace(storage_rank=0)
        self.replicas = SimpleNamespace(copies=lambda storage, token, step, timeout, **where: Copies(
            storage, token, step, 0, endpoints={}, secret="", bound=5.0, **where))
        self.persisted: list[int] = []

    def memory_keys(self) -> dict[int, tuple[str, int]]:
        return {self.step: (line_key(self.tok), self.step)}

    def memory_info(self, step: int) -> dict:
        return {"token": self.tok}

    def wait(self, timeout: float | None = None, *, copies: bool = True) -> None:
        pass

    def persist(self, step: int) -> None:
        self.persisted.append(step)
        assert commit(self.storage, step, self.tok, branch=3)


def test_a_flush_persists_this_runs_step_when_an_older_run_committed_the_same_number(tmp_path):
    storage = LocalStorage(str(tmp_path))
    for step in range(1, 7):
        assert commit(storage, step, OLD, branch=-1)
    write_scope(str(tmp_path), NEW, [0])
    engine = _Engine(storage, 4, NEW)  # loaded 3, saved 4 to memory only
    NodeLocal(node="n0", scopes={"n0": (0,)}).flush(engine, None)
    assert engine.persisted == [4]
    assert storage.metadata(4)["token"] == NEW and storage.latest_step() == 4
