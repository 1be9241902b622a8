"""The ``file`` disk backend: one preallocated file, positional aligned I/O.

NOTE [ File backend allocation ]

All records live in one file, ``entries.bin``, preallocated to the budget
when the backend starts, so that a full disk shows up at once, as a clear
error, and not halfway through a training step. A record takes a run of
bytes starting on a multiple of :data:`ALIGN` and rounded up to one, so that
the later ``O_DIRECT`` path can read it into an aligned buffer without a
bounce copy.

Backward frees saved tensors newest first, so the space is managed as a stack:
a bump pointer ``top`` hands out new extents, and freeing the extent that
ends at ``top`` just lowers it; both are O(1). Anything freed out of order
goes to a free list of coalesced extents below ``top``, which is searched
first-fit only when the stack has no room left. When ``top`` comes down to
the highest free extent, that extent is folded back into the stack.

I/O happens outside the lock: extents of live records never overlap, so two
threads never touch the same bytes. The positional calls (``pwritev`` /
``preadv``) keep no file offset, so no seek races either.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from tierstore.backends._spill import SpillDir
from tierstore.backends.base import Backend, Buffer

from tierstore.config import human_bytes
from tierstore.errors import (
    ConfigError,
    CorruptDataError,
    StoreClosedError,
    TierFullError,
    TierstoreError,
)

__all__ = ["ALIGN", "FileBackend"]

#: Records start on, and are rounded up to, a multiple of this many bytes.
ALIGN = 4096

_DATA_NAME = "entries.bin"

try:
    _IOV_MAX = max(1, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):  # pragma: no cover - every Linux has it
    _IOV_MAX = 1024


def _byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    # Lengths and slicing must count bytes, not items: a memoryview over a
    # float32 array has len() == nbytes / 4. Empty views are dropped, which
    # also keeps the short-I/O loops below from spinning on them.
    out: list[memoryview] = []
    for buf in buffers:
        view = memoryview(buf)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if view.nbytes:
            out.append(view)
    return out


def _advance(views: list[memoryview], start: int, done: int) -> int:
    # Consumes ``done`` bytes from views[start:], slicing a partly done view in
    # place; returns the index of the first view with bytes left.
    while done:
        size = views[start].nbytes
        if done >= size:
            done -= size
            start += 1
        else:
            views[start] = views[start][done:]
            done = 0
    return start


def _fallocate(fd: int, length: int) -> None:
    """Reserve ``length`` bytes for ``fd`` with fallocate(2), or raise OSError.

    Not os.posix_fallocate: where a filesystem lacks fallocate, glibc
    emulates it by writing every block, which for a large budget takes
    minutes and can fill the disk. fallocate(2) says EOPNOTSUPP instead.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate", None)
    if fallocate is None:  # not Linux: take the sparse file
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, 0, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class _ExtentAllocator:
    """Extents of a fixed-size file: a stack plus a coalesced free list.

    See ``NOTE [ File backend allocation ]``. Not thread-safe: the backend
    holds its lock around every call.

    Example:
        >>> a = _ExtentAllocator(16)
        >>> a.allocate(8), a.allocate(8), a.allocate(1)
        (0, 8, None)
        >>> a.free(8, 8)
        >>> a.top
        8
    """

    __slots__ = ("_lengths", "_offsets", "capacity", "top")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.top = 0
        # Free extents below top, sorted by offset, never adjacent to each
        # other nor ending at top (those are merged / folded into the stack).
        self._offsets: list[int] = []
        self._lengths: list[int] = []

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """The free list as ``(offset, length)`` pairs, lowest offset first."""
        return list(zip(self._offsets, self._lengths, strict=True))

    def free_bytes(self) -> int:
        """All free bytes: the free list plus the room above ``top``."""
        return self.capacity - self.top + sum(self._lengths)

    def largest_free(self) -> int:
        """The longest extent :meth:`allocate` could hand out now."""
        return max([self.capacity - self.top, *self._lengths])

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new extent of ``nbytes``, or ``None`` if none fits."""
        if self.top + nbytes <= self.capacity:
            offset = self.top
            self.top += nbytes
            return offset
        for i, length in enumerate(self._lengths):
            if length >= nbytes:
                offset = self._offsets[i]
                if length == nbytes:
                    del self._offsets[i]
                    del self._lengths[i]
                else:
                    self._offsets[i] = offset + nbytes
                    self._lengths[i] = length - nbytes
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent ``[offset, offset + nbytes)``.

        Raises:
            ValueError: The extent is not inside the allocated space, or
                overlaps a free one (a double free).
        """
        if nbytes == 0:
            return
        end = offset + nbytes
        if offset < 0 or end > self.top:
            raise ValueError(f"extent [{offset}, {end}) is not below top={self.top}")
        offsets, lengths = self._offsets, self._lengths
        if end == self.top:
            # The hot path: backward frees newest first.
            if offsets and offsets[-1] + lengths[-1] > offset:
                raise ValueError(f"extent [{offset}, {end}) overlaps a free extent")
            self.top = offset
            if offsets and offsets[-1] + lengths[-1] == offset:
                # Coalescing keeps free extents apart, so one fold is enough.
                self.top = offsets.pop()
                lengths.pop()
            return
        i = bisect.bisect_left(offsets, offset)
        if (i > 0 and offsets[i - 1] + lengths[i - 1] > offset) or (
            i < len(offsets) and offsets[i] < end
        ):
            raise ValueError(f"extent [{offset}, {end}) overlaps a free extent")
        joins_prev = i > 0 and offsets[i - 1] + lengths[i - 1] == offset
        joins_next = i < len(offsets) and offsets[i] == end
        if joins_prev and joins_next:
            lengths[i - 1] += nbytes + lengths[i]
            del offsets[i]
            del lengths[i]
        elif joins_prev:
            lengths[i - 1] += nbytes
        elif joins_next:
            offsets[i] = offset
            lengths[i] += nbytes
        else:
            offsets.insert(i, offset)
            lengths.insert(i, nbytes)


class FileBackend(Backend):
    """Records in one preallocated file, managed as a stack with a free list.

    The file, ``entries.bin``, lives in a private spill directory under
    ``root`` and is preallocated to ``capacity_bytes`` at construction. See
    ``NOTE [ File backend allocation ]`` for how space is handed out.
    Thread-safe; ``close()`` waits for reads and writes in flight.

    Args:
        root: ``TierConfig.disk_path``: where to create the spill directory.
        capacity_bytes: ``TierConfig.disk_budget``: the file's size. A budget
            that is not a multiple of :data:`ALIGN` is rounded down to one.

    Raises:
        ConfigError: ``root`` is unusable, or ``capacity_bytes`` is negative.
        TierFullError: The filesystem has no room for ``capacity_bytes``.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from tierstore.backends.file import FileBackend
        >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
        >>> backend.write(1, [b"saved", b" activation"])
        4096
        >>> out = bytearray(16)
        >>> backend.read_into(1, [memoryview(out)])
        >>> bytes(out)
        b'saved activation'
        >>> backend.used_bytes, len(backend)
        (4096, 1)
        >>> backend.delete(1)
        >>> backend.close()
    """

    name: ClassVar[str] = "file"

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ConfigError(
                f"tierstore: disk_budget={capacity_bytes} is negative; "
                "set disk_budget (TIERSTORE_DISK_BUDGET) to a size such as '64GiB'"
            )
        root = Path(root)
        self._budget = capacity_bytes
        self._capacity = capacity_bytes - capacity_bytes % ALIGN
        self._spill = SpillDir(root)
        self._path = self._spill.file(_DATA_NAME)
        try:
            fd = self._spill.open_file(_DATA_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                self._preallocate(fd, root)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            self._spill.close()
            raise
        self._fd = fd
        # Closes the fd if the backend is dropped without close(); close() calls it.
        self._fd_finalizer = weakref.finalize(self, os.close, fd)
        self._alloc = _ExtentAllocator(self._capacity)
        self._records: dict[int, tuple[int, int, int]] = {}  # key -> offset, length, footprint
        self._used = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False

    def _preallocate(self, fd: int, root: Path) -> None:
        if self._capacity == 0:
            return
        where = f"cannot preallocate disk_budget={human_bytes(self._budget)} in {root}"
        # Ask first: ext4 can allocate part of a request before it fails with
        # ENOSPC, and glibc emulates fallocate by writing blocks where the
        # filesystem lacks it. Either would fill the disk for other processes.
        st = os.fstatvfs(fd)
        free = st.f_bavail * st.f_frsize
        if self._capacity > free:
            raise TierFullError(
                f"tierstore: {where}: only {human_bytes(free)} free there; lower disk_budget "
                "(TIERSTORE_DISK_BUDGET) or set disk_path to a larger disk"
            )
        try:
            _fallocate(fd, self._capacity)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                # No fallocate on this filesystem: a sparse file of the right
                # size still works; the disk is then only claimed as we write.
                os.ftruncate(fd, self._capacity)
                return
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise TierFullError(
                    f"tierstore: {where}: {e.strerror}; lower disk_budget "
                    "(TIERSTORE_DISK_BUDGET) or set disk_path to a larger disk"
                ) from e
            raise TierstoreError(
                f"tierstore: {where}: {e.strerror}; set disk_path "
                "(TIERSTORE_DISK_PATH) to a writable local directory"
            ) from e

    # -- lifecycle ---------------------------------------------------------

    def _closed_error(self) -> StoreClosedError:
        return StoreClosedError(f"tierstore: the file backend at {self._spill.path} is closed")

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def close(self) -> None:
        """Close the file and remove the spill directory.

        Waits for reads and writes in flight on other threads. Idempotent:
        calling it again does nothing.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=8192)
            >>> backend.close()
            >>> backend.close()
            >>> backend.directory.exists()
            False
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # An fd closed under a running pwritev could be reused by another
            # open() and get our bytes, so wait for the I/O to drain first.
            while self._in_flight:
                self._idle.wait()
        self._fd_finalizer()
        self._spill.close()

    # -- facts -------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The private spill directory; it no longer exists after :meth:`close`.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=8192)
            >>> (backend.directory / "entries.bin").stat().st_size
            8192
            >>> backend.close()
        """
        return self._spill.path

    @property
    def capacity_bytes(self) -> int:
        """The file's size: the budget rounded down to a multiple of :data:`ALIGN`.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=10_000)
            >>> backend.capacity_bytes
            8192
            >>> backend.close()
        """
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Footprint bytes of live records (and of writes in flight).

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
            >>> backend.write(0, [bytes(5000)])
            8192
            >>> backend.used_bytes
            8192
            >>> backend.close()
        """
        with self._lock:
            if self._closed:
                raise self._closed_error()
            return self._used

    def footprint(self, nbytes: int) -> int:
        """``nbytes`` rounded up to a multiple of :data:`ALIGN`; 0 for an empty record.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=8192)
            >>> backend.footprint(0), backend.footprint(1), backend.footprint(4097)
            (0, 4096, 8192)
            >>> backend.close()
        """
        return -(-nbytes // ALIGN) * ALIGN

    def __len__(self) -> int:
        """The number of live records.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=8192)
            >>> backend.write(3, [b""])
            0
            >>> len(backend)
            1
            >>> backend.close()
        """
        with self._lock:
            if self._closed:
                raise self._closed_error()
            return len(self._records)

    # -- records -----------------------------------------------------------

    def _full_error(self, footprint: int) -> TierFullError:
        free = self._alloc.free_bytes()
        if free >= footprint:
            detail = (
                f"fragmented free space: {human_bytes(free)} free, "
                f"largest extent {human_bytes(self._alloc.largest_free())}"
            )
        else:
            detail = f"{human_bytes(free)} free"
        return TierFullError(
            f"tierstore: disk tier is full: {human_bytes(self._used)} in use of "
            f"disk_budget={human_bytes(self._budget)}; a record of "
            f"{human_bytes(footprint)} does not fit ({detail}); raise disk_budget "
            "(TIERSTORE_DISK_BUDGET)"
        )

    def write(self, key: int, chunks: Sequence[Buffer]) -> int:
        """Store the concatenation of ``chunks`` under ``key``; returns its footprint.

        Raises:
            TierFullError: No free extent is large enough; nothing is stored.
            TierstoreError: The write failed (the ``OSError`` is the
                ``__cause__``); nothing is stored.
            ValueError: ``key`` is already stored.
            StoreClosedError: The backend is closed.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
            >>> backend.write(1, [b"a" * 4096, b"b"])
            8192
            >>> backend.close()
        """
        views = _byte_views(chunks)
        length = sum(v.nbytes for v in views)
        footprint = self.footprint(length)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if key in self._records:
                raise ValueError(f"tierstore: key {key} is already stored in the disk tier")
            offset = self._alloc.allocate(footprint) if footprint else 0
            if offset is None:
                raise self._full_error(footprint)
            self._used += footprint
            self._in_flight += 1
        stored = False
        try:
            if views:
                self._pwrite(views, offset)
            with self._lock:
                if key in self._records:  # a racing write of the same key won
                    raise ValueError(f"tierstore: key {key} is already stored in the disk tier")
                self._records[key] = (offset, length, footprint)
                stored = True
        except OSError as e:
            raise TierstoreError(
                f"tierstore: writing entry {key} ({human_bytes(length)}) to {self._path} failed: "
                f"{e}; check the disk under disk_path (TIERSTORE_DISK_PATH)"
            ) from e
        finally:
            with self._lock:
                if not stored:
                    self._alloc.free(offset, footprint)
                    self._used -= footprint
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()
        return footprint

    def read_into(self, key: int, views: Sequence[memoryview]) -> None:
        """Fill ``views``, in order, with the bytes stored under ``key``.

        Raises:
            KeyError: Nothing is stored under ``key``.
            CorruptDataError: The views do not add up to the record's length,
                or the file ends before the record does.
            StoreClosedError: The backend is closed.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
            >>> backend.write(1, [b"header", b"payload"])
            4096
            >>> head, body = bytearray(6), bytearray(7)
            >>> backend.read_into(1, [memoryview(head), memoryview(body)])
            >>> bytes(head), bytes(body)
            (b'header', b'payload')
            >>> backend.close()
        """
        targets = _byte_views(views)
        wanted = sum(v.nbytes for v in targets)
        with self._lock:
            if self._closed:
                raise self._closed_error()
            offset, length, _ = self._records[key]
            if wanted != length:
                raise CorruptDataError(
                    f"tierstore: entry {key} in the disk tier ({self._path}) holds "
                    f"{length} bytes, not the {wanted} bytes asked for"
                )
            self._in_flight += 1
        try:
            if targets:
                self._pread(key, targets, offset)
        finally:
            self._leave()

    def delete(self, key: int) -> None:
        """Free the record under ``key``; its extent can be reused at once.

        Raises:
            KeyError: Nothing is stored under ``key``.
            StoreClosedError: The backend is closed.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends.file import FileBackend
            >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
            >>> backend.write(1, [b"x"])
            4096
            >>> backend.delete(1)
            >>> backend.used_bytes
            0
            >>> backend.close()
        """
        with self._lock:
            if self._closed:
                raise self._closed_error()
            offset, _, footprint = self._records.pop(key)
            self._alloc.free(offset, footprint)
            self._used -= footprint

    # -- I/O (NOTE: the O_DIRECT / async path replaces these two) -----------

    def _pwrite(self, views: list[memoryview], offset: int) -> None:
        i = 0
        while i < len(views):
            written = os.pwritev(self._fd, views[i : i + _IOV_MAX], offset)
            if written <= 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
            offset += written
            i = _advance(views, i, written)

    def _pread(self, key: int, views: list[memoryview], offset: int) -> None:
        start, done = offset, 0
        total = sum(v.nbytes for v in views)
        i = 0
        while i < len(views):
            try:
                got = os.preadv(self._fd, views[i : i + _IOV_MAX], offset)
            except OSError as e:
                raise TierstoreError(
                    f"tierstore: reading entry {key} from {self._path} failed: {e}; "
                    "check the disk under disk_path (TIERSTORE_DISK_PATH)"
                ) from e
            if got == 0:
                raise CorruptDataError(
                    f"tierstore: entry {key} in the disk tier ({self._path}) ends early: "
                    f"the file ends after {done} of its {total} bytes at offset {start}; "
                    "the file was truncated outside tierstore"
                )
            offset += got
            done += got
            i = _advance(views, i, got)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} records"
        return f"FileBackend('{self._spill.path}', capacity_bytes={self._capacity}, {state})"
