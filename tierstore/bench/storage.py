"""``tierstore bench storage``: disk backends against the baselines a user would compare with.

Every row writes the same tensors into the same directory, then reads them
back and checks each against what it wrote (``torch.equal``): a benchmark
checks the result it timed. Rows:

* ``raw``: ``os.pwrite`` / ``os.preadv`` into one preallocated file, at
  4 KiB-aligned offsets: the disk's practical limit through the page cache;
* ``torch.save``: ``torch.save`` / ``torch.load(weights_only=True)``, one file
  per tensor;
* ``safetensors``: ``save_file`` / ``load_file``, one file per tensor;
* ``file``, ``lmdb`` (each also ``+zstd``): tierstore's codec and disk
  backends (:func:`_tierstore_write_read`).

Below the rows, the checksums a record could carry (NOTE [ Record integrity ]
in ``tierstore/codec.py``) hash the same tensors in memory: xxh3, which the
store uses, against zlib's crc32 and, where the ``crc32c`` package is
installed, crc32c; with the share of the ``file`` row's write+read time that
hashing every byte on the way out and on the way back in would cost.

NOTE [ Page cache in the storage benchmark ]
The machine usually has more RAM than the benchmark writes, so without care
every read would come from the page cache and every write would end in it.
For every row alike: the timed write phase ends with ``fsync`` of every file
the row wrote (the bytes are on the device when the clock stops), and before
the read phase ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops those files'
pages (untimed), so reads come from the device where the kernel honours the
advice (Linux does for clean, unmapped pages). Creating a store, which
opens the LMDB environment, is not timed: a store does it once, not per
tensor; the ``file`` backend's file grows on demand during the timed writes
(a few fallocate calls: NOTE [ File backend growth ]); the ``raw`` file is
preallocated untimed. Files a baseline creates per
tensor are part of its cost. An untimed ``raw`` pass runs first: on the
development VM the first gigabyte a process writes was up to 5x slower than
the next, whichever row came first. The rows then run ``repeat`` times, each
repeat starting one row later, and the median phase times are reported.

NOTE [ Benchmark data ]
Fresh random data, not zeros (zstd would compress zeros to nothing): each
tensor is ``gelu(randn)`` in float32, which looks like the activations a
training step saves (half the values near zero, the rest Gaussian), so the
``zstd`` rows show a realistic compression ratio. Throughput always counts
the tensors' bytes, not the compressed ones.

Example:
    >>> import tempfile
    >>> from tierstore.bench.storage import bench_storage
    >>> report = bench_storage(total_bytes=2 << 20, sizes=[1 << 20],
    ...                        directory=tempfile.mkdtemp(), show_progress=False)
    >>> [row.name for row in report.rows]
    ['raw', 'torch.save', 'safetensors', 'file', 'file+zstd', 'lmdb', 'lmdb+zstd']
    >>> all(row.verified and row.write_read_gbps > 0 for row in report.rows)
    True
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstore import codec
from tierstore.bench.copies import bench_copies, format_copies
from tierstore.bench.report import (
    NA,
    Progress,
    Report,
    fmt_ratio,
    format_table,
    load_pyplot,
    machine_info,
    median,
    percentile,
    write_results,
)
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.config import TierConfig, human_bytes
from tierstore.errors import CorruptDataError, TierstoreError
from tierstore.pipeline import Pipeline

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "ChecksumRow",
    "StorageReport",
    "StorageRow",
    "bench_storage",
    "format_storage",
    "parse_size",
    "plot_storage",
    "run",
]

#: Disk backends the benchmark knows.
BACKENDS = ("file", "lmdb")
#: Compressions the benchmark knows.
COMPRESSIONS = ("none", "zstd")
#: The baselines, in the order they run and print.
BASELINES = ("raw", "torch.save", "safetensors")

#: The ``raw`` baseline's alignment; the same as the ``file`` backend's.
_ALIGN = 4096
_MIB = 1 << 20

_SIZE = TypeAdapter(ByteSize)


def parse_size(text: str, what: str) -> int:
    """A byte count from ``"16MiB"``, ``"1GiB"``, ``"1.5 GB"`` or a number of bytes.

    Raises:
        TierstoreError: ``text`` is not a size; the message names ``what``.

    Example:
        >>> parse_size("16MiB", "--sizes"), parse_size("4096", "--total")
        (16777216, 4096)
    """
    try:
        return int(_SIZE.validate_python(text.strip()))
    except ValidationError:
        raise TierstoreError(
            f"tierstore: {what} {text!r} is not a size; expected a size such as "
            "'64MiB', '1GiB' or a whole number of bytes"
        ) from None


@dataclass
class _Measured:
    """One row's timed run: phases, per-tensor latencies, and what it read back."""

    write_s: float
    read_s: float
    write_latency_s: list[float]
    read_latency_s: list[float]
    stored_bytes: int
    results: list[torch.Tensor]


_Runner = Callable[[list[torch.Tensor], Path, Progress], _Measured]


@dataclass
class StorageRow:
    """One row of the storage benchmark: throughput, latency and ratios.

    Throughputs are GB/s (10^9 tensor bytes per second; compressed rows count
    the uncompressed bytes), computed from the median phase times over the
    repeats. ``write_read_gbps`` is the bytes moved both ways over both
    phases: ``2 * bytes / (write_s + read_s)``. Latency percentiles pool the
    per-tensor times of all repeats. ``vs_raw`` and ``vs_torch_save`` divide
    ``write_read_gbps`` by the same figure of the ``raw`` and ``torch.save``
    rows.

    Example:
        >>> StorageRow("raw", "baseline", None, "none").kind
        'baseline'
    """

    name: str
    kind: str
    backend: str | None
    compression: str
    bytes: int = 0
    stored_bytes: int = 0
    compression_ratio: float | None = None
    write_s: float = 0.0
    read_s: float = 0.0
    write_gbps: float = 0.0
    read_gbps: float = 0.0
    write_read_gbps: float = 0.0
    write_p50_ms: float = 0.0
    write_p99_ms: float = 0.0
    read_p50_ms: float = 0.0
    read_p99_ms: float = 0.0
    vs_raw: float | None = None
    vs_torch_save: float | None = None
    verified: bool = False
    runs: list[dict[str, float]] = field(default_factory=list)


@dataclass
class ChecksumRow:
    """One checksum's in-memory throughput over the benchmark's tensors (one thread).

    ``gbps`` is ``None`` when the checksum's package is not installed.
    ``vs_file_row`` is the time hashing every byte twice (on write and on
    read) takes, as a share of the ``file`` row's write+read time.

    Example:
        >>> ChecksumRow("xxh3", True, 30.0).used
        True
    """

    name: str
    used: bool
    gbps: float | None
    vs_file_row: float | None = None


@dataclass
class StorageReport(Report[StorageRow]):
    """What :func:`bench_storage` measured, with the settings and the data it used.

    Example:
        >>> StorageReport(rows=[], settings={}, targets=[], data={}).as_dict()["rows"]
        []
    """

    data: dict[str, Any]
    checksums: list[ChecksumRow] = field(default_factory=list)


def _crc32c() -> Callable[[memoryview], int] | None:
    try:
        fn: Callable[[memoryview], int] = importlib.import_module("crc32c").crc32c
    except ImportError:
        return None
    return fn


def _bench_checksums(tensors: list[torch.Tensor], repeat: int) -> list[ChecksumRow]:
    """Time each checksum over every tensor's bytes; the best of ``repeat`` passes."""
    candidates: list[tuple[str, Callable[[memoryview], object] | None]] = [
        ("xxh3", codec.checksum),
        ("crc32c", _crc32c()),
        ("zlib.crc32", zlib.crc32),
    ]
    views = [codec.byte_view(t) for t in tensors]
    total = sum(v.nbytes for v in views)
    rows = []
    for name, fn in candidates:
        if fn is None:
            rows.append(ChecksumRow(name, False, None))
            continue
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for view in views:
                fn(view)
            best = min(best, time.perf_counter() - start)
        rows.append(ChecksumRow(name, fn is codec.checksum, total / best / 1e9))
    return rows


def _tensor_sizes(total_bytes: int, sizes: Sequence[int], seed: int) -> list[int]:
    # Sizes cycle until the total is reached, then are shuffled (seeded) so
    # that small and large tensors are mixed in the stream, as in a model.
    out: list[int] = []
    i = 0
    while sum(out) < total_bytes:
        out.append(sizes[i % len(sizes)])
        i += 1
    random.Random(seed).shuffle(out)
    return out


def _activations(sizes: Sequence[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [F.gelu(torch.randn(n // 4, generator=gen)) for n in sizes]


# -- page cache (NOTE [ Page cache in the storage benchmark ]) ----------------


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _fsync(paths: Sequence[Path]) -> None:
    # fsync flushes the inode, whichever descriptor asks: ours is as good as
    # the one the writer used.
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(paths: Sequence[Path]) -> None:
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _empty_like_source(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


# -- the rows -------------------------------------------------------------------


def _raw_write_read(tensors: list[torch.Tensor], workdir: Path, progress: Progress) -> _Measured:
    """``os.pwrite`` / ``os.preadv`` at aligned offsets of one preallocated file."""
    path = workdir / "raw.bin"
    offsets = []
    end = 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, end)  # untimed, as the file backend's preallocation
        write_lat = []
        start = time.perf_counter()
        for t, offset in zip(tensors, offsets, strict=True):
            t0 = time.perf_counter()
            view = codec.byte_view(t)
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], offset + done)
            write_lat.append(time.perf_counter() - t0)
            progress.advance(view.nbytes)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        _drop_cache([path])

        results = []
        read_lat = []
        start = time.perf_counter()
        for t, offset in zip(tensors, offsets, strict=True):
            t0 = time.perf_counter()
            out = _empty_like_source(t)
            view = codec.byte_view(out)
            done = 0
            while done < view.nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:
                    raise CorruptDataError(f"tierstore: {path} ends early at {offset + done}")
                done += got
            read_lat.append(time.perf_counter() - t0)
            results.append(out)
            progress.advance(view.nbytes)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
    return _Measured(write_s, read_s, write_lat, read_lat, end, results)


def _per_file_write_read(
    tensors: list[torch.Tensor],
    workdir: Path,
    progress: Progress,
    *,
    save: Callable[[torch.Tensor, Path], None],
    load: Callable[[Path], torch.Tensor],
    suffix: str,
) -> _Measured:
    paths = [workdir / f"{i}{suffix}" for i in range(len(tensors))]
    write_lat = []
    start = time.perf_counter()
    for t, path in zip(tensors, paths, strict=True):
        t0 = time.perf_counter()
        save(t, path)
        write_lat.append(time.perf_counter() - t0)
        progress.advance(t.numel() * t.element_size())
    _fsync(paths)
    write_s = time.perf_counter() - start
    _drop_cache(paths)
    stored = sum(p.stat().st_size for p in paths)

    results = []
    read_lat = []
    start = time.perf_counter()
    for t, path in zip(tensors, paths, strict=True):
        t0 = time.perf_counter()
        results.append(load(path))
        read_lat.append(time.perf_counter() - t0)
        progress.advance(t.numel() * t.element_size())
    read_s = time.perf_counter() - start
    return _Measured(write_s, read_s, write_lat, read_lat, stored, results)


def _torch_save_write_read(
    tensors: list[torch.Tensor], workdir: Path, progress: Progress
) -> _Measured:
    """``torch.save`` / ``torch.load(weights_only=True)``, one file per tensor."""

    def save(t: torch.Tensor, path: Path) -> None:
        torch.save(t, path)

    def load(path: Path) -> torch.Tensor:
        out: torch.Tensor = torch.load(path, weights_only=True)
        return out

    return _per_file_write_read(tensors, workdir, progress, save=save, load=load, suffix=".pt")


def _safetensors_load(path: Path) -> torch.Tensor:
    # load_file maps the file and pages it in only when the tensor is used
    # (safetensors 0.8 does), so the call alone reads next to nothing. The copy
    # makes the bytes process memory inside the timed phase, as every other
    # row's read does.
    return safetensors.torch.load_file(str(path))["t"].clone()


def _safetensors_write_read(
    tensors: list[torch.Tensor], workdir: Path, progress: Progress
) -> _Measured:
    """The safetensors baseline: ``save_file`` / ``load_file``, one file per tensor."""
    return _per_file_write_read(
        tensors,
        workdir,
        progress,
        save=lambda t, p: safetensors.torch.save_file({"t": t}, str(p)),
        load=_safetensors_load,
        suffix=".safetensors",
    )


def _tierstore_write_read(
    tensors: list[torch.Tensor],
    workdir: Path,
    progress: Progress,
    *,
    backend: str,
    compression: str,
    level: int = 1,
    io_workers: int = 4,
) -> _Measured:
    """The tierstore path, through the store's own movers (:class:`~tierstore.pipeline.Pipeline`).

    Write: every span is submitted at once, as forward would queue them;
    the pipeline frames them (zstd with byte shuffle when on) and writes
    them with ``io_workers`` requests in flight. Read: every record is
    submitted at once, as the prefetch window would, read back, checked
    against its header and decoded. A tensor's latency runs from its
    submission to the end of its I/O.
    """
    # Room for every record plus its header and a zstd frame that fails to
    # shrink incompressible bytes; the file backend grows only as it is used.
    capacity = sum(t.numel() * t.element_size() + _MIB for t in tensors) + 16 * _MIB
    config = TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget=capacity,
        disk_path=workdir,
        disk_backend=backend,
        compression=compression,
        compression_level=level,
        io_workers=io_workers,
    )
    pipe = Pipeline(config)
    try:
        pipe.open_backend()
        opened = pipe.backend_if_open
        assert opened is not None
        directory = opened.directory
        spans = [codec.to_span(t) for t in tensors]
        ended: dict[int, float] = {}

        def finish(key: int, nbytes: int) -> Callable[[Any], None]:
            def done(_: Any) -> None:
                ended[key] = time.perf_counter()
                progress.advance(nbytes)

            return done

        start = time.perf_counter()
        submitted = []
        writes = []
        for key, (span, _) in enumerate(spans):
            submitted.append(time.perf_counter())
            nbytes = span.numel() * span.element_size()
            writes.append(pipe.submit_write(key, span, finish(key, nbytes)))
        records = [w.result() for w in writes]
        files = _files_under(directory)
        _fsync(files)
        write_s = time.perf_counter() - start
        write_lat = [ended[k] - submitted[k] for k in range(len(spans))]
        stored = sum(len(r.header) + r.meta.payload_nbytes for r in records)
        _drop_cache(files)

        ended.clear()
        submitted.clear()
        start = time.perf_counter()
        reads = []
        for key, record in enumerate(records):
            submitted.append(time.perf_counter())
            future = pipe.submit_read(key, record)
            future.add_done_callback(finish(key, record.meta.raw_nbytes))
            reads.append(future)
        results = [
            codec.from_span(r.result(), layout) for r, (_, layout) in zip(reads, spans, strict=True)
        ]
        read_s = time.perf_counter() - start
        read_lat = [ended[k] - submitted[k] for k in range(len(records))]
    finally:
        pipe.close()
    return _Measured(write_s, read_s, write_lat, read_lat, stored, results)


def _rows(backends: Sequence[str], compressions: Sequence[str]) -> list[StorageRow]:
    rows = [StorageRow(name, "baseline", None, "none") for name in BASELINES]
    for backend in backends:
        for compression in compressions:
            name = backend if compression == "none" else f"{backend}+{compression}"
            rows.append(StorageRow(name, "tierstore", backend, compression))
    return rows


def _runner(row: StorageRow, level: int) -> _Runner:
    if row.name == "raw":
        return _raw_write_read
    if row.name == "torch.save":
        return _torch_save_write_read
    if row.name == "safetensors":
        return _safetensors_write_read
    backend, compression = row.backend, row.compression
    assert backend is not None

    def run(tensors: list[torch.Tensor], workdir: Path, progress: Progress) -> _Measured:
        return _tierstore_write_read(
            tensors, workdir, progress, backend=backend, compression=compression, level=level
        )

    return run


def _verify(row: StorageRow, sources: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    if len(got) != len(sources):
        raise TierstoreError(
            f"tierstore: bench storage: {row.name} read {len(got)} tensors back, "
            f"wrote {len(sources)}"
        )
    for i, (src, out) in enumerate(zip(sources, got, strict=True)):
        if out.dtype != src.dtype or out.shape != src.shape or not torch.equal(out, src):
            raise TierstoreError(
                f"tierstore: bench storage: {row.name} read tensor {i} "
                f"({human_bytes(src.numel() * src.element_size())}) back different from "
                "what it wrote; its timings are void"
            )


def _targets(report_rows: Sequence[StorageRow]) -> list[dict[str, Any]]:
    # The issue-3 targets: compression off, write + read throughput.
    by_name = {r.name: r for r in report_rows}
    checks: list[tuple[str, str, str, float]] = [
        ("file", "raw", "vs_raw", 0.9),
        ("lmdb", "raw", "vs_raw", 0.7),
        ("file", "torch.save", "vs_torch_save", 2.0),
        ("lmdb", "torch.save", "vs_torch_save", 2.0),
    ]
    out = []
    for name, against, attr, target in checks:
        row = by_name.get(name)
        if row is None:
            continue
        value = getattr(row, attr)
        out.append(
            {
                "row": name,
                "against": against,
                "measure": "write+read GB/s",
                "ratio": value,
                "target": target,
                "met": value is not None and value >= target,
            }
        )
    return out


def bench_storage(
    *,
    total_bytes: int = 1 << 30,
    sizes: Sequence[int] = (16 * _MIB, 32 * _MIB, 64 * _MIB),
    directory: str | os.PathLike[str] | None = None,
    backends: Sequence[str] = BACKENDS,
    compressions: Sequence[str] = COMPRESSIONS,
    repeat: int = 3,
    level: int = 1,
    seed: int = 0,
    show_progress: bool = True,
) -> StorageReport:
    """Write and read the same tensors through each backend and each baseline, and check them.

    See the module docstring and ``NOTE [ Page cache in the storage
    benchmark ]`` for what is timed.

    Args:
        total_bytes: bytes written (and read) per row and repeat, at least.
        sizes: tensor sizes in bytes, cycled and shuffled until ``total_bytes``.
        directory: where the files go (a temporary directory is made inside
            and removed at the end); default: the system temp directory.
        backends: tierstore backends to run (``"file"``, ``"lmdb"``).
        compressions: compressions to run each backend with (``"none"``, ``"zstd"``).
        repeat: runs of every row, each repeat starting one row later; phase
            times are the medians.
        level: zstd level.
        seed: seed of the data and of the size order.
        show_progress: draw a progress bar on stderr.

    Returns:
        The rows, the settings, a description of the data, and the issue's
        target ratios.

    Raises:
        TierstoreError: a bad argument, not enough free disk, or a row read
            back bytes different from those it wrote.

    Example:
        >>> import tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 19], backends=["file"],
        ...                        compressions=["zstd"], directory=tempfile.mkdtemp(),
        ...                        show_progress=False)
        >>> row = report.row("file+zstd")
        >>> row.verified, row.compression_ratio > 1, row.vs_raw > 0
        (True, True, True)
    """
    for name in backends:
        if name not in BACKENDS:
            raise TierstoreError(
                f"tierstore: bench storage: backend {name!r} is unknown; expected some of "
                f"{', '.join(BACKENDS)}"
            )
    for name in compressions:
        if name not in COMPRESSIONS:
            raise TierstoreError(
                f"tierstore: bench storage: compression {name!r} is unknown; expected some of "
                f"{', '.join(COMPRESSIONS)}"
            )
    if total_bytes <= 0 or repeat < 1 or not sizes or any(s < 4 for s in sizes):
        raise TierstoreError(
            f"tierstore: bench storage: total={total_bytes}, sizes={list(sizes)}, "
            f"repeat={repeat}; expected a positive total, sizes of at least 4 bytes, "
            "and repeat >= 1"
        )
    root = Path(directory if directory is not None else tempfile.gettempdir()).absolute()
    if not root.is_dir():
        raise TierstoreError(f"tierstore: bench storage: --dir {root} is not a directory")
    # float32 elements: sizes round down to a multiple of 4 bytes.
    sizes = [s - s % 4 for s in sizes]
    order = _tensor_sizes(total_bytes, sizes, seed)
    total = sum(order)
    # The largest row at rest: LMDB may grow its file past the data (NOTE
    # [ LMDB map size ]); one row's files exist at a time.
    free = shutil.disk_usage(root).free
    if free < 2 * total + 64 * _MIB:
        raise TierstoreError(
            f"tierstore: bench storage: {human_bytes(free)} free in {root}, but a row needs up "
            f"to {human_bytes(2 * total)}; lower --total or choose another --dir"
        )

    tensors = _activations(order, seed)
    rows = _rows(backends, compressions)
    measured: dict[str, list[_Measured]] = {r.name: [] for r in rows}
    workdir = make_scratch_dir("tierstore-bench-", root)
    try:
        with Progress(2 * total * len(rows) * repeat, enabled=show_progress) as progress:
            # The first gigabyte written in a process runs slower on some
            # machines (page allocator, host cache); an untimed pass takes it.
            with progress.phase("warm-up pass (untimed)"):
                warm = workdir / "warm-up"
                warm.mkdir()
                _raw_write_read(tensors, warm, Progress(0, enabled=False))
                shutil.rmtree(warm)
            for r in range(repeat):
                # Each repeat starts one row later: a row that follows a heavy
                # writer (the host flushing its cache) is not always the same.
                for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                    rowdir = workdir / row.name.replace("+", "-")
                    rowdir.mkdir()
                    suffix = f" (repeat {r + 1}/{repeat})" if repeat > 1 else ""
                    with progress.phase(f"{row.name}{suffix}"):
                        m = _runner(row, level)(tensors, rowdir, progress)
                    _verify(row, tensors, m.results)
                    m.results = []  # free the read-back copies before the next row
                    measured[row.name].append(m)
                    shutil.rmtree(rowdir)
    finally:
        remove_scratch_dir(workdir)

    for row in rows:
        runs = measured[row.name]
        row.bytes = total
        row.verified = True
        row.stored_bytes = runs[0].stored_bytes
        if row.compression != "none":
            row.compression_ratio = total / row.stored_bytes
        row.runs = [{"write_s": m.write_s, "read_s": m.read_s} for m in runs]
        row.write_s = median([m.write_s for m in runs])
        row.read_s = median([m.read_s for m in runs])
        row.write_gbps = total / row.write_s / 1e9
        row.read_gbps = total / row.read_s / 1e9
        row.write_read_gbps = 2 * total / (row.write_s + row.read_s) / 1e9
        write_lat = [x for m in runs for x in m.write_latency_s]
        read_lat = [x for m in runs for x in m.read_latency_s]
        row.write_p50_ms = percentile(write_lat, 50) * 1e3
        row.write_p99_ms = percentile(write_lat, 99) * 1e3
        row.read_p50_ms = percentile(read_lat, 50) * 1e3
        row.read_p99_ms = percentile(read_lat, 99) * 1e3
    raw = next(r for r in rows if r.name == "raw")
    ts = next(r for r in rows if r.name == "torch.save")
    for row in rows:
        row.vs_raw = row.write_read_gbps / raw.write_read_gbps
        row.vs_torch_save = row.write_read_gbps / ts.write_read_gbps

    settings = {
        "total_bytes": total_bytes,
        "sizes_bytes": list(sizes),
        "directory": str(root),
        "backends": list(backends),
        "compressions": list(compressions),
        "repeat": repeat,
        "zstd_level": level,
        "seed": seed,
    }
    data = {
        "tensors": len(order),
        "bytes": total,
        "dtype": "float32",
        "values": "gelu(randn), fresh per run (seeded)",
        "sizes_in_order_bytes": order,
        "timing": (
            "write phase: every write, then fsync of every file written (timed); "
            "then POSIX_FADV_DONTNEED on those files (untimed); read phase: every read; "
            "results checked with torch.equal after the phase (untimed)"
        ),
        "units": "GB/s = 1e9 tensor bytes per second; write+read = 2*bytes/(write_s+read_s)",
    }
    checksums = _bench_checksums(tensors, repeat)
    file_row = next((r for r in rows if r.name == "file"), None)
    for c in checksums:
        if c.gbps is not None and file_row is not None:
            c.vs_file_row = (2 * total / (c.gbps * 1e9)) / (file_row.write_s + file_row.read_s)
    return StorageReport(
        rows=rows, settings=settings, targets=_targets(rows), data=data, checksums=checksums
    )


def format_storage(report: StorageReport) -> str:
    """The results table, then the issue's target ratios, as text.

    Example:
        >>> import tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 20], backends=["file"],
        ...                        compressions=["none"], directory=tempfile.mkdtemp(),
        ...                        show_progress=False)
        >>> print(format_storage(report))  # doctest: +ELLIPSIS
        row          write GB/s  read GB/s  write+read GB/s  ...
        ...
        file: write+read 0... raw (target >= 0.9x: ...)
        ...
    """
    headers = [
        "row",
        "write GB/s",
        "read GB/s",
        "write+read GB/s",
        "vs raw",
        "vs torch.save",
        "write p50/p99 ms",
        "read p50/p99 ms",
        "zstd ratio",
    ]
    cells = []
    for r in report.rows:
        cells.append(
            [
                r.name,
                f"{r.write_gbps:.3f}",
                f"{r.read_gbps:.3f}",
                f"{r.write_read_gbps:.3f}",
                fmt_ratio(r.vs_raw),
                fmt_ratio(r.vs_torch_save),
                f"{r.write_p50_ms:.1f}/{r.write_p99_ms:.1f}",
                f"{r.read_p50_ms:.1f}/{r.read_p99_ms:.1f}",
                f"{r.compression_ratio:.3f}" if r.compression_ratio is not None else NA,
            ]
        )
    lines = [format_table(headers, cells)]
    if report.targets and report.data["bytes"] < 1 << 30:
        lines.append(
            f"(the targets below are for >= 1 GiB per row; this run wrote "
            f"{human_bytes(report.data['bytes'])})"
        )
    for t in report.targets:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(
            f"{t['row']}: write+read {fmt_ratio(t['ratio'])} {t['against']} "
            f"(target >= {t['target']:g}x: {verdict})"
        )
    if report.checksums:
        parts = []
        for c in report.checksums:
            if c.gbps is None:
                parts.append(f"{c.name} not installed")
                continue
            part = f"{c.name}{' (used)' * c.used} {c.gbps:.1f} GB/s"
            if c.vs_file_row is not None:
                part += f", {c.vs_file_row:.1%} of file's write+read"
            parts.append(part)
        lines.append("record checksums, in memory, one thread: " + "; ".join(parts))
    return "\n".join(lines)


def _describe(report: StorageReport, info: dict[str, Any]) -> str:
    data = report.data
    sizes = "/".join(human_bytes(s) for s in report.settings["sizes_bytes"])
    where = report.settings["directory"]
    if info.get("filesystem"):
        where += f" ({info['filesystem']} on {info['device']})"
    repeat = report.settings["repeat"]
    return (
        f"tierstore bench storage: {human_bytes(data['bytes'])} per row in {data['tensors']} "
        f"float32 tensors of {sizes} (gelu(randn)), {repeat} repeat{'s' * (repeat > 1)}, "
        f"into {where}; torch {torch.__version__}\n"
        "every read checked with torch.equal; writes end with fsync (timed); page cache "
        "dropped (POSIX_FADV_DONTNEED) before reads; GB/s = 1e9 tensor bytes/s, per phase;\n"
        "vs raw, vs torch.save = write+read GB/s over that row's; "
        "p50/p99 ms = one tensor's write or read time, median and 99th percentile over every "
        "tensor of every repeat: the baselines time each call alone, one after another; "
        "file and lmdb from a tensor's submission (all at once, as forward queues them) to the "
        "end of its I/O, so waiting in the queue counts; zstd ratio = tensor bytes / stored bytes"
    )


def plot_storage(report: StorageReport, path: str | os.PathLike[str]) -> None:
    """Bar chart of write, read and write+read GB/s per row, baselines first, as a PNG.

    Raises:
        TierstoreError: matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 20], backends=["file"],
        ...                        compressions=["none"], directory=tempfile.mkdtemp(),
        ...                        show_progress=False)
        >>> png = os.path.join(tempfile.mkdtemp(), "storage.png")
        >>> plot_storage(report, png)  # doctest: +SKIP
    """
    plt = load_pyplot()
    names = [r.name for r in report.rows]
    series = [
        ("write", [r.write_gbps for r in report.rows]),
        ("read", [r.read_gbps for r in report.rows]),
        ("write+read", [r.write_read_gbps for r in report.rows]),
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.5))
    width = 0.27
    handles = []
    for i, (label, values) in enumerate(series):
        xs = [x + (i - 1) * width for x in range(len(names))]
        bars = ax.bar(xs, values, width)
        for bar, row in zip(bars, report.rows, strict=True):
            if row.kind == "baseline":
                bar.set_hatch("//")
        # Legend swatches without the baselines' hatching.
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=bars[0].get_facecolor(), label=label))
    raw = report.row("raw")
    if raw is not None:
        ax.axhline(raw.write_read_gbps, color="grey", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, raw.write_read_gbps, " raw write+read", va="bottom", ha="right")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("GB/s (tensor bytes)")
    ax.set_title(
        f"tierstore bench storage: {human_bytes(report.data['bytes'])}, "
        "hatched = baselines, page cache dropped before reads"
    )
    ax.legend(handles=handles)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench storage``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--total", "8MiB"]).total
        '8MiB'
    """
    parser.add_argument("--total", default="1GiB", help="bytes per row and repeat (default 1GiB)")
    parser.add_argument(
        "--sizes",
        default="16MiB,32MiB,64MiB",
        help="tensor sizes, comma-separated, mixed in a shuffled order (default 16MiB,32MiB,64MiB)",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where to write (default: the system temp dir); pick the disk you will spill to",
    )
    parser.add_argument(
        "--backends", default="file,lmdb", help="tierstore backends (default file,lmdb)"
    )
    parser.add_argument(
        "--compression", default="none,zstd", help="compressions per backend (default none,zstd)"
    )
    parser.add_argument("--zstd-level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of every row; median times (default 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cuda: also time device <-> host copies through the pinned pool (default cpu)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a bar chart (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore bench storage`` with parsed options; print the table; 0 on success.

    Example:
        >>> import argparse, tempfile
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> args = p.parse_args(["--total", "1MiB", "--sizes", "1MiB", "--backends", "file",
        ...                      "--compression", "none", "--quiet", "--dir", tempfile.mkdtemp()])
        >>> run(args)  # doctest: +ELLIPSIS
        tierstore bench storage: 1.0 MiB per row ...
        0
    """
    if args.plot:
        load_pyplot()  # fail before the benchmark runs, not after
    if args.device not in ("cpu", "cuda"):
        raise TierstoreError(f"tierstore: bench storage: --device {args.device} is not cpu or cuda")
    info = machine_info(Path(args.dir or tempfile.gettempdir()).absolute())
    copies = []
    if args.device == "cuda":
        copies = bench_copies(
            parse_size(args.total, "--total"),
            [parse_size(s, "--sizes") for s in _csv(args.sizes)],
            repeat=args.repeat,
        )
        info["gpu"] = torch.cuda.get_device_name()
    report = bench_storage(
        total_bytes=parse_size(args.total, "--total"),
        sizes=[parse_size(s, "--sizes") for s in _csv(args.sizes)],
        directory=args.dir,
        backends=_csv(args.backends),
        compressions=_csv(args.compression),
        repeat=args.repeat,
        level=args.zstd_level,
        seed=args.seed,
        show_progress=not args.quiet,
    )
    if hasattr(os, "getloadavg"):
        info["loadavg_after_1_5_15min"] = list(os.getloadavg())
    print(_describe(report, info))
    print()
    print(format_storage(report))
    if copies:
        print()
        print("device <-> host copies of the same tensors (GPU: " + info["gpu"] + ")")
        print(format_copies(copies))
    if args.json:
        results = {**report.as_dict(), "copies": [asdict(c) for c in copies]}
        write_results(args, "storage", info, results)
    if args.plot:
        plot_storage(report, args.plot)
        print(f"plot: {args.plot}")
    return 0
