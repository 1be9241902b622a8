"""``tierstore bench storage``: disk backends against the baselines a user would compare with.

Every row writes the same tensors into the same directory, then reads them
back and checks each against what it wrote (``torch.equal``): a benchmark
checks the result it timed. Rows (``tierstore/bench/storage_rows.py``):

* ``raw``: the least any store must do, the way the ``file`` backend does
  it: one file, aligned offsets, ``O_DIRECT`` where the ``file`` backend
  uses it, the same requests in flight (``NOTE [ The raw baseline's access
  pattern ]``);
* ``raw-buffered`` (where ``raw`` is ``O_DIRECT``): the same through the
  page cache, the path LMDB, ``torch.save`` and safetensors are bound to;
* ``torch.save``: ``torch.save`` / ``torch.load(weights_only=True)``, one file
  per tensor;
* ``safetensors``: ``save_file`` / ``load_file``, one file per tensor;
* ``file``, ``lmdb`` (each also ``+zstd``): tierstore's codec and disk
  backends, through the store's movers.

Below the rows: where the ``lmdb`` backend's write time goes
(``NOTE [ LMDB's write path ]`` in ``tierstore/bench/lmdb_path.py``), and the
checksums a record could carry (NOTE [ Record integrity ] in
``tierstore/codec.py``) hashed over the same tensors in memory: xxh3, which
the store uses, against zlib's crc32 and, where the ``crc32c`` package is
installed, crc32c; with the share of the ``file`` row's write+read time that
hashing every byte on the way out and on the way back in would cost.

NOTE [ Steady state and first touch ]
A training run keeps one store for thousands of steps, and every step
writes into the space the previous step's entries freed: a backend's rate
from the second step on is the one a user sees. The first write into new
space is another matter: LMDB growing its map writes at a fraction of its
rate into pages it has freed, and buffered writes into fallocated, never
written blocks run at a fraction of the rate of writes over written ones,
where ``O_DIRECT`` loses far less. So each row is measured both ways:

* ``steady`` (the headline, and what the targets judge): one store per row,
  kept for the whole run (``raw``: one file). Its first pass is untimed.
  Every timed pass first frees what the previous pass wrote, newest first,
  as backward does (timed on its own: ``free``), then writes and reads the
  same volume again;
* ``first-touch``: a fresh store for every pass, as a store's first step.

Each repeat runs every row's steady pass and every row's first-touch pass,
the rows in a new (seeded) order each repeat and the two phases in
alternating order, so that the drift of a shared machine hits every row
alike and no row always runs right after the same other one. Figures are
the median over the repeats with the spread (smallest and largest); ``vs
raw`` and ``vs torch.save`` divide a row's write+read by that baseline's in
the same repeat and phase (measured seconds apart), then take the median of
those ratios.

NOTE [ Judging against a noisy baseline ]
A ratio is only as good as its denominator. Each target says, besides met or
missed, whether the baseline's own write+read varied across the repeats
(``(max - min) / median``) by more than the distance between the ratio and
the target (``|ratio / target - 1|``): then that verdict is within the
baseline's noise and says so, whichever way it went.

NOTE [ Page cache in the storage benchmark ]
The machine usually has more RAM than the benchmark writes, so without care
every read would come from the page cache and every write would end in it.
For every row alike: the timed write phase ends with ``fsync`` of every file
the row wrote (the bytes are on the device when the clock stops), and before
the read phase the files' pages are dropped (untimed: ``NOTE [ Dropping
LMDB's mapped pages ]``), so reads come from the device where the kernel
honours the advice (Linux does for clean pages that nothing maps); the share
of the files still resident when the reads began is reported per row.
Creating a store (opening the LMDB environment, preallocating the ``raw``
file) is not timed: a store does it once, not per tensor; the ``file``
backend's file grows on demand during its first timed writes (a few
fallocate calls: NOTE [ File backend growth ]). Files a baseline creates
per tensor are part of its cost. Where the steady state does not run, an
untimed ``raw`` pass runs first: the first gigabyte a process writes can
be several times slower than the next, and no row should pay that for
coming first.

NOTE [ Benchmark data ]
Fresh random data, not zeros (zstd would compress zeros to nothing): each
tensor is ``gelu(randn)`` in float32, which looks like the activations a
training step saves (half the values near zero, the rest Gaussian), so the
``zstd`` rows show a realistic compression ratio. Throughput always counts
the tensors' bytes, not the compressed ones. Every pass writes the same
sizes in the same order, as every training step does, but not the same
bytes at the same place: each position takes the next tensor of its size
at each pass (:func:`_pass_order`), so a store that handed back the
previous pass's record would fail the check.

Example:
    >>> import tempfile
    >>> from tierstore.bench.storage import bench_storage
    >>> report = bench_storage(total_bytes=2 << 20, sizes=[1 << 20], repeat=1,
    ...                        directory=tempfile.mkdtemp(), show_progress=False)
    >>> [row.name for row in report.rows if row.name != "raw-buffered"]
    ['raw', 'torch.save', 'safetensors', 'file', 'file+zstd', 'lmdb', 'lmdb+zstd']
    >>> all(r.verified and r.steady.write_read_gbps.min > 0 for r in report.rows)
    True
    >>> all(r.first_touch.write_read_gbps.min > 0 for r in report.rows)
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

import torch
import torch.nn.functional as F
from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstore import codec
from tierstore.bench.copies import bench_copies, format_copies
from tierstore.bench.lmdb_path import (
    STEPS,
    LmdbWritePass,
    LmdbWritePath,
    LmdbWriteSummary,
    summarize,
)
from tierstore.bench.report import (
    NA,
    Progress,
    Report,
    fmt_ratio,
    format_table,
    load_pyplot,
    machine_info,
    percentile,
    write_results,
)
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.bench.storage_rows import (
    IO_WORKERS,
    PassTimes,
    Session,
    Spread,
    direct_io_supported,
    open_session,
)
from tierstore.config import human_bytes
from tierstore.errors import TierstoreError

__all__ = [
    "BACKENDS",
    "COMPRESSIONS",
    "PHASES",
    "ChecksumRow",
    "PhaseFigures",
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
#: The phases, headline first: NOTE [ Steady state and first touch ].
PHASES = ("steady", "first-touch")
#: The baselines, in the order they print (``raw-buffered`` only where ``raw`` is direct).
BASELINES = ("raw", "raw-buffered", "torch.save", "safetensors")

_MIB = 1 << 20

_SIZE = TypeAdapter(ByteSize)

#: What each phase's table says it measured.
_PHASE_TITLES = {
    "steady": (
        "steady state: one store per row, kept for the run; each pass frees the previous "
        "pass's entries (free), then writes and reads again; its first pass untimed"
    ),
    "first-touch": "first touch: a fresh store for every pass, writing into new space",
}

#: (row, baseline, target): write+read ratios the steady state is judged on.
_TARGETS: tuple[tuple[str, str, float], ...] = (
    ("file", "raw", 0.95),
    ("lmdb", "raw", 0.8),
    ("file", "torch.save", 2.0),
    ("lmdb", "torch.save", 2.0),
)


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
class PhaseFigures:
    """One row's figures in one phase, over the repeats: NOTE [ Steady state and first touch ].

    Throughputs are GB/s (10^9 tensor bytes per second; compressed rows count
    the uncompressed bytes), one value per repeat, as a :class:`Spread`
    (min / median / max). ``write_read_gbps`` is both phases' bytes over
    both phases' time: ``2 * bytes / (write_s + read_s)``. ``vs_raw`` and
    ``vs_torch_save`` are that figure over the baseline's in the same
    repeat. ``free_ms``: freeing the previous pass's entries (0 on first
    touch). Latency percentiles pool the per-tensor times of every repeat.
    ``resident_before_read``: the largest share of the row's file pages
    still in the page cache when a read phase began.

    Example:
        >>> s = Spread(1.0, 1.0, 1.0)
        >>> PhaseFigures("steady", 3, s, s, s, s, s, s, s).write_read_gbps.median
        1.0
    """

    phase: str
    repeats: int
    write_s: Spread
    read_s: Spread
    free_ms: Spread
    write_gbps: Spread
    read_gbps: Spread
    write_read_gbps: Spread
    vs_raw: Spread | None = None
    vs_torch_save: Spread | None = None
    write_p50_ms: float = 0.0
    write_p99_ms: float = 0.0
    read_p50_ms: float = 0.0
    read_p99_ms: float = 0.0
    resident_before_read: float = 0.0
    runs: list[dict[str, float]] = field(default_factory=list)


@dataclass
class StorageRow:
    """One row of the storage benchmark: its store, and its figures in each phase it ran.

    ``io_path``: ``"O_DIRECT"`` or ``"buffered"`` (through the page cache).
    ``steady`` / ``first_touch``: :class:`PhaseFigures`, ``None`` where that
    phase did not run.

    Example:
        >>> StorageRow("raw", "baseline", None, "none").kind
        'baseline'
    """

    name: str
    kind: str
    backend: str | None
    compression: str
    io_path: str = ""
    bytes: int = 0
    stored_bytes: int = 0
    compression_ratio: float | None = None
    verified: bool = False
    steady: PhaseFigures | None = None
    first_touch: PhaseFigures | None = None

    def phase(self, name: str) -> PhaseFigures | None:
        """The figures of phase ``name`` (``"steady"``, ``"first-touch"``), if it ran."""
        return self.steady if name == "steady" else self.first_touch

    @property
    def headline(self) -> PhaseFigures:
        """The steady state's figures where it ran, else first touch's."""
        figures = self.steady or self.first_touch
        if figures is None:
            raise ValueError(f"row {self.name} has no figures yet")
        return figures


@dataclass
class ChecksumRow:
    """One checksum's in-memory throughput over the benchmark's tensors (one thread).

    ``gbps`` is ``None`` when the checksum's package is not installed.
    ``vs_file_row`` is the time hashing every byte twice (on write and on
    read) takes, as a share of the ``file`` row's median write+read time in
    the headline phase.

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

    ``lmdb_write_path``: where the ``lmdb`` backend's write time goes in the
    steady state (``NOTE [ LMDB's write path ]``), where that row ran.

    Example:
        >>> StorageReport(rows=[], settings={}, targets=[], data={}).as_dict()["rows"]
        []
    """

    data: dict[str, Any]
    checksums: list[ChecksumRow] = field(default_factory=list)
    lmdb_write_path: LmdbWriteSummary | None = None

    @property
    def phases(self) -> list[str]:
        """The phases that ran, headline first."""
        return [p for p in PHASES if p in self.settings.get("phases", [])]


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


def _pass_order(sizes: Sequence[int], index: int) -> list[int]:
    """Which tensor each position writes at pass ``index``: NOTE [ Benchmark data ].

    Position ``i`` keeps its size; among the positions of one size, pass
    ``index`` shifts the tensors by ``index``, so that where a size has more
    than one tensor, no position writes what it wrote the pass before.

    Example:
        >>> _pass_order([16, 32, 16, 16], 0), _pass_order([16, 32, 16, 16], 1)
        ([0, 1, 2, 3], [2, 1, 3, 0])
    """
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(n, []).append(i)
    out = list(range(len(sizes)))
    for positions in by_size.values():
        for j, i in enumerate(positions):
            out[i] = positions[(j + index) % len(positions)]
    return out


def _rows(backends: Sequence[str], compressions: Sequence[str], direct: bool) -> list[StorageRow]:
    rows = []
    for name in BASELINES:
        if name == "raw-buffered" and not direct:
            continue  # raw itself is buffered then
        io_path = "O_DIRECT" if name == "raw" and direct else "buffered"
        rows.append(StorageRow(name, "baseline", None, "none", io_path))
    for backend in backends:
        for compression in compressions:
            name = backend if compression == "none" else f"{backend}+{compression}"
            rows.append(StorageRow(name, "tierstore", backend, compression))
    return rows


def _open(
    row: StorageRow, workdir: Path, tensors: Sequence[torch.Tensor], direct: bool, level: int
) -> Session:
    session = open_session(
        row.name,
        workdir,
        tensors,
        direct=direct,
        backend=row.backend,
        compression=row.compression,
        level=level,
    )
    row.io_path = session.io_path
    return session


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


def _paired(passes: list[PassTimes], baseline: list[PassTimes] | None, total: int) -> Spread | None:
    # Each repeat's ratio to the baseline's pass of the same repeat and phase.
    if not baseline:
        return None
    return Spread.of(
        [
            p.write_read_gbps(total) / b.write_read_gbps(total)
            for p, b in zip(passes, baseline, strict=True)
        ]
    )


def _figures(
    phase: str, passes: list[PassTimes], total: int, by_name: dict[str, list[PassTimes]]
) -> PhaseFigures:
    write_lat = [x for m in passes for x in m.write_latency_s]
    read_lat = [x for m in passes for x in m.read_latency_s]
    return PhaseFigures(
        phase=phase,
        repeats=len(passes),
        write_s=Spread.of([m.write_s for m in passes]),
        read_s=Spread.of([m.read_s for m in passes]),
        free_ms=Spread.of([m.free_s * 1e3 for m in passes]),
        write_gbps=Spread.of([total / m.write_s / 1e9 for m in passes]),
        read_gbps=Spread.of([total / m.read_s / 1e9 for m in passes]),
        write_read_gbps=Spread.of([m.write_read_gbps(total) for m in passes]),
        vs_raw=_paired(passes, by_name.get("raw"), total),
        vs_torch_save=_paired(passes, by_name.get("torch.save"), total),
        write_p50_ms=percentile(write_lat, 50) * 1e3,
        write_p99_ms=percentile(write_lat, 99) * 1e3,
        read_p50_ms=percentile(read_lat, 50) * 1e3,
        read_p99_ms=percentile(read_lat, 99) * 1e3,
        resident_before_read=max(m.resident_share for m in passes),
        runs=[{"free_s": m.free_s, "write_s": m.write_s, "read_s": m.read_s} for m in passes],
    )


def _targets(rows: Sequence[StorageRow], phase: str) -> list[dict[str, Any]]:
    """Each target's ratio in ``phase``, met or not, and whether the verdict is within noise.

    See ``NOTE [ Judging against a noisy baseline ]``.
    """
    by_name = {r.name: r for r in rows}
    out = []
    for name, against, target in _TARGETS:
        row, base = by_name.get(name), by_name.get(against)
        figures = row.phase(phase) if row is not None else None
        base_figures = base.phase(phase) if base is not None else None
        if figures is None or base_figures is None:
            continue
        ratio = figures.vs_raw if against == "raw" else figures.vs_torch_save
        assert ratio is not None
        spread = base_figures.write_read_gbps.width
        margin = ratio.median / target - 1
        out.append(
            {
                "row": name,
                "against": against,
                "phase": phase,
                "measure": "write+read GB/s",
                "ratio": ratio.median,
                "ratio_min": ratio.min,
                "ratio_max": ratio.max,
                "target": target,
                "met": ratio.median >= target,
                "baseline_spread": spread,
                "margin": margin,
                "within_baseline_noise": spread > abs(margin),
            }
        )
    return out


def _lmdb_bound(rows: Sequence[StorageRow], phase: str) -> dict[str, Any] | None:
    # The page-cache path an LMDB store writes and reads through, without
    # LMDB's own work: raw-buffered, against raw (NOTE [ LMDB's write path ]).
    by_name = {r.name: r for r in rows}
    buffered = by_name.get("raw-buffered")
    figures = buffered.phase(phase) if buffered is not None else None
    if figures is None or figures.vs_raw is None:
        return None
    return {"row": "raw-buffered", "phase": phase, "vs_raw": asdict(figures.vs_raw)}


def _check_arguments(
    *,
    backends: Sequence[str],
    compressions: Sequence[str],
    phases: Sequence[str],
    total_bytes: int,
    sizes: Sequence[int],
    repeat: int,
) -> None:
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
    if not phases or any(p not in PHASES for p in phases):
        raise TierstoreError(
            f"tierstore: bench storage: --phases {','.join(phases)!r} is not a list of "
            f"phases; expected some of {', '.join(PHASES)}"
        )
    if total_bytes <= 0 or repeat < 1 or not sizes or any(s < 4 for s in sizes):
        raise TierstoreError(
            f"tierstore: bench storage: total={total_bytes}, sizes={list(sizes)}, "
            f"repeat={repeat}; expected a positive total, sizes of at least 4 bytes, "
            "and repeat >= 1"
        )


class _Run:
    """One benchmark run: the rows' steady sessions, and every pass each row ran."""

    def __init__(
        self,
        rows: list[StorageRow],
        tensors: list[torch.Tensor],
        workdir: Path,
        *,
        direct: bool,
        level: int,
        seed: int,
        progress: Progress,
    ) -> None:
        self.rows = rows
        self.seed = seed
        self.tensors = tensors
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.workdir = workdir
        self.direct = direct
        self.level = level
        self.progress = progress
        self.passes: dict[str, dict[str, list[PassTimes]]] = {p: {} for p in PHASES}
        self.steady: dict[str, Session] = {}
        self.lmdb_probe: LmdbWritePath | None = None
        self.lmdb_passes: list[LmdbWritePass] = []
        self._fresh = 0

    def _pass_tensors(self, index: int) -> list[torch.Tensor]:
        return [self.tensors[i] for i in _pass_order(self.sizes, index)]

    def _run(self, row: StorageRow, session: Session, label: str) -> PassTimes:
        # The store's own pass count: its passes one after the other differ.
        tensors = self._pass_tensors(session.passes)
        with self.progress.phase(label):
            m = session.run_pass(tensors, self.progress)
        _verify(row, tensors, m.results)
        m.results = []  # free the read-back copies before the next row
        row.stored_bytes = m.stored_bytes
        return m

    def open_steady(self, with_lmdb_probe: bool) -> None:
        """Open every row's steady store and run its untimed first pass."""
        base = self.workdir / "steady"
        base.mkdir()
        for row in self.rows:
            session = _open(row, base / _dirname(row), self.tensors, self.direct, self.level)
            self.steady[row.name] = session
            self._run(row, session, f"{row.name} steady: first pass (untimed)")
        if with_lmdb_probe:
            self.lmdb_probe = LmdbWritePath(base / "lmdb-write-path", self.tensors)
            with self.progress.phase("lmdb write path: first pass (untimed)"):
                self.lmdb_probe.run_pass(self._pass_tensors(0))

    def warm_up(self) -> None:
        """An untimed ``raw`` pass in a fresh file: NOTE [ Page cache in the storage benchmark ]."""
        raw = StorageRow("raw", "baseline", None, "none")
        session = _open(raw, self.workdir / "warm-up", self.tensors, self.direct, self.level)
        try:
            self._run(raw, session, "warm-up pass (untimed)")
        finally:
            session.close()

    def repeat(self, index: int, total: int, phases: Sequence[str]) -> None:
        """Repeat ``index``: every row in every phase, rows shuffled and phases alternated.

        A new order of the rows each repeat (seeded): no row always runs
        right after the same other one (NOTE [ Steady state and first touch ]).
        """
        order = list(self.rows)
        random.Random(self.seed * 7919 + index).shuffle(order)
        suffix = f" {index + 1}/{total}"
        for phase in phases if index % 2 == 0 else list(reversed(phases)):
            for row in order:
                if phase == "steady":
                    m = self._run(row, self.steady[row.name], f"{row.name} steady{suffix}")
                    if row.name == "lmdb" and self.lmdb_probe is not None:
                        tensors = self._pass_tensors(index + 1)
                        with self.progress.phase(f"lmdb write path{suffix}"):
                            self.lmdb_passes.append(self.lmdb_probe.run_pass(tensors))
                else:
                    self._fresh += 1
                    workdir = self.workdir / f"fresh-{self._fresh}-{_dirname(row)}"
                    session = _open(row, workdir, self.tensors, self.direct, self.level)
                    try:
                        m = self._run(row, session, f"{row.name} first touch{suffix}")
                    finally:
                        session.close()
                self.passes[phase].setdefault(row.name, []).append(m)

    def close(self) -> None:
        """Close every steady store (each close is idempotent)."""
        for session in self.steady.values():
            session.close()
        if self.lmdb_probe is not None:
            self.lmdb_probe.close()


def _disk_needed(rows: Sequence[StorageRow], total: int, *, steady: bool, probe: bool) -> int:
    """The most disk a run holds at once: every steady store, and one fresh one.

    A baseline's file holds the data; a tierstore store up to twice as much
    (the ``file`` backend grows by doubling: NOTE [ File backend growth ];
    LMDB's file may grow past the data: NOTE [ LMDB map size ]), as does
    the ``lmdb`` write path's environment.

    Example:
        >>> rows = [StorageRow("raw", "baseline", None, "none"),
        ...         StorageRow("file", "tierstore", "file", "none")]
        >>> _disk_needed(rows, 100, steady=True, probe=False) == 100 + 200 + 200 + 64 * _MIB
        True
    """
    per_row = [total if r.kind == "baseline" else 2 * total for r in rows]
    held = (sum(per_row) + 2 * total * probe) if steady else 0
    return held + max(per_row) + 64 * _MIB


def _dirname(row: StorageRow) -> str:
    return row.name.replace("+", "-")


def bench_storage(
    *,
    total_bytes: int = 1 << 30,
    sizes: Sequence[int] = (16 * _MIB, 32 * _MIB, 64 * _MIB),
    directory: str | os.PathLike[str] | None = None,
    backends: Sequence[str] = BACKENDS,
    compressions: Sequence[str] = COMPRESSIONS,
    phases: Sequence[str] = PHASES,
    repeat: int = 5,
    level: int = 1,
    seed: int = 0,
    show_progress: bool = True,
) -> StorageReport:
    """Write and read the same tensors through each backend and each baseline, and check them.

    See the module docstring, ``NOTE [ Steady state and first touch ]`` and
    ``NOTE [ Page cache in the storage benchmark ]`` for what is timed.

    Args:
        total_bytes: bytes written (and read) per row and pass, at least.
        sizes: tensor sizes in bytes, cycled and shuffled until ``total_bytes``.
        directory: where the files go (a temporary directory is made inside
            and removed at the end); default: the system temp directory.
        backends: tierstore backends to run (``"file"``, ``"lmdb"``).
        compressions: compressions to run each backend with (``"none"``, ``"zstd"``).
        phases: ``"steady"`` and/or ``"first-touch"``.
        repeat: timed passes of every row in every phase, the rows in a new
            order each repeat.
        level: zstd level.
        seed: seed of the data and of the size order.
        show_progress: draw a progress bar on stderr.

    Returns:
        The rows with their figures per phase, the settings, a description
        of the data, the targets (judged on the steady state where it ran),
        the ``lmdb`` write path and the checksums.

    Raises:
        TierstoreError: a bad argument, not enough free disk, or a row read
            back bytes different from those it wrote.

    Example:
        >>> import tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 19], backends=["file"],
        ...                        compressions=["zstd"], phases=["steady"], repeat=2,
        ...                        directory=tempfile.mkdtemp(), show_progress=False)
        >>> row = report.row("file+zstd")
        >>> row.verified, row.compression_ratio > 1, row.steady.vs_raw.median > 0
        (True, True, True)
        >>> row.first_touch is None, row.steady.repeats
        (True, 2)
    """
    _check_arguments(
        backends=backends,
        compressions=compressions,
        phases=phases,
        total_bytes=total_bytes,
        sizes=sizes,
        repeat=repeat,
    )
    phases = [p for p in PHASES if p in phases]  # the headline first, whatever the order given
    root = Path(directory if directory is not None else tempfile.gettempdir()).absolute()
    if not root.is_dir():
        raise TierstoreError(f"tierstore: bench storage: --dir {root} is not a directory")
    # float32 elements: sizes round down to a multiple of 4 bytes.
    sizes = [s - s % 4 for s in sizes]
    order = _tensor_sizes(total_bytes, sizes, seed)
    total = sum(order)

    workdir = make_scratch_dir("tierstore-bench-", root)
    try:
        direct = direct_io_supported(workdir)
        rows = _rows(backends, compressions, direct)
        probe = "steady" in phases and "lmdb" in backends and "none" in compressions
        need = _disk_needed(rows, total, steady="steady" in phases, probe=probe)
        free = shutil.disk_usage(root).free
        if free < need:
            raise TierstoreError(
                f"tierstore: bench storage: {human_bytes(free)} free in {root}, but the run "
                f"may hold up to {human_bytes(need)} there at once (the steady state keeps "
                "one store per row); lower --total, choose another --dir, or run "
                "--phases first-touch"
            )
        tensors = _activations(order, seed)
        passes_in_all = len(rows) * repeat * len(phases) + len(rows) * ("steady" in phases)
        progress = Progress(2 * total * passes_in_all, enabled=show_progress)
        run = _Run(rows, tensors, workdir, direct=direct, level=level, seed=seed, progress=progress)
        with progress:
            try:
                if "steady" in phases:
                    run.open_steady(with_lmdb_probe=probe)
                else:
                    run.warm_up()
                for r in range(repeat):
                    run.repeat(r, repeat, phases)
            finally:
                run.close()
    finally:
        remove_scratch_dir(workdir)

    for row in rows:
        row.bytes = total
        row.verified = True
        if row.compression != "none":
            row.compression_ratio = total / row.stored_bytes
        for phase in phases:
            figures = _figures(phase, run.passes[phase][row.name], total, run.passes[phase])
            if phase == "steady":
                row.steady = figures
            else:
                row.first_touch = figures

    headline = phases[0]
    settings = {
        "total_bytes": total_bytes,
        "sizes_bytes": list(sizes),
        "directory": str(root),
        "backends": list(backends),
        "compressions": list(compressions),
        "phases": list(phases),
        "repeat": repeat,
        "zstd_level": level,
        "seed": seed,
        "io_workers": IO_WORKERS,
    }
    data = {
        "tensors": len(order),
        "bytes": total,
        "dtype": "float32",
        "values": "gelu(randn), fresh per run (seeded); each pass rotates the tensors of one size",
        "sizes_in_order_bytes": order,
        "o_direct": direct,
        "timing": (
            "steady: one store per row for the run, first pass untimed, each timed pass frees "
            "the previous pass's entries (timed apart: free), then writes and reads; "
            "first-touch: a fresh store per pass; write phase: every write, then fsync of every "
            "file written (timed); then the files' pages unmapped and dropped from the page "
            "cache (untimed); read phase: every read; results checked with torch.equal after "
            "the phase (untimed); rows shuffle and phases alternate from repeat to repeat"
        ),
        "units": (
            "GB/s = 1e9 tensor bytes per second; write+read = 2*bytes/(write_s+read_s); "
            "spreads are min/median/max over the repeats; vs raw / vs torch.save = median of "
            "the per-repeat ratios"
        ),
    }
    checksums = _bench_checksums(tensors, repeat)
    file_row = next((r for r in rows if r.name == "file"), None)
    for c in checksums:
        if c.gbps is not None and file_row is not None:
            f = file_row.headline
            c.vs_file_row = (2 * total / (c.gbps * 1e9)) / (f.write_s.median + f.read_s.median)
    targets = _targets(rows, headline)
    bound = _lmdb_bound(rows, headline)
    for t in targets:
        if t["row"] == "lmdb" and t["against"] == "raw" and bound is not None:
            t["best_page_cache_path"] = bound
    lmdb_path = summarize(run.lmdb_passes) if run.lmdb_passes else None
    return StorageReport(
        rows=rows,
        settings=settings,
        targets=targets,
        data=data,
        checksums=checksums,
        lmdb_write_path=lmdb_path,
    )


def _spread_cell(s: Spread, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s.median)} [{fmt.format(s.min)}-{fmt.format(s.max)}]"


def _ratio_cell(s: Spread | None) -> str:
    if s is None:
        return NA
    return f"{fmt_ratio(s.median)} [{s.min:.2f}-{s.max:.2f}]"


def _phase_table(report: StorageReport, phase: str) -> str:
    headers = [
        "row",
        "I/O",
        "write GB/s",
        "read GB/s",
        "write+read GB/s",
        "vs raw",
        "vs torch.save",
        "free ms",
        "write p50/p99 ms",
        "read p50/p99 ms",
        "zstd ratio",
    ]
    cells = []
    for r in report.rows:
        f = r.phase(phase)
        if f is None:
            continue
        cells.append(
            [
                r.name,
                r.io_path,
                f"{f.write_gbps.median:.2f}",
                f"{f.read_gbps.median:.2f}",
                _spread_cell(f.write_read_gbps),
                _ratio_cell(f.vs_raw),
                fmt_ratio(f.vs_torch_save.median if f.vs_torch_save is not None else None),
                f"{f.free_ms.median:.1f}",
                f"{f.write_p50_ms:.1f}/{f.write_p99_ms:.1f}",
                f"{f.read_p50_ms:.1f}/{f.read_p99_ms:.1f}",
                f"{r.compression_ratio:.3f}" if r.compression_ratio is not None else NA,
            ]
        )
    return format_table(headers, cells)


def _target_lines(report: StorageReport) -> list[str]:
    lines = []
    for t in report.targets:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(
            f"{t['row']}: {t['phase']} write+read {fmt_ratio(t['ratio'])} {t['against']} "
            f"[{t['ratio_min']:.2f}-{t['ratio_max']:.2f}] (target >= {t['target']:g}x: {verdict})"
        )
        if t["within_baseline_noise"]:
            lines.append(
                f"  within the baseline's noise: {t['against']}'s own write+read varied by "
                f"{t['baseline_spread']:.0%} across the repeats (max-min over median), more "
                f"than the {abs(t['margin']):.0%} between this ratio and its target"
            )
        bound = t.get("best_page_cache_path")
        if bound is not None and not t["met"]:
            b = bound["vs_raw"]
            lines.append(
                f"  the best the page cache allows here: raw-buffered (the same bytes through "
                f"the page cache, no store) {b['median']:.2f}x raw [{b['min']:.2f}-"
                f"{b['max']:.2f}]; LMDB cannot write or read around the page cache"
            )
    return lines


def _lmdb_lines(s: LmdbWriteSummary) -> list[str]:
    lines = [
        f"lmdb write path, steady state ({s.passes} passes of {human_bytes(s.bytes)}, one "
        "writer, the lmdb backend's settings; seconds, median [min-max], share of the write):"
    ]
    cells = []
    for name, what in STEPS.items():
        share = f"{s.shares[name]:.0%}" if name in s.shares else "-"
        cells.append([name, _spread_cell(s.steps[name], "{:.3f}"), share, what])
    cells.append(["write", _spread_cell(s.write_s, "{:.3f}"), "100%", "join to sync"])
    lines.append(
        format_table(["step", "s", "share", "what"], cells, right=[False, True, True, False])
    )
    lines.append(
        f"write {_spread_cell(s.write_gbps)} GB/s, read back {_spread_cell(s.read_gbps)} GB/s; "
        f"the same bytes copied into reused memory (join) {_spread_cell(s.warm_copy_gbps)} GB/s, "
        f"into new memory (page faults) {_spread_cell(s.new_memory_copy_gbps)} GB/s; "
        f"put beyond one copy {_spread_cell(s.put_beyond_copy_s, '{:.3f}')} s; "
        f"data file {human_bytes(s.map_file_bytes)}"
    )
    return lines


def format_storage(report: StorageReport) -> str:
    """One table per phase, then the targets, the ``lmdb`` write path and the checksums, as text.

    Example:
        >>> import tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 20], backends=["file"],
        ...                        compressions=["none"], repeat=1,
        ...                        directory=tempfile.mkdtemp(), show_progress=False)
        >>> print(format_storage(report))  # doctest: +ELLIPSIS
        steady state: one store per row, ...
        row ... I/O ... write GB/s ... vs raw ...
        ...
        file: steady write+read ... raw [...] (target >= 0.95x: ...)
        ...
    """
    lines = []
    for phase in report.phases:
        lines.append(_PHASE_TITLES[phase])
        lines.append(_phase_table(report, phase))
        lines.append("")
    if report.targets and report.data["bytes"] < 1 << 30:
        lines.append(
            f"(the targets below are for >= 1 GiB per row; this run wrote "
            f"{human_bytes(report.data['bytes'])})"
        )
    lines += _target_lines(report)
    if report.lmdb_write_path is not None:
        lines.append("")
        lines += _lmdb_lines(report.lmdb_write_path)
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
        lines.append("")
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
        f"tierstore bench storage: {human_bytes(data['bytes'])} per row and pass in "
        f"{data['tensors']} float32 tensors of {sizes} (gelu(randn)), {repeat} "
        f"repeat{'s' * (repeat > 1)} of {' and '.join(report.phases)}, into {where}; "
        f"torch {torch.__version__}\n"
        "every read checked with torch.equal; writes end with fsync (timed); page cache "
        "dropped before reads; GB/s = 1e9 tensor bytes/s, per phase, median over the "
        "repeats, [min-max] where shown (every figure's spread is in the JSON);\n"
        "vs raw, vs torch.save = write+read GB/s over that row's in the same repeat, median "
        "[min-max]; free ms = freeing the previous pass's entries; "
        "p50/p99 ms = one tensor's write or read time, median and 99th percentile over every "
        "tensor of every repeat: torch.save and safetensors time each call alone, one after "
        "another; raw, file and lmdb from a tensor's submission (all at once, as forward "
        "queues them, 4 in flight) to the end of its I/O, so waiting in the queue counts; "
        "zstd ratio = tensor bytes / stored bytes"
    )


def plot_storage(report: StorageReport, path: str | os.PathLike[str]) -> None:
    """Bar chart of write, read and write+read GB/s per row in the headline phase, as a PNG.

    Bars are medians, whiskers the smallest and largest repeat; baselines hatched.

    Raises:
        TierstoreError: matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> report = bench_storage(total_bytes=1 << 20, sizes=[1 << 20], backends=["file"],
        ...                        compressions=["none"], directory=tempfile.mkdtemp(),
        ...                        repeat=1, show_progress=False)
        >>> png = os.path.join(tempfile.mkdtemp(), "storage.png")
        >>> plot_storage(report, png)  # doctest: +SKIP
    """
    plt = load_pyplot()
    names = [r.name for r in report.rows]
    figures = [r.headline for r in report.rows]
    series = [
        ("write", [f.write_gbps for f in figures]),
        ("read", [f.read_gbps for f in figures]),
        ("write+read", [f.write_read_gbps for f in figures]),
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)), 4.5))
    width = 0.27
    handles = []
    for i, (label, spreads) in enumerate(series):
        xs = [x + (i - 1) * width for x in range(len(names))]
        heights = [s.median for s in spreads]
        whiskers = [[s.median - s.min for s in spreads], [s.max - s.median for s in spreads]]
        bars = ax.bar(xs, heights, width, yerr=whiskers, capsize=2)
        for bar, row in zip(bars, report.rows, strict=True):
            if row.kind == "baseline":
                bar.set_hatch("//")
        # Legend swatches without the baselines' hatching.
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=bars[0].get_facecolor(), label=label))
    raw = report.row("raw")
    if raw is not None:
        level = raw.headline.write_read_gbps.median
        ax.axhline(level, color="grey", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, level, " raw write+read", va="bottom", ha="right")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("GB/s (tensor bytes)")
    ax.set_title(
        f"tierstore bench storage, {report.phases[0]}: {human_bytes(report.data['bytes'])}, "
        "hatched = baselines, whiskers = min-max"
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
        >>> p.parse_args(["--total", "8MiB"]).total, p.parse_args([]).phases
        ('8MiB', 'steady,first-touch')
    """
    parser.add_argument("--total", default="1GiB", help="bytes per row and pass (default 1GiB)")
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
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="steady (one store per row, reused pass after pass, as in training) and/or "
        "first-touch (a fresh store per pass) (default steady,first-touch)",
    )
    parser.add_argument("--zstd-level", type=int, default=1, help="zstd level (default 1)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed passes of every row in every phase; median and spread (default 5)",
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
    """Run ``tierstore bench storage`` with parsed options; print the tables; 0 on success.

    Example:
        >>> import argparse, tempfile
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> args = p.parse_args(["--total", "1MiB", "--sizes", "1MiB", "--backends", "file",
        ...                      "--compression", "none", "--repeat", "1", "--quiet",
        ...                      "--dir", tempfile.mkdtemp()])
        >>> run(args)  # doctest: +ELLIPSIS
        tierstore bench storage: 1.0 MiB per row and pass ...
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
        phases=_csv(args.phases),
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
