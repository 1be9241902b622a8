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
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tierstore import codec
from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.errors import (
    StoreClosedError,
    TierFullError,
    TierstoreError,
    TierstoreWarning,
    modified_in_place,
)
from tierstore.planning.runner import PlanRunner
from tierstore.stats import TIERS, PackTally, Placement, Stats, Tier, TierStats
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.forks import forked_message, leave_to_parent
from tierstore.tiers.handle import Handle
from tierstore.tiers.movers import LinkClock, Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.schedule import Schedule
from tierstore.tiers.transfers import Transfers, cuda_events, page_fault_s
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["TierManager", "resting_nbytes"]

# NOTE [ Placement ]
# A new entry goes to the fastest tier whose budget can hold it at all; when
# that pushes the tier over budget, its *oldest* entries move one tier down
# (recursively). Backward consumes saved tensors newest first, so keeping the
# newest in the fastest tier is Belady's optimal eviction for a known future.
# An entry moves only after it has landed below: if the disk refuses it, it
# stays where it was and the save that needed the room raises TierFullError.
# On CUDA an entry moved from the host tier to the disk keeps its block of
# the pinned pool until its write lands, so the pool (host_budget plus
# write_queue_bytes) can be full while the host tier has room: the save that
# made the room then waits for those writes rather than refuse (an H200
# step whose 1 GiB saves pushed the tier down raised TierFullError here).

# NOTE [ CPU tensors skip the host tier ]
# For a tensor on the CPU, the host tier is the same RAM it already sits in:
# a host "copy" frees nothing. So while there is a disk tier (disk_budget >
# 0), a CPU entry goes from the device tier (device_budget: the bytes it may
# keep in RAM as they are) straight to the disk. The host tier keeps its
# meaning for accelerator tensors, and for CPU tensors only where there is no
# disk tier (disk_budget=0: a host-only configuration, as before) and as the
# place where an entry whose disk write failed stays (NOTE [ Failed writes ]).
# The rule depends on values, not on where they came from: an explicit
# host_budget does not pull CPU tensors back into RAM, since equal configs
# describe the same store, and a fleet's TOML sizing host_budget for its GPU
# nodes must not make a CPU run save nothing. device_budget is the setting
# that keeps CPU tensors in RAM.

# NOTE [ Copies in flight ]
# A D2H copy's source stays on the device until the copy has read it, so
# the bytes under way are bounded, by write_queue_bytes as the disk queue
# is. Past that bound:
#   * without activation_budget, and in a step that follows no plan (the
#     safe placement of the warm-up, profiled and waiting steps), the save
#     waits for the oldest copy, as the README promises: every eligible
#     save leaves the device, and forward runs at the link's pace where the
#     link is the bottleneck. (It used to stay on the device without a
#     word: the tail of forward never moved. Under the safe placement,
#     which offloads everything, it let the device tier grow past the
#     budget by all that the link had not moved yet; an H200's warm-up
#     steps under a budget peaked at 5.4-6.9 GiB of a 7.6 GiB step, which
#     max_memory_reserved then kept.)
#   * in a planned step, forward never blocks the CPU on a CUDA event (while
#     it waits it queues no kernels, and the copies were meant to hide
#     behind those): a query, not a wait. While copies over the bound are
#     under way (the events queried at each call, Transfers.settle), a new
#     save stays on the device tier, over device_budget if need be, as the
#     newest entry; the plan bounds what it sends to what the link hides.
# Once the copies land, the next save first moves the device tier's oldest
# entries down until it is within budget again or the copies are over the
# bound once more; backward takes whatever is still on the device as it is.
# The decision reads only byte counts: the CPU tests drive it with events
# that report "not done".

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
# whole, no hook runs at all (NOTE [ Modules kept whole ] in tier_store.py). No
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
# the block it repeats (stayed_as_before; NOTE [ Quiet blocks ] in tier_store.py).

# NOTE [ Reads from backward's start ]
# Backward's reads ahead used to go out at its first unpack of an entry,
# the first get(). In a planned step, the saves it keeps take no entry and
# no get (NOTE [ Saves that stay ]): a plan that offloads the first blocks'
# saves, as one should (their reads have all of backward to come back),
# made its first get when backward reached those blocks, a miss, with the
# rest of the window's reads behind it; yet the planner plays every read
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
# get, and the finalizer's) made nine event queries in a row after a
# moved save's copy, on an H200's host some 3 us each with the Python
# around them. A drain on the way out or from a finalizer only releases.


#: The smallest rebuilt tensor :meth:`TierManager.empty` gives memory of the
#: store's own (NOTE [ Rebuilt tensors in the store's memory ] in autograd/recompute.py):
#: a leased buffer costs a rebuild about 15 us of Python (the pool's lock, a
#: window over the block, a finalizer), more than the op that fills a tensor
#: this small, while glibc serves one from its heap's free lists, which the
#: step's next allocation of that size takes again.
POOLED_MIN_BYTES = 64 << 10

#: NOTE [ Quiet blocks ] in tier_store.py: a block repeats the one before only
#: where that one's bytes fit this many times in the room device_budget leaves.
QUIET_ROOM = 8


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
        self._packed = 0  # saves that took the full path; kept ones are in _kept_by
        self._deduplicated = 0
        # NOTE [ Saves that stay ]: their counters, under a lock of their own.
        self._counts = threading.Lock()
        # Saves kept as they are, by why: [count, bytes] (device_budget: by the
        # budget or the plan, without an entry).
        self._kept_by: dict[Placement, list[int]] = {"device_budget": [0, 0]}
        # What the device tier had free of device_budget as the step began; -1:
        # this step's saves may not stay (its predecessor did not fit, or one
        # of its own saves did not).
        self._room = -1
        self._step_bytes = 0  # offloadable bytes saved this step (the hooks ask stays())
        self._stayed_n = 0  # of them, saves that stayed by device_budget without an entry
        self._stayed = 0  # and their bytes, once one did not: till then, all of _step_bytes
        self._recomputed = 0  # saves rebuilt in backward, and their bytes; under _counts
        self._recomputed_bytes = 0
        self._restrided_views = 0  # NOTE [ Spans ] in codec.py: views that come back dense
        self._copy_wait_s = 0.0  # forward's waits for D2H copies (NOTE [ Copies in flight ])
        # Saves by where they went (NOTE [ Is it working? ] in tierstore/stats.py).
        self.tally = PackTally()
        self._closed = False
        # What stats() returns once close() has run.
        self._final: Stats | None = None
        #: activation_budget's profile, plan and measurements (NOTE [ Planned steps ]).
        self.plans: PlanRunner | None = None
        if config.activation_budget is not None:
            self.plans = PlanRunner(
                config,
                self._pipeline.write_clock,
                self._pipeline.read_clock,
                lambda: self._pack_wait_s() + self._reads.unpack_wait_s,
                self._pipeline.io_cpu_s,
                events=cuda_events,  # NOTE [ Timing a profile ] in planning/runner.py
                device_links=links,
                cpu_step_began=self._trim,
                page_fault_s=page_fault_s,
            )
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
                self._tally(entry, 0)
                return self._handle(entry, t)
            if self._schedule.unpacking:
                self._step_started(cpu=t.device.type == "cpu")
            if self.plans is not None:
                self._follow_plan()
            size = resting_nbytes(t) if nbytes is None else nbytes
            copies_over = self._make_room_in_flight(size)
            self.check_open()  # closed by another thread while this one waited
            # NOTE [ Deduplication under threads ]: saved meanwhile by another thread?
            entry = self._deduplicated_entry(dedupe_key, storage)
            if entry is not None:
                self._tally(entry, 0)
                return self._handle(entry, t)
            entry = Entry(next(self._keys), t.detach(), size)
            stayed = self._stayed_now()[1]
            if stayed:  # NOTE [ Saves that stay ]: the device tier holds the rest
                self._tiers["device"].budget = max(0, int(self.config.device_budget) - stayed)
            if copies_over:  # NOTE [ Copies in flight ]
                self._hold(entry, "device")
            else:
                self._land(entry, 0 if tier is None else TIERS.index(tier))
            self._tally(entry, size)
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
            if self.plans is not None:
                self._note_resident()
            if entry.tier != "device":
                self._let_go(size, entry.device)
            return self._handle(entry, t)

    # -- activation_budget (NOTE [ Planned steps ] in planning/runner.py) ---------------------

    def _follow_plan(self) -> None:
        """The device tier holds what the plan keeps, or the safe placement's bytes."""
        assert self.plans is not None
        planned = self.plans.planned
        self._tiers["device"].budget = _UNBOUNDED if planned else self.plans.safe_device_bytes()

    def _note_resident(self) -> None:
        """Saved bytes on the device now, in flight included: the peak the budget bounds."""
        with self._counts:
            self._resident_peak = max(self._resident_peak, self._resident())

    def _resident(self) -> int:
        """Saved bytes on the device: the device tier, in flight, and what the plan kept."""
        return self._kept_resident() + self._reads.outstanding_bytes()

    def plan_step_ended(self) -> tuple[str | None, list[str]]:
        """The step ended: plan from its profile or measure the plan; (INFO line, warnings)."""
        runner = self.plans
        assert runner is not None
        with self._locked():
            self._transfers.settle()  # the copies that ended count in the link's rates
            with self._counts:
                # The peak where no backward ran; after one, less than it took.
                peak = max(self._resident_peak, self._kept_resident())
                self._resident_peak = 0
                n, nbytes = runner.kept()  # the step's plan-kept saves, counted for good
                counts = self._kept_by["device_budget"]
                counts[0] += n
                counts[1] += nbytes
            line = runner.step_ended(peak)
            # A plan's window bounds both ways: the write queue is resident
            # too, and a queue grown past the plan's would break the budget.
            # The limits stay within the largest kept plan's window; each
            # planned step holds them to its own plan's (in_flight_bytes).
            window = runner.window_bytes()
            self._reads.limit.bound(
                window if window is not None else int(self.config.prefetch_bytes)
            )
            self._writes.limit.bound(
                window if window is not None else int(self.config.write_queue_bytes)
            )
            self._reads.limit.hold_to(None)
            self._writes.limit.hold_to(None)
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

    def _step_started(self, *, cpu: bool) -> None:
        """The first new save after a backward: the in-flight limits learn from that step.

        A step under activation_budget on a CPU starts on a heap whose free
        pages went back to the system (NOTE [ Handing the heap back ] in
        tierstore/tiers/host_pool.py): here, unless the step follows a plan,
        whose runner handed them back as its first save came, kept or not.
        """
        self._reads.limit.step_started()
        self._writes.limit.step_started()
        plans = self.plans
        self._trim(cpu and plans is not None and not plans.planned)

    def _trim(self, heap: bool) -> None:
        """Hand back the pages of idle buffers as a step begins, and the heap's if ``heap``.

        Host buffers (NOTE [ Leased buffers ]) and disk I/O buffers (NOTE [
        Idle I/O buffers ]), each under its own pool's lock: from put() under
        the manager's lock too, from the plan runner not.
        """
        self._transfers.trim(heap)
        self._pipeline.trim()

    def _let_go(self, nbytes: int, device: torch.device) -> None:
        """Bytes of a save that left ``device``'s memory: counted by a planned CPU step.

        NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py. Under
        ``_counts``, which rebuilt saves count under without the manager's lock.
        """
        plans = self.plans
        if plans is not None and device.type == "cpu" and plans.hands_back():
            with self._counts:
                self._transfers.let_go(nbytes, plans.budget_bytes_now())

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
            if self.plans is not None:  # NOTE [ Timing a profile ] in planning/runner.py
                timer = self.plans.timer
                self._transfers.blocked = timer.blocked if timer is not None else None
            first = not self._schedule.unpacking
            if first:
                self._begin_reads()
            self._schedule.unpacked(entry.key)
            got = self._fetch(entry, first)
            if self.plans is not None:  # with this entry taken and the reads topped up
                self._note_resident()
            if entry.tier != "device":
                self._let_go(entry.nbytes, entry.device)
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

    def count_kept(self, nbytes: int, why: Placement = "keep", n: int = 1) -> None:
        """Count ``n`` saves of ``nbytes`` in all the caller left on the device, and why.

        NOTE [ Saves that stay ].
        """
        with self._counts:
            counts = self._kept_by.get(why)
            if counts is None:
                counts = self._kept_by[why] = [0, 0]
            counts[0] += n
            counts[1] += nbytes

    def _begin_reads(self) -> None:
        """Backward's reads begin: the schedule's order, the window's bound; under the lock."""
        self._schedule.begin()
        if self.plans is not None:  # NOTE [ Planned steps ]
            held = self._writes.queued_bytes + self._tiers["device"].bytes
            # NOTE [ In-flight sizing ] in tiers/sizing.py: a plan's window exactly
            ahead = self.plans.read_ahead_bytes(held)
            self._reads.limit.hold_to(ahead, exact=self.plans.planned)

    def backward_began(self, reads: bool = True) -> None:
        """A timed step's backward used its first save: take the peak, start the reads.

        Forward only adds what the plan keeps, so this is where all of it is
        resident (NOTE [ Saves that stay ]); a profiled step's peak is not
        judged. NOTE [ Reads from backward's start ]: the reads ahead go out
        now, not at the first unpack of an entry; ``reads=False``: not yet
        (a saved tensor read by hand, outside any backward).
        """
        with self._counts:
            self._resident_peak = max(self._resident_peak, self._kept_resident())
        if not reads or self._schedule.unpacking or not self._entries:
            return  # begun already (a step's second backward), or nothing to read
        with self._locked():
            if self._closed or self._schedule.unpacking:
                return
            self._begin_reads()
            self._reads.passed(first=True)
            if self.plans is not None:
                self._note_resident()

    def _kept_resident(self) -> int:
        """What the plan kept, the device tier and the write queue; under _counts.

        Forward's figure: nothing is read ahead yet, and the reads' count is theirs.
        """
        kept = self.plans.kept_resident() if self.plans is not None else 0
        return kept + self._tiers["device"].bytes + self._writes.queued_bytes

    def stays(self, nbytes: int) -> bool:
        """Whether a save of ``nbytes`` stays on the device by device_budget, counted if so.

        NOTE [ Saves that stay ]: only in a step whose predecessor fitted, and
        only while this step's saves so far fit too; once one does not, the
        device tier holds the budget less what stayed.
        """
        counts = self._counts
        counts.acquire()  # not `with`: half the cost, paid by every save that stays
        try:
            total = self._step_bytes = self._step_bytes + nbytes
            if total <= self._room:
                self._stayed_n += 1
                return True
            if self._room >= 0:  # the first that does not fit: the rest take the full path
                self._room = -1
                self._stayed = total - nbytes
            return False
        finally:
            counts.release()

    def stayed_as_before(self, tally: PackTally) -> bool:
        """A quiet block's saves, counted as those of the block it repeats (``tally``).

        NOTE [ Quiet blocks ] in tier_store.py: only where device_budget's saves may
        stay this step (NOTE [ Saves that stay ]) and the repeated block's fit
        :data:`QUIET_ROOM` times over in the room left; else ``False``, and
        nothing is counted.
        """
        n, nbytes = tally.counts.get("device_budget", (0, 0))
        with self._counts:
            if self.plans is not None or self._step_bytes + QUIET_ROOM * nbytes > self._room:
                return False  # a room of -1: this step's saves may not stay
            self._step_bytes += nbytes
            self._stayed_n += n
            for why, (k, b) in tally.counts.items():
                if why != "device_budget":
                    counts = self._kept_by.setdefault(why, [0, 0])  # type: ignore[arg-type]
                    counts[0] += k
                    counts[1] += b
            return True

    def _stayed_now(self) -> tuple[int, int]:
        """The saves that stayed by device_budget this step, and their bytes; under _counts."""
        return self._stayed_n, self._step_bytes if self._room >= 0 else self._stayed

    def _kept_now(self) -> tuple[int, int]:
        """Saves kept this step without an entry (not yet in ``_kept_by``); under _counts."""
        if self.plans is not None:
            return self.plans.kept()
        return self._stayed_now()

    def step_ended(self) -> None:
        """A backward ran and the next step begins (NOTE [ Saves that stay ])."""
        with self._counts:
            if self.plans is not None:
                return
            n, nbytes = self._stayed_now()
            counts = self._kept_by["device_budget"]
            counts[0] += n
            counts[1] += nbytes
            device = self._tiers["device"]
            device.budget = int(self.config.device_budget)
            room = device.budget - device.bytes  # a graph kept across steps holds some
            self._room = room if 0 < self._step_bytes <= room else -1
            self._step_bytes = self._stayed_n = self._stayed = 0

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
        with self._counts:
            self._recomputed += n
            self._recomputed_bytes += nbytes
            self.tally.add("recomputed", nbytes, n)
        if device is not None:
            self._let_go(nbytes, device)

    def pack_tally(self) -> PackTally:
        """A snapshot of the saves by where they went (NOTE [ Is it working? ])."""
        with self._counts:
            tally = self.tally.copy()
            now = self._kept_now()
            for why, (n, nbytes) in self._kept_by.items():
                live = now if why == "device_budget" else (0, 0)
                if n + live[0]:
                    had_n, had_bytes = tally.counts.get(why, (0, 0))
                    tally.counts[why] = (had_n + n + live[0], had_bytes + nbytes + live[1])
            return tally

    def _kept_totals(self) -> tuple[int, int]:
        """Saves kept as they are, whatever the reason, and their bytes."""
        with self._counts:
            n, nbytes = self._kept_now()
            return (
                n + sum(n for n, _ in self._kept_by.values()),
                nbytes + sum(b for _, b in self._kept_by.values()),
            )

    def _tally(self, entry: Entry, nbytes: int) -> None:
        """Count a save by where it landed: within device_budget, or below the device."""
        with self._counts:
            self.tally.add("device_budget" if entry.tier == "device" else "offloaded", nbytes)

    @property
    def moved(self) -> bool:
        """Whether anything left the device (host or disk tier held bytes) or is rebuilt."""
        return self._tiers["host"].peak > 0 or self._tiers["disk"].peak > 0 or self._recomputed > 0

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
        kept, kept_bytes = self._kept_totals()
        with self._counts:
            recomputed, recomputed_bytes = self._recomputed, self._recomputed_bytes
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
            restrided_views=self._restrided_views,
            prefetch_hits=reads.hits,
            prefetch_misses=reads.misses,
            bytes_prefetched=reads.prefetched_bytes,
            unpack_wait_s=reads.unpack_wait_s,
            pack_wait_s=self._pack_wait_s(),
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
            if self.plans is not None:
                self.plans.close()
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

    # -- placement (NOTE [ Placement ]) -----------------------------------------

    def _land(self, entry: Entry, start: int) -> None:
        """Rest ``entry`` in the fastest tier from ``TIERS[start]`` down that can take it."""
        for tier in TIERS[start:]:
            state = self._tiers[tier]
            if state.budget == 0 or self._skips(entry, tier):
                continue
            if tier == "disk":
                self._write_disk(entry)
                return
            if entry.nbytes <= state.budget:
                self._make_room(tier, entry.nbytes)
                self._hold(entry, tier)
                return
        raise self._no_tier_error(entry, start)

    def _skips(self, entry: Entry, tier: Tier) -> bool:
        """NOTE [ CPU tensors skip the host tier ]."""
        return tier == "host" and entry.device.type == "cpu" and self._tiers["disk"].budget > 0

    def _make_room(self, tier: Tier, nbytes: int) -> None:
        state = self._tiers[tier]
        below = TIERS.index(tier) + 1
        while state.bytes + nbytes > state.budget:
            oldest = state.oldest()
            if oldest is None:
                return
            self._land(oldest, below)  # raises, leaving `oldest` in place, if nothing takes it
            state.remove(oldest, oldest.nbytes)

    def _hold(self, entry: Entry, tier: Tier) -> None:
        if tier == "host" and entry.layout is None:
            span, layout = entry.span()
            try:
                self._transfers.to_host(entry, span)
            except TierFullError:
                if not self._writes:
                    raise
                # NOTE [ Placement ]: the entries just moved down hold their
                # pool blocks until their writes land. Wait for those, then
                # ask again; only a pool full of live entries refuses.
                self._writes.wait_all_locked()
                self._transfers.to_host(entry, span)
            self._laid_out(entry, layout, tier, span.element_size())
        entry.tier = tier
        self._tiers[tier].add(entry, entry.nbytes)

    def _write_disk(self, entry: Entry) -> None:
        self._pipeline.check_alive()  # before anything changes: a dead thread writes nothing
        state = self._tiers["disk"]
        self._reads.drop(entry.key)  # a copy back from the host tier
        reserve = self._pipeline.footprint_bound(entry.nbytes)
        if state.bytes + reserve > state.budget and self._writes:
            # Writes in flight hold reservations, and dead entries' writes hold
            # space they will give back: settle them before calling it full.
            self._writes.wait_all_locked()
        if state.bytes + reserve > state.budget:
            raise TierFullError(
                f"tierstore: the disk tier is full: {human_bytes(state.bytes)} of "
                f"disk_budget={human_bytes(state.budget)} in use, and a saved tensor of "
                f"{human_bytes(entry.nbytes)} needs {human_bytes(reserve)} more; raise "
                f"disk_budget ({ENV_PREFIX}DISK_BUDGET)"
            )
        if entry.layout is None:  # from the device tier: a view may need a dense copy
            assert entry.tensor is not None
            span, layout = codec.to_span(entry.tensor, self._transfers.allocator(entry.device))
        else:
            span, layout = entry.span()
        # NOTE [ Write staging ]: nothing is staged for a write put() waits for.
        self._transfers.to_host(entry, span, staged=not self._writes.synchronous)
        self._laid_out(entry, layout, "disk", span.element_size())
        entry.tier = "disk"
        entry.footprint = reserve
        state.add(entry, reserve, written=False)  # NOTE [ Write-behind ]: counted when written
        self._writes.submit(entry)  # waited for by put() when synchronous

    def _laid_out(self, entry: Entry, layout: codec.Layout, tier: Tier, itemsize: int) -> None:
        """Give ``entry`` the layout it rests in; a view that comes back dense is never silent.

        NOTE [ Spans ] in codec.py: counted in stats(), warned of once.
        """
        first, entry.layout = entry.layout is None, layout
        if not first or layout.saved_stride is None:  # counted once, when it first left
            return
        self._restrided_views += 1
        if self._restrided_views == 1:
            warnings.warn(_restrided_warning(entry, layout, tier, itemsize), stacklevel=2)

    def _make_room_in_flight(self, size: int) -> bool:
        """Backpressure before a save of ``size`` bytes; whether D2H copies leave it on the device.

        The write queue waits (NOTE [ Write-behind ]); D2H copies never do:
        NOTE [ Copies in flight ].
        """
        if self.plans is not None:  # NOTE [ Planned steps ]: the plan's or the safe placement's
            self._writes.limit.hold_to(self.plans.in_flight_bytes(adding=size))
        self._writes.make_room(self._unlocked)
        cap = self._writes.limit.cap_bytes
        device = self._tiers["device"]
        # Only a planned step may leave a save on the device instead of waiting.
        planned = self.plans is not None and self.plans.planned
        while not planned and self._transfers.copies_over(cap):
            began = time.perf_counter()
            self._unlocked(self._transfers.oldest_copy().synchronize)
            self._copy_wait_s += time.perf_counter() - began
            self._transfers.settle()
        while not self._transfers.copies_over(cap):
            oldest = device.oldest() if device.bytes > device.budget else None
            if oldest is None:
                return False
            self._land(oldest, TIERS.index("host"))  # raises, leaving it in place, if full
            device.remove(oldest, oldest.nbytes)
        return True

    def _pack_wait_s(self) -> float:
        """Seconds forward waited: for the write queue, and for copies off the device."""
        return self._writes.pack_wait_s + self._copy_wait_s

    def _unlocked(self, wait: Callable[[], object]) -> None:
        """Run ``wait`` with the lock released (forward waiting on copies or writes)."""
        self._lock.release()
        try:
            with torch.profiler.record_function("tierstore::pack_wait"):
                wait()
        finally:
            self._lock.acquire()

    def _no_tier_error(self, entry: Entry, start: int) -> TierFullError:
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


#: The device tier's budget while a plan decides what it keeps.
_UNBOUNDED = 1 << 62


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


def _restrided_warning(
    entry: Entry, layout: codec.Layout, tier: Tier, itemsize: int
) -> TierstoreWarning:
    """A saved view comes back dense: why, and how to keep its strides (NOTE [ Spans ])."""
    assert layout.saved_stride is not None
    reach = 1 + sum((n - 1) * st for n, st in zip(layout.shape, layout.saved_stride, strict=True))
    return TierstoreWarning(
        f"tierstore: a saved view of shape {layout.shape} and strides {layout.saved_stride} "
        f"reaches across {human_bytes(reach * itemsize)} of storage for "
        f"{human_bytes(entry.nbytes)} of elements; it comes back from the {tier} tier dense, "
        f"with strides {layout.stride}, rather than allocate all of that in backward. Its "
        "values are the same; code that relies on its strides (a custom autograd.Function, a "
        "compiled graph) sees others. Later ones are only counted, in "
        "stats().restrided_views; to keep its strides, save it inside tierstore.keep()"
    )


def _close_movers(pipeline: Pipeline, transfers: Transfers) -> None:
    pipeline.close()
    transfers.close()
