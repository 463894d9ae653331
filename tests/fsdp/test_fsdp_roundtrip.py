"""Same world size (2 gloo ranks): bit-exact round trips of FSDP2 and FSDP1 model and
optimizer state from memory and from storage, training that continues exactly as the
uninterrupted run, model-only saves and loads, a save before the optimizer's first
step that leaves training unchanged, and repeated saves that follow the live state."""

import pytest

from .conftest import assert_ok


@pytest.mark.parametrize("check", ["fsdp2", "fsdp1", "model_only", "fresh_optimizer", "repeated_saves"])
def test_round_trip(ran2, check):
    assert_ok(ran2, check)
