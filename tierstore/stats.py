"""What a store reports: bytes per tier now and at peak, and what moved.

Example:
    >>> import tierstore
    >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
    ...     s = store.stats()
    >>> s.tiers["host"].bytes, s.packed
    (0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tierstore.config import human_bytes

__all__ = ["TIERS", "Stats", "Tier", "TierStats"]

Tier = Literal["device", "host", "disk"]
#: The tiers, fastest first.
TIERS: tuple[Tier, ...] = ("device", "host", "disk")


@dataclass(frozen=True)
class TierStats:
    """One tier's counters.

    ``bytes`` and ``peak_bytes`` count what the tier holds: span bytes on the
    device and host, footprint bytes (after compression and alignment) on
    disk. ``bytes_written`` and ``bytes_read`` count what moved into and out
    of the tier since the store opened.

    Example:
        >>> TierStats(bytes=0, peak_bytes=4096, entries=0, bytes_written=4096, bytes_read=4096)
        TierStats(bytes=0, peak_bytes=4096, entries=0, bytes_written=4096, bytes_read=4096)
    """

    bytes: int
    peak_bytes: int
    entries: int
    bytes_written: int
    bytes_read: int


@dataclass(frozen=True)
class Stats:
    """A snapshot of a store's counters (see :meth:`tierstore.TierStore.stats`).

    Attributes:
        tiers: per tier ``"device"``, ``"host"``, ``"disk"``.
        packed: saved tensors handed to the store (offloaded or not).
        deduplicated: saves that reused an entry already held.
        kept: saves left on the device as they were (parameters, small
            tensors, ``tierstore.keep()``, ...).
        kept_bytes: bytes of those kept saves.
        prefetch_hits: entries backward found read ahead: from disk (or
            still in memory, their write not yet done), and on CUDA, host
            entries already being copied back to the device.
        prefetch_misses: entries backward had to read or copy on demand.
        bytes_prefetched: bytes read or copied ahead of use.
        unpack_wait_s: seconds backward waited for disk reads (a CUDA copy
            is waited for by the stream, not the host: not counted).
        pack_wait_s: seconds forward waited for the write queue
            (``write_queue_bytes``) to drain.
        host_pool_bytes: host memory the pool holds (pinned on CUDA; 0 on
            CPU, where the host tier needs no copy).
        host_pool_misses: copies off the device that found no room in the
            pool and allocated their own host memory.
        disk_io: how the disk tier moves bytes: ``"file: O_DIRECT"``,
            ``"file: buffered"`` (the filesystem refused O_DIRECT) or
            ``"lmdb"``; ``None`` until the disk tier is first used. Bytes to
            and from a GPU pass through pinned host memory (GPUDirect
            Storage is not used).
        failed_writes: disk writes that failed. None loses data: a live
            entry stays in host memory, and one released before its write
            ended needs nothing (NOTE [ Failed writes ] in
            ``tierstore/writebehind.py``).
        prefetch_window_bytes: bytes backward may read ahead now: the
            window learnt from stalls, at most ``prefetch_bytes``
            (NOTE [ In-flight sizing ] in ``tierstore/sizing.py``).
        prefetch_stalls: unpacks that waited for a read (other than the
            first of a backward), each of which grew the window.
        write_queue_limit_bytes: bytes forward may queue for the disk now,
            learnt the same way, at most ``write_queue_bytes``.
        pack_waits: saves that found the queue over its limit and waited,
            each of which grew it.
        buffer_bytes_in_use: on a CPU, bytes of tierstore's own buffers
            (disk reads not yet dropped by autograd, write staging) out of
            its pool now.
        buffer_misses: buffers that found the pool full and came from the
            heap.

    Example:
        >>> import torch, tierstore
        >>> store = tierstore.TierStore(tierstore.TierConfig(
        ...     device_budget=0, host_budget="1GiB", disk_budget=0, min_offload_bytes=0))
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with store.offload():
        ...     y = x.exp()
        >>> store.stats().tiers["host"].bytes
        262144
        >>> y.sum().backward(); store.close()
    """

    tiers: Mapping[Tier, TierStats]
    packed: int
    deduplicated: int
    kept: int
    kept_bytes: int
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    bytes_prefetched: int = 0
    unpack_wait_s: float = 0.0
    pack_wait_s: float = 0.0
    host_pool_bytes: int = 0
    host_pool_misses: int = 0
    disk_io: str | None = None
    failed_writes: int = 0
    prefetch_window_bytes: int = 0
    prefetch_stalls: int = 0
    write_queue_limit_bytes: int = 0
    pack_waits: int = 0
    buffer_bytes_in_use: int = 0
    buffer_misses: int = 0

    @property
    def prefetch_hit_rate(self) -> float | None:
        """Hits over unpacks that needed a read or copy, or ``None`` before any."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else None

    def __str__(self) -> str:
        rows = [
            f"{name:>6}: {human_bytes(t.bytes):>10} now, {human_bytes(t.peak_bytes):>10} peak, "
            f"{t.entries} entries, {human_bytes(t.bytes_written)} written, "
            f"{human_bytes(t.bytes_read)} read"
            for name, t in self.tiers.items()
        ]
        rows.append(
            f"packed {self.packed}, deduplicated {self.deduplicated}, "
            f"kept {self.kept} ({human_bytes(self.kept_bytes)})"
        )
        rate = self.prefetch_hit_rate
        rows.append(
            f"prefetch {self.prefetch_hits} hits, {self.prefetch_misses} misses"
            + (f" ({rate:.0%})" if rate is not None else "")
            + f", waited {self.unpack_wait_s:.3f} s in backward"
            + f", {self.pack_wait_s:.3f} s in forward"
        )
        if self.disk_io is not None:
            rows.append(f"disk I/O: {self.disk_io}")
        if self.host_pool_bytes or self.host_pool_misses:
            rows.append(
                f"host pool {human_bytes(self.host_pool_bytes)}, "
                f"{self.host_pool_misses} allocations outside it"
            )
        if self.failed_writes:
            rows.append(f"{self.failed_writes} disk writes failed (no saved tensor lost)")
        return "\n".join(rows)
