"""Placement: which tier an entry rests in, and the oldest moving down to make room.

The tier manager (:mod:`tierstore.tiers.manager`) calls this under its lock
with each new entry, and with the device tier's oldest ones once copies in
flight allow (:meth:`TierPlacement.device_to_budget`). Each tier's table is a
:class:`~tierstore.tiers.entry.TierState`; the bytes move through the
transfers (to the host tier) and the write-behind (to the disk).

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> mgr = TierManager(TierConfig(device_budget="8KiB", host_budget="1MiB", disk_budget=0))
    >>> handles = [mgr.put(torch.zeros(1024)) for _ in range(3)]  # 4 KiB each
    >>> tiers = mgr.stats().tiers  # the oldest moved down to make room
    >>> tiers["device"].entries, tiers["host"].entries
    (2, 1)
    >>> mgr.close()
"""

from __future__ import annotations

import warnings

from tierstore import codec
from tierstore.config import ENV_PREFIX, human_bytes
from tierstore.errors import TierFullError, TierstoreWarning
from tierstore.stats import TIERS, Tier
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.interrupts import held
from tierstore.tiers.movers import Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["TierPlacement"]

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
# made the room then waits for those writes rather than refuse.

# NOTE [ CPU tensors skip the host tier ]
# For a tensor on the CPU, the host tier is the same RAM it already sits in:
# a host "copy" frees nothing. So while there is a disk tier (disk_budget >
# 0), a CPU entry goes from the device tier (device_budget: the bytes it may
# keep in RAM as they are) straight to the disk. The host tier keeps its
# meaning for accelerator tensors, and for CPU tensors only where there is no
# disk tier (disk_budget=0: a host-only configuration) and as the
# place where an entry whose disk write failed stays (NOTE [ Failed writes ]).
# The rule depends on values, not on where they came from: an explicit
# host_budget does not pull CPU tensors back into RAM, since equal configs
# describe the same store, and a fleet's TOML sizing host_budget for its GPU
# nodes must not make a CPU run save nothing. device_budget is the setting
# that keeps CPU tensors in RAM.


class TierPlacement:
    """The three tiers' tables and the rule that places an entry in them (NOTE [ Placement ]).

    Shares the manager's movers; every call runs under the manager's lock.
    """

    def __init__(
        self,
        tiers: dict[Tier, TierState],
        *,
        pipeline: Pipeline,
        transfers: Transfers,
        reads: ReadAhead,
        writes: WriteBehind,
    ) -> None:
        self.tiers = tiers
        self._pipeline = pipeline
        self._transfers = transfers
        self._reads = reads
        self._writes = writes
        self.restrided_views = 0  # NOTE [ Spans ] in codec.py: views that come back dense

    def land(self, entry: Entry, start: int, leaving: TierState | None = None) -> None:
        """Rest ``entry`` in the fastest tier from ``TIERS[start]`` down that can take it.

        ``leaving``: the tier it moves out of, let go of in the same step as
        the new one takes it (:meth:`_rest`).
        """
        for tier in TIERS[start:]:
            state = self.tiers[tier]
            if state.budget == 0 or self._skips(entry, tier):
                continue
            if tier == "disk":
                self._write_disk(entry, leaving)
                return
            if entry.nbytes <= state.budget:
                self._make_room(tier, entry.nbytes)
                self.hold(entry, tier, leaving)
                return
        raise self._no_tier_error(entry, start)

    def _skips(self, entry: Entry, tier: Tier) -> bool:
        """NOTE [ CPU tensors skip the host tier ]."""
        return tier == "host" and entry.device.type == "cpu" and self.tiers["disk"].budget > 0

    def _make_room(self, tier: Tier, nbytes: int) -> None:
        state = self.tiers[tier]
        below = TIERS.index(tier) + 1
        while state.bytes + nbytes > state.budget:
            oldest = state.oldest()
            if oldest is None:
                return
            self.land(oldest, below, state)  # raises, leaving `oldest` where it is, if full

    def hold(self, entry: Entry, tier: Tier, leaving: TierState | None = None) -> None:
        """Rest ``entry`` in ``tier``, copied to the host pool if it goes there from the device."""
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
        with held:
            self._rest(entry, tier, entry.nbytes, leaving)

    def _rest(
        self,
        entry: Entry,
        tier: Tier,
        size: int,
        leaving: TierState | None,
        *,
        written: bool = True,
    ) -> None:
        """Out of ``leaving`` and into ``tier`` in one step; the caller holds interrupts.

        NOTE [ Interrupts held ] in tiers/interrupts.py: an entry whose
        ``tier`` is set is in that tier's table, and in no other, whatever
        Ctrl-C stops, so that letting go of it (put()'s ``except``, a
        release) finds it where it looks.
        """
        if leaving is not None:
            leaving.remove(entry, entry.nbytes)
        entry.tier = tier
        self.tiers[tier].add(entry, size, written=written)

    def _write_disk(self, entry: Entry, leaving: TierState | None = None) -> None:
        self._pipeline.check_alive()  # before anything changes: a dead thread writes nothing
        state = self.tiers["disk"]
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
        with held:
            # NOTE [ Write-behind ]: counted as written when it is
            self._rest(entry, "disk", reserve, leaving, written=False)
            entry.footprint = reserve
            self._writes.submit(entry)  # waited for by put() when synchronous

    def _laid_out(self, entry: Entry, layout: codec.Layout, tier: Tier, itemsize: int) -> None:
        """Give ``entry`` the layout it rests in; a view that comes back dense is never silent.

        NOTE [ Spans ] in codec.py: counted in stats(), warned of once.
        """
        first, entry.layout = entry.layout is None, layout
        if not first or layout.saved_stride is None:  # counted once, when it first left
            return
        self.restrided_views += 1
        if self.restrided_views == 1:
            warnings.warn(_restrided_warning(entry, layout, tier, itemsize), stacklevel=2)

    def device_to_budget(self, cap: int) -> bool:
        """Move the device tier's oldest entries down to its budget while copies allow.

        Whether copies in flight over ``cap`` stopped that, and so leave the
        next save on the device (NOTE [ Copies in flight ] in tiers/inflight.py).
        """
        device = self.tiers["device"]
        while not self._transfers.copies_over(cap):
            oldest = device.oldest() if device.bytes > device.budget else None
            if oldest is None:
                return False
            self.land(oldest, TIERS.index("host"), device)  # raises, leaving it in place, if full
        return True

    def _no_tier_error(self, entry: Entry, start: int) -> TierFullError:
        budgets = ", ".join(
            f"{tier}_budget={human_bytes(self.tiers[tier].budget)}" for tier in TIERS[start:]
        )
        last = next((t for t in reversed(TIERS) if self.tiers[t].budget), "disk")
        return TierFullError(
            f"tierstore: a saved tensor of {human_bytes(entry.nbytes)} fits in no tier "
            f"({budgets}); raise {last}_budget ({ENV_PREFIX}{last.upper()}_BUDGET)"
            + ("" if last == "disk" else " or give disk_budget a size")
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
