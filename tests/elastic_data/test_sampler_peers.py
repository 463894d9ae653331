"""The peer comparison of benchmarks/sampler_peers.py, checked: ours is exact on the
world-size-change scenario; what the peers get wrong is recorded (and pinned, so a
change in a peer shows up here and the comparison gets updated)."""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("sampler_peers", os.path.join(ROOT, "benchmarks", "sampler_peers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module.run()


def test_ours_trains_every_sample_once_plus_declared_padding(results):
    for new, r in results["elastic.ElasticDistributedSampler"].items():
        assert r["missing"] == 0 and r["repeats"] == r["declared_padding"], (new, r)


def test_what_the_peers_get_wrong(results):
    # restarting the epoch repeats everything trained before the checkpoint (480)
    assert results["DistributedSampler, restart epoch"][1] == {"missing": 0, "repeats": 480, "declared_padding": -1}
    # skipping the batches done uses the new layout: 3 ranks skip 240 never-trained
    # samples, 1 rank trains 240 samples a second time
    for peer in ("DistributedSampler, skip batches done", "torchdata StatefulDataLoader"):
        r = results[peer]
        if "error" in r[3]:
            pytest.skip(f"{peer}: {r[3]['error']}")
        assert r[3]["missing"] == 240 and r[1]["repeats"] == 240, (peer, r)
