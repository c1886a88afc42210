"""Small helpers shared across the engine."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)
