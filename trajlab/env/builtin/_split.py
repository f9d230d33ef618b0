"""Deterministic train/test assignment shared by the built-in task generators."""

import hashlib


def split_of(key: str, test_fraction: float = 0.2) -> str:
    """The split a task belongs to, from a hash of its content: the same task is never in two splits."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
    return "test" if bucket < test_fraction else "train"
