"""Process memory for the benchmarks: anonymous RSS, and glibc settings that change it.

``bench train`` and ``bench soak`` measure memory as anonymous resident bytes
(NOTE [ What bench train measures ] in ``tierstore/bench/train.py``).
``bench train``'s headline leaves the allocator alone, as a user's process
does: each strategy in a fresh process, no ``mallopt``, no ``malloc_trim``.
:func:`follow_live_memory` serves its live-memory pass, and
:func:`release_free_memory` (the garbage collector, then glibc's
``malloc_trim``) the runs that share one process between several
measurements (``bench soak``, ``bench train --in-process``, the live pass),
so that memory freed by an earlier one counts less against the next.

Example:
    >>> from tierstore.bench.memory import AnonRss, release_free_memory
    >>> release_free_memory(full=False)
    >>> rss = AnonRss()
    >>> rss() > 0
    True
    >>> rss.close()
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
from typing import Any

from tierstore.tiers.host_pool import release_free_heap

__all__ = ["AnonRss", "follow_live_memory", "release_free_memory"]


class AnonRss:
    """Anonymous resident bytes of this process, from ``/proc/self/statm``.

    Resident minus shared pages: the kernel's ``RssAnon``, ten times cheaper
    to read than ``/proc/self/status``. Linux only. Holds one descriptor
    until :meth:`close`.

    Example:
        >>> from tierstore.bench.memory import AnonRss
        >>> rss = AnonRss()
        >>> isinstance(rss(), int)
        True
        >>> rss.close()
    """

    def __init__(self) -> None:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __call__(self) -> int:
        """The anonymous resident bytes now."""
        fields = os.pread(self._fd, 256, 0).split()
        return (int(fields[1]) - int(fields[2])) * self._page

    def close(self) -> None:
        """Close the descriptor."""
        os.close(self._fd)


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None)


#: glibc's mallopt parameter number for M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3
#: Allocations from this size up get their own mapping (NOTE [ What bench train measures ]).
_MMAP_THRESHOLD_BYTES = 1 << 20


def follow_live_memory() -> bool:
    """Give every allocation of 1 MiB or more its own mapping; ``False`` where not glibc.

    Then RSS follows live memory, at the cost of page faults. Call first
    thing in a fresh process: free chunks already in the heap would still be
    reused (and kept) after it.

    Example:
        >>> from tierstore.bench.memory import follow_live_memory
        >>> follow_live_memory()  # doctest: +SKIP
        True
    """
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1


def release_free_memory(*, full: bool) -> None:
    """Collect garbage and hand free heap pages back to the system (glibc's ``malloc_trim``).

    A full collection takes ~0.1 s once torch is imported: the benchmarks run
    one per strategy, and only the young generations (where a step's garbage
    is) every step.

    Example:
        >>> from tierstore.bench.memory import release_free_memory
        >>> release_free_memory(full=True)
    """
    gc.collect() if full else gc.collect(1)
    release_free_heap()
