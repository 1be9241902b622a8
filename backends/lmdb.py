"""The ``lmdb`` disk backend: one LMDB environment in the spill directory.

NOTE [ LMDB map size ]

``map_size`` caps how large LMDB's data file may grow; it reserves address
space, not disk (the file grows as pages are used). Three things make the file
larger than the sum of the records' footprints (see :meth:`LmdbBackend.footprint`):

* B-tree pages: one leaf node of 26 bytes per overflow record (node header,
  8-byte key, first overflow page number, slot), leaves at least half full
  after splits, plus branch pages and two meta pages: about 1.3% of the
  budget with 4 KiB pages, more for many tiny records.
* Copy-on-write: a page freed by write transaction N is reused only from
  transaction N + 2 on (the older of the two meta pages may still reference
  it). Deleting a record and at once writing another of the same size grows
  the file; churning one record as large as the budget would need three
  times the budget.
* Free-space fragmentation: a value above ~2 KiB goes to a run of contiguous
  overflow pages, and LMDB extends the file when its free list has no run
  long enough. Forward-then-backward traffic of records of 1-16 MiB under a
  64 MiB budget peaked at 1.25-1.4x the budget in our measurements.

So ``map_size = 2 * capacity_bytes + 1 MiB``: twice the budget absorbs the
fragmentation and copy-on-write lag for records up to about half the budget,
and the 1 MiB holds the tree and meta pages of small budgets. When a write
still finds the map full, the backend commits up to two empty-handed write
transactions (put and delete a sentinel key) to age the freed pages into
reuse, retrying after each; only then does it raise
:class:`~tierstore.TierFullError`. With that, the measured traffic above
failed only with records close to the whole budget.

The budget is enforced on footprints, so live records never take more than
``capacity_bytes``; only the data file may grow past it, up to ``map_size``.

NOTE [ LMDB threads ]

py-lmdb opens every environment with ``MDB_NOTLS``, so a read transaction is
not bound to a thread and reads on many threads run in parallel. There is
one writer: writes and deletes queue on a Python lock (which releases the
GIL while waiting) before they open a write transaction.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import ClassVar

import lmdb

from tierstore.backends._aligned import AlignedBuffer, copy
from tierstore.backends.base import Backend
from tierstore.config import human_bytes
from tierstore.errors import DISK_HINT, CorruptDataError, TierFullError, TierstoreError

__all__ = ["LmdbBackend"]

_ENV_NAME = "entries.lmdb"

#: Room for the tree and meta pages when the budget is small.
_FIXED_HEADROOM = 1 << 20

#: LMDB's page header, which also heads the first page of an overflow run.
_PAGE_HEADER = 16

#: Written and deleted again to age freed pages into reuse; 9 bytes long, so
#: it never collides with a record's 8-byte key.
_SENTINEL_KEY = b"\xff" * 9

#: Write transactions committed to age freed pages when the map is full.
_AGING_TXNS = 2


def _map_size(capacity_bytes: int) -> int:
    """The LMDB ``map_size`` for a budget; see ``NOTE [ LMDB map size ]``.

    Example:
        >>> _map_size(1 << 30) == (2 << 30) + (1 << 20)
        True
    """
    return 2 * capacity_bytes + _FIXED_HEADROOM


def open_environment(path: Path, map_size: int) -> lmdb.Environment:
    """A new LMDB environment at ``path`` (made here, 0700), opened as the backend opens its own.

    Example:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as d:
        ...     env = open_environment(pathlib.Path(d) / "env", 1 << 20)
        ...     env.info()["map_size"] >= 1 << 20
        ...     env.close()
        True
    """
    # py-lmdb would make the subdirectory with ``mode`` (0600, no search
    # bit); make it ourselves, 0700.
    os.mkdir(path, 0o700)
    return lmdb.open(
        str(path),
        map_size=map_size,
        subdir=True,
        sync=False,
        metasync=False,
        # Kept on: a record is one run of contiguous overflow pages, read
        # front to back. Without readahead every 4 KiB page is its own disk
        # fault once the page cache is cold: 0.07 GiB/s against 2.4 GiB/s
        # with it, reading 16 MiB records on this machine.
        readahead=True,
        lock=True,
        max_dbs=0,
        meminit=False,
        # writemap stays off: it wrote about 30% faster here, but into a
        # sparse map file, where a full disk is a SIGBUS in the middle of a
        # memcpy instead of an ENOSPC from write(2).
        mode=0o600,
    )


def _key_bytes(key: int) -> bytes:
    # Big-endian so that LMDB's byte order is the numeric order: keys handed
    # out in increasing order append to the rightmost leaf.
    try:
        return key.to_bytes(8, "big")
    except OverflowError:
        raise ValueError(
            f"tierstore: key {key} is not an integer in [0, 2**64) and cannot be stored"
        ) from None


class LmdbBackend(Backend[bytes]):
    """Records in one LMDB environment, keyed by 8-byte big-endian integers.

    The environment, ``entries.lmdb``, lives in a private spill directory
    under ``root``. It is opened without fsync (the data does not outlive the
    process), with the kernel's readahead (each record is one sequential run of
    pages). See
    ``NOTE [ LMDB map size ]`` for how large its file may grow and
    ``NOTE [ LMDB threads ]`` for concurrency.

    Args:
        root: ``TierConfig.disk_path``: where to create the spill directory.
        capacity_bytes: ``TierConfig.disk_budget``: footprint bytes the live
            records may take at most.

    Raises:
        ConfigError: ``root`` is unusable, or ``capacity_bytes`` is negative.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from tierstore.backends.lmdb import LmdbBackend
        >>> backend = LmdbBackend(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
        >>> backend.map_size
        3145728
        >>> backend.write(1, [b"a" * 4096, b"b"])  # 4097 bytes + page header: 2 pages
        8192
        >>> out = bytearray(4097)
        >>> backend.read_into(1, [memoryview(out)])
        >>> bytes(out[-2:])
        b'ab'
        >>> backend.delete(1)
        >>> backend.used_bytes, len(backend)
        (0, 0)
        >>> backend.close()
    """

    name: ClassVar[str] = "lmdb"

    @property
    def map_size(self) -> int:
        """The LMDB ``map_size``; see ``NOTE [ LMDB map size ]``."""
        return _map_size(self._capacity)

    def _open_storage(self) -> None:
        self._path = self._spill.file(_ENV_NAME)
        self._write_lock = threading.Lock()
        # Where a record's chunks are joined for its put (one buffer per
        # value): mapped on first use, grown to the largest record, reused by
        # every write (they hold _write_lock), unmapped by close. A bytes
        # object per write would leave its pages in the I/O thread's heap.
        self._joined: AlignedBuffer | None = None
        try:
            self._env = open_environment(self._path, self.map_size)
        except (OSError, lmdb.Error) as e:
            raise TierstoreError(
                f"tierstore: cannot open an LMDB environment in {self._path}: {e}; "
                "set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
            ) from e
        self._page_size: int = self._env.stat()["psize"]
        # LMDB needs its files' names while open: NOTE [ Spill directory on SIGTERM ]
        # in tierstore/backends/_spill.py.
        self._spill.remove_on_sigterm()

    def _close_storage(self) -> None:
        self._env.close()
        if self._joined is not None:
            self._joined.close()

    def _trim_buffers(self) -> int:
        # The writes' buffer, unless a write holds it now. `with`, not
        # acquire(blocking=False) then try, where an interrupt in between would
        # leave the lock held (NOTE [ Finalizers and interrupts ] in
        # tierstore/tiers/release.py): at worst it waits for one write that
        # began since the check.
        if self._write_lock.locked():
            return 0
        with self._write_lock:
            return self._joined.trim() if self._joined is not None else 0

    def _footprint(self, nbytes: int) -> int:
        """An upper bound on the pages a record of ``nbytes`` takes.

        A value too large for a leaf page (above about half a page) is stored
        in a run of overflow pages, the first of which starts with a 16-byte
        page header: ``ceil((nbytes + 16) / page_size)`` pages. A smaller
        value shares a leaf page with others; counting it as one whole page
        over-estimates it, which keeps the budget safe. The record's leaf
        node is covered by the map's headroom (``NOTE [ LMDB map size ]``).
        """
        pages = -(-(nbytes + _PAGE_HEADER) // self._page_size)
        return pages * self._page_size

    def _reserve(self, key: int, footprint: int) -> bytes:
        # The budget is the base class's; LMDB's own room shows at the put.
        return _key_bytes(key)

    def _release(self, place: bytes, footprint: int) -> None:
        pass

    def _count(self) -> int:
        entries: int = self._env.stat()["entries"]
        return entries

    def _store(self, key: int, place: bytes, views: list[memoryview], length: int) -> None:
        try:
            with self._write_lock:
                if not self._put(place, self._one_buffer(views, length)):
                    raise CorruptDataError(
                        f"tierstore: entry {key} is already in the disk tier ({self._path}) "
                        "although it was never written"
                    )
        except lmdb.MapFullError as e:
            map_size = human_bytes(self._env.info()["map_size"])
            raise TierFullError(
                f"tierstore: LMDB map is full (map_size={map_size}) writing a record of "
                f"{human_bytes(length)}; raise disk_budget (TIERSTORE_DISK_BUDGET)"
            ) from e
        except lmdb.Error as e:
            raise TierstoreError(
                f"tierstore: writing entry {key} ({human_bytes(length)}) to {self._path} failed: "
                f"{e}; {DISK_HINT}"
            ) from e

    def _one_buffer(self, views: list[memoryview], length: int) -> memoryview:
        # py-lmdb takes one buffer per value: pass a lone chunk as it is and
        # join several, with one copy, in the reused buffer. Holds _write_lock.
        if len(views) <= 1:
            return views[0] if views else memoryview(b"")
        joined = self._joined
        if joined is None or joined.view.nbytes < length:
            if joined is not None:
                joined.close()
            size = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
            joined = self._joined = AlignedBuffer(size)
        joined.resident = True  # See NOTE [ Idle I/O buffers ] in _aligned.py
        at = 0
        for view in views:
            copy(joined.view[at : at + view.nbytes], view)
            at += view.nbytes
        return joined.view[:length]

    def _put(self, kb: bytes, value: bytes | memoryview) -> bool:
        # Caller holds _write_lock. See NOTE [ LMDB map size ] for the retries.
        aging_left = _AGING_TXNS
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    return bool(txn.put(kb, value, overwrite=False))
            except lmdb.MapFullError:
                if aging_left == 0 or not self._age_freed_pages():
                    raise
                aging_left -= 1

    def _age_freed_pages(self) -> bool:
        # Any committed write moves LMDB's transaction id on, and with it the
        # pages freed two transactions ago become reusable.
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_SENTINEL_KEY, b"")
                txn.delete(_SENTINEL_KEY)
        except lmdb.MapFullError:
            return False
        return True

    def _load(self, key: int, place: bytes, views: list[memoryview]) -> None:
        wanted = sum(v.nbytes for v in views)
        # buffers=True: the value is a view into the map, valid inside the
        # transaction only, so it is copied out before the txn ends.
        with self._env.begin(buffers=True) as txn:
            value = txn.get(place)
            if value is None:
                raise CorruptDataError(
                    f"tierstore: entry {key} is missing from the disk tier ({self._path})"
                )
            src = memoryview(value).cast("B")
            if src.nbytes != wanted:
                raise CorruptDataError(
                    f"tierstore: entry {key} in the disk tier ({self._path}) holds "
                    f"{src.nbytes} bytes, not the {wanted} bytes asked for"
                )
            pos = 0
            for dst in views:
                dst[:] = src[pos : pos + dst.nbytes]
                pos += dst.nbytes

    def _erase(self, key: int, place: bytes) -> None:
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                # A delete only copies a leaf and its parents: a few pages
                # that the map's fixed headroom holds.
                txn.delete(place)
        except lmdb.Error as e:
            raise TierstoreError(
                f"tierstore: deleting entry {key} from {self._path} failed: {e}; "
                "raise disk_budget (TIERSTORE_DISK_BUDGET) if the LMDB map is full"
            ) from e
