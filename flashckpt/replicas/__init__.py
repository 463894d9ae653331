"""Peer-memory replicas across nodes, and node-local directories built on them."""
