"""Host memory tierstore owns: a pool of (pinned) host buffers, reused across steps.

NOTE [ Host pool ]

On CUDA every saved tensor demoted off the device is copied into host memory
that must be page-locked for the copy to run asynchronously at full PCIe
speed. Pinning is slow: ``cudaHostAlloc`` of 1 GiB takes over half a
second, far longer than the copy it serves. So the pool pins a few large
*chunks* on first need, ``step`` bytes at a time and at most ``capacity``
bytes in all, and carves entries out of them with an
:class:`~tierstore.backends._extents.ExtentAllocator` per chunk (a stack:
backward frees newest first). Chunks are kept until :meth:`HostPool.close`,
so from the second step on no pinning happens at all. When no chunk has room
and the pool may not grow, the chunks with no block out are dropped and the
pool grows again: chunks grown for one step's sizes (a first step that sent
every save off the device in pieces of one size) must not turn away a later
step's larger block while most of their bytes are free. Only when that
leaves no room either does :meth:`HostPool.take` return ``None`` (counted in
``allocations_outside``). A copy off the device then is refused with an
error that names ``host_budget`` (``Transfers.host_block``): memory pinned
outside the pool would count against no budget, and the caching host
allocator would keep it pinned for the life of the process.

Pinning can fail: the locked-memory limit (``ulimit -l``) or the memory
left may be below what the pool may pin. The pool then warns once, naming
the settings that lower it, and goes on in pageable chunks, as with
``pin_memory=False``: slower copies, the same bytes. :func:`_pinned` is the
one place that pins.

The pool knows nothing about streams: a block still read or written by a
copy in flight must not be given back yet. Its owner (the movers) gives it
back once the copy's event has completed.

NOTE [ Leased buffers ]

On a CPU the same pool, unpinned, holds tierstore's own large buffers: the
destinations of disk reads, which become the tensors backward receives, and
write staging. Were they allocated from the process heap, glibc would keep
their pages after backward freed them (freed heap memory is reused, not
returned), and since reads are allocated on the I/O thread, in an arena of
its own, the heap would hold a second copy of the activations' footprint.
:meth:`HostPool.lease` hands out a tensor over a block whose *storage* gives
the block back when the last tensor viewing it is freed: autograd dropping
an unpacked saved tensor returns its memory to the pool, not to the heap.
That return can happen on any thread at any moment (a garbage collection
inside :meth:`HostPool.take`, say), so it only queues the block, and it
queues it without running Python: the window's weak reference has the
queue's ``deque.append`` as its callback (NOTE [ Finalizers and interrupts ]
in tierstore/tiers/release.py). Whoever next holds the pool's lock puts it back.

NOTE [ Pool blocks and interrupts ]

A Ctrl-C raises ``KeyboardInterrupt`` at whatever bytecode the main thread
runs next, and that may be in the middle of handing a block out or putting
one back: the allocator's free list then no longer matches the blocks out,
and the block is lost for the life of the pool. The pool does not try to
make each step atomic. It keeps the truth apart from the bookkeeping: a
block is out while its lease is in ``_leases`` or the block itself in
``_taken``; a single dict operation, which no interrupt splits, adds it
there as it is handed out and takes it away as it is put back, and only
then is the free list updated. A return is put back only if it is still in
``_leases``, and leaves the queue after that: an interrupt between the two
never frees a block twice. Whenever the lock is taken and nothing is out,
bytes still counted in use can only be bookkeeping an interrupt cut short,
and the pool starts its chunks' free lists afresh (``_reset``): what one
Ctrl-C mislaid comes back when the step that it interrupted has let go of
its buffers.

Unpinned chunks are private anonymous ``mmap`` memory (``PRIVATE`` in
``backends/_aligned.py`` says why not shared): only pages written to are resident,
and :meth:`HostPool.trim` hands the pages of chunks with no block out back
to the kernel (``MADV_DONTNEED``), so memory recycled within a step does not
stay resident between steps. They ask for transparent huge pages
(``MADV_HUGEPAGE``, which a kernel whose THP mode is ``madvise``, a common
default, grants only to mappings that ask): a chunk faulted back in after a
trim then costs one fault per 2 MiB instead of per 4 KiB, and the direct
I/O that reads into and writes from it pins a few large pages instead of
many small ones. Pinned chunks are never
trimmed: pinning is what the pool exists to do once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierstore.backends._aligned import PRIVATE
from tierstore.backends._extents import ExtentAllocator
from tierstore.config import ENV_PREFIX, human_bytes
from tierstore.errors import StoreClosedError, TierstoreWarning
from tierstore.tiers.interrupts import held

__all__ = [
    "BLOCK_ALIGN",
    "RELEASE_MIN_BYTES",
    "HostBlock",
    "HostPool",
    "map_large_allocations_apart",
    "page_fault_s",
    "release_free_heap",
]

#: Blocks start on a multiple of this (a page: DMA- and O_DIRECT-friendly).
BLOCK_ALIGN = 4096


@dataclass(frozen=True)
class HostBlock:
    """A piece of one pool chunk: ``tensor`` is ``nbytes`` of uint8 host memory.

    Example:
        >>> from tierstore.tiers.host_pool import HostPool
        >>> pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
        >>> block = pool.take(10)
        >>> block.tensor.numel(), block.offset
        (10, 0)
        >>> pool.give(block); pool.close()
    """

    chunk: int
    offset: int
    length: int
    tensor: torch.Tensor = field(repr=False)

    @property
    def nbytes(self) -> int:
        """The bytes asked for (``length`` is that, rounded up to :data:`BLOCK_ALIGN`)."""
        return self.tensor.numel()


# NOTE [ Handing the heap back ]
#
# On a CPU a saved activation is process memory: forward allocates it from
# the heap, the store writes it out, and forward frees it; in backward,
# autograd frees what it consumed and the gradients it made. glibc keeps
# freed heap pages resident (a heap gives back only what is free at its
# top), so RSS holds every page the step touched, and the steps before it,
# whatever the store moved out: at the budget's floor (everything written
# out, one read in use) the heaps hold several times their bytes in use
# free but resident, and the step peaks above a hook that torch.save()s
# every saved tensor.
#
# An activation budget bounds what the user's tools show, so a planned store
# on a CPU hands the heap's free pages back (glibc's malloc_trim, which
# gives back free chunks inside a heap too): at each step's first save
# (whatever the plan does with it: PlanRunner's cpu_step_began; not under a
# plan that hands nothing back, below), and
# whenever the step has let go of another budget's worth of bytes since the
# last time (saves written out or to be rebuilt, in forward; saves read
# back, in backward), but no more often than every RELEASE_MIN_BYTES let go,
# at a step's start as within it, as each call walks the heaps (a tiny
# budget would call after every save; glibc maps allocations larger than
# that apart anyway, and unmaps them when they are freed) and each page
# handed back is faulted in again when used. Steps that let go of less than
# that between them hold little the heap could give back, and a hand-back
# at each of their starts costs them its faults all the same, and makes
# their slowest steps slower. Nothing in use is freed; a page used again is
# faulted back in, zeroed. The saves themselves are mapped apart from the heaps
# (NOTE [ Large allocations mapped apart ]), so what is handed back is the
# small allocations' pages. Handing back at
# each step's start alone leaves forward's peak well above what the step
# holds; handing back within the step too, each budget's worth, brings it
# down by about a third. Without a budget tierstore promises
# no bound and does none of this. Where the C library has no malloc_trim
# (musl, macOS, Windows) nothing happens.
#
# Each hand-back costs the step the page faults of the pages it uses
# again, several times the minor faults of a step without hand-backs and
# about a tenth of a small model's step. A plan that moves nothing and
# rebuilds only natively
# (checkpointing modules whole: NOTE [ Replayed modules ] in
# tierstore/planning/planner.py) frees what it drops where torch.utils.checkpoint
# does, and the heap holds no more than checkpointing's: such a plan hands
# nothing back (Plan.hands_back; nor does one that keeps everything). Any
# other plan does, as above: without hand-backs for its rebuilt saves or
# at its start, a plan that keeps a few saves in the last blocks and
# rebuilds the rest op by op runs near checkpointing's step but well above
# its peak RSS, and handing back holds it near checkpointing's peak for a
# step at most a tenth slower. The planner prices the difference
# (Profile.hand_back_s): page_fault_s(), measured once a process, for
# each page the step saves, added to every plan that hands back. So on a
# CPU, where checkpointing modules meets the budget, a plan that keeps
# more and copies or rebuilds op by op the rest must be faster by more
# than its faults.
# A planned step also hands back the pages of the buffers the profiled
# steps used (HostPool.trim) as it begins, whatever its plan: one that
# stores nothing never reaches the tier manager's step start, and would
# keep the write staging the profile used resident through every step.

# NOTE [ Large allocations mapped apart ]
# glibc maps an allocation above its mmap threshold apart from the heap and
# unmaps it at free, but raises that threshold to the size of each such
# allocation freed, up to 32 MiB: after the first save is freed, a step's
# saves come from the heaps (one per thread that allocates: forward's, each
# I/O worker's), and a freed save's pages stay resident until a hand-back,
# which frees only the pages no live chunk shares. The process then holds
# far more than the step does, and under a memory limit (a container's
# cgroup) that excess is what the kernel kills. So a store with an
# activation budget, in a process under a memory limit, holds the threshold
# at glibc's default, 128 KiB (mallopt(M_MMAP_THRESHOLD), which also stops
# glibc moving it): a save, a staging copy or a read above it is mapped
# apart, and its pages leave the process as it is freed, so the process's
# memory follows what the step holds, which is what the budget bounds. It
# costs a mapping and its page faults per large allocation, the faults a
# hand-back costs anyway; without a limit, where resident pages kill
# nothing, the heap keeps them for reuse and the setting stays as it is.
# This is the one allocator setting tierstore changes, for the process's
# life (a store closed leaves it): where memory comes from, never what a
# program computes. Where the C library is not glibc, nothing happens.

#: glibc's mallopt parameter for the mmap threshold, and its default value.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 << 10


@functools.cache
def map_large_allocations_apart() -> bool:
    """Hold glibc's mmap threshold at its default: whether the C library took it.

    NOTE [ Large allocations mapped apart ]. Once a process; ``False`` where
    the C library is not glibc.

    Example:
        >>> from tierstore.tiers.host_pool import map_large_allocations_apart
        >>> map_large_allocations_apart() in (True, False)
        True
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # no such symbol; no CDLL(None) (Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


#: The fewest bytes a planned step lets go of between two heap releases
#: (NOTE [ Handing the heap back ]): glibc's largest heap allocation.
RELEASE_MIN_BYTES = 32 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # no such symbol; no CDLL(None) (Windows)
        return None


def release_free_heap() -> bool:
    """Hand the process heap's free pages back to the system; whether the C library could.

    NOTE [ Handing the heap back ]. Frees nothing in use and changes no
    allocator setting; ``False`` where the C library is not glibc.

    Example:
        >>> from tierstore.tiers.host_pool import release_free_heap
        >>> release_free_heap() in (True, False)
        True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


#: The memory :func:`page_fault_s` faults in, each time it measures.
_FAULT_PROBE_BYTES = 2 << 20


@functools.cache
def page_fault_s() -> float:
    """Seconds a page handed back costs when it is used again; 0.0 where none is handed back.

    NOTE [ Handing the heap back ]: the fault and the zeroing of a page of
    private anonymous memory in small pages, as the heap has, above writing
    it while resident. The least of three tries, measured once a process
    (a few milliseconds).

    Example:
        >>> from tierstore.tiers.host_pool import page_fault_s
        >>> page_fault_s() >= 0.0
        True
    """
    if _malloc_trim() is None:
        return 0.0
    region = mmap.mmap(-1, _FAULT_PROBE_BYTES, flags=PRIVATE)
    try:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # the heap's pages are small ones
            region.madvise(mmap.MADV_NOHUGEPAGE)
        view = (ctypes.c_char * _FAULT_PROBE_BYTES).from_buffer(region)
        cold = warm = float("inf")
        for _ in range(3):
            region.madvise(mmap.MADV_DONTNEED)
            start = time.perf_counter()
            ctypes.memset(view, 1, _FAULT_PROBE_BYTES)
            middle = time.perf_counter()
            ctypes.memset(view, 2, _FAULT_PROBE_BYTES)
            cold = min(cold, middle - start)
            warm = min(warm, time.perf_counter() - middle)
        del view
    finally:
        region.close()
    return max(cold - warm, 0.0) / (_FAULT_PROBE_BYTES // mmap.PAGESIZE)


def _pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory: the one place tierstore pins (NOTE [ Host pool ])."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _pin_failed(nbytes: int, capacity: int, exc: RuntimeError) -> str:
    """The warning of a pool whose pinning failed (NOTE [ Host pool ])."""
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"tierstore: pinning {human_bytes(nbytes)} of host memory for the host pool failed "
        f"({why}); the pool goes on in pageable memory, where copies to and from the GPU are "
        f"slower. The locked-memory limit (ulimit -l) or the free memory is below the "
        f"{human_bytes(capacity)} the pool may pin: lower host_budget ({ENV_PREFIX}HOST_BUDGET), "
        f"or set pin_memory=False ({ENV_PREFIX}PIN_MEMORY) to pin nothing"
    )


class _Chunk:
    __slots__ = ("alloc", "map", "memory", "used")

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.map: mmap.mmap | None = None
        if pin:
            self.memory = _pinned(nbytes)
        else:  # NOTE [ Leased buffers ]: pages can be handed back
            self.map = mmap.mmap(-1, nbytes, flags=PRIVATE)
            huge = getattr(mmap, "MADV_HUGEPAGE", None)
            if huge is not None:
                with contextlib.suppress(OSError):  # a kernel without THP
                    self.map.madvise(huge)
            self.memory = torch.frombuffer(self.map, dtype=torch.uint8)
        self.alloc = ExtentAllocator(nbytes)
        self.used = 0

    def trim(self) -> bool:
        """Hand the pages back if no block is out; whether it did."""
        if self.map is None or self.used:
            return False
        self.map.madvise(mmap.MADV_DONTNEED)
        return True


class _Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a leased window that carries its block (NOTE [ Leased buffers ]).

    Its callback is the pool's ``deque.append``: when the window dies, the C
    runtime queues this reference, and no Python code runs there.
    """

    __slots__ = ("block",)
    block: HostBlock


class HostPool:
    """Host buffers carved from a few large allocations (NOTE [ Host pool ]).

    Thread-safe. Allocates nothing until the first :meth:`take`; :meth:`close`
    drops every chunk and is idempotent.

    Args:
        capacity: the most bytes the pool may hold in chunks
            (``TierConfig.host_budget``).
        step: bytes per chunk (``TierConfig.host_pool_step``); a block
            larger than that gets a chunk of its own size.
        pin: page-lock the chunks (``TierConfig.pin_memory`` on CUDA).

    Warns:
        TierstoreWarning: pinning a chunk failed; the pool goes on unpinned
            (NOTE [ Host pool ]). Once per pool.

    Example:
        >>> import torch
        >>> from tierstore.tiers.host_pool import HostPool
        >>> pool = HostPool(capacity=1 << 20, step=1 << 19, pin=False)
        >>> a = pool.take(1000)
        >>> _ = a.tensor.copy_(torch.arange(1000) % 256)
        >>> pool.reserved_bytes, pool.used_bytes
        (524288, 4096)
        >>> pool.give(a); pool.used_bytes
        0
        >>> pool.close(); pool.reserved_bytes
        0
    """

    def __init__(self, capacity: int, step: int, *, pin: bool) -> None:
        self._capacity = -(-capacity // BLOCK_ALIGN) * BLOCK_ALIGN
        self._step = max(BLOCK_ALIGN, -(-step // BLOCK_ALIGN) * BLOCK_ALIGN)
        self._pin = pin
        self._chunks: list[_Chunk | None] = []  # None: a dropped chunk's place
        self._used = 0
        self._outside = 0
        self._lock = threading.Lock()
        self._closed = False
        # Leases out, by id, and the leases whose windows died, not yet put back:
        # NOTE [ Leased buffers ].
        self._leases: dict[int, _Lease] = {}
        self._returns: deque[_Lease] = deque()
        # Blocks out through take(), by id: NOTE [ Pool blocks and interrupts ].
        self._taken: dict[int, HostBlock] = {}

    @property
    def pinned(self) -> bool:
        """Whether the chunks are page-locked (``False`` once pinning has failed)."""
        return self._pin

    @property
    def capacity_bytes(self) -> int:
        """The most bytes the pool may hold in chunks (rounded up to :data:`BLOCK_ALIGN`)."""
        return self._capacity

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated in chunks (held until :meth:`close`)."""
        return sum(c.memory.numel() for c in self._chunks if c is not None)

    @property
    def used_bytes(self) -> int:
        """Bytes handed out in blocks now (each rounded up to :data:`BLOCK_ALIGN`)."""
        with self._lock:
            self._put_back()
            return self._used

    @property
    def allocations_outside(self) -> int:
        """How often :meth:`take` found no room (NOTE [ Host pool ] says what the caller does)."""
        return self._outside

    def take(self, nbytes: int) -> HostBlock | None:
        """A block of ``nbytes``, or ``None`` when the pool is full (the caller allocates).

        Raises:
            StoreClosedError: the pool was closed.
        """
        with self._lock:
            block = self._take(nbytes)
            if block is not None:
                self._taken[id(block)] = block
            return block

    def _take(self, nbytes: int) -> HostBlock | None:
        # Caller holds the lock and registers the block (NOTE [ Pool blocks
        # and interrupts ]): until then an interrupt only mislays it.
        length = max(BLOCK_ALIGN, -(-nbytes // BLOCK_ALIGN) * BLOCK_ALIGN)
        if self._closed:
            raise StoreClosedError("tierstore: the host pool is closed")
        self._put_back()
        for i, chunk in enumerate(self._chunks):
            offset = chunk.alloc.allocate(length) if chunk is not None else None
            if offset is not None:
                return self._block(i, offset, length, nbytes)
        room = self._capacity - self.reserved_bytes
        if length > room:  # NOTE [ Host pool ]: drop the idle chunks, then grow
            self._chunks = [c if c is not None and c.used else None for c in self._chunks]
            room = self._capacity - self.reserved_bytes
        if length > room:
            self._outside += 1
            return None
        size = max(min(self._step, room), length)
        # Pinning takes long (NOTE [ Host pool ]), but only while the pool grows.
        chunk = self._chunk(size)
        if None in self._chunks:
            i = self._chunks.index(None)
            self._chunks[i] = chunk
        else:
            i = len(self._chunks)
            self._chunks.append(chunk)
        offset = chunk.alloc.allocate(length)
        assert offset == 0
        return self._block(i, offset, length, nbytes)

    def _chunk(self, size: int) -> _Chunk:
        if self._pin:
            try:
                return _Chunk(size, pin=True)
            except RuntimeError as exc:  # NOTE [ Host pool ]: pageable from now on
                self._pin = False
                warnings.warn(
                    TierstoreWarning(_pin_failed(size, self._capacity, exc)), stacklevel=4
                )
        return _Chunk(size, pin=False)

    def _block(self, i: int, offset: int, length: int, nbytes: int) -> HostBlock:
        chunk = self._chunks[i]
        assert chunk is not None
        self._used += length
        chunk.used += length
        return HostBlock(i, offset, length, chunk.memory[offset : offset + nbytes])

    def lease(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of uint8 whose block comes back when the tensor's storage is freed.

        Views of the tensor keep the block out, as they keep its storage;
        ``None`` when the pool is full (NOTE [ Leased buffers ]).

        Raises:
            StoreClosedError: the pool was closed.

        Example:
            >>> import gc
            >>> from tierstore.tiers.host_pool import HostPool
            >>> pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
            >>> t = pool.lease(5000)
            >>> t.numel(), pool.used_bytes
            (5000, 8192)
            >>> del t; _ = gc.collect(); pool.used_bytes
            0
            >>> pool.close()
        """
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            block = self._take(nbytes)
            if block is None:
                return None
            with held:  # NOTE [ Pool blocks and interrupts ]
                window = (ctypes.c_char * nbytes).from_address(block.tensor.data_ptr())
                # frombuffer keeps `window` until the storage dies; `window` keeps the
                # block's tensor, whose memory stays valid even after close().
                window._block = block.tensor  # type: ignore[attr-defined]
                lease = _Lease(window, self._returns.append)
                lease.block = block
                self._leases[id(lease)] = lease  # out from here
        return torch.frombuffer(window, dtype=torch.uint8)

    def _put_back(self) -> None:
        # Caller holds the lock. NOTE [ Pool blocks and interrupts ]: a return
        # leaves `_leases` before its block is freed and the queue after.
        returns, leases = self._returns, self._leases
        with held:
            while returns:
                lease = returns[0]
                if leases.pop(id(lease), None) is not None:
                    self._free(lease.block)
                returns.popleft()
            if self._used and not leases and not self._taken:
                self._reset()

    def _reset(self) -> None:
        # Nothing is out: the bytes counted are an interrupt's (NOTE [ Pool
        # blocks and interrupts ]). `_used` last: cut short, it runs again.
        for chunk in self._chunks:
            if chunk is not None:
                chunk.alloc = ExtentAllocator(chunk.memory.numel())
                chunk.used = 0
        self._used = 0

    def _free(self, block: HostBlock) -> None:
        if self._closed:
            return
        chunk = self._chunks[block.chunk]
        assert chunk is not None  # a chunk with a block out is never dropped
        chunk.alloc.free(block.offset, block.length)
        chunk.used -= block.length
        self._used -= block.length

    def give(self, block: HostBlock) -> None:
        """Return ``block``; no copy may still be using its memory. No-op once closed."""
        with self._lock, held:
            if self._taken.pop(id(block), None) is None and not self._closed:
                raise ValueError(
                    f"tierstore: host pool block [{block.offset}, {block.offset + block.length}) "
                    f"of chunk {block.chunk} is not out: given back twice"
                )
            self._free(block)

    def trim(self) -> int:
        """Hand back the pages of unpinned chunks with no block out; returns their bytes.

        The chunks stay mapped: using them again costs page faults, not a
        system call (NOTE [ Leased buffers ]).

        Example:
            >>> from tierstore.tiers.host_pool import HostPool
            >>> pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
            >>> pool.give(pool.take(100)); pool.trim()
            1048576
            >>> pool.close()
        """
        with self._lock:
            if self._closed:
                return 0
            self._put_back()
            return sum(c.memory.numel() for c in self._chunks if c is not None and c.trim())

    def close(self) -> None:
        """Drop every chunk (blocks handed out keep their memory alive). Idempotent."""
        with self._lock:
            self._closed = True
            self._chunks.clear()
            self._returns.clear()
            self._leases.clear()
            self._taken.clear()
            self._used = 0
