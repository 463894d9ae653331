import importlib.metadata
import os
import sys

import pytest

pytest.importorskip("lightning")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session", autouse=True)
def lightning_exporter(tmp_path_factory):
    """The saver finds exporters by entry point; an editable install made before the
    ``lightning`` exporter was added lacks it (``pip install -e .`` adds it): the tests then
    register it through a dist-info of their own on PYTHONPATH (the saver inherits it)."""
    group = importlib.metadata.entry_points(group="flashckpt.exporters")
    if "lightning" in group.names:
        yield
        return
    where = tmp_path_factory.mktemp("entry-points")
    info = where / "flashckpt_lightning_tests-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashckpt-lightning-tests\nVersion: 0\n")
    (info / "entry_points.txt").write_text('[flashckpt.exporters]\nlightning = flashckpt.lightning._export\n')
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(where), ROOT, before) if p)
    sys.path.insert(0, str(where))
    yield
    sys.path.remove(str(where))
    if before is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = before
