"""stable_seed: a seed from any parts, the same in every process and every run (sha256 of their
repr, unlike hash() of strings, which Python salts per process). The RL run names its streams in
rl/seeds.py; evaluation derives its own per benchmark."""

import hashlib


def stable_seed(*parts) -> int:
    """A 31-bit seed from parts, the same in every process (unlike hash() of strings)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") >> 1
