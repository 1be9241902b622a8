"""Helpers the backend tests share (importable through pytest's ``pythonpath``)."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable
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


def run_in_threads(worker: Callable[[int], object], n: int = 8) -> list[BaseException]:
    """Run ``worker(0)`` ... ``worker(n - 1)`` on ``n`` threads at once; what they raised."""
    errors: list[BaseException] = []

    def guarded(tid: int) -> None:
        try:
            worker(tid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def churn(backend: Backend[Any], tid: int, max_size: int, rounds: int = 100) -> None:
    """Write, read back and delete random records under keys of thread ``tid`` only."""
    rng = random.Random(tid)
    for i in range(rounds):
        key = tid * 1000 + i
        data = rng.randbytes(rng.randrange(0, max_size))
        backend.write(key, [data[:10], data[10:]])
        assert read(backend, key, [len(data)]) == data
        backend.delete(key)
