"""Bad input: a model that differs from the checkpoint (extra or missing layer, other
shapes) gets an error listing the differing keys on every rank, with the same and with
another world size; asking for an optimizer the checkpoint lacks is an error too
(see ``_fsdp_ranks.bad_input``, ``model_only`` and ``mismatch``). A truncated or missing
shard of a resharded step is an error naming the file (``damaged``)."""

from .conftest import assert_ok


def test_same_world_lists_differing_keys_and_shapes(ran2):
    assert_ok(ran2, "bad_input")


def test_missing_optimizer_is_an_error(ran2):
    assert_ok(ran2, "model_only")


def test_resharding_lists_differing_keys(ran1, ran2b):
    assert_ok(ran1, "mismatch")
    assert_ok(ran2b, "mismatch")


def test_resharding_names_a_truncated_or_missing_shard(ran2b):
    assert_ok(ran2b, "damaged")
