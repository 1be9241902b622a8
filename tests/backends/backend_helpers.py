"""Helpers the backend tests share (importable through pytest's ``pythonpath``)."""

from __future__ import annotations

import itertools
from typing import Any

from tierstore.backends import Backend

KiB = 1024
MiB = 1024 * KiB
FULL_HINT = "; raise disk_budget (TIERSTORE_DISK_BUDGET)"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at ``cuts`` (clamped, deduplicated) into consecutive chunks."""
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def read(backend: Backend[Any], key: int, sizes: list[int]) -> bytes:
    """Read record ``key`` back scattered into buffers of ``sizes``, joined."""
    bufs = [bytearray(n) for n in sizes]
    backend.read_into(key, [memoryview(b) for b in bufs])
    return b"".join(bufs)
