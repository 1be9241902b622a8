"""The contract every disk backend keeps, and the bookkeeping they share.

A backend is a resting place for bytes. It knows nothing about autograd,
placement or streams: the store hands it a record as a list of buffers and a
key, and later asks for the same bytes back, scattered into buffers it owns.

:class:`Backend` does everything that does not depend on how bytes rest: the
private spill directory, the record table, the budget in footprint bytes,
the open/closed state and waiting for I/O in flight before closing. A
backend supplies the six hooks at the bottom of the class.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from tierstore.backends.file import FileBackend
    >>> root = Path(tempfile.mkdtemp())
    >>> backend = FileBackend(root, capacity_bytes=1 << 20)
    >>> backend.write(7, [b"head", b"er-and-payload"])  # the footprint: one 4 KiB page
    4096
    >>> out = bytearray(18)
    >>> backend.read_into(7, [memoryview(out)])
    >>> bytes(out)
    b'header-and-payload'
    >>> backend.delete(7)
    >>> backend.close()
    >>> backend.close()  # idempotent
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from tierstore.backends._spill import SpillDir
from tierstore.config import human_bytes
from tierstore.errors import ConfigError, CorruptDataError, StoreClosedError, TierFullError

__all__ = ["Backend", "Buffer"]

#: Anything that exposes the buffer protocol: ``bytes``, ``bytearray``,
#: ``memoryview``, or a memoryview onto a tensor's memory.
Buffer = bytes | bytearray | memoryview

#: Where a backend put a record: a file extent's offset, an LMDB key, ...
Place = TypeVar("Place")


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """Flat unsigned-byte views of the non-empty ``buffers``, without copying.

    Lengths and slices then count bytes, not items (a memoryview over a
    float32 array has ``len() == nbytes / 4``), and short-I/O loops never
    spin on an empty view.

    Example:
        >>> import array
        >>> from tierstore.backends.base import byte_views
        >>> [v.nbytes for v in byte_views([b"ab", b"", array.array("i", [1])])]
        [2, 4]
    """
    out = []
    for buf in buffers:
        view = memoryview(buf)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if view.nbytes:
            out.append(view)
    return out


class Backend(abc.ABC, Generic[Place]):
    """A disk tier: one private spill directory holding keyed records.

    A backend owns its spill directory (created on construction under
    ``root``, mode 0700, removed by :meth:`close` and at interpreter exit)
    and everything in it. Keys are non-negative integers chosen by the
    caller; a key is written once and deleted once.

    Capacity is accounted in *footprint* bytes, the space a record really
    takes (alignment, pages), so that the caller can check a budget before
    writing. Thread-safe: bookkeeping happens under one lock, I/O outside it,
    and :meth:`close` waits for the I/O in flight.

    Args:
        root: ``TierConfig.disk_path``: where to create the spill directory.
        capacity_bytes: ``TierConfig.disk_budget``.

    Raises:
        ConfigError: ``root`` is unusable, or ``capacity_bytes`` is negative.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from tierstore.backends.lmdb import LmdbBackend
        >>> backend = LmdbBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
        >>> backend.footprint(10) >= 10
        True
        >>> backend.close()
    """

    #: The value of ``TierConfig.disk_backend`` that selects this backend.
    name: ClassVar[str]

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ConfigError(
                f"tierstore: disk_budget={capacity_bytes} is negative; "
                "set disk_budget (TIERSTORE_DISK_BUDGET) to a size such as '64GiB'"
            )
        self._budget = capacity_bytes
        self._capacity = capacity_bytes
        self._spill = SpillDir(Path(root))
        self._records: dict[int, tuple[Place, int, int]] = {}  # key -> place, length, footprint
        self._used = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        try:
            self._open_storage()
        except BaseException:
            self._spill.close()
            raise

    # -- facts ---------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The private spill directory; it no longer exists after :meth:`close`."""
        return self._spill.path

    @property
    def capacity_bytes(self) -> int:
        """Footprint bytes this backend can hold at most."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Footprint bytes held now by live records (and by writes in flight)."""
        with self._lock:
            self._check_open()
            return self._used

    @property
    def path(self) -> Path:
        """Where the records rest: the data file, or the LMDB environment's directory."""
        return self._path

    @property
    def io_path(self) -> str:
        """How bytes reach the disk, for ``Stats.disk_io``: the backend's name by default."""
        return self.name

    def footprint(self, nbytes: int) -> int:
        """Bytes a record of ``nbytes`` would take from :attr:`capacity_bytes`."""
        return self._footprint(nbytes)

    def __len__(self) -> int:
        """The number of live records, as the storage itself counts them."""
        with self._io():
            return self._count()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._records)} records"
        return (
            f"{type(self).__name__}('{self._spill.path}', capacity_bytes={self._capacity}, {state})"
        )

    # -- records -------------------------------------------------------------

    def write(self, key: int, chunks: Sequence[Buffer]) -> int:
        """Store the concatenation of ``chunks`` under ``key``; returns its footprint.

        Raises:
            TierFullError: no room (naming ``disk_budget``); nothing is stored.
            TierstoreError: the write failed (the storage's error is the
                ``__cause__``); nothing is stored.
            ValueError: ``key`` is already stored.
            StoreClosedError: the backend is closed.
        """
        views = byte_views(chunks)
        length = sum(v.nbytes for v in views)
        footprint = self._footprint(length)
        with self._lock:
            self._check_open()
            if key in self._records:
                raise ValueError(f"tierstore: key {key} is already stored in the disk tier")
            if self._used + footprint > self._capacity:
                raise self._full_error(footprint)
            place = self._reserve(key, footprint)
            # Claimed now, so that concurrent writers cannot overshoot together.
            self._records[key] = (place, length, footprint)
            self._used += footprint
            self._in_flight += 1
        stored = False
        try:
            self._store(key, place, views, length)
            stored = True
        finally:
            with self._lock:
                if not stored:
                    del self._records[key]
                    self._used -= footprint
                    self._release(place, footprint)
                self._done()
        return footprint

    def read_into(self, key: int, views: Sequence[memoryview]) -> None:
        """Fill ``views``, in order, with the bytes stored under ``key``.

        Raises:
            KeyError: nothing is stored under ``key``.
            CorruptDataError: the views do not add up to the record's length,
                or the storage returns fewer bytes than were written.
            StoreClosedError: the backend is closed.
        """
        targets = byte_views(views)
        wanted = sum(v.nbytes for v in targets)
        with self._lock:
            self._check_open()
            place, length, _ = self._records[key]
            if wanted != length:
                raise CorruptDataError(
                    f"tierstore: entry {key} in the disk tier ({self._path}) holds "
                    f"{length} bytes, not the {wanted} bytes asked for"
                )
            self._in_flight += 1
        try:
            self._load(key, place, targets)
        finally:
            with self._lock:
                self._done()

    def delete(self, key: int) -> None:
        """Free the record under ``key``; its footprint counts as free at once.

        Raises:
            KeyError: nothing is stored under ``key``.
            StoreClosedError: the backend is closed.
        """
        with self._lock:
            self._check_open()
            place, length, footprint = self._records.pop(key)
            self._in_flight += 1
        erased = False
        try:
            self._erase(key, place)
            erased = True
        finally:
            with self._lock:
                if erased:
                    self._used -= footprint
                    self._release(place, footprint)
                else:  # still there: keep accounting for it
                    self._records[key] = (place, length, footprint)
                self._done()

    def close(self) -> None:
        """Wait for I/O in flight, close the storage and remove the spill directory.

        Idempotent: calling it again does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Closing under a running read or write could hand its fd or map
            # to someone else mid-copy, so let the I/O drain first.
            while self._in_flight:
                self._idle.wait()
        try:
            self._close_storage()
        finally:
            self._spill.close()

    def trim(self) -> int:
        """Hand back the pages of I/O buffers no request holds; returns their bytes.

        Called as a step begins (NOTE [ Idle I/O buffers ] in _aligned.py);
        the buffers stay, and a later request faults their pages back in. A
        closed backend has nothing to hand back.

        Example:
            >>> import tempfile
            >>> from tierstore.backends import FileBackend
            >>> backend = FileBackend(tempfile.mkdtemp(), 1 << 20)
            >>> backend.trim()  # nothing lent yet
            0
            >>> backend.close(); backend.trim()
            0
        """
        try:
            with self._io():  # close() waits for it, as for a request
                return self._trim_buffers()
        except StoreClosedError:
            return 0

    # -- shared helpers ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(
                f"tierstore: the {self.name} backend at {self._spill.path} is closed"
            )

    def _done(self) -> None:
        # Caller holds the lock.
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.notify_all()

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._done()

    def _full_error(self, footprint: int, detail: str = "") -> TierFullError:
        free = max(self._capacity - self._used, 0)
        return TierFullError(
            f"tierstore: disk tier is full: {human_bytes(self._used)} in use of "
            f"disk_budget={human_bytes(self._budget)}; a record of "
            f"{human_bytes(footprint)} does not fit ({detail or human_bytes(free) + ' free'}); "
            "raise disk_budget (TIERSTORE_DISK_BUDGET)"
        )

    # -- what each backend supplies -----------------------------------------

    #: The file or environment the records rest in, named in error messages.
    _path: Path

    @abc.abstractmethod
    def _open_storage(self) -> None:
        """Create the files in :attr:`directory` and set ``_path``; called from ``__init__``."""

    @abc.abstractmethod
    def _footprint(self, nbytes: int) -> int:
        """Footprint of a record of ``nbytes``."""

    @abc.abstractmethod
    def _reserve(self, key: int, footprint: int) -> Place:
        """Claim room for a record (under the lock); raise TierFullError if there is none."""

    @abc.abstractmethod
    def _release(self, place: Place, footprint: int) -> None:
        """Give back what :meth:`_reserve` claimed (under the lock)."""

    @abc.abstractmethod
    def _store(self, key: int, place: Place, views: list[memoryview], length: int) -> None:
        """Write the record's bytes (outside the lock)."""

    @abc.abstractmethod
    def _load(self, key: int, place: Place, views: list[memoryview]) -> None:
        """Read the record's bytes into ``views`` (outside the lock)."""

    def _erase(self, key: int, place: Place) -> None:
        """Remove the record from storage (outside the lock); nothing to do by default."""

    def _trim_buffers(self) -> int:
        """Hand back the pages of idle I/O buffers (outside the lock); none by default."""
        return 0

    def _count(self) -> int:
        """Live records as the storage counts them (inside :meth:`_io`)."""
        return len(self._records)

    @abc.abstractmethod
    def _close_storage(self) -> None:
        """Release file handles and environments; the spill directory goes after."""
