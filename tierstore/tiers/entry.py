"""One stored tensor and where its bytes rest: what the tier manager and in-flight modules share.

The tier manager (``tierstore/tiers/manager.py``) creates entries and places them;
read-ahead, write-behind and the transfers move their bytes, always under
the manager's lock. An entry has no behaviour beyond the version probe and
its span.

Example:
    >>> import torch
    >>> from tierstore.tiers.entry import Entry
    >>> e = Entry(0, torch.arange(4.0).reshape(2, 2).t(), 16)
    >>> span, layout = e.span()
    >>> span.shape, layout.stride
    (torch.Size([4]), (1, 2))
"""

from __future__ import annotations

import concurrent.futures
import heapq
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierstore import codec
from tierstore.errors import modified_in_place
from tierstore.stats import Tier

if TYPE_CHECKING:
    from tierstore.tiers.handle import Handle
    from tierstore.tiers.host_pool import HostBlock
    from tierstore.tiers.movers import Record

__all__ = ["Entry", "TierState", "check_version"]

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


class Entry:
    """One stored tensor and where its bytes rest now.

    Resting form: the tensor itself (device tier), a span and its layout
    (host tier), or a disk record (``record``; ``tensor`` too while the
    write is under way: NOTE [ Write-behind ] in ``tierstore/tiers/writebehind.py``).

    Example:
        >>> import torch
        >>> from tierstore.tiers.entry import Entry
        >>> Entry(3, torch.zeros(2), 8).refs
        1
    """

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
        "staged",
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
        self.tensor: torch.Tensor | None = t
        self.layout: codec.Layout | None = None
        self.record: Record | None = None
        self.footprint = 0
        # NOTE [ Version check ]: a tensor sharing the
        # saved tensor's version counter, kept while our bytes alias the
        # caller's memory; when we copy them, a version other than the one at
        # pack marks the entry stale, since the copy then holds modified values.
        self.probe: torch.Tensor | None = t
        self.version = t._version
        self.stale: int | None = None
        # The last tensor read back: weakly, or strongly while other handles
        # of a deduplicated entry still need it (as eager autograd keeps one
        # saved tensor for every node that saved it).
        self.loaded: weakref.ref[torch.Tensor] | None = None
        self.held: torch.Tensor | None = None
        self.dedupe_key: tuple[object, ...] | None = None
        self.writing: concurrent.futures.Future[Record] | None = None
        # CUDA (NOTE [ Copies on CUDA ] in tierstore/tiers/transfers.py): the D2H
        # copy filling self.tensor while it runs, what it reads, and the pool
        # block self.tensor lives in.
        self.ready: torch.cuda.Event | None = None
        self.source: torch.Tensor | None = None
        self.block: HostBlock | None = None
        # self.tensor is a copy in a leased buffer, codec.HEADROOM bytes in
        # (NOTE [ Write staging ] in tierstore/tiers/writebehind.py).
        self.staged = False
        self.refs = 1

    def let_go_of_original(self) -> None:
        """Drop the probe once our bytes are a copy (NOTE [ Version check ])."""
        probe = self.probe
        if probe is not None and probe._version != self.version and self.stale is None:
            self.stale = probe._version
        self.probe = None

    def span(self) -> tuple[torch.Tensor, codec.Layout]:
        """The bytes as a 1-D span and the layout that views them (NOTE [ Spans ])."""
        assert self.tensor is not None
        if self.layout is None:
            return codec.to_span(self.tensor)
        return self.tensor, self.layout

    def read_back(self) -> torch.Tensor | None:
        """The tensor last read back for this entry, if something still holds it."""
        if self.held is not None:
            return self.held
        return self.loaded() if self.loaded is not None else None

    def remember(self, out: torch.Tensor) -> torch.Tensor:
        """Keep what was read back for the entry's other handles (strongly if it has any)."""
        if self.refs > 1:
            self.held = out
        else:
            self.loaded = weakref.ref(out)
        return out


@dataclass
class TierState:
    """One tier's table: its entries, oldest first, and its byte counters.

    Example:
        >>> import torch
        >>> from tierstore.tiers.entry import Entry, TierState
        >>> state = TierState(budget=100, entries={}, heap=[])
        >>> state.add(Entry(0, torch.zeros(2), 8), 8); state.bytes, state.written
        (8, 8)
    """

    budget: int
    entries: dict[int, Entry]
    heap: list[int]  # keys, oldest first; stale keys are skipped lazily
    bytes: int = 0
    peak: int = 0
    step_peak: int = 0  # since the step began (NOTE [ Where kept saves count ] in tiers/counts.py)
    written: int = 0
    read: int = 0

    def size_of(self, entry: Entry) -> int:
        """Bytes ``entry`` takes here: footprint bytes on disk, span bytes elsewhere."""
        return entry.footprint if entry.tier == "disk" else entry.nbytes

    def oldest(self) -> Entry | None:
        """The entry held longest, or ``None``."""
        while self.heap:
            entry = self.entries.get(self.heap[0])
            if entry is not None:
                return entry
            heapq.heappop(self.heap)
        return None

    def add(self, entry: Entry, size: int, *, written: bool = True) -> None:
        """Hold ``entry`` (``size`` bytes); ``written=False``: its bytes are not there yet."""
        self.entries[entry.key] = entry
        heapq.heappush(self.heap, entry.key)
        self.bytes += size
        if written:
            self.written += size
        self.peak = max(self.peak, self.bytes)
        self.step_peak = max(self.step_peak, self.bytes)

    def resize(self, before: int, after: int) -> None:
        """An entry held here takes ``after`` bytes now instead of ``before``.

        Example:
            >>> from tierstore.tiers.entry import TierState
            >>> state = TierState(budget=100, entries={}, heap=[], bytes=8, peak=8)
            >>> state.resize(8, 12); state.bytes, state.peak
            (12, 12)
        """
        self.bytes += after - before
        self.peak = max(self.peak, self.bytes)
        self.step_peak = max(self.step_peak, self.bytes)

    def remove(self, entry: Entry, size: int) -> None:
        """Let go of ``entry`` (``size`` bytes)."""
        del self.entries[entry.key]
        self.bytes -= size
        if len(self.heap) > 2 * len(self.entries) + 64:
            # Released entries leave stale keys behind; rebuild before they pile up.
            self.heap = sorted(self.entries)


def check_version(entry: Entry, handle: Handle) -> None:
    """Raise as eager autograd would if the saved tensor changed (NOTE [ Version check ])."""
    aliases = (entry.probe, *handle.sources())
    versions = [entry.stale, *(a._version for a in aliases if a is not None)]
    for version in versions:
        if version is not None and version != handle.version:
            raise modified_in_place(handle.shape, handle.dtype, version, handle.version)
