"""Write-behind: the queue of disk writes behind forward, its failures and its backpressure.

Called under the tier manager's lock, with the manager's tier tables and
entries: a write that ends moves its entry's bytes from memory to its disk
record, or, when it fails, its entry to the host tier. See
``NOTE [ Write-behind ]`` and ``NOTE [ Failed writes ]``.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.writebehind import WriteBehind
    >>> WriteBehind(TierConfig(write_queue_bytes="1GiB"), None, None, {}, {}).limit.bytes
    33554432
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.errors import DISK_HINT, TierstoreError, TierstoreWarning, quoted
from tierstore.stats import Tier
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.interrupts import held
from tierstore.tiers.sizing import InFlightLimit
from tierstore.tiers.transfers import Transfers

if TYPE_CHECKING:
    from tierstore import codec
    from tierstore.tiers.movers import Pipeline, Record

__all__ = ["WriteBehind"]

# NOTE [ Write-behind ]
# Pack never waits for the disk while the queue has room. An entry demoted to
# disk first reserves the most disk it can take (Pipeline.footprint_bound)
# and is queued; it keeps its in-memory span until the write ends, and an
# unpack in the meantime is served from that span. The write's
# done-callback, on the I/O thread, only sets entry.record and then drops
# entry.tensor (in that order, so a reader that finds no tensor finds the
# record); everything else (the real footprint, releasing an entry that died
# while being written, failures) is settled by harvest() under the lock at
# the next call. Backpressure: while more than the queue's limit is queued
# (NOTE [ In-flight sizing ]: at most write_queue_bytes), put() waits, with
# the lock released, for the oldest write; the wait is counted in
# stats().pack_wait_s. A failed write loses nothing: NOTE [ Failed writes ].

# NOTE [ Write staging ]
# On a CPU, a saved tensor queued for the disk would keep the caller's own
# memory until its write ends: forward goes on allocating around it, and
# glibc, which hands freed heap memory back only from the top of the heap,
# keeps what it grew to (forward's RSS stands above that of a hook that
# writes synchronously, with the same live bytes). So a write queued
# behind forward first copies the span into a leased buffer
# (Transfers.stage; NOTE [ Leased buffers ] in tierstore/tiers/host_pool.py)
# and lets go of the original, as a D2H copy does on CUDA: the caller's
# memory is freed when forward drops it, as in eager, and the queue's bytes
# live in pages tierstore recycles (lowest free extent first: NOTE [ Extent
# allocation ]) and hands back between steps. The copy runs at memory speed
# on the caller's thread, HEADROOM bytes into its buffer so that LMDB gets
# the record as one value without a join (NOTE [ Records in one buffer ] in
# tierstore/codec.py), and which also puts a large record on a page, so the
# file backend's O_DIRECT path moves it without a bounce copy (NOTE [ File
# backend O_DIRECT ]). Spans that are already a copy (a compact copy of a view, a
# pinned block) and CPU entries of the host tier are not copied again; a
# full pool writes from the original, unstaged. With no queue at all
# (write_queue_bytes=0, or a plan's SYNCHRONOUS window: NOTE [ Planning ] in
# tierstore/planning/planner.py) nothing is staged: the save waits, with the lock
# released, for its own write from the caller's memory, which forward holds
# meanwhile anyway, as a hook that writes synchronously does.

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

_START_BYTES = 32 << 20
_MIN_BYTES = 8 << 20

#: Runs a wait with the manager's lock released.
Unlocked = Callable[[Callable[[], object]], None]


class WriteBehind:
    """Disk writes queued behind forward, and what their ends change.

    ``tiers`` and ``entries`` are the tier manager's own tables.

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.writebehind import WriteBehind
        >>> wb = WriteBehind(TierConfig(write_queue_bytes=0), None, None, {}, {})
        >>> wb.queued_bytes, wb.limit.bytes
        (0, 0)
    """

    def __init__(
        self,
        config: TierConfig,
        pipeline: Pipeline | None,
        transfers: Transfers | None,
        tiers: Mapping[Tier, TierState],
        entries: Mapping[int, Entry],
    ) -> None:
        self._config = config
        self._pipeline = pipeline
        self._transfers = transfers
        self._tiers = tiers
        self._entries = entries
        self.limit = InFlightLimit(int(config.write_queue_bytes), _START_BYTES, _MIN_BYTES)
        self._writing: dict[int, Entry] = {}
        self.queued_bytes = 0
        # The first failed write past the host room, and its entry's key.
        self._failure: tuple[BaseException, int] | None = None
        self.failed_writes = 0
        self._warned = False
        self.pack_wait_s = 0.0

    def __contains__(self, key: int) -> bool:
        return key in self._writing

    @property
    def synchronous(self) -> bool:
        """Whether no write may be queued now: a save waits for its own (NOTE [ Write staging ])."""
        return self.limit.allowed == 0

    def __bool__(self) -> bool:
        return bool(self._writing)

    def submit(self, entry: Entry) -> None:
        """Queue ``entry``'s bytes (``entry.tensor``, reserved on disk already) for writing."""
        assert self._pipeline is not None and entry.tensor is not None
        # Held before the write is queued, and queued whatever stops this call:
        # NOTE [ Requests that an interrupt cannot split ] in tiers/movers.py,
        # and no interrupt in between where tierstore holds them (NOTE
        # [ Interrupts held ] in tiers/interrupts.py).
        with held:
            future: concurrent.futures.Future[Record] = concurrent.futures.Future()
            entry.writing = future
            self._writing[entry.key] = entry
            self.queued_bytes += entry.nbytes
            done: Callable[[concurrent.futures.Future[Record]], None] | None = None
            scratch: codec.Alloc | None = None
            try:

                def written(future: concurrent.futures.Future[Record]) -> None:
                    # On the I/O thread, without the lock: assignments only.
                    if not future.cancelled() and future.exception() is None:
                        entry.record = future.result()
                        entry.let_go_of_original()
                        entry.tensor = None  # the memory goes now, not at the next call

                done = written
                assert self._transfers is not None
                scratch = self._transfers.allocator(entry.tensor.device)  # compression's, on a CPU
            finally:
                self._pipeline.submit_write(
                    entry.key,
                    entry.tensor,
                    done,
                    entry.ready,
                    scratch,
                    headroom=entry.staged,
                    future=future,
                )

    def futures(self, *, dead_only: bool = False) -> list[concurrent.futures.Future[Record]]:
        """Writes under way (of released entries only, with ``dead_only``)."""
        return [
            e.writing
            for k, e in self._writing.items()
            if e.writing is not None and not (dead_only and k in self._entries)
        ]

    def wait(self, futures: list[concurrent.futures.Future[Record]], unlocked: Unlocked) -> float:
        """Wait for writes with the lock released, then settle them; returns seconds waited."""
        assert self._pipeline is not None
        with held:  # done() takes each future's condition: NOTE [ Interrupts held ]
            pending = [f for f in futures if not f.done()]
        start = time.perf_counter()
        if pending:
            pipeline = self._pipeline
            unlocked(lambda: pipeline.wait(pending))
        self.harvest()
        return time.perf_counter() - start

    def finish(self, unlocked: Unlocked) -> None:
        """Wait, with the lock released, for every write (NOTE [ Write staging ]).

        Called once the saved tensor's entry is registered: a write that
        ends for an entry the store does not know is settled as released.
        """
        self.pack_wait_s += self.wait(self.futures(), unlocked)

    def wait_all_locked(self) -> None:
        """Settle every write, keeping the lock: placement needs their reservations back.

        Write callbacks never take the lock, so this cannot deadlock.
        """
        assert self._pipeline is not None
        self._pipeline.wait(self.futures())
        self.harvest()

    def make_room(self, unlocked: Unlocked) -> None:
        """Backpressure (NOTE [ Write-behind ]): wait while the queue is over its limit.

        The wait is a stall, unless a hold (``InFlightLimit.hold_to``) set
        the limit: the limit grows for the saves after this one
        (NOTE [ In-flight sizing ]).
        """
        limit = self.limit.allowed
        if self.queued_bytes <= limit:
            return
        if limit == self.limit.bytes:
            self.limit.stalled()
        while self.queued_bytes > limit:
            oldest = self._writing[min(self._writing)].writing
            self.pack_wait_s += self.wait([oldest] if oldest is not None else [], unlocked)

    def harvest(self) -> None:
        """Settle finished writes (NOTE [ Write-behind ])."""
        if not self._writing:  # every lock of the manager drains: most find nothing
            return
        with held:  # NOTE [ Interrupts held ] in tiers/interrupts.py
            for key in [k for k, e in self._writing.items() if e.writing and e.writing.done()]:
                entry = self._writing.pop(key)
                future, entry.writing = entry.writing, None
                assert future is not None
                self.queued_bytes -= entry.nbytes
                error = None if future.cancelled() else future.exception()
                if future.cancelled() or error is not None:
                    self._failed(entry, error)
                else:
                    self._landed(entry, future.result())

    def _landed(self, entry: Entry, record: Record) -> None:
        assert self._pipeline is not None and self._transfers is not None
        # The done-callback does this too, but it runs after waiters wake:
        # whoever waited for the write (flush) finds the memory gone.
        entry.record = record
        entry.let_go_of_original()
        entry.tensor = None
        disk = self._tiers["disk"]
        self._transfers.free_host(entry.block)  # the bytes are on disk now
        entry.block = None
        disk.resize(entry.footprint, record.footprint)  # the reservation was a bound
        disk.written += record.footprint  # counted once the bytes are there: never decreases
        entry.footprint = record.footprint
        if entry.key not in self._entries:  # released while it was being written
            disk.remove(entry, entry.footprint)
            self._pipeline.delete(entry.key)

    def _failed(self, entry: Entry, error: BaseException | None) -> None:
        # Nothing reached the disk; the bytes are still in entry.tensor.
        assert self._transfers is not None
        disk, host = self._tiers["disk"], self._tiers["host"]
        disk.remove(entry, entry.footprint)
        entry.footprint = 0
        alive = entry.key in self._entries
        allowed = host.budget + int(self._config.write_queue_bytes)
        # A released entry needs no room: its failure is only counted.
        roomy = not alive or host.bytes + self.queued_bytes + entry.nbytes <= allowed
        if alive:
            entry.tier = "host"
            host.add(entry, entry.nbytes)
        else:
            self._transfers.free_host(entry.block)
            entry.block = None
        if error is None:  # cancelled: close() is under way
            return
        self.failed_writes += 1  # NOTE [ Failed writes ]
        if not roomy:
            if self._failure is None or self._failure[1] not in self._entries:
                self._failure = (error, entry.key)
        elif not self._warned:
            self._warned = True
            warnings.warn(self._failed_warning(entry, error, kept=alive), stacklevel=2)

    @staticmethod
    def _failed_warning(entry: Entry, error: BaseException, kept: bool) -> TierstoreWarning:
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

    def raise_failure(self) -> None:
        """Raise the failure that host memory had no room for (NOTE [ Failed writes ])."""
        failure, self._failure = self._failure, None
        # An entry released since (its graph gone with an earlier error, say)
        # no longer holds host memory: its failure is only counted.
        if failure is not None and failure[1] in self._entries:
            error = failure[0]
            self._warned = True  # the user has heard: later failures are only counted
            raise TierstoreError(
                f"tierstore: a background write to the disk tier failed: {quoted(error)}; the "
                "saved tensors it held are still in host memory. Check the disk under disk_path "
                f"({ENV_PREFIX}DISK_PATH), or raise host_budget ({ENV_PREFIX}HOST_BUDGET) or "
                f"write_queue_bytes ({ENV_PREFIX}WRITE_QUEUE_BYTES) so that failed writes can "
                "stay in host memory (they do while both have room)"
            ) from error

    def clear(self) -> None:
        """Forget every write (close(): the I/O has ended or been cancelled)."""
        self._writing.clear()
        self.queued_bytes = 0
