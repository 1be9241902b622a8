"""Page-aligned bounce buffers for ``O_DIRECT`` I/O, and a copy that releases the GIL.

NOTE [ Aligned buffer pool ]

``O_DIRECT`` wants the memory it reads into and writes from aligned to the
device's block size, and a tensor's memory is not (torch aligns to 64 bytes,
and a record's payload follows its header). The file backend therefore goes
through bounce buffers: anonymous ``mmap`` memory, which is page-aligned,
allocated on first use and reused for every later request, so the hot path
allocates nothing. Several I/O threads run at once, each needs a buffer of
its own for the length of one request: the pool hands them out from a free
list, grows up to ``max_buffers`` and past that makes the next caller wait
for a buffer to come back.

The copies into and out of the buffers use ``ctypes.memmove`` where both
sides are writable (a tensor's byte view is), which runs without the GIL: a
slice assignment holds it for the whole copy, and stalls the training thread
for as long (about a millisecond per 8 MiB).

NOTE [ Huge pages for I/O buffers ]

An ``O_DIRECT`` request hands the device the buffer's physical pages, one
scatter-gather segment per physically contiguous run. Which runs a buffer
gets depends on how its pages were first touched: a buffer that a
``memmove`` faulted in page by page (as the ``file`` backend's first writes
do) is scattered in small runs, and reads into it can take half as long
again or twice as long as the same reads into memory the kernel faulted in
for an earlier read: the same syscalls, offsets and descriptor, only the
memory differs. So a buffer of :data:`_HUGE_MIN` bytes or more asks for
transparent huge pages (``madvise(MADV_HUGEPAGE)``, honoured where the
system's THP setting is ``madvise`` or ``always``) before it is touched:
2 MiB physically contiguous pages, whichever way they are first touched.
A bounce buffer is written whole, so it takes no more memory; a buffer
touched only in part (LMDB's join buffer, sized to the largest
record) may take up to one huge page more than it touches. Where the
kernel has no huge page to give, it falls back to small pages silently.

NOTE [ Idle I/O buffers ]

A buffer the pool lends keeps its pages after the request: the next
request reuses them without a fault. Between steps that is memory the
step does not need, and where a step moves nothing to disk (a plan that
keeps or rebuilds, after profiled steps that wrote everything) it would
stay resident for the rest of the run, up to ``max_buffers`` times the
buffer size. So each step's start hands back the pages of the buffers no
request holds (:meth:`AlignedBufferPool.trim`, reached through
``Backend.trim``), as the host pool does with its idle chunks (NOTE [
Leased buffers ] in host.py): a step that writes again faults them back
in, one fault per huge page where the kernel grants them (NOTE [ Huge
pages for I/O buffers ]).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

__all__ = ["PRIVATE", "AlignedBuffer", "AlignedBufferPool", "address", "copy", "direct_io_works"]

#: Flags of every anonymous mapping tierstore makes. Private, not Python's
#: default MAP_SHARED: shared anonymous memory is shmem, which the kernel
#: counts as shared (RssShmem, not RssAnon) and which ``MADV_DONTNEED`` only
#: unmaps from the process without freeing. Private pages are plain anonymous
#: memory: counted where a user looks (``top``'s RES, RssAnon) and freed when
#: handed back.
PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS

# Below this, a slice assignment is quicker than finding two addresses.
_GIL_FREE_MIN = 64 * 1024

#: Buffers of at least this many bytes (one huge page) ask for huge pages:
#: NOTE [ Huge pages for I/O buffers ].
_HUGE_MIN = 2 << 20


def address(view: memoryview) -> int:
    """The address of a writable, contiguous byte view's first byte.

    The ``c_char`` holding the export is dropped at once, so nothing keeps
    the buffer pinned.

    Example:
        >>> import mmap
        >>> from tierstore.backends._aligned import address
        >>> address(memoryview(mmap.mmap(-1, 4096))) % 4096
        0
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (byte views of the same length).

    Releases the GIL for the copy where ``src`` is writable; a read-only
    source (``bytes``: a record's header) is copied by slice assignment.

    Example:
        >>> from tierstore.backends._aligned import copy
        >>> out = bytearray(3)
        >>> copy(memoryview(out), memoryview(bytearray(b"abc")))
        >>> copy(memoryview(out)[:1], memoryview(b"z"))
        >>> bytes(out)
        b'zbc'
    """
    n = src.nbytes
    if n != dst.nbytes:
        raise ValueError(f"copy: {n} bytes into a buffer of {dst.nbytes}")
    if src.readonly or n < _GIL_FREE_MIN:
        dst[:] = src
    else:
        ctypes.memmove(address(dst), address(src), n)


#: The block the O_DIRECT probe writes and expects back.
_PROBE = b"tierstore O_DIRECT probe".ljust(mmap.PAGESIZE, b"\0")


def direct_io_works(fd: int) -> bool:
    """Whether ``fd``, opened with ``O_DIRECT``, writes and reads back one block at offset 0.

    Some filesystems accept the open and fail the first I/O (EINVAL): only a
    block written and read back says. What was at offset 0 is overwritten.

    Example:
        >>> import os, tempfile
        >>> from tierstore.backends._aligned import direct_io_works
        >>> fd = os.open(os.path.join(tempfile.mkdtemp(), "probe"), os.O_RDWR | os.O_CREAT)
        >>> direct_io_works(fd)   # no O_DIRECT asked for, yet the round trip holds
        True
        >>> os.close(fd)
    """
    try:
        probe = AlignedBuffer(len(_PROBE))
    except OSError:  # no memory to map
        return False
    try:
        probe.view[:] = _PROBE
        if os.pwritev(fd, [probe.view], 0) != len(_PROBE):
            return False
        probe.view[:] = bytes(len(_PROBE))
        return os.preadv(fd, [probe.view], 0) == len(_PROBE) and probe.view == _PROBE
    except OSError:
        return False
    finally:
        probe.close()


class AlignedBuffer:
    """One page-aligned buffer of the pool: an anonymous ``mmap`` and a byte view of it.

    One of :data:`_HUGE_MIN` bytes or more asks for huge pages: NOTE [ Huge
    pages for I/O buffers ].

    Example:
        >>> from tierstore.backends._aligned import AlignedBuffer
        >>> buf = AlignedBuffer(8192)
        >>> buf.address % mmap.PAGESIZE, buf.view.nbytes
        (0, 8192)
        >>> buf.close(); buf.closed
        True
    """

    __slots__ = ("_map", "address", "resident", "view")

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes, flags=PRIVATE)
        #: Whether its pages may be resident: lent since it was last trimmed.
        self.resident = False
        if nbytes >= _HUGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
            # Before the first touch: NOTE [ Huge pages for I/O buffers ].
            with contextlib.suppress(OSError):  # THP compiled out, or disabled
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self._map)
        self.address = address(self.view)

    @property
    def closed(self) -> bool:
        """Whether the memory has been given back to the system."""
        return self._map.closed

    def trim(self) -> int:
        """Hand its pages back, keeping it mapped; returns the bytes, 0 if none could be resident.

        Private anonymous memory: the pages are freed, and the next touch
        faults in zeroed ones (NOTE [ Idle I/O buffers ]).
        """
        if not self.resident or self._map.closed:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED)
        self.resident = False
        return len(self._map)

    def close(self) -> None:
        """Unmap the memory. Idempotent.

        A slice of :attr:`view` that outlives its request (held by a
        traceback, say) keeps the memory mapped until it is dropped.
        """
        if not self._map.closed:
            self.view.release()
            with contextlib.suppress(BufferError):
                self._map.close()


class AlignedBufferPool:
    """Page-aligned buffers of ``buffer_bytes`` each, lent to one caller at a time.

    See ``NOTE [ Aligned buffer pool ]``. Thread-safe. Buffers are created
    on demand, at most ``max_buffers``; :meth:`close` unmaps them all.

    Args:
        buffer_bytes: the size of every buffer, a multiple of the page size.
        max_buffers: how many buffers may exist at once; a caller past that
            waits for one to be returned.

    Example:
        >>> from tierstore.backends._aligned import AlignedBufferPool
        >>> pool = AlignedBufferPool(1 << 20, max_buffers=2)
        >>> with pool.buffer() as buf:
        ...     buf.view[:5] = b"bytes"
        >>> with pool.buffer() as again:  # the same buffer, reused
        ...     bytes(again.view[:5])
        b'bytes'
        >>> pool.created
        1
        >>> pool.close(); pool.close()  # idempotent
    """

    def __init__(self, buffer_bytes: int, max_buffers: int) -> None:
        if buffer_bytes <= 0 or buffer_bytes % mmap.PAGESIZE or max_buffers < 1:
            raise ValueError(
                f"AlignedBufferPool: buffer_bytes={buffer_bytes} must be a positive multiple "
                f"of {mmap.PAGESIZE} and max_buffers={max_buffers} at least 1"
            )
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max_buffers
        self._all: list[AlignedBuffer] = []
        self._free: list[AlignedBuffer] = []
        self._returned = threading.Condition()
        self._closed = False

    @property
    def created(self) -> int:
        """Buffers allocated so far (those lent out included)."""
        with self._returned:
            return len(self._all)

    @property
    def buffers(self) -> list[AlignedBuffer]:
        """Every buffer this pool has allocated (a copy of the list)."""
        with self._returned:
            return list(self._all)

    @contextlib.contextmanager
    def buffer(self) -> Iterator[AlignedBuffer]:
        """Lend a buffer for the ``with`` block; it returns to the pool after.

        Raises:
            RuntimeError: the pool is closed.
        """
        buf = self._take()
        try:
            yield buf
        finally:
            with self._returned:
                if self._closed:
                    buf.close()
                else:
                    self._free.append(buf)
                    self._returned.notify()

    def _take(self) -> AlignedBuffer:
        with self._returned:
            while True:
                if self._closed:
                    raise RuntimeError("tierstore: the aligned buffer pool is closed")
                if self._free:
                    buf = self._free.pop()
                elif len(self._all) < self.max_buffers:
                    # Mapped under the lock: rare (max_buffers times in all) and cheap,
                    # as the kernel only hands out pages on first touch.
                    buf = AlignedBuffer(self.buffer_bytes)
                    self._all.append(buf)
                else:
                    self._returned.wait()
                    continue
                buf.resident = True  # See NOTE [ Idle I/O buffers ]
                return buf

    def trim(self) -> int:
        """Hand back the pages of the buffers no caller holds; returns their bytes.

        NOTE [ Idle I/O buffers ]. The buffers stay in the pool, mapped.

        Example:
            >>> from tierstore.backends._aligned import AlignedBufferPool
            >>> pool = AlignedBufferPool(1 << 20, max_buffers=2)
            >>> with pool.buffer() as buf:
            ...     buf.view[:5] = b"bytes"
            >>> pool.trim(), pool.trim()  # the second finds nothing resident
            (1048576, 0)
            >>> with pool.buffer() as buf:  # zeroed pages on the next touch
            ...     buf.view[:5].tolist()
            [0, 0, 0, 0, 0]
            >>> pool.close()
        """
        with self._returned:
            return sum(buf.trim() for buf in self._free)

    def close(self) -> None:
        """Unmap every buffer in the pool; one still lent out goes when it returns.

        Idempotent: calling it again does nothing.
        """
        with self._returned:
            self._closed = True
            for buf in self._free:
                buf.close()
            self._free.clear()
            self._returned.notify_all()
