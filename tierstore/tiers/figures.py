"""The figures ``stats()`` reports, gathered from the tier manager's parts.

The tier manager (:mod:`tierstore.tiers.manager`) owns the parts that count:
its tiers' tables, the save counts, placement, the reads ahead, the write
queue, the bytes in flight, the host buffers and the disk backend.
:meth:`Figures.snapshot` reads them all, under the manager's lock, into one
:class:`~tierstore.stats.Stats`.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> mgr = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> h = mgr.put(torch.zeros(256))
    >>> stats = mgr.stats()  # Figures.snapshot, under the lock
    >>> stats.packed, stats.tiers["host"].bytes
    (1, 1024)
    >>> mgr.close()
"""

from __future__ import annotations

from tierstore.stats import Stats, Tier, TierStats
from tierstore.tiers.counts import SaveCounts
from tierstore.tiers.entry import TierState
from tierstore.tiers.inflight import InFlight
from tierstore.tiers.movers import Pipeline
from tierstore.tiers.placement import TierPlacement
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["Figures"]


class Figures:
    """Reads a tier manager's counters into a :class:`~tierstore.stats.Stats`.

    Holds the manager's parts, not copies of their figures: each
    :meth:`snapshot` reads them as they are then.
    """

    def __init__(
        self,
        tiers: dict[Tier, TierState],
        *,
        counts: SaveCounts,
        placing: TierPlacement,
        pipeline: Pipeline,
        transfers: Transfers,
        reads: ReadAhead,
        writes: WriteBehind,
        flight: InFlight,
    ) -> None:
        self._tiers = tiers
        self._counts = counts
        self._placing = placing
        self._pipeline = pipeline
        self._transfers = transfers
        self._reads = reads
        self._writes = writes
        self._flight = flight

    def snapshot(self, packed: int, deduplicated: int) -> Stats:
        """The counters as they are (under the manager's lock).

        ``packed``: the saves that took the manager's full path (the kept and
        rebuilt ones are in the counts); ``deduplicated``: of them, those that
        shared an entry.
        """
        pinned = self._transfers.pinned_pool_if_open
        buffers = self._transfers.buffers_if_open
        backend = self._pipeline.backend_if_open
        reads, writes = self._reads, self._writes
        counts = self._counts
        kept, kept_bytes = counts.kept_totals()
        parameters, parameter_bytes = counts.parameters()
        device_peak = counts.device_peak()  # NOTE [ Where kept saves count ] in tiers/counts.py
        with counts.lock:
            recomputed, recomputed_bytes = counts.recomputed, counts.recomputed_bytes
        return Stats(
            tiers={
                name: TierStats(
                    bytes=s.bytes,
                    peak_bytes=device_peak if name == "device" else s.peak,
                    entries=len(s.entries),
                    bytes_written=s.written,
                    bytes_read=s.read,
                )
                for name, s in self._tiers.items()
            },
            packed=packed + kept + recomputed,
            deduplicated=deduplicated,
            kept=kept,
            kept_bytes=kept_bytes,
            parameters=parameters,
            parameter_bytes=parameter_bytes,
            recomputed=recomputed,
            recomputed_bytes=recomputed_bytes,
            restrided_views=self._placing.restrided_views,
            prefetch_hits=reads.hits,
            prefetch_misses=reads.misses,
            bytes_prefetched=reads.prefetched_bytes,
            unpack_wait_s=reads.unpack_wait_s,
            pack_wait_s=self._flight.pack_wait_s(),
            host_pool_bytes=pinned.reserved_bytes if pinned is not None else 0,
            host_pool_misses=pinned.allocations_outside if pinned is not None else 0,
            disk_io=backend.io_path if backend is not None else None,
            failed_writes=writes.failed_writes,
            prefetch_window_bytes=reads.limit.bytes,
            prefetch_stalls=reads.limit.stalls,
            write_queue_limit_bytes=writes.limit.bytes,
            pack_waits=writes.limit.stalls,
            buffer_bytes_in_use=buffers.used_bytes if buffers is not None else 0,
            buffer_misses=buffers.allocations_outside if buffers is not None else 0,
        )
