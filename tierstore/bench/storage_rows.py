"""The rows of ``tierstore bench storage``: one store (or file) each, and the passes it runs.

A row is a :class:`Session`: what it writes into (one preallocated file, a
directory of files, a tierstore disk backend) is created when the session
opens and removed when it closes. :meth:`Session.run_pass` runs one pass:
free what the previous pass wrote, write every tensor, read every tensor
back. The steady state keeps one session per row across all its passes;
first touch opens a fresh one for each pass (``NOTE [ Steady state and
first touch ]`` in ``tierstore/bench/storage.py``).

NOTE [ The raw baseline's access pattern ]
``raw`` is the least any store must do to put these tensors on this disk
and get them back, done the way the ``file`` backend does it, so that the
ratio of the two is tierstore's own cost and nothing else: one file,
records at 4 KiB-aligned offsets, every tensor submitted at once to
:data:`IO_WORKERS` threads (the store's ``io_workers``), each tensor one
request. Where the ``file`` backend uses ``O_DIRECT`` (the same probe
decides: an open and one aligned block written and read back), ``raw``
does too, through page-aligned bounce buffers of :data:`CHUNK_BYTES` from
the same :class:`~tierstore.backends._aligned.AlignedBufferPool`, since a
tensor's memory is not page-aligned: copy a chunk in, write it whole; read
whole blocks, copy them out into a new tensor allocated on the I/O thread,
as the store's reads allocate theirs (where a thread's memory comes from
moves a read's time: a copy into memory not yet faulted in runs at a
fraction of the rate of one into warm memory). It skips what
only a store needs: the record header, its checksum, the allocator, the
event loop. ``raw-buffered`` is
the same through the page cache (``pwrite`` / ``preadv`` from and into the
tensors' memory): the path every row that cannot use ``O_DIRECT`` (LMDB,
``torch.save``, safetensors) is bound to.

NOTE [ Dropping LMDB's mapped pages ]
``posix_fadvise(POSIX_FADV_DONTNEED)`` leaves alone pages that a process
has mapped. LMDB reads through a read-only shared map of its data file, so
once a store has read its records back, the pages stay mapped; the next
pass overwrites them through the page cache, and after the advice most of
them are still resident (mincore shows it on this benchmark's steady-state
``lmdb`` row): its reads would come from memory. So before the
advice, :func:`drop_cache` unmaps this process's shared maps of the files
from its page tables (``madvise(MADV_DONTNEED)``, found in
``/proc/self/maps``). On a shared file map this discards nothing: the next
access maps the page again from the cache or the file. After both, none of
the file stayed resident. :func:`resident_share` measures it, and the
benchmark reports it for every pass.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from tierstore.bench.storage_rows import open_session
    >>> tensors = [torch.randn(1024), torch.randn(2048)]
    >>> session = open_session("raw", Path(tempfile.mkdtemp()) / "raw", tensors, direct=False)
    >>> first = session.run_pass(tensors)
    >>> again = session.run_pass(tensors)  # the same file, overwritten
    >>> all(torch.equal(a, b) for a, b in zip(again.results, tensors))
    True
    >>> session.close(); session.close()  # idempotent: the file is gone
"""

from __future__ import annotations

import abc
import concurrent.futures
import ctypes
import functools
import mmap
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from tierstore import codec
from tierstore.backends._aligned import AlignedBufferPool, copy, direct_io_works
from tierstore.bench.report import Progress, median
from tierstore.config import TierConfig
from tierstore.errors import CorruptDataError, TierstoreError
from tierstore.tiers.movers import Pipeline, Record

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "IO_WORKERS",
    "PassTimes",
    "Session",
    "Spread",
    "direct_io_supported",
    "drop_cache",
    "fsync_files",
    "open_session",
    "resident_share",
]

#: Records start on, and are rounded up to, this many bytes: the ``file`` backend's ALIGN.
ALIGN = 4096
#: One ``O_DIRECT`` request through a bounce buffer: the ``file`` backend's chunk.
CHUNK_BYTES = 4 << 20
#: Requests in flight: the ``file``/``lmdb`` rows' ``io_workers``, and ``raw``'s threads.
IO_WORKERS = 4

_MIB = 1 << 20
#: Files in a backend's spill directory that hold no records.
_NOT_RECORDS = frozenset({".lock", "lock.mdb"})


@dataclass
class Spread:
    """One figure over the repeats: its smallest, median and largest value.

    Example:
        >>> s = Spread.of([1.0, 3.0, 2.0]); (s.min, s.median, s.max), s.width
        ((1.0, 2.0, 3.0), 1.0)
    """

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of ``values`` (at least one)."""
        if not values:
            raise ValueError("Spread.of: no values")
        return cls(min(values), median(values), max(values))

    @property
    def width(self) -> float:
        """``(max - min) / median``: how far apart the repeats were, relative to the median."""
        return (self.max - self.min) / self.median if self.median else float("inf")

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.min:.3f}-{self.max:.3f}]"


@dataclass
class PassTimes:
    """One pass of one row: its phases' seconds, per-tensor latencies, what it read back.

    ``free_s``: freeing what the previous pass wrote (0 on a fresh store).
    ``write_s`` ends with ``fsync`` of every file the row wrote;
    ``resident_share``: the share of those files' pages still in the page
    cache when the read phase began (``NOTE [ Dropping LMDB's mapped pages ]``).

    Example:
        >>> PassTimes(0.0, 1.0, 0.5).write_read_gbps(1_000_000_000)
        1.3333333333333333
    """

    free_s: float
    write_s: float
    read_s: float
    write_latency_s: list[float] = field(default_factory=list)
    read_latency_s: list[float] = field(default_factory=list)
    stored_bytes: int = 0
    resident_share: float = 0.0
    results: list[torch.Tensor] = field(default_factory=list)

    def write_read_gbps(self, nbytes: int) -> float:
        """Both phases' bytes over both phases' time: ``2 * nbytes / (write_s + read_s)``, GB/s."""
        return 2 * nbytes / (self.write_s + self.read_s) / 1e9


# -- the page cache (NOTE [ Page cache in the storage benchmark ]) -------------------


def fsync_files(paths: Sequence[Path]) -> None:
    """``fsync`` every file: its bytes are on the device when this returns.

    fsync flushes the inode, whichever descriptor asks: ours is as good as
    the one the writer used.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "f"; _ = path.write_bytes(b"x")
        >>> fsync_files([path])
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(paths: Sequence[Path]) -> None:
    """Drop the files' clean pages from the page cache, this process's shared maps of them first.

    See ``NOTE [ Dropping LMDB's mapped pages ]``. Does nothing where the
    platform has no ``posix_fadvise``.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "f"; _ = path.write_bytes(b"x" * 8192)
        >>> fsync_files([path]); drop_cache([path])
    """
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
        return
    _unmap_shared(paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def _unmap_shared(paths: Sequence[Path]) -> None:
    # Shared maps only ('s' in the permissions): on those MADV_DONTNEED drops
    # page-table entries and nothing else. On a private map it would throw
    # away the process's own copies.
    wanted = {str(Path(p).resolve()) for p in paths}
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            lines = maps.readlines()
    except OSError:  # pragma: no cover - no procfs
        return
    libc = _libc()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[5].rstrip("\n") not in wanted or parts[1][3] != "s":
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        libc.madvise(start, end - start, mmap.MADV_DONTNEED)


def resident_share(paths: Sequence[Path]) -> float:
    """The share of the files' pages in the page cache now (mincore), 0.0 to 1.0.

    0.0 where the platform cannot tell, or the files are empty.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> path = Path(tempfile.mkdtemp()) / "f"; _ = path.write_bytes(b"x" * 8192)
        >>> resident_share([path])  # just written: in the cache
        1.0
    """
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
        return 0.0
    libc = _libc()
    page = mmap.PAGESIZE
    resident = pages = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            continue
        try:
            vec = ctypes.create_string_buffer(-(-size // page))
            if libc.mincore(addr, size, vec) != 0:
                continue
            resident += sum(b & 1 for b in vec.raw)
            pages += len(vec.raw)
        finally:
            libc.munmap(addr, size)
    return resident / pages if pages else 0.0


def direct_io_supported(directory: Path) -> bool:
    """Whether files in ``directory`` take ``O_DIRECT``, probed as the ``file`` backend probes.

    An open with ``O_DIRECT`` and one aligned block written and read back:
    some filesystems accept the open and fail the first I/O.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> direct_io_supported(Path(tempfile.mkdtemp())) in (True, False)
        True
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:  # pragma: no cover - not Linux
        return False
    path = directory / ".o_direct_probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o600)
    except OSError:
        return False
    try:
        return direct_io_works(fd)
    finally:
        os.close(fd)
        path.unlink()


# -- sessions -----------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ends_early(path: Path, offset: int) -> CorruptDataError:
    return CorruptDataError(f"tierstore: bench storage: {path} ends early at byte {offset}")


class Session(abc.ABC):
    """One row's store, kept for as many passes as its phase runs.

    Subclasses create what they write into in ``__init__`` and supply
    :meth:`_free`, :meth:`_write`, :meth:`_read` and :meth:`files`.
    :meth:`close` removes ``workdir`` and everything in it. Idempotent.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> s = open_session("torch.save", Path(tempfile.mkdtemp()) / "t", [torch.ones(4)])
        >>> s.run_pass([torch.ones(4)]).free_s, s.run_pass([torch.ones(4)]).free_s > 0
        (0.0, True)
        >>> s.close()
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(mode=0o700)
        #: Passes run so far.
        self.passes = 0
        self._written = False
        self._closed = False

    def run_pass(
        self, tensors: Sequence[torch.Tensor], progress: Progress | None = None
    ) -> PassTimes:
        """Free the previous pass's entries, write ``tensors``, drop the cache, read them back.

        ``tensors`` must have the same sizes, in the same order, at every pass.
        """
        progress = progress if progress is not None else Progress(0, enabled=False)
        free_s = 0.0
        if self._written:
            start = time.perf_counter()
            self._free()
            free_s = time.perf_counter() - start
        start = time.perf_counter()
        write_lat = self._write(tensors, progress)
        files = self.files()
        fsync_files(files)
        write_s = time.perf_counter() - start
        self._written = True
        drop_cache(files)
        resident = resident_share(files)
        start = time.perf_counter()
        read_lat, results = self._read(tensors, progress)
        read_s = time.perf_counter() - start
        self.passes += 1
        return PassTimes(
            free_s,
            write_s,
            read_s,
            write_lat,
            read_lat,
            self.stored_bytes(),
            resident,
            results,
        )

    @property
    def io_path(self) -> str:
        """How the row's bytes reach the disk: ``"buffered"`` (the page cache) unless it says."""
        return "buffered"

    @abc.abstractmethod
    def files(self) -> list[Path]:
        """The files the last pass wrote, for ``fsync`` and the cache drop."""

    @abc.abstractmethod
    def stored_bytes(self) -> int:
        """Bytes the last pass's entries take on disk."""

    @abc.abstractmethod
    def _free(self) -> None: ...

    @abc.abstractmethod
    def _write(self, tensors: Sequence[torch.Tensor], progress: Progress) -> list[float]: ...

    @abc.abstractmethod
    def _read(
        self, tensors: Sequence[torch.Tensor], progress: Progress
    ) -> tuple[list[float], list[torch.Tensor]]: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:
        """Release the session's store and remove its directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _submitted(
    executor: concurrent.futures.ThreadPoolExecutor,
    jobs: Sequence[Callable[[], tuple[int, torch.Tensor | None]]],
    progress: Progress,
) -> tuple[list[float], list[torch.Tensor | None]]:
    # Every job submitted at once; a job's latency runs from its submission
    # to its end, so waiting for a free thread counts, as in the store. A
    # job returns its bytes and what it read (None for a write).
    def timed(
        job: Callable[[], tuple[int, torch.Tensor | None]],
    ) -> tuple[float, torch.Tensor | None]:
        nbytes, out = job()
        progress.advance(nbytes)
        return time.perf_counter(), out

    starts, futures = [], []
    for job in jobs:
        starts.append(time.perf_counter())
        futures.append(executor.submit(timed, job))
    done = [f.result() for f in futures]
    return [end - s for (end, _), s in zip(done, starts, strict=True)], [out for _, out in done]


class _RawSession(Session):
    """``raw`` and ``raw-buffered``: NOTE [ The raw baseline's access pattern ]."""

    def __init__(self, workdir: Path, tensors: Sequence[torch.Tensor], *, direct: bool) -> None:
        super().__init__(workdir)
        self._path = workdir / "raw.bin"
        self._offsets = []
        end = 0
        for t in tensors:
            self._offsets.append(end)
            end += -(-_nbytes(t) // ALIGN) * ALIGN
        self._end = end
        self._fd: int | None = None
        self._dfd: int | None = None
        self._pool: AlignedBufferPool | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            # Reserved untimed, as the file backend's growth reserves its file
            # (a few fallocate calls): on first touch the blocks exist, unwritten.
            os.posix_fallocate(self._fd, 0, end)
            if direct:
                self._dfd = os.open(self._path, os.O_RDWR | os.O_DIRECT)
                self._pool = AlignedBufferPool(CHUNK_BYTES, 2 * IO_WORKERS)
            self._executor = concurrent.futures.ThreadPoolExecutor(
                IO_WORKERS, thread_name_prefix="bench-raw"
            )
        except BaseException:
            self.close()
            raise

    @property
    def io_path(self) -> str:
        """``"O_DIRECT"`` or ``"buffered"``."""
        return "O_DIRECT" if self._dfd is not None else "buffered"

    def files(self) -> list[Path]:
        return [self._path]

    def stored_bytes(self) -> int:
        return self._end

    def _free(self) -> None:
        pass  # nothing to free: the next pass overwrites the same offsets

    def _write(self, tensors: Sequence[torch.Tensor], progress: Progress) -> list[float]:
        assert self._executor is not None
        jobs = [
            functools.partial(self._write_one, t, o)
            for t, o in zip(tensors, self._offsets, strict=True)
        ]
        return _submitted(self._executor, jobs, progress)[0]

    def _write_one(self, t: torch.Tensor, offset: int) -> tuple[int, None]:
        assert self._fd is not None
        view = codec.byte_view(t)
        if self._dfd is None or self._pool is None:
            done = 0
            while done < view.nbytes:
                done += os.pwrite(self._fd, view[done:], offset + done)
            return view.nbytes, None
        with self._pool.buffer() as buf:
            for pos in range(0, view.nbytes, CHUNK_BYTES):
                n = min(CHUNK_BYTES, view.nbytes - pos)
                copy(buf.view[:n], view[pos : pos + n])
                end = -(-n // ALIGN) * ALIGN
                buf.view[n:end] = bytes(end - n)
                written = 0
                while written < end:
                    written += os.pwritev(
                        self._dfd, [buf.view[written:end]], offset + pos + written
                    )
        return view.nbytes, None

    def _read(
        self, tensors: Sequence[torch.Tensor], progress: Progress
    ) -> tuple[list[float], list[torch.Tensor]]:
        assert self._executor is not None
        jobs = [
            functools.partial(self._read_one, t, o)
            for t, o in zip(tensors, self._offsets, strict=True)
        ]
        latencies, results = _submitted(self._executor, jobs, progress)
        return latencies, [r for r in results if r is not None]

    def _read_one(self, like: torch.Tensor, offset: int) -> tuple[int, torch.Tensor]:
        # The destination is allocated here, on the I/O thread, as the
        # store's reads allocate theirs: where a thread's memory comes from
        # (which malloc arena, memory already faulted in or not) can cost as
        # much as the copy itself.
        assert self._fd is not None
        out = torch.empty(like.shape, dtype=like.dtype)
        view = codec.byte_view(out)
        if self._dfd is None or self._pool is None:
            done = 0
            while done < view.nbytes:
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got == 0:
                    raise _ends_early(self._path, offset + done)
                done += got
            return view.nbytes, out
        with self._pool.buffer() as buf:
            for pos in range(0, view.nbytes, CHUNK_BYTES):
                n = min(CHUNK_BYTES, view.nbytes - pos)
                end = -(-n // ALIGN) * ALIGN
                filled = 0
                while filled < end:
                    got = os.preadv(self._dfd, [buf.view[filled:end]], offset + pos + filled)
                    if got == 0:
                        raise _ends_early(self._path, offset + pos + filled)
                    filled += got
                copy(view[pos : pos + n], buf.view[:n])
        return view.nbytes, out

    def _close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._pool is not None:
            self._pool.close()
        for fd in (self._dfd, self._fd):
            if fd is not None:
                os.close(fd)


class _PerFileSession(Session):
    """``torch.save`` and ``safetensors``: one file per tensor, one call at a time."""

    def __init__(
        self,
        workdir: Path,
        *,
        save: Callable[[torch.Tensor, Path], None],
        load: Callable[[Path], torch.Tensor],
        suffix: str,
    ) -> None:
        super().__init__(workdir)
        self._save, self._load, self._suffix = save, load, suffix
        self._paths: list[Path] = []

    def files(self) -> list[Path]:
        return list(self._paths)

    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._paths)

    def _free(self) -> None:
        # A store of one file per tensor frees an entry by removing its file.
        for path in reversed(self._paths):
            path.unlink()
        self._paths = []

    def _write(self, tensors: Sequence[torch.Tensor], progress: Progress) -> list[float]:
        self._paths = [self.workdir / f"{i}{self._suffix}" for i in range(len(tensors))]
        latencies = []
        for t, path in zip(tensors, self._paths, strict=True):
            t0 = time.perf_counter()
            self._save(t, path)
            latencies.append(time.perf_counter() - t0)
            progress.advance(_nbytes(t))
        return latencies

    def _read(
        self, tensors: Sequence[torch.Tensor], progress: Progress
    ) -> tuple[list[float], list[torch.Tensor]]:
        results, latencies = [], []
        for t, path in zip(tensors, self._paths, strict=True):
            t0 = time.perf_counter()
            results.append(self._load(path))
            latencies.append(time.perf_counter() - t0)
            progress.advance(_nbytes(t))
        return latencies, results


def _torch_load(path: Path) -> torch.Tensor:
    out: torch.Tensor = torch.load(path, weights_only=True)
    return out


def _safetensors_load(path: Path) -> torch.Tensor:
    # load_file maps the file and pages it in only when the tensor is used
    # (safetensors 0.8 does), so the call alone reads next to nothing. The copy
    # makes the bytes process memory inside the timed phase, as every other
    # row's read does.
    return safetensors.torch.load_file(str(path))["t"].clone()


class _TierstoreSession(Session):
    """``file``, ``lmdb`` (``+zstd``): the movers (:class:`~tierstore.tiers.movers.Pipeline`).

    Write: every span is submitted at once, as forward would queue them; the
    pipeline frames them (zstd with byte shuffle when on) and writes them
    with ``io_workers`` requests in flight. Free: every record deleted,
    newest first, as backward releases them. Read: every record submitted at
    once, as the prefetch window would, read back, checked against its
    header and decoded. A tensor's latency runs from its submission to the
    end of its I/O.
    """

    def __init__(
        self,
        workdir: Path,
        tensors: Sequence[torch.Tensor],
        *,
        backend: str,
        compression: str,
        level: int,
    ) -> None:
        super().__init__(workdir)
        # Room for every record plus its header and a zstd frame that fails to
        # shrink incompressible bytes; the file backend grows only as it is used.
        capacity = sum(_nbytes(t) + _MIB for t in tensors) + 16 * _MIB
        config = TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget=capacity,
            disk_path=workdir,
            disk_backend=backend,
            compression=compression,
            compression_level=level,
            io_workers=IO_WORKERS,
        )
        self._pipe = Pipeline(config)
        try:
            self._pipe.open_backend()
        except BaseException:
            self._pipe.close()
            raise
        opened = self._pipe.backend_if_open
        assert opened is not None
        self.backend = opened
        self._next_key = 0
        self._records: list[tuple[int, Record]] = []
        self._layouts: list[Any] = []

    @property
    def io_path(self) -> str:
        """``"O_DIRECT"`` where the backend bypasses the page cache, else ``"buffered"``."""
        return "O_DIRECT" if getattr(self.backend, "direct", False) else "buffered"

    def files(self) -> list[Path]:
        # The records' files: not the spill directory's pid lock, nor LMDB's
        # reader table (lock.mdb), which LMDB keeps mapped and writes to. The
        # file backend's data file has no name in the directory (NOTE [ File
        # backend unlinked ]): its path reaches it through its descriptor.
        named = sorted(
            p
            for p in self.backend.directory.rglob("*")
            if p.is_file() and p.name not in _NOT_RECORDS
        )
        data = self.backend.path
        return named if data in named or not data.is_file() else [*named, data]

    def stored_bytes(self) -> int:
        return sum(len(r.header) + r.meta.payload_nbytes for _, r in self._records)

    def _free(self) -> None:
        for key, _ in reversed(self._records):
            self._pipe.delete(key)
        self._pipe.settle_deletes()
        self._records = []

    def _write(self, tensors: Sequence[torch.Tensor], progress: Progress) -> list[float]:
        spans = [codec.to_span(t) for t in tensors]
        self._layouts = [layout for _, layout in spans]
        ended: dict[int, float] = {}

        def finish(key: int, nbytes: int) -> Callable[[Any], None]:
            def done(_: Any) -> None:
                ended[key] = time.perf_counter()
                progress.advance(nbytes)

            return done

        submitted, writes = [], []
        for span, _ in spans:
            key = self._next_key
            self._next_key += 1
            submitted.append((key, time.perf_counter()))
            writes.append(self._pipe.submit_write(key, span, finish(key, _nbytes(span))))
        self._records = [(k, w.result()) for (k, _), w in zip(submitted, writes, strict=True)]
        return [ended[k] - t for k, t in submitted]

    def _read(
        self, tensors: Sequence[torch.Tensor], progress: Progress
    ) -> tuple[list[float], list[torch.Tensor]]:
        ended: dict[int, float] = {}
        submitted, reads = [], []
        for key, record in self._records:
            submitted.append((key, time.perf_counter()))
            future = self._pipe.submit_read(key, record)
            nbytes = record.meta.raw_nbytes

            def done(_: Any, key: int = key, nbytes: int = nbytes) -> None:
                ended[key] = time.perf_counter()
                progress.advance(nbytes)

            future.add_done_callback(done)
            reads.append(future)
        results = [
            codec.from_span(r.result(), layout)
            for r, layout in zip(reads, self._layouts, strict=True)
        ]
        return [ended[k] - t for k, t in submitted], results

    def _close(self) -> None:
        self._pipe.close()


def open_session(
    row: str,
    workdir: Path,
    tensors: Sequence[torch.Tensor],
    *,
    direct: bool = False,
    backend: str | None = None,
    compression: str = "none",
    level: int = 1,
) -> Session:
    """Open the store of the row called ``row`` in ``workdir`` (created here, removed by close).

    Args:
        row: ``"raw"``, ``"raw-buffered"``, ``"torch.save"``, ``"safetensors"``,
            or a tierstore row (then ``backend`` names its backend).
        workdir: a path that does not exist yet, on the disk to measure.
        tensors: the tensors every pass writes (sizes and order).
        direct: ``raw`` only: ``O_DIRECT`` through bounce buffers.
        backend: a tierstore row's disk backend (``"file"``, ``"lmdb"``).
        compression: a tierstore row's compression.
        level: zstd level.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> s = open_session("lmdb", Path(tempfile.mkdtemp()) / "x", [torch.ones(4)],
        ...                  backend="lmdb")
        >>> s.run_pass([torch.ones(4)]).results[0].tolist()
        [1.0, 1.0, 1.0, 1.0]
        >>> s.close()
    """
    if row in ("raw", "raw-buffered"):
        return _RawSession(workdir, tensors, direct=direct and row == "raw")
    if row == "torch.save":
        return _PerFileSession(workdir, save=torch.save, load=_torch_load, suffix=".pt")
    if row == "safetensors":
        return _PerFileSession(
            workdir,
            save=lambda t, p: safetensors.torch.save_file({"t": t}, str(p)),
            load=_safetensors_load,
            suffix=".safetensors",
        )
    if backend is None:
        raise TierstoreError(f"tierstore: bench storage: row {row!r} names no backend")
    return _TierstoreSession(
        workdir, tensors, backend=backend, compression=compression, level=level
    )
