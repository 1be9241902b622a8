"""The bytes under way, held to the limits the tier manager follows.

Each save that takes the manager's full path first makes room in flight
here: the write queue's limit, then the D2H copies off the device (NOTE [
Copies in flight ]). Each step's start, backward's first read and a plan's
end set the limits of the read-ahead and the write-behind from the
:class:`~tierstore.tiers.limits.Limits` the manager follows, or from the
config where it follows none. Everything here runs under the manager's lock,
except what takes the counters' lock (:class:`~tierstore.tiers.counts.SaveCounts`).

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> manager = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> h = manager.put(torch.ones(256))
    >>> manager.stats().pack_wait_s  # no copy to wait for on a CPU
    0.0
    >>> manager.close()
"""

from __future__ import annotations

import time

import torch

from tierstore.config import TierConfig
from tierstore.tiers.counts import SaveCounts
from tierstore.tiers.entry import TierState
from tierstore.tiers.limits import Limits, Measures
from tierstore.tiers.movers import LinkClock, Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.schedule import Schedule
from tierstore.tiers.transfers import Transfers, cuda_events, page_fault_s
from tierstore.tiers.writebehind import Unlocked, WriteBehind

__all__ = ["InFlight"]

# NOTE [ Copies in flight ]
# A D2H copy's source stays on the device until the copy has read it, so
# the bytes under way are bounded, by write_queue_bytes as the disk queue
# is. Past that bound:
#   * without activation_budget, and in a step that follows no plan (the
#     safe placement of the warm-up, profiled and waiting steps), the save
#     waits for the oldest copy, as the README promises: every eligible
#     save leaves the device, and forward runs at the link's pace where the
#     link is the bottleneck. A save that stayed on the device instead would
#     leave the tail of forward unmoved and, under the safe placement, which
#     offloads everything, let the device tier grow past the budget by all
#     that the link had not moved yet, which max_memory_reserved then keeps.
#   * in a planned step, forward never blocks the CPU on a CUDA event (while
#     it waits it queues no kernels, and the copies were meant to hide
#     behind those): a query, not a wait. While copies over the bound are
#     under way (the events queried at each call, Transfers.settle), a new
#     save stays on the device tier, over device_budget if need be, as the
#     newest entry; the plan bounds what it sends to what the link hides.
# Once the copies land, the next save first moves the device tier's oldest
# entries down until it is within budget again or the copies are over the
# bound once more (InFlight.make_room); backward takes
# whatever is still on the device as it is.
# The decision reads only byte counts: the CPU tests drive it with events
# that report "not done".

#: The device tier's budget while a plan decides what it keeps.
_UNBOUNDED = 1 << 62


class InFlight:
    """The in-flight limits of one manager, from what it follows (:attr:`limits`) or its config.

    Shares the manager's movers and tables; called under the manager's lock,
    which the waits here release through ``unlocked``.
    """

    def __init__(
        self,
        config: TierConfig,
        *,
        pipeline: Pipeline,
        transfers: Transfers,
        reads: ReadAhead,
        writes: WriteBehind,
        schedule: Schedule,
        counts: SaveCounts,
        device: TierState,
        links: tuple[LinkClock, LinkClock] | None,
    ) -> None:
        self._config = config
        self._pipeline = pipeline
        self._transfers = transfers
        self._reads = reads
        self._writes = writes
        self._schedule = schedule
        self._counts = counts
        self._device = device
        self._links = links
        #: What the manager follows (TierManager.follow); ``None``: the config's limits.
        self.limits: Limits | None = None
        self._copy_wait_s = 0.0  # forward's waits for D2H copies (NOTE [ Copies in flight ])
        #: Backward's reads ahead follow the safe placement's budget: bound again at each read.
        self.safe_reads = False

    def measures(self) -> Measures:
        """The clocks and waits a plan's runner measures the step by."""
        reads = self._reads
        return Measures(
            writes=self._pipeline.write_clock,
            reads=self._pipeline.read_clock,
            waits=lambda: self.pack_wait_s() + reads.unpack_wait_s,
            io_cpu=self._pipeline.io_cpu_s,
            events=cuda_events,  # NOTE [ Timing a profile ] in planning/timers.py
            device_links=self._links,
            cpu_step_began=self.trim,
            page_fault_s=page_fault_s,
        )

    def make_room(self, size: int, unlocked: Unlocked) -> int:
        """Backpressure before a save of ``size`` bytes; the bound on copies in flight.

        The device tier takes the plan's budget or the safe placement's
        (NOTE [ Planned steps ] in planning/runner.py); the write queue waits
        (NOTE [ Write-behind ]); D2H copies are waited for only in a step
        that follows no plan, down to what its budget leaves beside the
        device tier and this save (NOTE [ Copies in flight ]).
        """
        limits = self.limits
        writes = self._writes
        planned = limits is not None and limits.planned
        room = None
        if limits is not None:
            device = self._device
            device.budget = _UNBOUNDED if planned else limits.safe_device_bytes()
            room = limits.in_flight_bytes(adding=size, held=device.bytes)
            writes.limit.hold_to(room)
        writes.make_room(unlocked)
        cap = writes.limit.cap_bytes
        if planned:  # only a planned step may leave a save on the device instead of waiting
            return cap
        if room is not None:
            cap = min(cap, room)
        transfers = self._transfers
        while transfers.copies_over(cap):
            began = time.perf_counter()
            unlocked(transfers.oldest_copy().synchronize)
            self._copy_wait_s += time.perf_counter() - began
            transfers.settle()
        return cap

    def pack_wait_s(self) -> float:
        """Seconds forward waited: for the write queue, and for copies off the device."""
        return self._writes.pack_wait_s + self._copy_wait_s

    def step_started(self, *, cpu: bool) -> None:
        """The first new save after a backward: the in-flight limits learn from that step.

        A step under activation_budget on a CPU starts on a heap whose free
        pages went back to the system (NOTE [ Handing the heap back ] in
        tierstore/tiers/host_pool.py): here, unless the step follows a plan,
        whose runner handed them back as its first save came, kept or not.
        """
        self._reads.limit.step_started()
        self._writes.limit.step_started()
        limits = self.limits
        self.trim(cpu and limits is not None and not limits.planned)

    def trim(self, heap: bool) -> None:
        """Hand back the pages of idle buffers as a step begins, and the heap's if ``heap``.

        Host buffers (NOTE [ Leased buffers ]) and disk I/O buffers (NOTE [
        Idle I/O buffers ]), each under its own pool's lock: from put() under
        the manager's lock too, from the plan runner not.
        """
        self._transfers.trim(heap)
        self._pipeline.trim()

    def let_go(self, nbytes: int, device: torch.device) -> None:
        """Bytes of a save that left ``device``'s memory: counted by a planned CPU step.

        NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py. Under
        the counters' lock, which rebuilt saves count under without the manager's.
        """
        limits = self.limits
        if limits is not None and device.type == "cpu" and limits.hands_back():
            with self._counts.lock:
                self._transfers.let_go(nbytes, limits.budget_bytes_now())

    def begin_reads(self) -> None:
        """Backward's reads begin: the schedule's order, the window's bound; under the lock."""
        self._schedule.begin()
        limits = self.limits
        self.safe_reads = limits is not None and not limits.planned
        if limits is not None:  # NOTE [ Planned steps ]
            self.hold_reads()

    def hold_reads(self) -> None:
        """Bound the reads ahead by what the step holds now; under the lock.

        NOTE [ In-flight sizing ] in tiers/sizing.py: a plan's window exactly.
        The safe placement asks again at each read (:attr:`safe_reads`), as
        backward frees the device tier's entries.
        """
        limits = self.limits
        assert limits is not None
        held = self._writes.queued_bytes + self._device.bytes + self._transfers.copying_bytes
        self._reads.limit.hold_to(limits.read_ahead_bytes(held), exact=limits.planned)

    def resident(self) -> int:
        """Saved bytes on the device: the device tier, in flight, and what the plan kept."""
        return self.kept_resident() + self._reads.outstanding_bytes()

    def kept_resident(self) -> int:
        """What the plan kept, the device tier and the write queue; under the counters' lock.

        Forward's figure: nothing is read ahead yet, and the reads' count is theirs.
        """
        kept = self.limits.kept_resident() if self.limits is not None else 0
        return kept + self._device.bytes + self._writes.queued_bytes

    def plan_step_ended(self, window: int | None) -> None:
        """A planned step ended: the limits stay within the largest kept plan's ``window``.

        A plan's window bounds both ways: the write queue is resident too,
        and a queue grown past the plan's would break the budget. Each
        planned step holds the limits to its own plan's (``in_flight_bytes``).
        """
        config = self._config
        self._reads.limit.bound(window if window is not None else int(config.prefetch_bytes))
        self._writes.limit.bound(window if window is not None else int(config.write_queue_bytes))
        self._reads.limit.hold_to(None)
        self._writes.limit.hold_to(None)
