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

import contextlib
import heapq
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tierstore import codec
from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.errors import StoreClosedError, TierFullError, TierstoreError
from tierstore.handle import Handle
from tierstore.pipeline import Pipeline, Record
from tierstore.stats import TIERS, Stats, Tier, TierStats

__all__ = ["TierManager", "resting_nbytes"]

# NOTE [ Placement ]
# A new entry goes to the fastest tier whose budget can hold it at all; when
# that pushes the tier over budget, its *oldest* entries move one tier down
# (recursively). Backward consumes saved tensors newest first, so keeping the
# newest in the fastest tier is Belady's optimal eviction for a known future.
# An entry moves only after it has landed below: if the disk refuses it, it
# stays where it was and the save that needed the room raises TierFullError.

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
        "dedupe_key",
        "device",
        "footprint",
        "key",
        "layout",
        "loaded",
        "nbytes",
        "probe",
        "record",
        "refs",
        "tensor",
        "tier",
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
        # A tensor sharing the saved tensor's version counter, kept only while
        # our bytes alias the caller's memory (see TierManager.get).
        self.probe: torch.Tensor | None = t
        self.loaded: weakref.ref[torch.Tensor] | None = None
        self.dedupe_key: tuple[object, ...] | None = None
        self.refs = 1

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
        self._packed = 0
        self._deduplicated = 0
        self._kept = 0
        self._kept_bytes = 0
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

    def put(self, t: torch.Tensor) -> Handle:
        """Store ``t`` and return a handle; the entry lives as long as a handle does."""
        with self._locked():
            self.check_open()
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
            entry = _Entry(next(self._keys), t.detach(), resting_nbytes(t))
            self._land(entry, 0)
            self._entries[entry.key] = entry
            with contextlib.suppress(TypeError):  # storages that refuse weak references
                self._dedupe[dedupe_key] = (weakref.ref(storage), entry.key)
                entry.dedupe_key = dedupe_key
            return self._handle(entry, t)

    def get(self, handle: Handle) -> torch.Tensor:
        """The tensor ``handle`` refers to, on its original device, shape and strides.

        Raises:
            TierstoreError: the saved tensor was modified in place after it was
                stored (the error eager autograd raises in that case).
            StoreClosedError: the store was closed.
        """
        with self._locked():
            self.check_open()
            entry = self._entries[handle.key]
            for probe in (entry.probe, handle.source()):
                if probe is not None and probe._version != handle.version:
                    raise TierstoreError(
                        "tierstore: one of the variables needed for gradient computation has "
                        "been modified by an inplace operation: a saved tensor of shape "
                        f"{list(handle.shape)} and dtype {handle.dtype} is at version "
                        f"{probe._version}; expected version {handle.version} instead. "
                        "Hint: clone the tensor before modifying it in place, or "
                        "modify it before it is saved"
                    )
            tier = entry.tier
            if tier == "device":
                assert entry.tensor is not None
                return entry.tensor
            state = self._tiers[tier] if tier is not None else None
            if tier == "host":
                span, layout = entry.span()
                if state is not None:
                    state.read += entry.nbytes
                return codec.from_span(self._pipeline.to_device(span, entry.device), layout)
            # Disk. Several handles of one entry (a tensor saved by several ops)
            # share the tensor read first, while it is alive.
            cached = entry.loaded() if entry.loaded is not None else None
            if cached is not None:
                return cached
            assert entry.record is not None and entry.layout is not None
            span = self._pipeline.read(entry.key, entry.record)
            if state is not None:
                state.read += entry.footprint
            out = codec.from_span(self._pipeline.to_device(span, entry.device), entry.layout)
            entry.loaded = weakref.ref(out)
            return out

    def count_kept(self, nbytes: int) -> None:
        """Count a saved tensor the caller left on the device."""
        with self._locked():
            self._packed += 1
            self._kept += 1
            self._kept_bytes += nbytes

    def stats(self) -> Stats:
        """A snapshot of the counters; see :class:`~tierstore.stats.Stats`."""
        with self._locked():
            self.check_open()
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
            )

    @property
    def disk_directory(self) -> str | None:
        """The spill directory, once the disk tier has been used."""
        backend = self._pipeline.backend_if_open
        return str(backend.directory) if backend is not None else None

    def close(self) -> None:
        """Drop every entry, close the disk backend, remove the spill directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._dedupe.clear()
            self._pending.clear()
            for state in self._tiers.values():
                state.entries.clear()
                state.heap.clear()
                state.bytes = 0
            self._pipeline.close()

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
            host = self._pipeline.to_host(span)
            if host.untyped_storage().data_ptr() != span.untyped_storage().data_ptr():
                entry.probe = None  # a copy: later changes to the original cannot reach it
            entry.tensor, entry.layout = host, layout
        entry.tier = tier
        self._tiers[tier].add(entry, entry.nbytes)

    def _write_disk(self, entry: _Entry) -> None:
        state = self._tiers["disk"]
        span, layout = entry.span()
        frame = self._pipeline.encode(span)
        footprint = self._pipeline.footprint(frame)
        if state.bytes + footprint > state.budget:
            raise TierFullError(
                f"tierstore: the disk tier is full: {human_bytes(state.bytes)} of "
                f"disk_budget={human_bytes(state.budget)} in use, and a saved tensor of "
                f"{human_bytes(entry.nbytes)} needs {human_bytes(footprint)} more; raise "
                f"disk_budget ({ENV_PREFIX}DISK_BUDGET)"
            )
        entry.record = self._pipeline.write(entry.key, frame)
        entry.footprint = entry.record.footprint
        entry.tensor, entry.layout, entry.probe = None, layout, None
        entry.tier = "disk"
        state.add(entry, entry.footprint)

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
        if not self._lock.acquire(blocking=False):
            self._pending.append(key)
            return
        try:
            self._release_locked(key)
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
        if self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
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
        tier = entry.tier
        if tier is not None:
            state = self._tiers[tier]
            state.remove(entry, state.size_of(entry, tier))
            if tier == "disk":
                self._pipeline.delete(key)
        entry.tensor = entry.probe = None
