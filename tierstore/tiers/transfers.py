"""Transfers: host memory tierstore owns, and the copies between it and the device.

One owner for every host buffer and every copy on a CUDA stream: the pinned
pool and the copy streams (``NOTE [ Copies on CUDA ]``), the D2H copies
still under way, and on a CPU the pool of buffers that disk reads and write
staging lease (``NOTE [ Leased buffers ]`` in ``tierstore/tiers/host_pool.py``).
All of it is created on first use and released by :meth:`Transfers.close`.
Called under the tier manager's lock.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.transfers import Transfers
    >>> transfers = Transfers(TierConfig(disk_budget="1MiB"))
    >>> buf = transfers.buffer(10_000)
    >>> buf.numel(), transfers.buffers_if_open.used_bytes
    (10000, 12288)
    >>> del buf; transfers.close(); transfers.close()
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierstore import codec
from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.errors import StoreClosedError, TierFullError
from tierstore.tiers.entry import Entry
from tierstore.tiers.forks import leave_to_parent
from tierstore.tiers.host_pool import (
    RELEASE_MIN_BYTES,
    HostBlock,
    HostPool,
    page_fault_s,
    release_free_heap,
)

__all__ = ["DeviceCopy", "HostCopy", "Transfers", "page_fault_s"]

# NOTE [ Copies on CUDA ]
# D2H (a saved tensor leaves the device): the d2h stream waits on the
# producer's stream, read at call time, then copies into a pooled pinned
# block and records an event. Pack returns at once; the entry keeps the span
# copied from (for a view with gaps, a compact temporary that nothing else
# holds) and the saved tensor referenced until that event has completed
# (Entry.ready, Entry.source, Entry.probe), so the caching allocator cannot
# hand its memory to a new tensor while the copy still reads it. A disk
# write of the block first waits for the event on the I/O thread.
# H2D (backward needs it back): the destination is allocated on the
# consumer's stream (the current stream where the copy is issued: backward's),
# and the h2d stream waits for an event recorded there after the allocation,
# then for the entry's D2H event if that copy is still under way. The
# consumer's stream then waits on the H2D event (DeviceCopy.ready;
# Transfers.consume): no host synchronisation anywhere. Why the consumer's
# stream: the caching allocator keeps a pool per stream and never hands a
# block freed on one stream to another, so reloads allocated on the h2d
# stream would build a second pool beside the compute stream's, reserved
# memory that nvidia-smi shows and that the warm-up and profiled steps leave
# behind even under a budget that moves nothing. The wait on
# the allocation costs little: a prefetch is issued at an earlier unpack,
# so the copy waits only for the compute queued before that unpack and runs
# beside the compute after it.
# Lifetime: the block belongs to the stream that uses the tensor, so the
# allocator's stream-ordered reuse is right without record_stream, which
# fragments the pool and delays every free (PyTorch's compiled offloading
# dropped it for that). A consumer on another stream than the allocation's
# (a model that runs backward on a side stream) still gets record_stream.
# A copy dropped unconsumed (a read-ahead backward never asked for) makes
# its stream wait on the copy's event (Transfers.dropped), so no later
# kernel there can reuse the block while the copy still writes it.
# A pool block goes back only once every copy issued before the release, on
# both copy streams, has completed (an event recorded on each at release).
# Rates: each copy is timed by a timing event recorded on its stream before
# it (after the stream's waits) and its own completion event; as copies
# complete (settle()) their bytes and seconds go to the link's clock each
# way (the store's, passed in). Copies on one stream run one after another, so the
# seconds add up to the time the stream was busy: what a plan for this
# device divides by (NOTE [ Timing a profile ] in planning/timers.py).


@dataclass(frozen=True)
class HostCopy:
    """A span's bytes in host memory, and the copy that fills them (NOTE [ Copies on CUDA ]).

    ``ready`` is ``None`` when the bytes are there already (always on CPU);
    otherwise the event of the D2H copy. ``block`` is the pool block holding
    them, to be given back with :meth:`Transfers.free_host`.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.transfers import Transfers
        >>> copy = Transfers(TierConfig(disk_budget=0)).host_copy(torch.ones(2))
        >>> copy.ready is None and copy.block is None
        True
    """

    tensor: torch.Tensor
    ready: torch.cuda.Event | None = None
    block: HostBlock | None = None


@dataclass(frozen=True)
class DeviceCopy:
    """A span copied back to its device on the h2d stream; ``ready`` is that copy's event.

    ``stream``: the stream its memory was allocated on, the consumer's
    (NOTE [ Copies on CUDA ]); ``None`` with no copy.

    Example:
        >>> import torch
        >>> from tierstore.tiers.transfers import DeviceCopy
        >>> DeviceCopy(torch.ones(2), None).ready is None
        True
    """

    tensor: torch.Tensor
    ready: torch.cuda.Event | None
    stream: torch.cuda.Stream | None = None


class Clock(Protocol):
    """A link's clock as the copies feed it (``pipeline.LinkClock``, owned by the store)."""

    def add(self, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` that kept the link busy ``seconds``."""


class _Streams:
    """The copy streams of one CUDA device, created on first use."""

    __slots__ = ("d2h", "h2d")

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)


class Transfers:
    """Host buffers and device copies for one store; see the module docstring.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.transfers import Transfers
        >>> transfers = Transfers(TierConfig(disk_budget=0))
        >>> transfers.host_copy(torch.ones(2)).tensor.device
        device(type='cpu')
        >>> transfers.close()
    """

    def __init__(self, config: TierConfig, links: tuple[Clock, Clock] | None = None) -> None:
        self._config = config
        self._lock = (
            threading.Lock()
        )  # creating the pools; everything else runs under the manager's
        self._closed = False
        self._pinned: HostPool | None = None
        self._buffers: HostPool | None = None
        self._streams: dict[torch.device, _Streams] = {}
        # Pool blocks waiting for the copies issued before their release.
        self._returns: deque[tuple[list[torch.cuda.Event], HostBlock]] = deque()
        # D2H copies under way, oldest first, and their bytes.
        self._copying: deque[Entry] = deque()
        self.copying_bytes = 0
        # The device link's clocks each way, fed by timed copies (NOTE [ Copies on CUDA ]);
        # None: nobody reads the rates, and copies are not timed.
        self._links = links
        self._timed: deque[tuple[Clock, Any, Any, int]] = deque()  # copies not yet counted
        #: A profiled step's list for the compute stream's waits on copies back, else None.
        self.blocked: list[tuple[Any, Any]] | None = None
        self.heap_releases = 0
        self._let_go_bytes = 0  # since the heap was last handed back
        leave_to_parent(self)

    def _forked(self) -> None:
        # NOTE [ Forked children ] in tierstore/tiers/forks.py: the pools and the
        # copies under way are the parent's (CUDA does not survive a fork).
        self._lock = threading.Lock()
        self._closed = True

    # -- host memory (NOTE [ Host pool ], NOTE [ Leased buffers ]) --------------

    @property
    def pinned_pool_if_open(self) -> HostPool | None:
        """The host tier's pool on CUDA, if a copy off the device has created it."""
        return self._pinned

    @property
    def buffers_if_open(self) -> HostPool | None:
        """The CPU buffer pool, if a read or write staging has created it."""
        return self._buffers

    def _pool(self, pinned: bool) -> HostPool:
        pool = self._pinned if pinned else self._buffers
        if pool is not None:
            return pool
        with self._lock:
            if self._closed:
                raise StoreClosedError("tierstore: this store is closed; its host memory is gone")
            cfg = self._config
            if pinned:
                # Queued disk writes hold blocks too, beyond the host tier's own.
                capacity = int(cfg.host_budget) + int(cfg.write_queue_bytes)
                pool = self._pinned = HostPool(
                    capacity, int(cfg.host_pool_step), pin=cfg.pin_memory
                )
            else:
                # Twice the bytes in flight the settings allow: a window being
                # read while the last one is still held by backward, and the
                # write queue's staging; and at least a chunk, so that with
                # nothing in flight (both at 0) the read in use lands here too,
                # not in an I/O thread's heap. Pages are used only as needed.
                in_flight = int(cfg.prefetch_bytes) + int(cfg.write_queue_bytes)
                capacity = max(2 * in_flight, int(cfg.host_pool_step))
                pool = self._buffers = HostPool(capacity, int(cfg.host_pool_step), pin=False)
        return pool

    def buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 host memory that returns to the pool when its storage is freed.

        From the heap when the pool is full (counted in ``allocations_outside``).
        """
        out = self._pool(pinned=False).lease(nbytes)
        return out if out is not None else torch.empty(nbytes, dtype=torch.uint8)

    def allocator(self, device: torch.device) -> Callable[[int], torch.Tensor] | None:
        """Where disk reads for an entry on ``device`` land: leased buffers on a CPU.

        ``None`` (the heap) for a GPU's entries: the copy to the device reads
        them once and lets go, and a pageable buffer must not be recycled while
        a copy may still read it.
        """
        return self.buffer if device.type == "cpu" else None

    def trim(self, heap: bool = False) -> None:
        """Hand back the pages of idle buffers (NOTE [ Leased buffers ]); at a step's start.

        ``heap``: the free pages of the process heap too (:meth:`release_heap`),
        once the steps have let go of :data:`~tierstore.tiers.host_pool.RELEASE_MIN_BYTES`
        since the last time (NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py).

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.tiers.host_pool import RELEASE_MIN_BYTES
            >>> from tierstore.tiers.transfers import Transfers
            >>> transfers = Transfers(TierConfig())
            >>> transfers.let_go(RELEASE_MIN_BYTES - 1, budget=1 << 40)
            >>> transfers.trim(heap=True); transfers.heap_releases  # too little let go
            0
            >>> transfers.close()
        """
        if self._buffers is not None:
            self._buffers.trim()
        if heap and self._let_go_bytes >= RELEASE_MIN_BYTES:
            self.release_heap()

    def let_go(self, nbytes: int, budget: int) -> None:
        """Count ``nbytes`` a planned CPU step let go of; past ``budget``'s worth, release the heap.

        No more often than every :data:`~tierstore.tiers.host_pool.RELEASE_MIN_BYTES`
        (NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py).

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.tiers.transfers import Transfers
            >>> transfers = Transfers(TierConfig())
            >>> transfers.let_go(1 << 20, budget=0)  # 1 MiB: not yet
            >>> transfers.heap_releases
            0
            >>> transfers.close()
        """
        self._let_go_bytes += nbytes
        if self._let_go_bytes >= max(budget, RELEASE_MIN_BYTES):
            self.release_heap()

    def release_heap(self) -> None:
        """Hand the process heap's free pages back, counted in :attr:`heap_releases`.

        NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py.
        """
        self._let_go_bytes = 0
        if release_free_heap():
            self.heap_releases += 1

    # -- D2H ---------------------------------------------------------------------

    def _streams_of(self, device: torch.device) -> _Streams:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = _Streams(device)
        return streams

    def host_block(self, nbytes: int) -> HostBlock:
        """A block of the host pool for a copy off the device; never memory outside it.

        The pool holds at most ``host_budget`` plus ``write_queue_bytes`` (the
        copies on their way to disk). Memory pinned past that would count
        against no budget (NOTE [ Host pool ] in tierstore/tiers/host_pool.py).

        Raises:
            TierFullError: the pool has no room for ``nbytes``.

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.tiers.transfers import Transfers
            >>> transfers = Transfers(TierConfig(host_budget="1MiB", pin_memory=False))
            >>> transfers.host_block(1000).nbytes
            1000
            >>> transfers.close()
        """
        pool = self._pool(pinned=True)
        block = pool.take(nbytes)
        if block is None and self._returns:
            # Blocks given back wait for the copies issued before their release
            # (NOTE [ Copies on CUDA ]); with the host far ahead of the device,
            # they can fill the pool: wait for those copies rather than refuse.
            for events, _ in self._returns:
                for event in events:
                    event.synchronize()
            self.reclaim()
            block = pool.take(nbytes)
        if block is None:
            cfg = self._config
            raise TierFullError(
                f"tierstore: the host pool has no room for a copy of {human_bytes(nbytes)} "
                f"off the device: {human_bytes(pool.used_bytes)} of its "
                f"{human_bytes(pool.capacity_bytes)} (host_budget="
                f"{human_bytes(int(cfg.host_budget))} plus write_queue_bytes="
                f"{human_bytes(int(cfg.write_queue_bytes))}) are in use; raise host_budget "
                f"({ENV_PREFIX}HOST_BUDGET), or write_queue_bytes "
                f"({ENV_PREFIX}WRITE_QUEUE_BYTES) for copies on their way to disk"
            )
        return block

    def host_copy(self, span: torch.Tensor) -> HostCopy:
        """Start copying a span to host memory; on CPU the span itself is the copy."""
        if span.device.type == "cpu":
            return HostCopy(span)
        if span.device.type != "cuda":  # other accelerators: a plain synchronous copy
            return HostCopy(span.to("cpu"))
        self.reclaim()
        block = self.host_block(span.numel() * span.element_size())
        host = block.tensor.view(span.dtype).view(span.shape)
        streams = self._streams_of(span.device)
        producer = torch.cuda.current_stream(span.device)  # at call time, never cached
        links = self._links
        with _traced("tierstore::d2h"):
            streams.d2h.wait_stream(producer)
            with _on(streams.d2h, producer):
                began = _timing_event(streams.d2h) if links is not None else None
                host.copy_(span, non_blocking=True)
                ready = torch.cuda.Event(enable_timing=links is not None)
                ready.record(streams.d2h)
        if links is not None:
            self._timed.append((links[0], began, ready, span.numel() * span.element_size()))
        return HostCopy(host, ready, block)

    def _count_copies(self) -> None:
        """Give the link clocks the copies that completed (NOTE [ Copies on CUDA ])."""
        timed = self._timed
        while timed and timed[0][2].query():
            clock, began, ended, nbytes = timed.popleft()
            clock.add(nbytes, max(0.0, float(began.elapsed_time(ended)) / 1e3))

    def stage(self, span: torch.Tensor) -> torch.Tensor:
        """A copy of a CPU span in a leased buffer; the span itself when the pool is full.

        The copy starts :data:`~tierstore.codec.HEADROOM` bytes into its
        buffer, room for its record's header (NOTE [ Records in one buffer ]
        in tierstore/codec.py). NOTE [ Write staging ] in tierstore/tiers/writebehind.py.
        """
        nbytes = span.numel() * span.element_size()
        buf = self._pool(pinned=False).lease(codec.HEADROOM + nbytes)
        if buf is None:
            return span
        return buf[codec.HEADROOM :].view(span.dtype).copy_(span)

    def to_host(self, entry: Entry, span: torch.Tensor, *, staged: bool = False) -> None:
        """Rest ``entry``'s bytes in host memory: a copy off the device, or the span itself.

        ``staged``: a CPU span that is still the caller's memory is copied into
        a leased buffer (NOTE [ Write staging ] in tierstore/tiers/writebehind.py).
        """
        # Only a staged copy has room in front (NOTE [ Records in one buffer ]
        # in tierstore/codec.py), and only while it stays the entry's bytes (a
        # rewrite after a failed write passes the same tensor back).
        if staged and span.device.type == "cpu" and entry.probe is not None:
            copy = HostCopy(self.stage(span))
            entry.staged = copy.tensor is not span
        else:
            copy = self.host_copy(span)
            entry.staged = entry.staged and copy.tensor is entry.tensor
        if copy.tensor is span:
            entry.tensor = span  # already host memory (CPU, or an entry on the host tier)
            return
        entry.tensor, entry.block = copy.tensor, copy.block
        if copy.ready is None:
            entry.let_go_of_original()  # a copy: later changes cannot reach it
        else:
            # NOTE [ Copies on CUDA ]: the source stays referenced (by the
            # probe) until the copy has read it; settle() lets go.
            entry.ready, entry.source = copy.ready, span
            self._copying.append(entry)
            self.copying_bytes += entry.nbytes

    def settle(self) -> None:
        """Let go of sources whose D2H copies have ended, and of pool blocks they freed."""
        while self._copying and self.done(self._copying[0].ready):
            entry = self._copying.popleft()
            self.copying_bytes -= entry.nbytes
            entry.ready = entry.source = None
            entry.let_go_of_original()
        self._count_copies()
        self.reclaim()

    def oldest_copy(self) -> torch.cuda.Event:
        """The event of the oldest D2H copy under way.

        NOTE [ Copies in flight ] in tiers/inflight.py.
        """
        ready = self._copying[0].ready
        assert ready is not None
        return ready

    def copies_over(self, cap_bytes: int) -> bool:
        """Whether D2H copies still under way hold more than ``cap_bytes``; never waits.

        What has landed was let go of by the last :meth:`settle` (an event
        query each); NOTE [ Copies in flight ] in tierstore/tiers/inflight.py says what
        the caller does instead of waiting.
        """
        return self.copying_bytes > cap_bytes

    # -- H2D ---------------------------------------------------------------------

    def device_copy(
        self, span: torch.Tensor, device: torch.device, after: torch.cuda.Event | None = None
    ) -> DeviceCopy:
        """Start copying a host span to ``device``; ``after``: the D2H that fills ``span``.

        On CPU (or when the span is already there) no copy is made.
        """
        if span.device == device:
            return DeviceCopy(span, None)
        if device.type != "cuda":
            return DeviceCopy(span.to(device), None)
        streams = self._streams_of(device)
        consumer = torch.cuda.current_stream(device)  # at call time, never cached
        with _traced("tierstore::h2d"):
            # On the consumer's stream; the copy waits for the allocation
            # there (NOTE [ Copies on CUDA ]).
            out = torch.empty(span.shape, dtype=span.dtype, device=device)
            allocated = torch.cuda.Event()
            allocated.record(consumer)
            streams.h2d.wait_event(allocated)
            if after is not None:
                streams.h2d.wait_event(after)
            links = self._links
            with _on(streams.h2d, consumer):
                began = _timing_event(streams.h2d) if links is not None else None
                out.copy_(span, non_blocking=span.is_pinned())
                ready = torch.cuda.Event(enable_timing=links is not None)
                ready.record(streams.h2d)
        if links is not None:
            self._timed.append((links[1], began, ready, span.numel() * span.element_size()))
        return DeviceCopy(out, ready, consumer)

    def consume(self, copy: DeviceCopy) -> torch.Tensor:
        """The copied tensor, usable on the current stream (which waits for the copy).

        Its memory is the stream's it was allocated on; a use on another
        stream is recorded on it (NOTE [ Copies on CUDA ]). While a profile
        runs, the wait is timed into :attr:`blocked` (NOTE [ Timing a
        profile ] in planning/timers.py).
        """
        if copy.ready is not None:
            consumer = torch.cuda.current_stream(copy.tensor.device)  # at call time
            blocked = self.blocked
            if blocked is None:
                consumer.wait_event(copy.ready)
            else:
                began = _timing_event(consumer)
                consumer.wait_event(copy.ready)
                blocked.append((began, _timing_event(consumer)))
            if consumer != copy.stream:
                copy.tensor.record_stream(consumer)
        return copy.tensor

    @staticmethod
    def dropped(copy: DeviceCopy) -> None:
        """A copy no one will consume: its memory's stream waits for it before reusing it.

        NOTE [ Copies on CUDA ]: the block goes back to that stream's pool
        when the tensor dies, and a kernel queued there later must not write
        it while the copy still does.
        """
        if copy.ready is not None and copy.stream is not None:
            copy.stream.wait_event(copy.ready)

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        """Whether a copy's event has completed (``None``: there was nothing to wait for)."""
        return event is None or event.query()

    # -- pool blocks --------------------------------------------------------------

    def free_host(self, block: HostBlock | None) -> None:
        """Give a pinned pool block back once the copies issued so far have ended."""
        if block is None:
            return
        events = []
        for streams in self._streams.values():
            for stream in (streams.d2h, streams.h2d):
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        self._returns.append((events, block))

    def reclaim(self) -> None:
        """Give back the pool blocks whose copies have all ended (cheap when none wait)."""
        pool = self._pinned
        while self._returns and all(e.query() for e in self._returns[0][0]):
            _, block = self._returns.popleft()
            if pool is not None:
                pool.give(block)

    def close(self) -> None:
        """Wait for every copy under way, then drop the pools. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pinned, self._pinned = self._pinned, None
            buffers, self._buffers = self._buffers, None
        for entry in self._copying:  # copies into host memory about to be freed
            if entry.ready is not None:
                entry.ready.synchronize()
        self._copying.clear()
        self.copying_bytes = 0
        self._timed.clear()
        for events, _ in self._returns:  # copies still using a block
            for event in events:
                event.synchronize()
        self._returns.clear()
        for pool in (pinned, buffers):
            if pool is not None:
                pool.close()


_UNTRACED = contextlib.nullcontext()


def _on(
    stream: torch.cuda.Stream, current: torch.cuda.Stream
) -> contextlib.AbstractContextManager[object]:
    """``stream`` as the current stream, then ``current`` (of the same device) again.

    For a stream of the current device, what ``torch.cuda.stream(stream)``
    does without the two lookups of the current device it makes (each
    reads ``torch.cuda.is_available()``), several times the cost of the two
    calls of :class:`_On` (benchmarks/gpu_host.py times both). Setting a
    stream of another device makes that
    device the current one, which ``torch.cuda.stream`` undoes.
    """
    if stream.device_index != torch.cuda.current_device():
        return torch.cuda.stream(stream)
    return _On(stream, current)


class _On:
    """``stream`` as its device's current stream, then ``current`` again (see :func:`_on`)."""

    __slots__ = ("current", "stream")

    def __init__(self, stream: torch.cuda.Stream, current: torch.cuda.Stream) -> None:
        self.stream, self.current = stream, current

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.current)


def _traced(name: str) -> contextlib.AbstractContextManager[object]:
    """A profiler range named ``name`` while a profiler runs; else nothing.

    A ``record_function`` costs a dispatcher call each way even with no
    profiler (microseconds a copy), and every moved save makes a copy
    each way.
    """
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _UNTRACED


def _timing_event(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A timing event recorded now on ``stream`` (the current stream by default)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


#: Cycles of the spin that keeps a profiled stream busy: about half a millisecond
#: at a clock near 2 GHz, longer than the host takes to launch one op through the
#: recorder (about 0.1 ms).
KEEP_BUSY_CYCLES = 1_000_000


class CudaEvents:
    """Timing events on the current stream, and a spin that keeps it busy.

    A profile's :class:`~tierstore.planning.timers.BusyTimer` calls it for each event
    and, before an op, :meth:`keep_busy` when the stream has run dry (NOTE
    [ Timing a profile ] in planning/timers.py): the op's start event then waits behind
    the spin while the host launches the op, so its span is the op's kernels
    alone, not the host's launch.
    """

    def __call__(self) -> torch.cuda.Event:
        return _timing_event()

    @staticmethod
    def keep_busy() -> None:
        """Queue a spin on the current stream."""
        torch.cuda._sleep(KEEP_BUSY_CYCLES)


_CUDA_EVENTS = CudaEvents()


def cuda_events() -> CudaEvents | None:
    """The device's timing events when CUDA is in use, else ``None``.

    Example:
        >>> import torch
        >>> from tierstore.tiers.transfers import cuda_events
        >>> (cuda_events() is None) == (not torch.cuda.is_initialized())
        True
    """
    return _CUDA_EVENTS if torch.cuda.is_initialized() else None
