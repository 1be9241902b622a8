"""Release: an entry let go when its last handle dies, deferred while the manager's lock is held.

The tier manager (:mod:`tierstore.tiers.manager`) takes its lock through
:meth:`Releases.locked`, which drains the releases queued meanwhile, and
gives every handle a finalizer that releases its entry here
(:meth:`Releases.handle`). Releasing is bookkeeping on the manager's tables:
the entry leaves its tier, its dedupe key, the read-ahead window and its host
block; a disk record is deleted on the I/O thread.

Example:
    >>> import gc, torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> mgr = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> h = mgr.put(torch.zeros(256))
    >>> with mgr._releases.lock:  # held: the finalizer queues the key
    ...     del h; _ = gc.collect()
    ...     len(mgr._releases.pending)
    1
    >>> mgr.stats().tiers["host"].entries  # drained as the next call lets go
    0
    >>> mgr.close()
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from tierstore.stats import Tier
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.handle import Handle
from tierstore.tiers.movers import Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["Releases"]

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


class Releases:
    """The manager's lock, and the releases of entries deferred while it is held.

    The tables are the manager's own (its entries, dedupe keys and tiers),
    shared, not copied. :attr:`closed` is set by the manager as it closes (or
    in a forked child): from then on queued keys are dropped, not released.
    """

    def __init__(
        self,
        entries: dict[int, Entry],
        dedupe: dict[tuple[object, ...], tuple[weakref.ref[object], int]],
        tiers: dict[Tier, TierState],
        *,
        pipeline: Pipeline,
        transfers: Transfers,
        reads: ReadAhead,
        writes: WriteBehind,
    ) -> None:
        self.lock = threading.Lock()
        self.pending: deque[int] = deque()
        self.closed = False
        self._entries = entries
        self._dedupe = dedupe
        self._tiers = tiers
        self._pipeline = pipeline
        self._transfers = transfers
        self._reads = reads
        self._writes = writes

    def forked(self) -> None:
        """In a forked child: closed, with a lock of its own.

        NOTE [ Forked children ] in tiers/forks.py.
        """
        self.lock = threading.Lock()
        self.closed = True

    def handle(self, entry: Entry, t: torch.Tensor) -> Handle:
        """A handle on ``entry`` whose death releases one reference to it."""
        handle = Handle(entry.key, t)
        weakref.finalize(handle, self.release, entry.key).atexit = False
        return handle

    def release(self, key: int) -> None:
        """Release one reference to entry ``key`` now, or queue it while the lock is held.

        A handle's finalizer (:meth:`handle`), on any thread, at any moment.
        """
        # Queue first, then drain if the lock is free. Whoever holds the lock
        # drains after its work and checks the queue again once it has let
        # go, so a key queued at any moment is released at once by one side.
        self.pending.append(key)
        while self.pending and self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, settling what the movers finished as it is taken, draining releases."""
        with self.lock:
            self._drain(settle=True)
            yield
            self._drain()
        # A finalizer in another thread may have queued a key after the drain.
        while self.pending and self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def unlocked(self, wait: Callable[[], object]) -> None:
        """Run ``wait`` with the lock released (forward waiting on copies or writes)."""
        self.lock.release()
        try:
            with torch.profiler.record_function("tierstore::pack_wait"):
                wait()
        finally:
            self.lock.acquire()

    def drop_all(self) -> None:
        """Drop every entry at once, as the manager closes (its I/O has ended)."""
        self._entries.clear()
        self._dedupe.clear()
        self.pending.clear()
        self._writes.clear()
        for state in self._tiers.values():
            state.entries.clear()
            state.heap.clear()
            state.bytes = 0

    def _drain(self, *, settle: bool = False) -> None:
        """Release the queued keys; with ``settle``, first what the movers finished.

        NOTE [ Deferred release ]: copies and writes are settled once per
        lock, as it is taken, not at each drain.
        """
        if self.closed:
            self.pending.clear()
            return
        if settle:
            self._transfers.settle()
            self._writes.harvest()
        while self.pending:
            self.release_locked(self.pending.popleft())

    def release_locked(self, key: int) -> None:
        """Let go of one reference to entry ``key`` (under the lock); the last frees it."""
        entry = self._entries.get(key)
        if entry is None:  # closed, or never landed
            return
        entry.refs -= 1
        if entry.refs:
            return
        del self._entries[key]
        key_of = entry.dedupe_key
        if key_of is not None and self._dedupe.get(key_of, (None, None))[1] == key:
            # only its own: NOTE [ Deduplication under threads ] in tiers/dedupe.py
            del self._dedupe[key_of]
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
