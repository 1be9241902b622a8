"""The tier manager: budgets, placement, demotion, deduplication, the version check, release.

It knows tensors and budgets, not autograd: :meth:`TierManager.put` takes a
tensor and returns a :class:`~tierstore.tiers.handle.Handle`, :meth:`TierManager.get`
gives the tensor back. The autograd boundary (``tierstore.tier_store``) decides
which tensors to hand it. What is in flight has a module each, called under
this manager's lock: ``readahead`` (the prefetch window), ``writebehind``
(the disk write queue) and ``transfers`` (host buffers and CUDA copies);
``pipeline`` moves bytes to and from the disk.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
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
import dataclasses
import itertools
import math
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tierstore import codec
from tierstore.config import TierConfig
from tierstore.errors import (
    StoreClosedError,
    TierstoreError,
    modified_in_place,
)
from tierstore.stats import TIERS, PackTally, Stats, Tier, TierStats
from tierstore.tiers.counts import QUIET_ROOM, SaveCounts
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.forks import forked_message, leave_to_parent
from tierstore.tiers.handle import Handle
from tierstore.tiers.inflight import InFlight
from tierstore.tiers.limits import Limits, Measures
from tierstore.tiers.movers import LinkClock, Pipeline
from tierstore.tiers.placement import TierPlacement
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.schedule import Schedule
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["POOLED_MIN_BYTES", "QUIET_ROOM", "TierManager", "resting_nbytes"]

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

# NOTE [ Deduplication under threads ]
# The same storage, view and version saved again shares its entry: the
# lookup and the new reference are one step under the lock, and a release
# queued by a finalizer meanwhile is drained only after it (the entry then
# still has the new reference). put() may release the lock after a miss
# (backpressure waits for the write queue), and another thread may save the
# same tensor then: so put() looks again once it has the lock back, rather
# than store the bytes twice. Two entries can still share a dedupe key (a
# freed storage's address reused, the weak reference dead): a release then
# removes the registration only if it is its own.

# NOTE [ Saves that stay ]
# On a GPU the step is often bound by the CPU that launches its kernels, so a
# save that stays where autograd made it must cost next to nothing: the
# filters' and keep()'s saves, those a plan keeps, and those device_budget
# holds. Each costs a decision, a count and, at unpack, the version check on
# the kept alias (where no recorder runs and no plan counts it, a bare pair
# of alias and version: a tuple is built in C, a _Kept in Python).
# device_budget's and the filters' counts are taken under a lock of their
# own (never the manager's lock, which drains releases, settles copies and
# harvests writes); a plan's are not taken save by save at all: every save
# of a step before it left its plan took the plan's choice, so the runner
# reads them off the plan (PlanRunner.kept); in a module the plan keeps
# whole, no hook runs at all (NOTE [ Modules kept whole ] in autograd/regions.py). No
# entry, handle, finalizer, dedupe key or schedule slot: autograd holds the
# tensor itself, so it lives exactly as long as eager autograd would keep
# it, and nothing needs releasing. What that skips is safe to skip:
#   * placement: an entry without one can never be demoted. So device_budget
#     keeps saves this way only in a step whose predecessor's offloadable
#     saves all fitted it (then Belady's rule demotes nothing), and only up
#     to the budget; past it, the step's later saves take the full path
#     with the device tier's budget less what stayed. The first step, and
#     one after a step that did not fit, take the full path throughout.
#   * dedupe: saving one tensor twice keeps no second copy anyway; the
#     counters count it twice, as they count kept parameters.
#   * the version check: the kept alias is a detach(), which shares the
#     version counter; unpack compares it, as eager autograd does.
#   * the plan's measured peak: a save the plan keeps is resident from its
#     save to its first use in backward, beside the device tier and the
#     bytes in flight; the peak is taken as backward begins (backward_began).
# A step that repeats one whose saves all stayed skips even the decision and
# the count: its block runs without hooks after its first save, counted as
# the block it repeats (stayed_as_before; NOTE [ Quiet blocks ] in autograd/quiet.py).

# NOTE [ Reads from backward's start ]
# Backward's reads ahead go out from backward's start, not from its first
# unpack of an entry (the first get()). In a planned step, the saves it
# keeps take no entry and no get (NOTE [ Saves that stay ]): a plan that
# offloads the first blocks' saves, as one should (their reads have all of
# backward to come back), makes its first get only when backward reaches
# those blocks, and reads sent from there begin with a miss, the rest of
# the window's reads behind it; yet the planner plays every read
# from backward's start (planner.simulate), and the plan is priced so. So
# a timed step's first use in backward (the hooks' backward_began, at a
# kept save as at a stored one) begins the reads: the schedule's order, the
# window's bound, and a top-up, whose reads count as the first unpack's
# (NOTE [ Hits ] in tierstore/tiers/readahead.py).

# NOTE [ Deferred release ]
# A Handle's finalizer can run at any moment: in another thread, or in this
# one while put() holds the lock (a garbage collection triggered inside put).
# Releasing then would mutate the tier tables mid-update. So the finalizer
# releases only when it can take the lock without waiting; otherwise it
# queues the key, and whoever holds the lock drains the queue on the way out.
# Releasing is bookkeeping only: a disk record is deleted on the I/O thread
# (NOTE [ Deletes on the I/O thread ] in tiers/movers.py), never under this lock.
# What the movers finished (D2H copies that ended: Transfers.settle; writes
# that landed: WriteBehind.harvest) is settled once, as the lock is taken,
# not at every drain: on CUDA each settle queries the events of the copies
# under way, and five drains a save (the lock's entry and exit in put and
# get, and the finalizer's) would make nine event queries in a row after a
# moved save's copy, microseconds each with the Python around them. A
# drain on the way out or from a finalizer only releases.


#: The smallest rebuilt tensor :meth:`TierManager.empty` gives memory of the
#: store's own (NOTE [ Rebuilt tensors in the store's memory ] in autograd/recipes.py):
#: a leased buffer costs a rebuild about 15 us of Python (the pool's lock, a
#: window over the block, a finalizer), more than the op that fills a tensor
#: this small, while glibc serves one from its heap's free lists, which the
#: step's next allocation of that size takes again.
POOLED_MIN_BYTES = 64 << 10


def resting_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes once offloaded: broadcast (stride-0) dimensions count once.

    A view whose elements share places rests as the storage it covers
    (NOTE [ Spans ] in codec.py).

    Example:
        >>> import torch
        >>> from tierstore.tiers.manager import resting_nbytes
        >>> resting_nbytes(torch.zeros(1, 256).expand(1024, 256))
        1024
    """
    return codec.span_nbytes(t)


class TierManager:
    """Places tensors in the device, host and disk tiers within their budgets.

    Thread-safe. Owns the movers (:class:`~tierstore.tiers.movers.Pipeline`, and
    through it the disk backend) and the transfers (host buffers, CUDA
    copies); :meth:`close` releases everything and is idempotent.

    Example:
        >>> import tempfile, torch
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.manager import TierManager
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
        self._tiers: dict[Tier, TierState] = {
            "device": TierState(int(config.device_budget), {}, []),
            "host": TierState(int(config.host_budget), {}, []),
            "disk": TierState(int(config.disk_budget), {}, []),
        }
        self._entries: dict[int, Entry] = {}
        self._dedupe: dict[tuple[object, ...], tuple[weakref.ref[object], int]] = {}
        self._keys = itertools.count()
        self._pipeline = Pipeline(config)
        # The device link's clocks, fed by timed copies, read by a plan (NOTE [ Copies
        # on CUDA ] in tiers/transfers.py): only with activation_budget, which reads them.
        links = (LinkClock(), LinkClock()) if config.activation_budget is not None else None
        self._transfers = Transfers(config, links)
        # Stops the I/O threads and frees host memory even if the store is
        # dropped without close().
        self._finalizer = weakref.finalize(self, _close_movers, self._pipeline, self._transfers)
        self._schedule = Schedule()
        self._reads = ReadAhead(
            config,
            self._pipeline,
            self._transfers,
            self._schedule,
            self._entries,
            disk=self._tiers["disk"],
        )
        self._writes = WriteBehind(
            config, self._pipeline, self._transfers, self._tiers, self._entries
        )
        self._packed = 0  # saves that took the full path; kept ones are in the counts
        self._deduplicated = 0
        self._placing = TierPlacement(
            self._tiers,
            pipeline=self._pipeline,
            transfers=self._transfers,
            reads=self._reads,
            writes=self._writes,
        )
        # NOTE [ Saves that stay ]: their counters, under a lock of their own.
        self._counts = SaveCounts(self._tiers["device"], int(config.device_budget))
        # Every save that stays calls one of these: bound here, not wrapped
        # (SaveCounts.stays, SaveCounts.count_kept).
        self.stays = self._counts.stays
        self.count_kept = self._counts.count_kept
        self._flight = InFlight(
            config,
            pipeline=self._pipeline,
            transfers=self._transfers,
            reads=self._reads,
            writes=self._writes,
            schedule=self._schedule,
            counts=self._counts,
            device=self._tiers["device"],
            links=links,
        )
        self._closed = False
        # What stats() returns once close() has run.
        self._final: Stats | None = None
        #: What the in-flight limits follow (:meth:`follow`): activation_budget's
        #: plan runner (NOTE [ Planned steps ] in planning/runner.py), else ``None``.
        self.limits: Limits | None = None
        self._resident_peak = 0
        self._parent: int | None = None  # NOTE [ Forked children ] in tierstore/tiers/forks.py
        leave_to_parent(self)

    def _forked(self) -> None:
        # Closed in the child, without touching its entries or movers (the
        # finalizer's close of those returns at once: they are marked too).
        if self._parent is None:
            self._parent = os.getppid()
        self._lock = threading.Lock()
        self._closed = True

    # -- public --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def holds_entries(self) -> bool:
        """Whether a saved tensor still has an entry here (a backward may still need it)."""
        with self._locked():
            return bool(self._entries)

    def check_open(self) -> None:
        """Raise :class:`~tierstore.StoreClosedError` if the store is closed."""
        if self._closed:
            if self._parent is not None:
                raise StoreClosedError(forked_message("this TierStore", self._parent))
            raise StoreClosedError(
                "tierstore: this TierStore is closed; create a new one, or call close() "
                "only after the last backward that needs its saved tensors"
            )

    def put(self, t: torch.Tensor, nbytes: int | None = None, tier: Tier | None = None) -> Handle:
        """Store ``t`` and return a handle; the entry lives as long as a handle does.

        ``nbytes`` is ``resting_nbytes(t)`` when the caller has it already.
        ``tier`` asks for a tier (``tierstore.keep(tier=...)``): the entry goes
        there or, when that tier's budget is 0, as far down as placement takes
        it; ``None`` starts at the fastest tier (NOTE [ Placement ]).
        """
        with self._locked():
            self.check_open()
            self._writes.raise_failure()
            self._packed += 1
            storage = t.untyped_storage()
            dedupe_key = _dedupe_key(t, storage)
            entry = self._deduplicated_entry(dedupe_key, storage)
            if entry is not None:
                self._counts.tallied(entry.tier, 0)
                return self._handle(entry, t)
            if self._schedule.unpacking:
                self._flight.step_started(cpu=t.device.type == "cpu")
            size = resting_nbytes(t) if nbytes is None else nbytes
            # NOTE [ Copies in flight ] in tiers/inflight.py: what leaves the device waits
            # for room in flight, then the device tier's oldest move down to its budget.
            cap = self._flight.make_room(size, self._unlocked)
            copies_over = self._placing.device_to_budget(cap)
            self.check_open()  # closed by another thread while this one waited
            # NOTE [ Deduplication under threads ]: saved meanwhile by another thread?
            entry = self._deduplicated_entry(dedupe_key, storage)
            if entry is not None:
                self._counts.tallied(entry.tier, 0)
                return self._handle(entry, t)
            entry = Entry(next(self._keys), t.detach(), size)
            stayed = self._counts.stayed_now()[1]
            if stayed:  # NOTE [ Saves that stay ]: the device tier holds the rest
                self._tiers["device"].budget = max(0, int(self.config.device_budget) - stayed)
            if copies_over:  # NOTE [ Copies in flight ] in tiers/inflight.py
                self._placing.hold(entry, "device")
            else:
                self._placing.land(entry, 0 if tier is None else TIERS.index(tier))
            self._counts.tallied(entry.tier, size)
            self._entries[entry.key] = entry
            self._schedule.packed(entry.key, (dedupe_key[2], t.dtype))
            with contextlib.suppress(TypeError):  # storages that refuse weak references
                self._dedupe[dedupe_key] = (weakref.ref(storage), entry.key)
                entry.dedupe_key = dedupe_key
            # Writes in flight (WriteBehind is true while any is) and none may
            # queue: this save waits for its own (NOTE [ Write staging ]).
            if self._writes and self._writes.synchronous:
                try:
                    self._writes.finish(self._unlocked)
                except BaseException:  # Ctrl-C in the wait, say: no handle will release it
                    self._release_locked(entry.key)
                    raise
            if self.limits is not None:
                self._note_resident()
                if entry.tier != "device":
                    self._flight.let_go(size, entry.device)
            return self._handle(entry, t)

    # -- activation_budget (NOTE [ Planned steps ] in planning/runner.py) ---------------------

    def measures(self) -> Measures:
        """The clocks and waits a plan's runner measures this manager's steps by.

        The keyword arguments of ``PlanRunner`` after the config: the public
        ``TierStore`` builds the runner from them and has this manager
        :meth:`follow` it (the tiers never import planning).
        """
        return self._flight.measures()

    def follow(self, limits: Limits | None) -> None:
        """Take the in-flight limits, and the device tier's, from ``limits`` from now on.

        ``None``: the config's own. The manager closes what it follows as it
        closes (:meth:`close`).
        """
        self.limits = self._counts.limits = self._flight.limits = limits

    def _note_resident(self) -> None:
        """Saved bytes on the device now, in flight included: the peak the budget bounds."""
        with self._counts.lock:
            self._resident_peak = max(self._resident_peak, self._flight.resident())

    def plan_step_ended(self) -> tuple[str | None, list[str]]:
        """The step ended: plan from its profile or measure the plan; (INFO line, warnings)."""
        runner = self.limits
        assert runner is not None
        with self._locked():
            self._transfers.settle()  # the copies that ended count in the link's rates
            counts = self._counts
            with counts.lock:
                # The peak where no backward ran; after one, less than it took.
                peak = max(self._resident_peak, self._flight.kept_resident())
                self._resident_peak = 0
                n, nbytes = runner.kept()  # the step's plan-kept saves, counted for good
                counts.add_kept("device_budget", n, nbytes)
            line = runner.step_ended(peak)
            self._flight.plan_step_ended(runner.window_bytes())
            said, runner.warnings = runner.warnings, []
            return line, said

    def _deduplicated_entry(self, dedupe_key: tuple[Any, ...], storage: object) -> Entry | None:
        """The live entry already holding this storage, view and version, with one more ref."""
        hit = self._dedupe.get(dedupe_key)
        # The weak reference proves it is the same storage, not a new one
        # that happens to sit at a freed address.
        if hit is None or hit[0]() is not storage:
            return None
        entry = self._entries[hit[1]]
        entry.refs += 1
        self._deduplicated += 1
        return entry

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
            self._writes.raise_failure()
            entry = self._entries[handle.key]
            self._check_version(entry, handle)
            limits = self.limits
            if limits is not None:  # NOTE [ Timing a profile ] in planning/timers.py
                timer = limits.timer
                self._transfers.blocked = timer.blocked if timer is not None else None
            first = not self._schedule.unpacking
            if first:
                self._flight.begin_reads()
            self._schedule.unpacked(entry.key)
            got = self._fetch(entry, first)
            if limits is not None:  # with this entry taken and the reads topped up
                self._note_resident()
                if entry.tier != "device":
                    self._flight.let_go(entry.nbytes, entry.device)
        if isinstance(got, torch.Tensor):
            return got
        return self._reads.finish(entry, got, self._lock)  # waits outside the lock

    def _fetch(
        self, entry: Entry, first: bool
    ) -> torch.Tensor | concurrent.futures.Future[torch.Tensor]:
        """``entry``'s tensor, or the read to wait for with the lock released."""
        if entry.tier == "device":
            assert entry.tensor is not None
            self._reads.passed(first=first)  # NOTE [ Prefetch ]
            return entry.tensor
        if entry.tier == "host":
            span, layout = entry.span()
            self._tiers["host"].read += entry.nbytes
            if span.device == entry.device:  # CPU: the host tier is the device's memory
                return codec.from_span(span, layout, self._transfers.allocator(span.device))
            return self._reads.from_host(entry, span, layout, first=first)
        return self._reads.from_disk(entry, first=first)

    @staticmethod
    def _check_version(entry: Entry, handle: Handle) -> None:
        """Raise as eager autograd would if the saved tensor changed (NOTE [ Version check ])."""
        aliases = (entry.probe, *handle.sources())
        versions = [entry.stale, *(a._version for a in aliases if a is not None)]
        for version in versions:
            if version is not None and version != handle.version:
                raise modified_in_place(handle.shape, handle.dtype, version, handle.version)

    def backward_began(self, reads: bool = True) -> None:
        """A timed step's backward used its first save: take the peak, start the reads.

        Forward only adds what the plan keeps, so this is where all of it is
        resident (NOTE [ Saves that stay ]); a profiled step's peak is not
        judged. NOTE [ Reads from backward's start ]: the reads ahead go out
        now, not at the first unpack of an entry; ``reads=False``: not yet
        (a saved tensor read by hand, outside any backward).
        """
        with self._counts.lock:
            self._resident_peak = max(self._resident_peak, self._flight.kept_resident())
        if not reads or self._schedule.unpacking or not self._entries:
            return  # begun already (a step's second backward), or nothing to read
        with self._locked():
            if self._closed or self._schedule.unpacking:
                return
            self._flight.begin_reads()
            self._reads.passed(first=True)
            if self.limits is not None:
                self._note_resident()

    def stayed_as_before(self, tally: PackTally) -> bool:
        """A quiet block's saves, counted as those of the block it repeats (``tally``).

        NOTE [ Quiet blocks ] in autograd/quiet.py; :meth:`SaveCounts.stayed_as_before
        <tierstore.tiers.counts.SaveCounts.stayed_as_before>`.
        """
        return self._counts.stayed_as_before(tally)

    def step_ended(self) -> None:
        """A backward ran and the next step begins (NOTE [ Saves that stay ])."""
        self._counts.step_ended()

    def empty(
        self,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor | None:
        """An uninitialised tensor of this layout in the store's own memory, or ``None``.

        On a CPU, a leased pool buffer that returns when the tensor's storage is
        freed, as disk reads land (the heap when the pool is full); ``None`` for
        another device, or one under :data:`POOLED_MIN_BYTES`. Like a read,
        it counts against the prefetch window while it lives (NOTE [ Prefetch ]
        in tiers/readahead.py).
        """
        alloc = self._transfers.allocator(device)
        if alloc is None or math.prod(shape) * dtype.itemsize < POOLED_MIN_BYTES:
            return None
        with self._locked():
            self.check_open()
            out = codec.empty_strided(shape, stride, dtype, alloc)
            return self._reads.hold(out, out.untyped_storage().nbytes())

    def count_recomputed(self, nbytes: int, device: torch.device | None = None, n: int = 1) -> None:
        """Count ``n`` saved tensors, ``nbytes`` in all, the caller will rebuild in backward.

        ``device``: theirs (a planned step counts a CPU tensor's bytes as let
        go: NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py).
        """
        # No entry, so not the manager's lock: counted as kept saves are
        # (NOTE [ Saves that stay ]).
        counts = self._counts
        with counts.lock:
            counts.recomputed += n
            counts.recomputed_bytes += nbytes
            counts.tally.add("recomputed", nbytes, n)
        if device is not None and self.limits is not None:
            self._flight.let_go(nbytes, device)

    def pack_tally(self) -> PackTally:
        """A snapshot of the saves by where they went (NOTE [ Is it working? ])."""
        return self._counts.pack_tally()

    @property
    def moved(self) -> bool:
        """Whether anything left the device (host or disk tier held bytes) or is rebuilt."""
        return (
            self._tiers["host"].peak > 0
            or self._tiers["disk"].peak > 0
            or self._counts.recomputed > 0
        )

    def stats(self) -> Stats:
        """A snapshot of the counters; see :class:`~tierstore.stats.Stats`.

        Writes of entries already released are waited for first, so that what
        backward freed shows as freed. A live entry whose write is still
        queued counts its reservation (an upper bound) in the disk bytes;
        :meth:`flush` settles those too. After :meth:`close`, the figures as
        close() left them: totals and peaks kept, every byte held now 0.
        """
        with self._locked():
            if self._final is not None:
                return self._final
            if not self._closed:
                self._writes.wait(self._writes.futures(dead_only=True), self._unlocked)
                if self._pipeline.deleting:  # NOTE [ Deletes on the I/O thread ]
                    self._unlocked(self._pipeline.settle_deletes)
            return self._snapshot()

    def _snapshot(self) -> Stats:
        """The counters as they are (under the lock)."""
        pinned = self._transfers.pinned_pool_if_open
        buffers = self._transfers.buffers_if_open
        backend = self._pipeline.backend_if_open
        reads, writes = self._reads, self._writes
        counts = self._counts
        kept, kept_bytes = counts.kept_totals()
        with counts.lock:
            recomputed, recomputed_bytes = counts.recomputed, counts.recomputed_bytes
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
            packed=self._packed + kept + recomputed,
            deduplicated=self._deduplicated,
            kept=kept,
            kept_bytes=kept_bytes,
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

    def flush(self) -> None:
        """Wait until every queued disk write has ended (and raise if one failed)."""
        with self._locked():
            self._writes.wait(self._writes.futures(), self._unlocked)
            self._writes.raise_failure()

    @property
    def disk_directory(self) -> str | None:
        """The spill directory, once the disk tier has been used."""
        backend = self._pipeline.backend_if_open
        return str(backend.directory) if backend is not None else None

    def close(self) -> None:
        """Drop every entry, stop the I/O, remove the spill directory. Idempotent.

        :meth:`stats` still answers afterwards, with the final figures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.limits is not None:
                self.limits.close()
            futures: list[concurrent.futures.Future[Any]] = list(self._writes.futures())
            futures += self._reads.in_flight()
            self._reads.close()
        # Requests under way end first (their callbacks take no lock); then the
        # threads stop and the backend and its directory go. With a dead I/O
        # thread they never end (NOTE [ A dead I/O thread ]): close anyway.
        with contextlib.suppress(TierstoreError):
            self._pipeline.wait(futures)
        with self._lock:
            self._entries.clear()
            self._dedupe.clear()
            self._pending.clear()
            self._writes.clear()
            for state in self._tiers.values():
                state.entries.clear()
                state.heap.clear()
                state.bytes = 0
            final = self._snapshot()
        self._finalizer()
        with self._lock:  # the pools are gone with the movers: nothing is held now
            self._final = dataclasses.replace(final, host_pool_bytes=0, buffer_bytes_in_use=0)

    def _unlocked(self, wait: Callable[[], object]) -> None:
        """Run ``wait`` with the lock released (forward waiting on copies or writes)."""
        self._lock.release()
        try:
            with torch.profiler.record_function("tierstore::pack_wait"):
                wait()
        finally:
            self._lock.acquire()

    # -- lifetimes (NOTE [ Deferred release ]) ----------------------------------

    def _handle(self, entry: Entry, t: torch.Tensor) -> Handle:
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
            self._drain(settle=True)
            yield
            self._drain()
        # A finalizer in another thread may have queued a key after the drain.
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self, *, settle: bool = False) -> None:
        """Release the queued keys; with ``settle``, first what the movers finished.

        NOTE [ Deferred release ]: copies and writes are settled once per
        lock, as it is taken, not at each drain.
        """
        if self._closed:
            self._pending.clear()
            return
        if settle:
            self._transfers.settle()
            self._writes.harvest()
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
        key_of = entry.dedupe_key
        if key_of is not None and self._dedupe.get(key_of, (None, None))[1] == key:
            del self._dedupe[key_of]  # only its own: NOTE [ Deduplication under threads ]
        self._reads.drop(key)
        if key in self._writes:
            return  # harvest() frees it once the write has ended
        if entry.tier is not None:
            state = self._tiers[entry.tier]
            state.remove(entry, state.size_of(entry))
            if entry.tier == "disk":
                self._pipeline.delete(key)
        self._transfers.free_host(entry.block)
        entry.tensor = entry.held = entry.block = None
        if entry.ready is None:  # else settle() lets go once the copy has read it
            entry.probe = None


def _dedupe_key(t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """What makes two saves the same bytes: storage address, view, dtype, device, version."""
    return (
        storage.data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
        t._version,
    )


def _close_movers(pipeline: Pipeline, transfers: Transfers) -> None:
    pipeline.close()
    transfers.close()
