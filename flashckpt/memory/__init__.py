"""Shared-memory slots, the safetensors image format, and the copies in and out of them."""
