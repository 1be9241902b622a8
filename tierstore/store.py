"""The tier manager: budgets, placement, demotion and deduplication.

It knows tensors and budgets, not autograd: :meth:`TierManager.put` takes a
tensor and returns a :class:`~tierstore.handle.Handle`, :meth:`TierManager.get`
gives the tensor back. The autograd boundary (``tierstore.hooks``) decides
which tensors to hand it.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.store import TierManager
    >>> mgr = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> h = mgr.put(torch.arange(6.0))
    >>> mgr.get(h).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> mgr.stats().tiers["host"].entries
    1
    >>> del h; mgr.stats().tiers["host"].entries
    0
    >>> mgr.close()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tierstore import codec
from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.errors import (
    DISK_HINT,
    StoreClosedError,
    TierFullError,
    TierstoreError,
    TierstoreWarning,
    quoted,
)
from tierstore.handle import Handle
from tierstore.pipeline import DeviceCopy, HostBlock, Pipeline, Record
from tierstore.schedule import Schedule
from tierstore.stats import TIERS, Stats, Tier, TierStats

__all__ = ["TierManager", "resting_nbytes"]

# NOTE [ Placement ]
# A new entry goes to the fastest tier whose budget can hold it at all; when
# that pushes the tier over budget, its *oldest* entries move one tier down
# (recursively). Backward consumes saved tensors newest first, so keeping the
# newest in the fastest tier is Belady's optimal eviction for a known future.
# An entry moves only after it has landed below: if the disk refuses it, it
# stays where it was and the save that needed the room raises TierFullError.

# NOTE [ Write-behind ]
# Pack never waits for the disk. An entry demoted to disk first reserves the
# most disk it can take (Pipeline.footprint_bound) and is queued; it keeps its
# in-memory span until the write ends, and an unpack in the meantime is served
# from that span. The write's done-callback, on the I/O thread, only sets
# entry.record and then drops entry.tensor (in that order, so a reader that
# finds no tensor finds the record); everything else (the real footprint,
# releasing an entry that died while being written, failures) is settled by
# _harvest under the lock at the next call. Backpressure: while more than
# write_queue_bytes are queued, put() waits, with the lock released, for the
# oldest write; the wait is counted in stats().pack_wait_s. A failed write
# loses nothing: NOTE [ Failed writes ].

# NOTE [ Failed writes ]
# A write that fails (ENOSPC, EIO, a full LMDB map) has put nothing on the
# disk, and its bytes are still in entry.tensor, so the entry moves to the host
# tier, where it can be read as any host entry. The host memory the settings
# allow is host_budget plus write_queue_bytes (the bytes queued for the disk
# are held in host memory too; the pinned pool is sized the same way). While
# the host entries and the queue still fit in that, the step goes on: the
# store warns once (TierstoreWarning) and counts every failure in
# stats().failed_writes. Past it, the error is raised by the next put() or
# get() (with the original as __cause__): the user asked for host memory to
# stay within those settings, and only they can choose between more room and
# a healthier disk. A write can also end after backward has used and released
# its entry (writes run behind; a read is served from the span meanwhile):
# nothing is lost then, but the disk is still failing, so that failure warns
# too when it is the first. The warning is issued by whichever call settles
# the write; flush() settles them all. Once a failure has been raised, the
# user has heard: later ones are only counted.
# A failed read cannot be worked around, the disk held the only copy: get()
# raises (a TierstoreError, or CorruptDataError for wrong bytes) and the
# entry stays where it is, so a retry after a transient error may succeed.

# NOTE [ Prefetch ]
# Backward asks for entries in the order the Schedule predicts (recorded from
# the last step, else reverse pack order). Each get() tops up a window of
# reads in flight, at most prefetch_bytes, and then waits, outside the lock,
# only for the entry it needs. A read of an entry whose write is still under
# way is chained after that write. An entry found in the window, still in
# memory, or already read for another handle is a hit; one that must be read
# on demand is a miss. The first unpack of a backward whose entries are all
# on disk is always a miss: nothing says when forward has ended.

# NOTE [ Version check ]
# Eager autograd raises at backward if a saved tensor was modified in place.
# An entry checks the version counter of (a) the tensor that was saved and
# its base, through weak references: while anything keeps them alive they
# can be modified; and (b) its own probe, an alias it holds while its bytes
# are the caller's memory. When the bytes are copied (to disk, or off the
# device), a probe whose version moved marks the entry stale: the copy holds
# modified values, and get() raises as eager would. Not seen: a modification
# through a detach()ed alias once both the saved tensor and our alias are
# gone, since nothing shares a version counter without sharing the memory.

# NOTE [ Deferred release ]
# A Handle's finalizer can run at any moment: in another thread, or in this
# one while put() holds the lock (a garbage collection triggered inside put).
# Releasing then would mutate the tier tables mid-update. So the finalizer
# releases only when it can take the lock without waiting; otherwise it
# queues the key, and whoever holds the lock drains the queue on the way out.


def resting_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes once offloaded: broadcast (stride-0) dimensions count once.

    Example:
        >>> import torch
        >>> from tierstore.store import resting_nbytes
        >>> resting_nbytes(torch.zeros(1, 256).expand(1024, 256))
        1024
    """
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
        elif size == 0:
            return 0
    return n


class _Entry:
    """One stored tensor and where its bytes rest now."""

    __slots__ = (
        "block",
        "dedupe_key",
        "device",
        "footprint",
        "held",
        "key",
        "layout",
        "loaded",
        "nbytes",
        "probe",
        "ready",
        "record",
        "refs",
        "source",
        "stale",
        "tensor",
        "tier",
        "version",
        "writing",
    )

    def __init__(self, key: int, t: torch.Tensor, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.device = t.device
        self.tier: Tier | None = None
        # Resting form: the tensor itself (device tier), a span + layout
        # (host tier), or a disk record.
        self.tensor: torch.Tensor | None = t
        self.layout: codec.Layout | None = None
        self.record: Record | None = None
        self.footprint = 0
        # NOTE [ Version check ]: a tensor sharing the saved tensor's version
        # counter, kept while our bytes alias the caller's memory; when we
        # copy them, a version other than the one at pack marks the entry
        # stale, since the copy then holds the modified values.
        self.probe: torch.Tensor | None = t
        self.version = t._version
        self.stale: int | None = None
        # The last tensor read from disk: weakly, or strongly while other
        # handles of a deduplicated entry still need it (as eager autograd
        # keeps one saved tensor for every node that saved it).
        self.loaded: weakref.ref[torch.Tensor] | None = None
        self.held: torch.Tensor | None = None
        self.dedupe_key: tuple[object, ...] | None = None
        self.writing: concurrent.futures.Future[Record] | None = None
        # CUDA (NOTE [ Copies on CUDA ] in pipeline.py): the D2H copy filling
        # self.tensor while it runs, and the pool block self.tensor lives in.
        self.ready: torch.cuda.Event | None = None
        self.source: torch.Tensor | None = None  # what that copy reads (a compact temp, say)
        self.block: HostBlock | None = None
        self.refs = 1

    def let_go_of_original(self) -> None:
        """Drop the probe once our bytes are a copy (NOTE [ Version check ])."""
        probe = self.probe
        if probe is not None and probe._version != self.version and self.stale is None:
            self.stale = probe._version
        self.probe = None

    def span(self) -> tuple[torch.Tensor, codec.Layout]:
        assert self.tensor is not None
        if self.layout is None:
            return codec.to_span(self.tensor)
        return self.tensor, self.layout


@dataclass
class _TierState:
    budget: int
    entries: dict[int, _Entry]
    heap: list[int]  # keys, oldest first; stale keys are skipped lazily
    bytes: int = 0
    peak: int = 0
    written: int = 0
    read: int = 0

    def size_of(self, entry: _Entry, tier: Tier) -> int:
        return entry.footprint if tier == "disk" else entry.nbytes

    def oldest(self) -> _Entry | None:
        while self.heap:
            entry = self.entries.get(self.heap[0])
            if entry is not None:
                return entry
            heapq.heappop(self.heap)
        return None

    def add(self, entry: _Entry, size: int) -> None:
        self.entries[entry.key] = entry
        heapq.heappush(self.heap, entry.key)
        self.bytes += size
        self.written += size
        self.peak = max(self.peak, self.bytes)

    def remove(self, entry: _Entry, size: int) -> None:
        del self.entries[entry.key]
        self.bytes -= size
        if len(self.heap) > 2 * len(self.entries) + 64:
            # Released entries leave stale keys behind; rebuild before they pile up.
            self.heap = sorted(self.entries)


class TierManager:
    """Places tensors in the device, host and disk tiers within their budgets.

    Thread-safe. Owns a :class:`~tierstore.pipeline.Pipeline` (and through it
    the disk backend); :meth:`close` releases everything and is idempotent.

    Example:
        >>> import tempfile, torch
        >>> from tierstore import TierConfig
        >>> from tierstore.store import TierManager
        >>> cfg = TierConfig(device_budget=0, host_budget=0, disk_budget="1MiB",
        ...                  disk_path=tempfile.mkdtemp())
        >>> mgr = TierManager(cfg)
        >>> h = mgr.put(torch.ones(1000))
        >>> mgr.stats().tiers["disk"].bytes
        8192
        >>> float(mgr.get(h).sum())
        1000.0
        >>> mgr.close()
    """

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pending: deque[int] = deque()
        self._tiers: dict[Tier, _TierState] = {
            "device": _TierState(int(config.device_budget), {}, []),
            "host": _TierState(int(config.host_budget), {}, []),
            "disk": _TierState(int(config.disk_budget), {}, []),
        }
        self._entries: dict[int, _Entry] = {}
        self._dedupe: dict[tuple[object, ...], tuple[weakref.ref[object], int]] = {}
        self._keys = itertools.count()
        self._pipeline = Pipeline(config)
        # Stops the I/O threads even if the store is dropped without close().
        self._finalizer = weakref.finalize(self, Pipeline.close, self._pipeline)
        self._schedule = Schedule()
        self._writing: dict[int, _Entry] = {}  # NOTE [ Write-behind ]
        self._queued_bytes = 0
        # The first failed write past the host room, and its entry's key.
        self._failure: tuple[BaseException, int] | None = None
        self._failed_writes = 0
        self._warned_write = False
        # Reads ahead: disk reads (futures) and, on CUDA, H2D copies of host entries.
        self._window: dict[int, tuple[concurrent.futures.Future[torch.Tensor] | DeviceCopy, int]]
        self._window = {}
        self._copying: deque[_Entry] = deque()  # D2H copies under way, oldest first
        self._copying_bytes = 0
        self._window_bytes = 0
        self._demand: dict[int, concurrent.futures.Future[torch.Tensor]] = {}
        self._packed = 0
        self._deduplicated = 0
        self._kept = 0
        self._kept_bytes = 0
        self._hits = 0
        self._misses = 0
        self._prefetched_bytes = 0
        self._unpack_wait = 0.0
        self._pack_wait = 0.0
        self._closed = False

    # -- public --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def check_open(self) -> None:
        """Raise :class:`~tierstore.StoreClosedError` if the store is closed."""
        if self._closed:
            raise StoreClosedError(
                "tierstore: this TierStore is closed; create a new one, or call close() "
                "only after the last backward that needs its saved tensors"
            )

    def put(self, t: torch.Tensor, nbytes: int | None = None) -> Handle:
        """Store ``t`` and return a handle; the entry lives as long as a handle does.

        ``nbytes`` is ``resting_nbytes(t)`` when the caller has it already.
        """
        with self._locked():
            self.check_open()
            self._raise_failure()
            self._packed += 1
            storage = t.untyped_storage()
            dedupe_key = (
                storage.data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.device,
                t._version,
            )
            hit = self._dedupe.get(dedupe_key)
            # The weak reference proves it is the same storage, not a new one
            # that happens to sit at a freed address.
            if hit is not None and hit[0]() is storage:
                entry = self._entries[hit[1]]
                entry.refs += 1
                self._deduplicated += 1
                return self._handle(entry, t)
            self._wait_for_queue()
            self.check_open()  # closed by another thread while this one waited
            size = resting_nbytes(t) if nbytes is None else nbytes
            entry = _Entry(next(self._keys), t.detach(), size)
            self._land(entry, 0)
            self._entries[entry.key] = entry
            self._schedule.packed(entry.key, (dedupe_key[2], t.dtype))
            with contextlib.suppress(TypeError):  # storages that refuse weak references
                self._dedupe[dedupe_key] = (weakref.ref(storage), entry.key)
                entry.dedupe_key = dedupe_key
            return self._handle(entry, t)

    def get(self, handle: Handle) -> torch.Tensor:
        """The tensor ``handle`` refers to, on its original device, shape and strides.

        Raises:
            TierstoreError: the saved tensor was modified in place after it was
                stored (the error eager autograd raises in that case), or a
                background write failed (its error is the ``__cause__``).
            StoreClosedError: the store was closed.
        """
        with self._locked():
            self.check_open()
            self._raise_failure()
            entry = self._entries[handle.key]
            aliases = (entry.probe, *handle.sources())
            versions = [entry.stale, *(a._version for a in aliases if a is not None)]
            for version in versions:
                if version is not None and version != handle.version:
                    raise TierstoreError(
                        "tierstore: one of the variables needed for gradient computation has "
                        "been modified by an inplace operation: a saved tensor of shape "
                        f"{list(handle.shape)} and dtype {handle.dtype} is at version "
                        f"{version}; expected version {handle.version} instead. "
                        "Hint: clone the tensor before modifying it in place, or "
                        "modify it before it is saved"
                    )
            self._schedule.unpacked(entry.key)
            tier = entry.tier
            if tier == "device":
                assert entry.tensor is not None
                return entry.tensor
            if tier == "host":
                span, layout = entry.span()
                self._tiers["host"].read += entry.nbytes
                if span.device == entry.device:  # CPU: the host tier is the device's memory
                    return codec.from_span(span, layout)
                return self._copy_back(entry, span, layout)
            # Disk: NOTE [ Prefetch ].
            cached = entry.held
            if cached is None and entry.loaded is not None:
                cached = entry.loaded()
            in_memory = entry.tensor  # still being written: NOTE [ Write-behind ]
            assert entry.layout is not None
            layout = entry.layout
            ahead = self._window.pop(entry.key, None)
            if ahead is not None:
                self._window_bytes -= ahead[1]
            if cached is not None or in_memory is not None:
                if ahead is not None:
                    self._drop_ahead(ahead[0])
                self._hits += 1
                self._top_up_window()
                if cached is not None:
                    return cached
                assert in_memory is not None
                copy = self._pipeline.device_copy(in_memory, entry.device, entry.ready)
                return codec.from_span(self._pipeline.consume(copy), layout)
            if ahead is not None:
                assert not isinstance(ahead[0], DeviceCopy)
                self._hits += 1
                future = ahead[0]
            else:
                self._misses += 1
                source = entry.record if entry.record is not None else entry.writing
                assert source is not None
                future = self._pipeline.submit_read(entry.key, source)
                self._demand[entry.key] = future
            self._tiers["disk"].read += entry.footprint
            self._top_up_window()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function("tierstore::unpack_wait"):
                self._pipeline.wait([future])  # outside the lock: NOTE [ Movers ]
                span = future.result()  # close() waits for reads under way: never cancelled
        finally:
            waited = time.perf_counter() - start
            with self._lock:
                self._unpack_wait += waited
                self._demand.pop(entry.key, None)
        copy = self._pipeline.device_copy(span, entry.device)
        return self._remember(entry, codec.from_span(self._pipeline.consume(copy), layout))

    def count_kept(self, nbytes: int) -> None:
        """Count a saved tensor the caller left on the device."""
        with self._locked():
            self._packed += 1
            self._kept += 1
            self._kept_bytes += nbytes

    def stats(self) -> Stats:
        """A snapshot of the counters; see :class:`~tierstore.stats.Stats`.

        Writes of entries already released are waited for first, so that what
        backward freed shows as freed. A live entry whose write is still
        queued counts its reservation (an upper bound) in the disk bytes;
        :meth:`flush` settles those too.
        """
        with self._locked():
            self.check_open()
            self._wait_for([e.writing for k, e in self._writing.items() if k not in self._entries])
            pool = self._pipeline.pool_if_open
            backend = self._pipeline.backend_if_open
            return Stats(
                tiers={
                    name: TierStats(
                        bytes=s.bytes,
                        peak_bytes=s.peak,
                        entries=len(s.entries),
                        bytes_written=s.written,
                        bytes_read=s.read,
                    )
                    for name, s in self._tiers.items()
                },
                packed=self._packed,
                deduplicated=self._deduplicated,
                kept=self._kept,
                kept_bytes=self._kept_bytes,
                prefetch_hits=self._hits,
                prefetch_misses=self._misses,
                bytes_prefetched=self._prefetched_bytes,
                unpack_wait_s=self._unpack_wait,
                pack_wait_s=self._pack_wait,
                host_pool_bytes=pool.reserved_bytes if pool is not None else 0,
                host_pool_misses=pool.allocations_outside if pool is not None else 0,
                disk_io=backend.io_path if backend is not None else None,
                failed_writes=self._failed_writes,
            )

    def flush(self) -> None:
        """Wait until every queued disk write has ended (and raise if one failed)."""
        with self._locked():
            self._wait_for([e.writing for e in self._writing.values()])
            self._raise_failure()

    @property
    def disk_directory(self) -> str | None:
        """The spill directory, once the disk tier has been used."""
        backend = self._pipeline.backend_if_open
        return str(backend.directory) if backend is not None else None

    def close(self) -> None:
        """Drop every entry, stop the I/O, remove the spill directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            futures: list[concurrent.futures.Future[Any]] = [
                e.writing for e in self._writing.values() if e.writing is not None
            ]
            futures += [f for f, _ in self._window.values() if not isinstance(f, DeviceCopy)]
            futures += list(self._demand.values())
            for ahead, _ in self._window.values():  # copies into device memory about to be freed
                if isinstance(ahead, DeviceCopy) and ahead.ready is not None:
                    ahead.ready.synchronize()
            for entry in self._copying:  # copies into host memory about to be freed
                if entry.ready is not None:
                    entry.ready.synchronize()
            self._copying.clear()
            self._copying_bytes = 0
        # Requests under way end first (their callbacks take no lock); then the
        # threads stop and the backend and its directory go. With a dead I/O
        # thread they never end (NOTE [ A dead I/O thread ]): close anyway.
        with contextlib.suppress(TierstoreError):
            self._pipeline.wait(futures)
        with self._lock:
            self._entries.clear()
            self._dedupe.clear()
            self._pending.clear()
            self._writing.clear()
            self._window.clear()
            self._demand.clear()
            for state in self._tiers.values():
                state.entries.clear()
                state.heap.clear()
                state.bytes = 0
        self._finalizer()

    # -- placement (NOTE [ Placement ]) -----------------------------------------

    def _land(self, entry: _Entry, start: int) -> None:
        """Rest ``entry`` in the fastest tier from ``TIERS[start]`` down that can take it."""
        for tier in TIERS[start:]:
            state = self._tiers[tier]
            if state.budget == 0:
                continue
            if tier == "disk":
                self._write_disk(entry)
                return
            if entry.nbytes <= state.budget:
                self._make_room(tier, entry.nbytes)
                self._hold(entry, tier)
                return
        raise self._no_tier_error(entry, start)

    def _make_room(self, tier: Tier, nbytes: int) -> None:
        state = self._tiers[tier]
        below = TIERS.index(tier) + 1
        while state.bytes + nbytes > state.budget:
            oldest = state.oldest()
            if oldest is None:
                return
            self._land(oldest, below)  # raises, leaving `oldest` in place, if nothing takes it
            state.remove(oldest, oldest.nbytes)

    def _hold(self, entry: _Entry, tier: Tier) -> None:
        if tier == "host" and entry.layout is None:
            span, layout = entry.span()
            self._copy_to_host(entry, span)
            entry.layout = layout
        entry.tier = tier
        self._tiers[tier].add(entry, entry.nbytes)

    def _write_disk(self, entry: _Entry) -> None:
        self._pipeline.check_alive()  # before anything changes: a dead thread writes nothing
        state = self._tiers["disk"]
        ahead = self._window.pop(entry.key, None)  # a copy back from the host tier
        if ahead is not None:
            self._window_bytes -= ahead[1]
            self._drop_ahead(ahead[0])
        span, layout = entry.span()
        reserve = self._pipeline.footprint_bound(entry.nbytes)
        if state.bytes + reserve > state.budget and self._writing:
            # Writes in flight hold reservations, and dead entries' writes hold
            # space they will give back: settle them before calling it full.
            # The lock stays held (we are mid-placement); write callbacks never
            # take it, so this cannot deadlock.
            self._pipeline.wait([e.writing for e in self._writing.values()])
            self._harvest()
        if state.bytes + reserve > state.budget:
            raise TierFullError(
                f"tierstore: the disk tier is full: {human_bytes(state.bytes)} of "
                f"disk_budget={human_bytes(state.budget)} in use, and a saved tensor of "
                f"{human_bytes(entry.nbytes)} needs {human_bytes(reserve)} more; raise "
                f"disk_budget ({ENV_PREFIX}DISK_BUDGET)"
            )
        self._copy_to_host(entry, span)
        entry.layout = layout
        entry.tier = "disk"
        entry.footprint = reserve
        state.add(entry, reserve)
        self._writing[entry.key] = entry
        self._queued_bytes += entry.nbytes

        def written(future: concurrent.futures.Future[Record]) -> None:
            # On the I/O thread, without the lock: assignments only.
            if not future.cancelled() and future.exception() is None:
                entry.record = future.result()
                entry.let_go_of_original()
                entry.tensor = None  # the memory goes now, not at the next call

        assert entry.tensor is not None
        entry.writing = self._pipeline.submit_write(entry.key, entry.tensor, written, entry.ready)

    def _copy_to_host(self, entry: _Entry, span: torch.Tensor) -> None:
        """Rest ``entry``'s bytes in host memory: a copy off the device, or the span itself."""
        copy = self._pipeline.host_copy(span)
        if copy.tensor is span:
            entry.tensor = span  # already host memory (CPU, or an entry on the host tier)
            return
        entry.tensor, entry.block = copy.tensor, copy.block
        if copy.ready is None:
            entry.let_go_of_original()  # a copy: later changes cannot reach it
        else:
            # NOTE [ Copies on CUDA ]: the source stays referenced (by the
            # probe) until the copy has read it; _settle_copies lets go.
            entry.ready, entry.source = copy.ready, span
            self._copying.append(entry)
            self._copying_bytes += entry.nbytes

    def _copy_back(self, entry: _Entry, span: torch.Tensor, layout: codec.Layout) -> torch.Tensor:
        """A host entry back on its CUDA device (NOTE [ Prefetch ]); called with the lock held."""
        cached = entry.held
        if cached is None and entry.loaded is not None:
            cached = entry.loaded()
        ahead = self._window.pop(entry.key, None)
        if ahead is not None:
            self._window_bytes -= ahead[1]
        if cached is not None:
            if ahead is not None:
                self._drop_ahead(ahead[0])
            self._hits += 1
            self._top_up_window()
            return cached
        if isinstance(ahead, tuple) and isinstance(ahead[0], DeviceCopy):
            self._hits += 1
            copy = ahead[0]
        else:
            self._misses += 1
            copy = self._pipeline.device_copy(span, entry.device, entry.ready)
        # Remembered first, so that the top-up does not copy this entry again.
        out = self._remember(entry, codec.from_span(self._pipeline.consume(copy), layout))
        self._top_up_window()
        return out

    @staticmethod
    def _remember(entry: _Entry, out: torch.Tensor) -> torch.Tensor:
        """Keep what was read back for the entry's other handles (strongly if it has any)."""
        # As eager autograd keeps one saved tensor for every node that saved it.
        if entry.refs > 1:
            entry.held = out
        else:
            entry.loaded = weakref.ref(out)
        return out

    def _settle_copies(self) -> None:
        """Let go of sources whose D2H copies have ended; called with the lock held."""
        while self._copying and self._pipeline.done(self._copying[0].ready):
            entry = self._copying.popleft()
            self._copying_bytes -= entry.nbytes
            entry.ready = entry.source = None
            entry.let_go_of_original()
        self._pipeline.reclaim()

    def _drop_ahead(self, ahead: concurrent.futures.Future[torch.Tensor] | DeviceCopy) -> None:
        """Forget a read ahead that is not needed (any more)."""
        if isinstance(ahead, DeviceCopy):
            # Its memory belongs to the consumer's stream: let that stream wait
            # for the copy before the allocator may hand the memory out again.
            self._pipeline.consume(ahead)
        else:
            ahead.cancel()  # a read has no side effect: dropping it is safe

    def _wait_for_queue(self) -> None:
        """Backpressure (NOTE [ Write-behind ]); called with the lock held."""
        limit = int(self.config.write_queue_bytes)
        while self._queued_bytes > limit:
            self._pack_wait += self._wait_for([self._writing[min(self._writing)].writing])
        # D2H copies too: their sources stay on the device until copied, so a
        # forward that outruns PCIe would otherwise keep every one of them.
        while self._copying_bytes > limit:
            ready = self._copying[0].ready
            start = time.perf_counter()
            if ready is not None:
                self._unlocked(ready.synchronize)
            self._settle_copies()
            self._pack_wait += time.perf_counter() - start

    def _wait_for(self, futures: list[concurrent.futures.Future[Record] | None]) -> float:
        """Wait for writes with the lock released, then settle them; returns seconds waited."""
        pending = [f for f in futures if f is not None and not f.done()]
        start = time.perf_counter()
        if pending:
            self._unlocked(lambda: self._pipeline.wait(pending))
        self._harvest()
        return time.perf_counter() - start

    def _unlocked(self, wait: Callable[[], object]) -> None:
        """Run ``wait`` with the lock released (forward waiting on copies or writes)."""
        self._lock.release()
        try:
            with torch.profiler.record_function("tierstore::pack_wait"):
                wait()
        finally:
            self._lock.acquire()

    def _harvest(self) -> None:
        """Settle finished writes (NOTE [ Write-behind ]); called with the lock held."""
        disk = self._tiers["disk"]
        for key in [k for k, e in self._writing.items() if e.writing and e.writing.done()]:
            entry = self._writing.pop(key)
            future, entry.writing = entry.writing, None
            assert future is not None
            self._queued_bytes -= entry.nbytes
            error = None if future.cancelled() else future.exception()
            alive = key in self._entries
            if future.cancelled() or error is not None:
                # Nothing reached the disk; the bytes are still in entry.tensor.
                disk.remove(entry, entry.footprint)
                entry.footprint = 0
                host = self._tiers["host"]
                allowed = host.budget + int(self.config.write_queue_bytes)
                # A released entry needs no room: its failure is only counted.
                roomy = not alive or host.bytes + self._queued_bytes + entry.nbytes <= allowed
                if alive:
                    entry.tier = "host"
                    host.add(entry, entry.nbytes)
                else:
                    self._pipeline.free_host(entry.block)
                    entry.block = None
                if error is not None:  # NOTE [ Failed writes ]
                    self._failed_writes += 1
                    if not roomy:
                        if self._failure is None or self._failure[1] not in self._entries:
                            self._failure = (error, key)
                    elif not self._warned_write:
                        self._warned_write = True
                        warning = self._write_failed_warning(entry, error, kept=alive)
                        warnings.warn(warning, stacklevel=2)
                continue
            record = future.result()
            self._pipeline.free_host(entry.block)  # the bytes are on disk now
            entry.block = None
            disk.bytes += record.footprint - entry.footprint  # the reservation was a bound
            disk.written += record.footprint - entry.footprint
            entry.footprint = record.footprint
            if not alive:  # released while it was being written
                disk.remove(entry, entry.footprint)
                self._pipeline.delete(key)

    @staticmethod
    def _write_failed_warning(entry: _Entry, error: BaseException, kept: bool) -> TierstoreWarning:
        fate = (
            "stays in host memory, within host_budget + write_queue_bytes, and the step goes on"
            if kept
            else "was released before its write ended, so nothing was lost"
        )
        return TierstoreWarning(
            f"tierstore: a write to the disk tier failed ({quoted(error)}); the saved tensor "
            f"of {human_bytes(entry.nbytes)} {fate}. Later failures are only counted, in "
            f"stats().failed_writes; {DISK_HINT}"
        )

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        # An entry released since (its graph gone with an earlier error, say)
        # no longer holds host memory: its failure is only counted.
        if failure is not None and failure[1] in self._entries:
            error = failure[0]
            self._warned_write = True  # the user has heard: later failures are only counted
            raise TierstoreError(
                f"tierstore: a background write to the disk tier failed: {quoted(error)}; the "
                "saved tensors it held are still in host memory. Check the disk under disk_path "
                f"({ENV_PREFIX}DISK_PATH), or raise host_budget ({ENV_PREFIX}HOST_BUDGET) or "
                f"write_queue_bytes ({ENV_PREFIX}WRITE_QUEUE_BYTES) so that failed writes can "
                "stay in host memory (they do while both have room)"
            ) from error

    def _top_up_window(self) -> None:
        """Queue reads in schedule order up to prefetch_bytes (NOTE [ Prefetch ])."""
        limit = int(self.config.prefetch_bytes)
        while self._window_bytes < limit:
            key = self._schedule.next_planned()
            if key is None:
                return
            entry = self._entries.get(key)
            if entry is None or key in self._window:
                continue
            if entry.tier == "host" and entry.device.type == "cuda":
                if entry.held is not None or (
                    entry.loaded is not None and entry.loaded() is not None
                ):
                    continue
                span, _ = entry.span()
                copy = self._pipeline.device_copy(span, entry.device, entry.ready)
                self._window[key] = (copy, entry.nbytes)
                self._window_bytes += entry.nbytes
                self._prefetched_bytes += entry.nbytes
                continue
            if (
                entry.tier != "disk"
                or key in self._demand
                or entry.held is not None
                or (entry.loaded is not None and entry.loaded() is not None)
            ):
                continue
            # A write still under way: the read follows it (NOTE [ Prefetch ]).
            source = entry.record if entry.record is not None else entry.writing
            if source is None:
                continue
            future = self._pipeline.submit_read(key, source)
            self._window[key] = (future, entry.nbytes)
            self._window_bytes += entry.nbytes
            self._prefetched_bytes += entry.footprint

    def _no_tier_error(self, entry: _Entry, start: int) -> TierFullError:
        budgets = ", ".join(
            f"{tier}_budget={human_bytes(self._tiers[tier].budget)}" for tier in TIERS[start:]
        )
        last = next((t for t in reversed(TIERS) if self._tiers[t].budget), "disk")
        return TierFullError(
            f"tierstore: a saved tensor of {human_bytes(entry.nbytes)} fits in no tier "
            f"({budgets}); raise {last}_budget ({ENV_PREFIX}{last.upper()}_BUDGET)"
            + ("" if last == "disk" else " or give disk_budget a size")
        )

    # -- lifetimes (NOTE [ Deferred release ]) ----------------------------------

    def _handle(self, entry: _Entry, t: torch.Tensor) -> Handle:
        handle = Handle(entry.key, t)
        weakref.finalize(handle, self._release, entry.key).atexit = False
        return handle

    def _release(self, key: int) -> None:
        # Queue first, then drain if the lock is free. Whoever holds the lock
        # drains after its work and checks the queue again once it has let
        # go, so a key queued at any moment is released at once by one side.
        self._pending.append(key)
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._drain()
            yield
            self._drain()
        # A finalizer in another thread may have queued a key after the drain.
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        if self._closed:
            self._pending.clear()
            return
        self._settle_copies()
        self._harvest()
        while self._pending:
            self._release_locked(self._pending.popleft())

    def _release_locked(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is None:  # closed, or never landed
            return
        entry.refs -= 1
        if entry.refs:
            return
        del self._entries[key]
        if entry.dedupe_key is not None:
            self._dedupe.pop(entry.dedupe_key, None)
        ahead = self._window.pop(key, None)
        if ahead is not None:
            self._window_bytes -= ahead[1]
            self._drop_ahead(ahead[0])
        tier = entry.tier
        if key in self._writing:
            return  # _harvest frees it once the write has ended
        if tier is not None:
            state = self._tiers[tier]
            state.remove(entry, state.size_of(entry, tier))
            if tier == "disk":
                self._pipeline.delete(key)
        self._pipeline.free_host(entry.block)
        entry.tensor = entry.held = entry.block = None
        if entry.ready is None:  # else _settle_copies lets go once the copy has read it
            entry.probe = None
