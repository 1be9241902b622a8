"""The ``file`` disk backend: one preallocated file, positional aligned I/O.

NOTE [ File backend allocation ]

All records live in one file, ``entries.bin``, preallocated to the budget
when the backend starts, so that a full disk shows up at once, as a clear
error, and not halfway through a training step. A record takes a run of
bytes starting on a multiple of :data:`ALIGN` and rounded up to one, so that
the later ``O_DIRECT`` path can read it into an aligned buffer without a
bounce copy.

Space in the file is handed out by an
:class:`~tierstore.backends._extents.ExtentAllocator` (``NOTE [ Extent
allocation ]``): a stack for the newest-first frees of backward, and a
coalesced free list for the rest.

I/O happens outside the lock: extents of live records never overlap, so two
threads never touch the same bytes. The positional calls (``pwritev`` /
``preadv``) keep no file offset, so no seek races either.
"""

from __future__ import annotations

import ctypes
import errno
import os
import weakref
from typing import ClassVar

from tierstore.backends._extents import ExtentAllocator
from tierstore.backends.base import Backend
from tierstore.config import human_bytes
from tierstore.errors import CorruptDataError, TierFullError, TierstoreError

__all__ = ["ALIGN", "FileBackend"]

#: Records start on, and are rounded up to, a multiple of this many bytes.
ALIGN = 4096

_DATA_NAME = "entries.bin"

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


class FileBackend(Backend[int]):
    """Records in one preallocated file, managed as a stack with a free list.

    The file, ``entries.bin``, lives in a private spill directory under
    ``root`` and is preallocated to ``capacity_bytes`` at construction. See
    ``NOTE [ File backend allocation ]`` for how space is handed out.

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
        >>> backend = FileBackend(Path(tempfile.mkdtemp()), capacity_bytes=10_000)
        >>> backend.capacity_bytes  # rounded down to whole pages
        8192
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
        >>> backend.directory.exists()
        False
    """

    name: ClassVar[str] = "file"

    def _open_storage(self) -> None:
        self._capacity = self._budget - self._budget % ALIGN
        self._path = self._spill.file(_DATA_NAME)
        fd = self._spill.open_file(_DATA_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            self._preallocate(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # Closes the fd if the backend is dropped without close(); close() calls it.
        self._fd_finalizer = weakref.finalize(self, os.close, fd)
        self._alloc = ExtentAllocator(self._capacity)

    def _preallocate(self, fd: int) -> None:
        if self._capacity == 0:
            return
        root = self._spill.path.parent
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

    def _close_storage(self) -> None:
        self._fd_finalizer()

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

    # -- I/O (NOTE: the O_DIRECT / async path replaces these two) -----------

    def _store(self, key: int, place: int, views: list[memoryview], length: int) -> None:
        offset, i = place, 0
        try:
            while i < len(views):
                written = os.pwritev(self._fd, views[i : i + _IOV_MAX], offset)
                if written <= 0:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                offset += written
                i = _advance(views, i, written)
        except OSError as e:
            raise TierstoreError(
                f"tierstore: writing entry {key} ({human_bytes(length)}) to {self._path} failed: "
                f"{e}; check the disk under disk_path (TIERSTORE_DISK_PATH)"
            ) from e

    def _load(self, key: int, place: int, views: list[memoryview]) -> None:
        offset, done, i = place, 0, 0
        total = sum(v.nbytes for v in views)
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
                    f"the file ends after {done} of its {total} bytes at offset {place}; "
                    "the file was truncated outside tierstore"
                )
            offset += got
            done += got
            i = _advance(views, i, got)
