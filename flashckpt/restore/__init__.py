"""Restoring a step: the agreement on what every rank loads, shard reading, resharding."""
