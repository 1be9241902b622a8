"""Read-ahead: the window of reads and copies backward will want next, sized by need.

Called under the tier manager's lock, with the manager's entries and
schedule; it issues disk reads through the movers and, on CUDA, copies of
host entries back to the device through the transfers. See
``NOTE [ Prefetch ]``; the window's size, ``NOTE [ In-flight sizing ]``.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.readahead import ReadAhead
    >>> from tierstore.tiers.schedule import Schedule
    >>> ReadAhead(TierConfig(prefetch_bytes="64MiB"), None, None, Schedule(), {}).limit.bytes
    16777216
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from tierstore import codec
from tierstore.config import TierConfig
from tierstore.errors import TierstoreError
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.interrupts import held
from tierstore.tiers.schedule import Schedule
from tierstore.tiers.sizing import InFlightLimit
from tierstore.tiers.transfers import DeviceCopy, Transfers

if TYPE_CHECKING:
    from tierstore.tiers.movers import Pipeline, Record

__all__ = ["ReadAhead"]

# NOTE [ Prefetch ]
# Backward asks for entries in the order the Schedule predicts (recorded from
# the last step, else reverse pack order). Each get() tops up a window of
# reads in flight, up to the window's limit (NOTE [ In-flight sizing ]), and
# then waits, outside the lock, only for the entry it needs; in a timed step
# the first top-up comes at backward's first use of any save (NOTE [ Reads
# from backward's start ] in tierstore/tiers/manager.py). A read of an
# entry whose write is still under way is chained after that write. An
# unpack of an entry that never left the device (or of a rebuilt tensor's
# inputs, which come through get() too) tops up the window all the same
# (passed()): otherwise the first host or disk entry after a run of device
# entries would always be a miss. Hits and misses: NOTE [ Hits ].
#
# What the window's limit bounds is memory backward holds from the store at
# once, not only reads in flight: a read stays charged to it after backward
# takes it, for as long as the tensor lives (autograd drops it once its node
# has run; a recompute recipe may keep an input for that input's own unpack,
# and its rebuilt tensor, which comes from the store too, is charged the same
# way; see hold()). Counting only reads in flight would let those held
# tensors sit on top of a full window: with recompute, the inputs a rebuild
# has just read ahead of their own unpacks, and the rebuilt tensor. While held
# tensors fill the limit, one read is still kept in flight, so backward
# always has the next entry coming (none with prefetch_bytes=0, which turns
# read-ahead off).

# NOTE [ A read handed to backward ]
# An unpack whose entry is on disk takes its read (ahead, or on demand) out
# of the window under the lock, counts its bytes as held, and waits for it
# with the lock released (finish). Ctrl-C can land between the two, and the
# wait that would have tied the bytes to the tensor never runs: the read,
# its leased buffer and its held bytes would stay for good, shrinking every
# later read-ahead window. So the read is kept in `_demand` from the moment
# it is handed out (in one hold: NOTE [ Interrupts held ] in
# tiers/interrupts.py) until the wait ties its bytes to the tensor, and
# whichever comes first, the wait's end or the entry's release (the graph
# that an interrupted backward drops), takes it out with one dict.pop and
# settles the bytes; the other finds nothing to do.

# NOTE [ Hits ]
# A prefetch is a hit only if its bytes had landed when backward asked: the
# read's future done (disk), the copy's event complete (CUDA: an event
# query, which never blocks). An entry still in memory, or already read back
# for another handle, is a hit too. Anything else is a miss: read or copied
# on demand, or read ahead but not there yet. Counting a prefetch as a hit
# when it is issued would count hits over copies that backward still waits
# for. One rule, arrived(), judges both the disk path and the
# CUDA copies, so the CPU tests that drive the disk path check the rule the
# GPU runs.
# A miss whose bytes are not there is a stall, and a stall grows the window
# (NOTE [ In-flight sizing ]), on CUDA as on disk: measured where the wait
# happens, at the unpack, whether it is the host or the consumer's stream
# that will wait. Except: the first unpack of a backward is not a stall of
# the window's making (nothing could have read it ahead) and does not grow
# it; nor does a wait for any read the first unpack's top-up sent out. Those
# reads left the moment backward began, behind the writes forward had just
# queued, and a larger window would only have queued more behind them.
# Such a wait comes early in every step's backward; counted as stalls,
# those waits would hold the window at prefetch_bytes, step after step.
_START_BYTES = 16 << 20
_MIN_BYTES = 4 << 20


class _Held(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a tensor handed to backward, carrying its bytes.

    Its callback is ``deque.append``: NOTE [ Finalizers and interrupts ] in
    tiers/release.py.
    """

    __slots__ = ("nbytes",)
    nbytes: int


class ReadAhead:
    """The prefetch window: reads and copies ahead of backward, and its hit counters.

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.readahead import ReadAhead
        >>> from tierstore.tiers.schedule import Schedule
        >>> ra = ReadAhead(TierConfig(prefetch_bytes="1GiB"), None, None, Schedule(), {})
        >>> ra.window_bytes, ra.limit.bytes
        (0, 16777216)
    """

    def __init__(
        self,
        config: TierConfig,
        pipeline: Pipeline | None,
        transfers: Transfers | None,
        schedule: Schedule,
        entries: Mapping[int, Entry],
        *,
        host: TierState | None = None,
        disk: TierState | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._transfers = transfers
        # The tier manager's own: the plan to read ahead in, the entries it
        # names, and the host and disk tiers whose bytes_read count what is read.
        self._schedule = schedule
        self._entries = entries
        self._host = host
        self._disk = disk
        self.limit = InFlightLimit(int(config.prefetch_bytes), _START_BYTES, _MIN_BYTES)
        self._window: dict[int, tuple[concurrent.futures.Future[torch.Tensor] | DeviceCopy, int]]
        self._window = {}
        self.window_bytes = 0
        self._demand: dict[int, concurrent.futures.Future[torch.Tensor]] = {}
        self.hits = 0
        self.misses = 0
        self.first_waits = 0  # first unpacks of a backward that waited: not the window's doing
        self._opening: set[int] = set()  # reads the first unpack's top-up sent out
        self.prefetched_bytes = 0
        self.unpack_wait_s = 0.0
        # Bytes of tensors handed to backward and still alive (NOTE [ Prefetch ]).
        # They die on any thread, at any moment (a garbage collection under the
        # manager's lock, say), so a death only queues its bytes, with no
        # Python run and no lock taken (NOTE [ Finalizers and interrupts ] in
        # tiers/release.py). The next top-up settles them.
        self.held_bytes = 0
        self._freed: deque[_Held] = deque()
        self._held: dict[int, _Held] = {}  # the references alive, by id

    # -- the window ----------------------------------------------------------------

    def __contains__(self, key: int) -> bool:
        return key in self._window

    def take(self, key: int) -> concurrent.futures.Future[torch.Tensor] | DeviceCopy | None:
        """Remove ``key``'s read or copy ahead from the window and return it (``None``: none)."""
        ahead = self._window.pop(key, None)
        if ahead is None:
            return None
        self.window_bytes -= ahead[1]
        return ahead[0]

    def drop(self, key: int) -> None:
        """Forget ``key``'s read or copy ahead, if any: it is not needed (any more)."""
        ahead = self.take(key)
        if ahead is not None:
            self._forget(ahead)

    def released(self, entry: Entry) -> None:
        """``entry`` was let go of: forget its reads, the one handed to backward too.

        A read handed to backward that no wait took over (an interrupt came
        first: NOTE [ A read handed to backward ]) gives its bytes back.
        """
        self.drop(entry.key)
        handed = self._demand.pop(entry.key, None)
        if handed is not None:
            handed.cancel()
            self.held_bytes -= entry.nbytes

    def hold(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Charge ``nbytes`` to the window until ``tensor`` is freed; returns ``tensor``.

        For tensors the store hands to backward (NOTE [ Prefetch ]). Called
        under the manager's lock.

        Example:
            >>> import gc, torch
            >>> from tierstore import TierConfig
            >>> from tierstore.tiers.readahead import ReadAhead
            >>> from tierstore.tiers.schedule import Schedule
            >>> ra = ReadAhead(TierConfig(), None, None, Schedule(), {})
            >>> t = ra.hold(torch.empty(1024, dtype=torch.uint8), 1024)
            >>> ra.outstanding_bytes()
            1024
            >>> del t; _ = gc.collect(); ra.outstanding_bytes()
            0
        """
        self.held_bytes += nbytes
        return self._until_freed(tensor, nbytes)

    def _until_freed(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        # Bytes already counted in held_bytes come off when the tensor dies.
        ref = _Held(tensor, self._freed.append)
        ref.nbytes = nbytes
        self._held[id(ref)] = ref
        return tensor

    def outstanding_bytes(self) -> int:
        """What the window's limit bounds: reads ahead plus tensors still held."""
        freed = self._freed
        while freed:
            ref = freed.popleft()
            del self._held[id(ref)]
            self.held_bytes -= ref.nbytes
        return self.window_bytes + self.held_bytes

    def top_up(self) -> None:
        """Queue reads in schedule order up to the window's limit (NOTE [ Prefetch ])."""
        assert self._pipeline is not None and self._transfers is not None
        limit = self.limit.allowed
        while self.outstanding_bytes() < limit or (limit and not self._window):
            key = self._schedule.next_planned()
            if key is None:
                return
            entry = self._entries.get(key)
            if entry is None or key in self._window or entry.read_back() is not None:
                continue
            if entry.tier == "host" and entry.device.type == "cuda":
                span, _ = entry.span()
                ahead: concurrent.futures.Future[torch.Tensor] | DeviceCopy
                ahead = self._transfers.device_copy(span, entry.device, entry.ready)
                self.prefetched_bytes += entry.nbytes
            elif entry.tier == "disk" and key not in self._demand:
                # A write still under way: the read follows it (NOTE [ Prefetch ]).
                source = entry.record if entry.record is not None else entry.writing
                if source is None:
                    continue
                ahead = self._read(entry, source)
                self.prefetched_bytes += entry.footprint
            else:
                continue
            self._window[key] = (ahead, entry.nbytes)
            self.window_bytes += entry.nbytes

    def _read(
        self, entry: Entry, source: Record | concurrent.futures.Future[Record]
    ) -> concurrent.futures.Future[torch.Tensor]:
        assert self._pipeline is not None and self._transfers is not None
        alloc = self._transfers.allocator(entry.device)
        return self._pipeline.submit_read(entry.key, source, alloc)

    # -- unpack --------------------------------------------------------------------

    def fetch(
        self, entry: Entry, first: bool
    ) -> torch.Tensor | concurrent.futures.Future[torch.Tensor]:
        """``entry``'s tensor, or the read to wait for with the lock released.

        The tier manager's get, under its lock; ``first``: backward's first unpack.
        """
        if entry.tier == "device":
            assert entry.tensor is not None
            self.passed(first=first)  # NOTE [ Prefetch ]
            return entry.tensor
        if entry.tier == "host":
            assert self._host is not None and self._transfers is not None
            span, layout = entry.span()
            self._host.read += entry.nbytes
            if span.device == entry.device:  # CPU: the host tier is the device's memory
                return codec.from_span(span, layout, self._transfers.allocator(span.device))
            return self.from_host(entry, span, layout, first=first)
        return self.from_disk(entry, first=first)

    def from_host(
        self, entry: Entry, span: torch.Tensor, layout: codec.Layout, *, first: bool
    ) -> torch.Tensor:
        """A host entry back on its CUDA device (NOTE [ Prefetch ])."""
        assert self._transfers is not None
        cached = entry.read_back()
        ahead = self.take(entry.key)
        if cached is not None:
            if ahead is not None:
                self._forget(ahead)
            self.hits += 1
            self._top_up_after(first)
            return cached
        if isinstance(ahead, DeviceCopy):
            copy = ahead
        else:
            copy = self._transfers.device_copy(span, entry.device, entry.ready)
        self.arrived(entry, ahead=ahead is not None, landed=Transfers.done(copy.ready), first=first)
        # Remembered first, so that the top-up does not copy this entry again.
        out = codec.from_span(self._transfers.consume(copy), layout)
        out = entry.remember(self.hold(out, entry.nbytes))
        self._top_up_after(first)
        return out

    def from_disk(
        self, entry: Entry, *, first: bool
    ) -> torch.Tensor | concurrent.futures.Future[torch.Tensor]:
        """A disk entry: the tensor if memory has it, else the read to wait for, unlocked."""
        assert self._transfers is not None and entry.layout is not None
        cached = entry.read_back()
        in_memory = entry.tensor  # still being written: NOTE [ Write-behind ]
        ahead = self.take(entry.key)
        if cached is not None or in_memory is not None:
            if ahead is not None:
                self._forget(ahead)
            self.hits += 1
            self._top_up_after(first)
            if cached is not None:
                return cached
            assert in_memory is not None
            copy = self._transfers.device_copy(in_memory, entry.device, entry.ready)
            return self._restore(entry, self._transfers.consume(copy))
        with held:  # NOTE [ A read handed to backward ]
            if ahead is not None:
                assert not isinstance(ahead, DeviceCopy)
                future = ahead
            else:
                source = entry.record if entry.record is not None else entry.writing
                assert source is not None
                future = self._read(entry, source)
            # Held from now on (finish() ties it to the tensor), so that the
            # top-up below leaves room for it.
            self._demand[entry.key] = future
            self.held_bytes += entry.nbytes
        self.arrived(entry, ahead=ahead is not None, landed=future.done(), first=first)
        if self._disk is not None:
            self._disk.read += entry.footprint
        self._top_up_after(first)
        return future

    def arrived(self, entry: Entry, *, ahead: bool, landed: bool, first: bool) -> None:
        """Count an unpack that needed a read or a copy (NOTE [ Hits ]).

        ``ahead``: it was read or copied ahead; ``landed``: its bytes were
        there when backward asked; ``first``: the first unpack of a backward.

        Example:
            >>> import torch
            >>> from tierstore import TierConfig
            >>> from tierstore.tiers.entry import Entry
            >>> from tierstore.tiers.readahead import ReadAhead
            >>> from tierstore.tiers.schedule import Schedule
            >>> ra = ReadAhead(TierConfig(prefetch_bytes="1GiB"), None, None, Schedule(), {})
            >>> e = Entry(0, torch.zeros(2), 8)
            >>> ra.arrived(e, ahead=True, landed=False, first=False)  # still on its way
            >>> ra.hits, ra.misses, ra.limit.stalls, ra.limit.bytes
            (0, 1, 1, 33554432)
        """
        if ahead and landed:
            self.hits += 1
            return
        self.misses += 1
        if landed:
            return
        if first or entry.key in self._opening:
            self.first_waits += 1
        else:
            self.limit.stalled()

    def passed(self, *, first: bool) -> None:
        """Backward took an entry that never left the device: read ahead all the same."""
        self._top_up_after(first)

    def _top_up_after(self, first: bool) -> None:
        self.top_up()
        if first:  # the reads sent out as backward began (NOTE [ Prefetch ])
            self._opening = set(self._window)

    def finish(
        self,
        entry: Entry,
        future: concurrent.futures.Future[torch.Tensor],
        lock: threading.Lock,
    ) -> torch.Tensor:
        """Wait for ``future`` (the caller holds no lock), then the entry's tensor.

        NOTE [ A read handed to backward ]: the first of this wait and the
        entry's release to take the read back from ``_demand`` settles its bytes.
        """
        try:
            out = self._wait(entry, future, lock)
            with lock, held:
                if self._demand.pop(entry.key, None) is None:  # released meanwhile
                    self.held_bytes += entry.nbytes
                return entry.remember(self._until_freed(out, entry.nbytes))
        except BaseException:
            with lock, held:
                if self._demand.pop(entry.key, None) is not None:
                    self.held_bytes -= entry.nbytes  # counted by from_disk; nothing came back
            raise

    def _wait(
        self,
        entry: Entry,
        future: concurrent.futures.Future[torch.Tensor],
        lock: threading.Lock,
    ) -> torch.Tensor:
        assert self._pipeline is not None and self._transfers is not None
        start = time.perf_counter()
        try:
            with torch.profiler.record_function("tierstore::unpack_wait"):
                self._pipeline.wait([future])  # NOTE [ Movers ]
                with held:  # done: result() only takes its condition (NOTE [ Interrupts held ])
                    span = _result(future)  # close() waits for reads under way: never cancelled
        finally:
            waited = time.perf_counter() - start
            with lock:
                self.unpack_wait_s += waited
        copy = self._transfers.device_copy(span, entry.device)
        return self._restore(entry, self._transfers.consume(copy))

    def _restore(self, entry: Entry, span: torch.Tensor) -> torch.Tensor:
        assert self._transfers is not None and entry.layout is not None
        return codec.from_span(span, entry.layout, self._transfers.allocator(span.device))

    @staticmethod
    def _forget(ahead: concurrent.futures.Future[torch.Tensor] | DeviceCopy) -> None:
        # A copy's memory is its consumer stream's, which must wait for the
        # copy before reusing it (NOTE [ Copies on CUDA ]). A read has no
        # side effect: cancelling it is safe.
        if isinstance(ahead, DeviceCopy):
            Transfers.dropped(ahead)
        else:
            ahead.cancel()

    # -- lifetime ------------------------------------------------------------------

    def in_flight(self) -> list[concurrent.futures.Future[torch.Tensor]]:
        """Reads under way (ahead or on demand), for close() to wait on."""
        reads = [f for f, _ in self._window.values() if not isinstance(f, DeviceCopy)]
        return reads + list(self._demand.values())

    def close(self) -> None:
        """Wait for copies reading host memory about to be freed; forget everything."""
        for ahead, _ in self._window.values():
            if isinstance(ahead, DeviceCopy) and ahead.ready is not None:
                ahead.ready.synchronize()
        self._window.clear()
        self._opening.clear()
        self._demand.clear()
        self.window_bytes = 0
        self._held.clear()
        self._freed.clear()


def _result(future: concurrent.futures.Future[torch.Tensor]) -> torch.Tensor:
    """The read's tensor, or its error raised afresh, with the same message and cause.

    The error object is shared with the I/O thread's task, which may outlive
    this call. Raised here as it is, its traceback would take in backward's
    frames, and with them the graph and every entry it holds, for as long as
    that task lives: a failed backward's entries stayed on disk after the
    graph was dropped.
    """
    error = future.exception()
    if error is None:
        return future.result()
    if isinstance(error, TierstoreError):
        raise type(error)(str(error)) from error.__cause__
    raise error
