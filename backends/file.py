"""The ``file`` disk backend: one file grown on demand, positional aligned I/O, ``O_DIRECT``.

NOTE [ File backend allocation ]

All records live in one file, ``entries.bin``, which has no name once the
backend has opened it (``NOTE [ File backend unlinked ]``). A record takes a run of
bytes starting on a multiple of :data:`ALIGN` and rounded up to one, so that
``O_DIRECT`` (``NOTE [ File backend O_DIRECT ]``) can write and read it in
whole aligned blocks.

Space in the file is handed out by an
:class:`~tierstore.backends._extents.ExtentAllocator` (``NOTE [ Extent
allocation ]``) over the whole budget: a stack for the newest-first frees of
backward, and a coalesced free list for the rest. The file itself only
covers what has been handed out (``NOTE [ File backend growth ]``).

I/O happens outside the lock: extents of live records never overlap, so two
threads never touch the same bytes. The positional calls (``pwritev`` /
``preadv``) keep no file offset, so no seek races either.

NOTE [ File backend unlinked ]

The backend opens ``entries.bin`` (twice, with the ``O_DIRECT`` probe) and
then unlinks it: from then on the file lives only through its descriptors,
and the kernel frees its blocks when the last one closes, however the
process ends (SIGKILL and the OOM killer included), and in a forked child
only once both have let go. No spilled byte outlives the process. What is
left after a kill is the private directory and its ``.lock``, a few bytes,
which the next store under the same ``disk_path`` sweeps (``NOTE [ Spill
directory lifecycle ]``). ``O_TMPFILE`` would make the file nameless from the
start, but the ``O_DIRECT`` descriptor needs a second open of the same file:
through ``/proc/self/fd`` that needs procfs, by name it needs the name.
:attr:`FileBackend.path` names the file through its descriptor
(``/proc/self/fd/N``), for whoever wants to look at it while it is open;
errors name where it was made.

NOTE [ File backend growth ]

The file starts empty and grows when a record would end past it, never
beyond the budget: a step that spills a few MiB takes a few MiB of disk,
whatever the budget. Each growth asks the filesystem first (``fstatvfs``): ext4 can allocate part
of a request before it fails with ENOSPC, and glibc emulates fallocate by
writing blocks where the filesystem lacks it; either would fill the disk for
other processes. The grown range is then reserved with fallocate(2), so that
a full disk shows up as a clear :class:`~tierstore.TierFullError` at the
growth (naming ``disk_budget``, the directory and the free space) and never
as an ENOSPC halfway through a record; a filesystem without fallocate gets a
sparse extension instead. A failed growth stores nothing: the write fails,
and the store keeps the entry in host memory (``NOTE [ Failed writes ]``).

The step is geometric: the file grows by its own size, at least
:data:`_MIN_GROWTH`, and at least to the end of the record that needs it,
capped by the budget. So a spill of ``S`` bytes costs about
``log2(S / 16 MiB) + 1`` growths (8 for 2 GiB, 12 for the default 32 GiB
budget), each one fallocate call that reserves extents without writing
them, while the file never holds more than twice the high-water mark of the
spill (or 16 MiB past it): a spill of a few MiB takes 16 MiB of disk. A
fixed step would cost one growth per step (hundreds for a large spill);
growing to each record's end, one per record.
When the free space cannot take the full step but can take the record, the
file grows just to the record's end: the disk's last bytes are used before
the store calls it full. The file never shrinks while the store is open:
the next training step spills as much again, and a file shrunk after
backward would grow again during the next forward. Growth runs outside the
backend's lock, under one of its own, so reads, frees and other writes go
on meanwhile; a record is written only once the file covers it.

NOTE [ File backend O_DIRECT ]

A record is read back once, soon, and then deleted: caching it in the page
cache only doubles the memory it takes (the host copy and the cached one)
and evicts pages other processes want. So where the filesystem accepts it,
the backend opens ``entries.bin`` a second time with ``O_DIRECT`` and does
all its I/O there, from the device straight to memory. The open and a test
write and read of one block (in the first record slot, before any record
exists; the file is cut back to empty after) decide; where either fails (a
filesystem without ``O_DIRECT``, EINVAL at the first aligned write) the
backend keeps the buffered descriptor and says nothing:
:attr:`FileBackend.direct` tells which path is in use.

``O_DIRECT`` needs aligned memory, offsets and lengths. Offsets and lengths
are aligned by allocation. Memory is aligned where tierstore allocated it
for the record: a large record staged or compressed into a pooled buffer
starts on a page, its header padded to fill the page in front of the payload
(``NOTE [ Records in one buffer ]``), and a read lands in such a buffer too.
Wherever a view is aligned at an aligned file offset, its whole blocks go
straight between the device and that memory. The rest (a short header, a
tensor in the caller's memory, the last part block of a record) goes
through a page-aligned bounce buffer of :data:`_CHUNK` bytes from a pool
(``NOTE [ Aligned buffer pool ]``): gather the views into it and write it
whole, the last block padded with zeros into the record's footprint; read
whole blocks into it and scatter them into the views. That copy runs
without the GIL, but it is one more pass over every byte on the I/O
threads, which on a machine whose cores all train is time taken from the
model: the direct path removes it for every large record.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import weakref
from pathlib import Path
from typing import ClassVar

from tierstore.backends._aligned import (
    AlignedBufferPool,
    address,
    copy,
    direct_io_works,
)
from tierstore.backends._extents import ExtentAllocator
from tierstore.backends.base import Backend
from tierstore.config import human_bytes
from tierstore.errors import DISK_HINT, CorruptDataError, TierFullError, TierstoreError

__all__ = ["ALIGN", "FileBackend"]

#: Records start on, and are rounded up to, a multiple of this many bytes.
ALIGN = 4096

_DATA_NAME = "entries.bin"

#: Bytes of one bounce buffer: one ``O_DIRECT`` request at most.
_CHUNK = 4 << 20

#: Bounce buffers at most, one per request in flight; more requests wait.
_MAX_BUFFERS = 8

#: The least a growth adds to the file: ``NOTE [ File backend growth ]``.
_MIN_GROWTH = 16 << 20


try:
    _IOV_MAX = max(1, os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):  # pragma: no cover - every Linux has it
    _IOV_MAX = 1024


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


def _fallocate(fd: int, offset: int, length: int) -> None:
    """Reserve ``length`` bytes from ``offset`` for ``fd`` with fallocate(2), or raise OSError.

    The file grows to ``offset + length`` if it was shorter.

    Not os.posix_fallocate: where a filesystem lacks fallocate, glibc
    emulates it by writing every block, which for a large budget takes
    minutes and can fill the disk. fallocate(2) says EOPNOTSUPP instead.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate", None)
    if fallocate is None:  # not Linux: take the sparse file
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, 0, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _free_bytes(fd: int) -> int:
    """Bytes an unprivileged process may still allocate on ``fd``'s filesystem."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class FileBackend(Backend[int]):
    """Records in one file grown on demand, managed as a stack with a free list.

    The file, ``entries.bin``, lives in a private spill directory under
    ``root``; it starts empty and grows in steps as records need room, up to
    ``capacity_bytes`` (``NOTE [ File backend growth ]``). See ``NOTE [ File
    backend allocation ]`` for how space is handed out.

    Where the filesystem accepts ``O_DIRECT``, reads and writes bypass the
    page cache (``NOTE [ File backend O_DIRECT ]``); :attr:`direct` says
    whether they do.

    Args:
        root: ``TierConfig.disk_path``: where to create the spill directory.
        capacity_bytes: ``TierConfig.disk_budget``: the most the file grows
            to. A budget that is not a multiple of :data:`ALIGN` is rounded
            down to one.

    Raises:
        ConfigError: ``root`` is unusable, or ``capacity_bytes`` is negative.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from tierstore.backends.file import FileBackend
        >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=10_000)
        >>> backend.capacity_bytes  # rounded down to whole pages
        8192
        >>> backend.direct in (True, False)  # O_DIRECT where the filesystem allows it
        True
        >>> backend.file_bytes  # nothing on disk before the first record
        0
        >>> backend.write(1, [b"saved", b" activation"])
        4096
        >>> backend.file_bytes  # grown to cover it, within the budget
        8192
        >>> out = bytearray(16)
        >>> backend.read_into(1, [memoryview(out)])
        >>> bytes(out)
        b'saved activation'
        >>> backend.used_bytes, len(backend)
        (4096, 1)
        >>> backend.delete(1)
        >>> backend.close()
        >>> backend.directory.exists()
        False
    """

    name: ClassVar[str] = "file"

    def _open_storage(self) -> None:
        self._capacity = self._budget - self._budget % ALIGN
        self._path = self._spill.file(_DATA_NAME)
        try:
            fd = self._spill.open_file(_DATA_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        except OSError as e:  # O_EXCL | O_NOFOLLOW: something was planted there
            raise TierstoreError(
                f"tierstore: cannot create the spill file {self._path}: {e}; "
                "set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
            ) from e
        self._fd = fd
        self._file_bytes = 0  # See NOTE [ File backend growth ]
        self._grow_lock = threading.Lock()
        self._sparse = False  # the filesystem has no fallocate: grow by ftruncate
        # Closes the fd if the backend is dropped without close(); close() calls it.
        self._fd_finalizer = weakref.finalize(self, os.close, fd)
        self._alloc = ExtentAllocator(self._capacity)
        self._direct_fd = self._open_direct()
        os.unlink(self._path)  # NOTE [ File backend unlinked ]: opened both ways, no name
        with contextlib.suppress(OSError):  # the probe's block; growth covers it anyway
            os.ftruncate(fd, 0)  # the file holds nothing until the first record
        self._pool = AlignedBufferPool(_CHUNK, _MAX_BUFFERS)  # maps nothing until used
        self._pool_finalizer = weakref.finalize(self, self._pool.close)
        if self._direct_fd is not None:
            self._direct_finalizer = weakref.finalize(self, os.close, self._direct_fd)

    @property
    def path(self) -> Path:
        """The data file, through its descriptor: ``NOTE [ File backend unlinked ]``.

        ``/proc/self/fd/N`` (valid while the backend is open, in this
        process); where there is no ``/proc``, the name it was made under.
        """
        proc = Path(f"/proc/self/fd/{self._fd}")
        return proc if os.path.isdir("/proc/self/fd") else self._path

    @property
    def direct(self) -> bool:
        """Whether I/O bypasses the page cache: ``NOTE [ File backend O_DIRECT ]``."""
        return self._direct_fd is not None

    @property
    def io_path(self) -> str:
        """``"file: O_DIRECT"`` or ``"file: buffered"`` (the fallback)."""
        return "file: O_DIRECT" if self.direct else "file: buffered"

    @property
    def file_bytes(self) -> int:
        """The size ``entries.bin`` has grown to: ``NOTE [ File backend growth ]``.

        At most :attr:`capacity_bytes`; it never shrinks while the backend is open.
        """
        return self._file_bytes

    def _open_direct(self) -> int | None:
        # An O_DIRECT descriptor on entries.bin, or None where the filesystem
        # refuses one. Some accept the open and fail the first I/O (EINVAL),
        # so the probe writes and reads one block where no record is yet.
        flag = getattr(os, "O_DIRECT", 0)
        if not flag or self._capacity < ALIGN:
            return None
        try:
            fd = self._spill.open_file(_DATA_NAME, os.O_RDWR | flag)
        except OSError:
            return None
        if not direct_io_works(fd):
            os.close(fd)
            return None
        return fd

    def _cover(self, end: int) -> None:
        """Grow the file if need be so that it holds ``[0, end)``: NOTE [ File backend growth ]."""
        if end <= self._file_bytes:  # only ever grows: a stale read just takes the lock
            return
        with self._grow_lock:
            size = self._file_bytes
            if end > size:
                step = -(-max(_MIN_GROWTH, size) // ALIGN) * ALIGN
                self._grow(size, end, min(self._capacity, max(end, size + step)))

    def _grow(self, size: int, end: int, target: int) -> None:
        # Under _grow_lock, with size < end <= target <= capacity. The full
        # step first; where the disk cannot take it, just this record's end.
        free = _free_bytes(self._fd)
        if target - size > free:
            target = end
        if target - size > free:
            raise self._growth_error(size, end, f"only {human_bytes(free)} free there")
        for goal in dict.fromkeys((target, end)):
            try:
                self._extend(size, goal)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                if goal == end:
                    raise self._growth_error(size, end, e.strerror or str(e)) from e
                continue
            self._file_bytes = goal
            return

    def _extend(self, size: int, goal: int) -> None:
        """Make the file ``goal`` bytes long, reserving the new blocks where it can."""
        if not self._sparse:
            try:
                _fallocate(self._fd, size, goal - size)
                return
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    # ext4 may have allocated part of the range: give it back.
                    with contextlib.suppress(OSError):
                        os.ftruncate(self._fd, size)
                    raise
            # No fallocate on this filesystem: a sparse extension still works;
            # the disk is then only claimed as records are written.
            self._sparse = True
        os.ftruncate(self._fd, goal)

    def _growth_error(self, size: int, end: int, why: str) -> TierFullError:
        root = self._spill.path.parent
        return TierFullError(
            f"tierstore: cannot grow the disk tier's file from {human_bytes(size)} to "
            f"{human_bytes(end)} in {root} (disk_budget={human_bytes(self._budget)}): {why}; "
            "set disk_path (TIERSTORE_DISK_PATH) to a disk with more room, or lower "
            "disk_budget (TIERSTORE_DISK_BUDGET) to what this one holds"
        )

    def _close_storage(self) -> None:
        self._pool_finalizer()
        if self._direct_fd is not None:
            self._direct_finalizer()
        self._fd_finalizer()

    def _trim_buffers(self) -> int:
        return self._pool.trim()

    def _footprint(self, nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    def _reserve(self, key: int, footprint: int) -> int:
        offset = self._alloc.allocate(footprint) if footprint else 0
        if offset is None:
            free = self._alloc.free_bytes()
            raise self._full_error(
                footprint,
                f"fragmented free space: {human_bytes(free)} free, "
                f"largest extent {human_bytes(self._alloc.largest_free())}",
            )
        return offset

    def _release(self, place: int, footprint: int) -> None:
        self._alloc.free(place, footprint)

    # -- I/O: O_DIRECT through bounce buffers, or buffered from the views ----

    def _store(self, key: int, place: int, views: list[memoryview], length: int) -> None:
        try:
            if not views:
                return
            self._cover(place + self._footprint(length))
            if self._direct_fd is not None:
                self._store_direct(self._direct_fd, place, views)
                return
            offset, i = place, 0
            while i < len(views):
                written = os.pwritev(self._fd, views[i : i + _IOV_MAX], offset)
                if written <= 0:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                offset += written
                i = _advance(views, i, written)
        except OSError as e:
            raise TierstoreError(
                f"tierstore: writing entry {key} ({human_bytes(length)}) to {self._path} failed: "
                f"{e}; {DISK_HINT}"
            ) from e

    def _store_direct(self, fd: int, place: int, views: list[memoryview]) -> None:
        # Writes the aligned blocks of aligned views as they are; gathers the
        # rest into the bounce buffer and writes it whole, chunk after chunk,
        # the last one padded with zeros to a block.
        with self._pool.buffer() as buf:
            offset, fill = place, 0
            for view in views:
                pos = 0
                while pos < view.nbytes:
                    n = _direct_bytes(view[pos:], offset) if fill == 0 else 0
                    if n:
                        _pwrite_all(fd, view[pos : pos + n], offset)
                        offset += n
                        pos += n
                        continue
                    n = min(view.nbytes - pos, _CHUNK - fill)
                    copy(buf.view[fill : fill + n], view[pos : pos + n])
                    fill += n
                    pos += n
                    if fill == _CHUNK:
                        _pwrite_all(fd, buf.view[:_CHUNK], offset)
                        offset += _CHUNK
                        fill = 0
            if fill:
                end = -(-fill // ALIGN) * ALIGN
                buf.view[fill:end] = bytes(end - fill)  # no stale bytes of another record
                _pwrite_all(fd, buf.view[:end], offset)

    def _load(self, key: int, place: int, views: list[memoryview]) -> None:
        total = sum(v.nbytes for v in views)
        if self._direct_fd is not None and total:
            self._load_direct(key, self._direct_fd, place, views, total)
            return
        offset, done, i = place, 0, 0
        while i < len(views):
            try:
                got = os.preadv(self._fd, views[i : i + _IOV_MAX], offset)
            except OSError as e:
                raise self._read_error(key, e) from e
            if got == 0:
                raise self._ends_early(key, place, done, total)
            offset += got
            done += got
            i = _advance(views, i, got)

    def _load_direct(
        self, key: int, fd: int, place: int, views: list[memoryview], total: int
    ) -> None:
        # Reads the aligned blocks of an aligned view straight into it; reads
        # the rest as whole blocks into the bounce buffer, chunk after chunk,
        # and scatters each chunk into the views.
        with self._pool.buffer() as buf:
            done, i = 0, 0
            while done < total:
                n = _direct_bytes(views[i], place + done)
                if n:
                    self._pread_all(key, fd, views[i][:n], place=place, done=done, total=total)
                    done += n
                    if n == views[i].nbytes:
                        i += 1
                    else:
                        views[i] = views[i][n:]
                    continue
                n = min(_CHUNK, total - done)
                end = -(-n // ALIGN) * ALIGN
                filled = 0
                while filled < n:
                    try:
                        got = os.preadv(fd, [buf.view[filled:end]], place + done + filled)
                    except OSError as e:
                        raise self._read_error(key, e) from e
                    filled += got
                    # O_DIRECT stops short only at the end of the file; a
                    # part block means the file ends inside this record.
                    if got == 0 or (filled < n and filled % ALIGN):
                        raise self._ends_early(key, place, done + min(filled, n), total)
                pos = 0
                while pos < n:
                    view = views[i]
                    k = min(view.nbytes, n - pos)
                    copy(view[:k], buf.view[pos : pos + k])
                    pos += k
                    if k == view.nbytes:
                        i += 1
                    else:
                        views[i] = view[k:]
                done += n

    def _pread_all(
        self, key: int, fd: int, view: memoryview, *, place: int, done: int, total: int
    ) -> None:
        # Fills an aligned view of whole blocks from the record at place,
        # done bytes in, from an aligned offset.
        filled = 0
        while filled < view.nbytes:
            try:
                got = os.preadv(fd, [view[filled:]], place + done + filled)
            except OSError as e:
                raise self._read_error(key, e) from e
            if got == 0 or got % ALIGN:
                raise self._ends_early(key, place, done + filled + got, total)
            filled += got

    def _read_error(self, key: int, e: OSError) -> TierstoreError:
        return TierstoreError(
            f"tierstore: reading entry {key} from {self._path} failed: {e}; {DISK_HINT}"
        )

    def _ends_early(self, key: int, place: int, done: int, total: int) -> CorruptDataError:
        return CorruptDataError(
            f"tierstore: entry {key} in the disk tier ({self._path}) ends early: "
            f"the file ends after {done} of its {total} bytes at offset {place}; "
            "the file was truncated outside tierstore"
        )


def _direct_bytes(view: memoryview, offset: int) -> int:
    """How many of ``view``'s first bytes ``O_DIRECT`` can move at ``offset`` as they are.

    Its whole blocks, where the view is writable (so its address can be
    taken) and both it and ``offset`` are block-aligned; else 0.
    """
    n = view.nbytes // ALIGN * ALIGN
    if n == 0 or offset % ALIGN or view.readonly or address(view) % ALIGN:
        return 0
    return n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    # Writes the view at offset; a short write is resumed where it stopped.
    done, end = 0, view.nbytes
    while done < end:
        written = os.pwritev(fd, [view[done:end]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += written
