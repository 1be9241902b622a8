"""The tier manager: a tensor put in the tiers within their budgets, and got back.

It knows tensors and budgets, not autograd: :meth:`TierManager.put` takes a
tensor and returns a :class:`~tierstore.tiers.handle.Handle`, :meth:`TierManager.get`
gives the tensor back. The autograd boundary (``tierstore.tier_store``) decides
which tensors to hand it. What is in flight has a module each, called under
this manager's lock: ``readahead`` (the prefetch window), ``writebehind``
(the disk write queue) and ``transfers`` (host buffers and CUDA copies);
``movers`` moves bytes to and from the disk. Where an entry rests is
``placement``'s; its deduplication ``dedupe``'s, its version check
``entry``'s, its release and the lock itself ``release``'s; the figures of
:meth:`TierManager.stats` are ``figures``'.

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
import functools
import itertools
import math
import os
import weakref
from typing import Any

import torch

from tierstore import codec
from tierstore.config import TierConfig
from tierstore.errors import (
    StoreClosedError,
    TierstoreError,
)
from tierstore.stats import TIERS, PackTally, Stats, Tier
from tierstore.tiers.counts import QUIET_ROOM, SaveCounts
from tierstore.tiers.dedupe import Dedupe, dedupe_key_of
from tierstore.tiers.entry import Entry, TierState, check_version
from tierstore.tiers.figures import Figures
from tierstore.tiers.forks import forked_message, leave_to_parent
from tierstore.tiers.handle import Handle
from tierstore.tiers.inflight import InFlight
from tierstore.tiers.interrupts import held, hold_interrupts, let_go_of_interrupts
from tierstore.tiers.limits import Limits, Measures
from tierstore.tiers.movers import LinkClock, Pipeline
from tierstore.tiers.placement import TierPlacement
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.release import Releases, close_collected, close_now, close_when_collected
from tierstore.tiers.schedule import Schedule
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["POOLED_MIN_BYTES", "QUIET_ROOM", "TierManager", "resting_nbytes"]

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
        self._tiers: dict[Tier, TierState] = {
            "device": TierState(int(config.device_budget), {}, []),
            "host": TierState(int(config.host_budget), {}, []),
            "disk": TierState(int(config.disk_budget), {}, []),
        }
        self._entries: dict[int, Entry] = {}
        self._dedupe = Dedupe(self._entries)
        self._keys = itertools.count()
        self._pipeline = Pipeline(config)
        # The device link's clocks, fed by timed copies, read by a plan (NOTE [ Copies
        # on CUDA ] in tiers/transfers.py): only with activation_budget, which reads them.
        links = (LinkClock(), LinkClock()) if config.activation_budget is not None else None
        self._transfers = Transfers(config, links)
        # Stops the I/O threads and frees host memory even if the store is
        # dropped without close().
        # NOTE [ Finalizers and interrupts ] in tiers/release.py: queued, not run, when collected.
        close_collected()
        hold_interrupts()  # let go of as the movers close: NOTE [ Interrupts held ]
        self._finalizer = close_when_collected(
            self, functools.partial(_close_movers, self._pipeline, self._transfers)
        )
        self._schedule = Schedule()
        self._reads = ReadAhead(
            config,
            self._pipeline,
            self._transfers,
            self._schedule,
            self._entries,
            host=self._tiers["host"],
            disk=self._tiers["disk"],
        )
        self._writes = WriteBehind(
            config, self._pipeline, self._transfers, self._tiers, self._entries
        )
        self._packed = 0  # saves that took the full path; kept ones are in the counts
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
        # The lock over the tables above, and the releases deferred while it
        # is held (NOTE [ Deferred release ] in tiers/release.py).
        self._releases = Releases(
            self._entries,
            self._dedupe.keys,
            self._tiers,
            pipeline=self._pipeline,
            transfers=self._transfers,
            reads=self._reads,
            writes=self._writes,
        )
        self._figures = Figures(
            self._tiers,
            counts=self._counts,
            placing=self._placing,
            pipeline=self._pipeline,
            transfers=self._transfers,
            reads=self._reads,
            writes=self._writes,
            flight=self._flight,
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
        self._releases.forked()
        self._closed = True

    # -- public --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def holds_entries(self) -> bool:
        """Whether a saved tensor still has an entry here (a backward may still need it)."""
        with self._releases.locked():
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
        with self._releases.locked():
            self.check_open()
            self._writes.raise_failure()
            self._packed += 1
            storage = t.untyped_storage()
            dedupe_key = dedupe_key_of(t, storage)
            entry = self._dedupe.entry(dedupe_key, storage)
            if entry is not None:
                self._counts.tallied(entry.tier, 0)
                return self._releases.handle(entry, t)
            if self._schedule.unpacking:
                self._flight.step_started(cpu=t.device.type == "cpu")
            size = resting_nbytes(t) if nbytes is None else nbytes
            # NOTE [ Copies in flight ] in tiers/inflight.py: what leaves the device waits
            # for room in flight, then the device tier's oldest move down to its budget.
            cap = self._flight.make_room(size, self._releases.unlocked)
            copies_over = self._placing.device_to_budget(cap)
            self.check_open()  # closed by another thread while this one waited
            # Saved meanwhile by another thread? (NOTE [ Deduplication under threads ]
            # in tiers/dedupe.py)
            entry = self._dedupe.entry(dedupe_key, storage)
            if entry is not None:
                self._counts.tallied(entry.tier, 0)
                return self._releases.handle(entry, t)
            entry = Entry(next(self._keys), t.detach(), size)
            try:
                return self._place(
                    entry, t, tier, copies_over=copies_over, dedupe_key=dedupe_key, storage=storage
                )
            except BaseException:  # Ctrl-C, say: no handle will release it (NOTE [ Finalizers
                self._entries.setdefault(entry.key, entry)  # and interrupts ] in release.py)
                self._releases.release_locked(entry.key)
                raise

    def _place(
        self,
        entry: Entry,
        t: torch.Tensor,
        tier: Tier | None,
        *,
        copies_over: bool,
        dedupe_key: tuple[object, ...],
        storage: Any,
    ) -> Handle:
        """The rest of :meth:`put`, under the lock: ``entry`` placed, registered, handed out."""
        size = entry.nbytes
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
            self._dedupe.keys[dedupe_key] = (weakref.ref(storage), entry.key)
            entry.dedupe_key = dedupe_key
        # Writes in flight (WriteBehind is true while any is) and none may
        # queue: this save waits for its own (NOTE [ Write staging ]).
        if self._writes and self._writes.synchronous:
            self._writes.finish(self._releases.unlocked)  # put() lets go if this raises
        if self.limits is not None:
            self._note_resident()
            if entry.tier != "device":
                self._flight.let_go(size, entry.device)
        return self._releases.handle(entry, t)

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
        with self._releases.locked():
            self._transfers.settle()  # the copies that ended count in the link's rates
            counts = self._counts
            with counts.lock:
                # The peak where no backward ran; after one, less than it took.
                peak = max(self._resident_peak, self._flight.kept_resident())
                self._resident_peak = 0
                n, nbytes = runner.kept()  # the step's plan-kept saves, counted for good
                counts.add_kept("device_budget", n, nbytes)
            line = runner.step_ended(peak)
            with counts.lock:  # NOTE [ Where kept saves count ] in tiers/counts.py
                counts.device_step_ended()
            self._flight.plan_step_ended(runner.window_bytes())
            said, runner.warnings = runner.warnings, []
            return line, said

    def step_failed(self, excess: int | None) -> tuple[str | None, list[str]]:
        """The step under way raised: dropped, the next one begins clean; (INFO line, warnings).

        ``excess``: the bytes an out-of-memory error showed the step short of;
        ``None``: another error (NOTE [ A step that raised ] in tierstore/tier_store.py).
        Its entries go as autograd drops its graph, as any graph's do.
        """
        with self._releases.locked():
            self._schedule.abandon()
            self._transfers.settle()
            runner = self.limits
            counts = self._counts
            with counts.lock:
                self._resident_peak = 0
                if runner is not None:
                    n, nbytes = runner.kept()  # the plan-kept saves it made, counted
                    counts.add_kept("device_budget", n, nbytes)
            counts.step_failed()
            if runner is None:
                return None, []
            line = runner.step_failed(excess)
            with counts.lock:  # NOTE [ Where kept saves count ] in tiers/counts.py
                counts.device_step_ended()
            self._flight.plan_step_ended(runner.window_bytes())
            said, runner.warnings = runner.warnings, []
            return line, said

    def get(self, handle: Handle) -> torch.Tensor:
        """The tensor ``handle`` refers to, on its original device, shape and strides.

        Raises:
            TierstoreError: the saved tensor was modified in place after it was
                stored (the error eager autograd raises in that case), or a
                background write failed (its error is the ``__cause__``).
            StoreClosedError: the store was closed.
        """
        with self._releases.locked():
            self.check_open()
            self._writes.raise_failure()
            entry = self._entries[handle.key]
            check_version(entry, handle)
            limits = self.limits
            if limits is not None:  # NOTE [ Timing a profile ] in planning/timers.py
                timer = limits.timer
                self._transfers.blocked = timer.blocked if timer is not None else None
            first = not self._schedule.unpacking
            if first:
                self._flight.begin_reads()
            elif self._flight.safe_reads:  # NOTE [ Planned steps ]: held as backward frees
                self._flight.hold_reads()
            self._schedule.unpacked(entry.key)
            with held:  # no wait in it: NOTE [ A read handed to backward ] in tiers/readahead.py
                got = self._reads.fetch(entry, first)
            if limits is not None:  # with this entry taken and the reads topped up
                self._note_resident()
                if entry.tier != "device":
                    self._flight.let_go(entry.nbytes, entry.device)
        if isinstance(got, torch.Tensor):
            return got
        return self._reads.finish(entry, got, self._releases.lock)  # waits outside the lock

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
        with self._releases.locked():
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
        with self._releases.locked():
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
        with self._releases.locked():
            if self._final is not None:
                return self._final
            if not self._closed:
                self._writes.wait(self._writes.futures(dead_only=True), self._releases.unlocked)
                if self._pipeline.deleting:  # NOTE [ Deletes on the I/O thread ]
                    self._releases.unlocked(self._pipeline.settle_deletes)
            return self._figures.snapshot(self._packed, self._dedupe.hits)

    def flush(self) -> None:
        """Wait until every queued disk write has ended (and raise if one failed)."""
        with self._releases.locked():
            self._writes.wait(self._writes.futures(), self._releases.unlocked)
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
        with self._releases.lock:
            if self._closed:
                return
            self._closed = self._releases.closed = True
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
        with self._releases.lock:
            self._releases.drop_all()
            final = self._figures.snapshot(self._packed, self._dedupe.hits)
        close_now(self._finalizer)
        close_collected()
        with self._releases.lock:  # the pools are gone with the movers: nothing is held now
            self._final = dataclasses.replace(final, host_pool_bytes=0, buffer_bytes_in_use=0)


def _close_movers(pipeline: Pipeline, transfers: Transfers) -> None:
    pipeline.close()
    transfers.close()
    let_go_of_interrupts()
