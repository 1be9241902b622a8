"""Where the ``lmdb`` backend's write time goes in the steady state, step by step.

NOTE [ LMDB's write path ]
The ``lmdb`` row times a write as one figure. :class:`LmdbWritePath` runs
the same passes beside it (same tensors, same framing, freed and written
again in one environment that lives across passes) in an environment of its
own, opened with the ``lmdb`` backend's settings (``NOTE [ LMDB map size ]``
in ``tierstore/backends/lmdb.py``: no sync at commit, readahead, map size
twice the budget), and times each step of a record's write the way the
backend takes them, on one thread (LMDB has one writer):

* ``free``: the previous pass's records deleted, newest first, one write
  transaction each, as backward releases them;
* ``join``: the record's header and payload copied into one buffer, reused
  by every write (py-lmdb takes one buffer per value): a copy of every byte
  into memory that is already mapped;
* ``put``: ``txn.put``: LMDB finds pages for the value (pages freed two
  transactions ago, else the end of the map), allocates memory for them
  (``malloc``: for values of megabytes, memory the kernel maps fresh and
  faults in page by page) and copies the value in;
* ``commit``: LMDB writes those pages into the page cache (``pwrite``) and
  updates its free list and meta page;
* ``sync``: ``fsync`` of the data file: the page cache written to the device.

Beside them, two copies of the same bytes say what ``put`` would cost if it
were only a copy: ``join`` itself (into warm memory), and ``copy to new
memory`` (into a fresh heap tensor, faulting every small page in, as LMDB's
``malloc``-ed pages are). Then every record is read back and compared, after
the page cache is dropped, as the row does.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from tierstore.bench.lmdb_path import LmdbWritePath, summarize
    >>> tensors = [torch.randn(1 << 16), torch.randn(1 << 17)]
    >>> probe = LmdbWritePath(Path(tempfile.mkdtemp()) / "lmdb-path", tensors)
    >>> passes = [probe.run_pass(tensors) for _ in range(3)]
    >>> probe.close(); probe.close()  # idempotent
    >>> summary = summarize(passes[1:])
    >>> sorted(summary.steps) == sorted(STEPS)
    True
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierstore import codec
from tierstore.backends._aligned import AlignedBuffer, copy
from tierstore.backends.base import byte_views
from tierstore.backends.lmdb import open_environment
from tierstore.bench.storage_rows import Spread, drop_cache, fsync_files
from tierstore.errors import TierstoreError

__all__ = ["STEPS", "LmdbWritePass", "LmdbWritePath", "LmdbWriteSummary", "summarize"]

#: The steps of a write, in order, and what each one is.
STEPS = {
    "free": "delete the previous pass's records, one write transaction each",
    "join": "copy header and payload into one buffer (memory reused by every write)",
    "put": "txn.put: find pages, allocate memory for them, copy the value in",
    "commit": "write the pages into the page cache (pwrite), update the free list",
    "sync": "fsync the data file: the page cache to the device",
}

_MIB = 1 << 20


@dataclass
class LmdbWritePass:
    """One pass of :class:`LmdbWritePath`: seconds per step, in all, over every record.

    ``write_s`` runs from the first ``join`` to the end of ``sync``;
    ``new_memory_copy_s`` is the reference copy into fresh memory;
    ``map_file_bytes`` how large LMDB's data file was after the pass.

    Example:
        >>> LmdbWritePass(steps={"put": 1.0}, write_s=2.0).steps["put"]
        1.0
    """

    steps: dict[str, float]
    write_s: float
    read_s: float = 0.0
    new_memory_copy_s: float = 0.0
    bytes: int = 0
    map_file_bytes: int = 0


@dataclass
class LmdbWriteSummary:
    """:class:`LmdbWritePass` figures over the timed passes, each as a :class:`Spread`.

    ``shares``: each step's median over the median write time (free is not
    part of the write). ``warm_copy_gbps`` / ``new_memory_copy_gbps``: the
    two reference copies of the same bytes. ``put_beyond_copy_s``: the
    median of ``put`` minus ``join`` per pass, 0 where ``put`` was timed
    below ``join``: what ``put`` spends beyond copying the bytes (allocating
    and faulting in memory, finding pages).

    Example:
        >>> s = summarize([LmdbWritePass({k: 0.1 for k in STEPS}, 0.4, 0.2, 0.1, 10**9)])
        >>> round(s.shares["put"], 2), s.passes
        (0.25, 1)
    """

    passes: int
    bytes: int
    steps: dict[str, Spread]
    write_s: Spread
    write_gbps: Spread
    read_gbps: Spread
    warm_copy_gbps: Spread
    new_memory_copy_gbps: Spread
    put_beyond_copy_s: Spread
    shares: dict[str, float] = field(default_factory=dict)
    map_file_bytes: int = 0


def summarize(passes: Sequence[LmdbWritePass]) -> LmdbWriteSummary:
    """Spreads of every step over ``passes`` (the timed ones), and each step's share.

    Example:
        >>> p = LmdbWritePass({k: 0.1 for k in STEPS}, 0.4, 0.2, 0.1, 10**9)
        >>> summarize([p, p]).write_gbps.median
        2.5
    """
    if not passes:
        raise ValueError("summarize: no passes")
    nbytes = passes[0].bytes
    steps = {k: Spread.of([p.steps[k] for p in passes]) for k in STEPS}
    write_s = Spread.of([p.write_s for p in passes])
    return LmdbWriteSummary(
        passes=len(passes),
        bytes=nbytes,
        steps=steps,
        write_s=write_s,
        write_gbps=Spread.of([nbytes / p.write_s / 1e9 for p in passes]),
        read_gbps=Spread.of([nbytes / p.read_s / 1e9 for p in passes if p.read_s > 0] or [0.0]),
        warm_copy_gbps=Spread.of([nbytes / p.steps["join"] / 1e9 for p in passes]),
        new_memory_copy_gbps=Spread.of([nbytes / p.new_memory_copy_s / 1e9 for p in passes]),
        # A duration: a put timed below its copy (noise, a warm page cache) is 0, not negative.
        put_beyond_copy_s=Spread.of([max(0.0, p.steps["put"] - p.steps["join"]) for p in passes]),
        shares={k: steps[k].median / write_s.median for k in STEPS if k != "free"},
        map_file_bytes=max(p.map_file_bytes for p in passes),
    )


class LmdbWritePath:
    """An LMDB environment with the ``lmdb`` backend's settings, timed step by step.

    See ``NOTE [ LMDB's write path ]``. ``workdir`` is created here and
    removed by :meth:`close` (idempotent).

    Args:
        workdir: a path that does not exist yet, on the disk to measure.
        tensors: the tensors every pass writes; they size the map as the
            benchmark's ``lmdb`` row sizes its budget.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> probe = LmdbWritePath(Path(tempfile.mkdtemp()) / "p", [torch.ones(1 << 16)])
        >>> one = probe.run_pass([torch.ones(1 << 16)])
        >>> one.steps["free"], one.write_s > one.steps["put"] > 0
        (0.0, True)
        >>> probe.close()
    """

    def __init__(self, workdir: Path, tensors: Sequence[torch.Tensor]) -> None:
        self.workdir = workdir
        workdir.mkdir(mode=0o700)
        self._closed = False
        self._keys: list[bytes] = []
        self._next_key = 0
        self._joined: AlignedBuffer | None = None
        # The lmdb row's budget, and the backend's map for it (twice, + 1 MiB).
        budget = sum(t.numel() * t.element_size() + _MIB for t in tensors) + 16 * _MIB
        self._path = workdir / "entries.lmdb"
        try:
            self._env = open_environment(self._path, 2 * budget + _MIB)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    @property
    def data_file(self) -> Path:
        """LMDB's data file (``data.mdb``)."""
        return self._path / "data.mdb"

    def _join(self, views: list[memoryview], length: int) -> memoryview:
        # The backend's _one_buffer: one reused buffer, grown to the largest record.
        joined = self._joined
        if joined is None or joined.view.nbytes < length:
            if joined is not None:
                joined.close()
            joined = self._joined = AlignedBuffer(-(-length // 4096) * 4096)
        at = 0
        for view in views:
            copy(joined.view[at : at + view.nbytes], view)
            at += view.nbytes
        return joined.view[:length]

    def run_pass(self, tensors: Sequence[torch.Tensor]) -> LmdbWritePass:
        """Free the last pass's records, write ``tensors``, sync, read them back and check them.

        Raises:
            TierstoreError: a record read back differs from what was written.
        """
        frames = [codec.encode(codec.to_span(t)[0]) for t in tensors]  # framing is not LMDB's
        steps = dict.fromkeys(STEPS, 0.0)
        if self._keys:
            start = time.perf_counter()
            for kb in reversed(self._keys):
                with self._env.begin(write=True) as txn:
                    txn.delete(kb)
            steps["free"] = time.perf_counter() - start
            self._keys = []

        start = time.perf_counter()
        for frame in frames:
            kb = self._next_key.to_bytes(8, "big")
            self._next_key += 1
            t0 = time.perf_counter()
            value = self._join(byte_views(frame.views()), frame.nbytes)
            t1 = time.perf_counter()
            txn = self._env.begin(write=True)
            try:
                txn.put(kb, value, overwrite=False)
                t2 = time.perf_counter()
                txn.commit()
            except BaseException:
                txn.abort()
                raise
            t3 = time.perf_counter()
            steps["join"] += t1 - t0
            steps["put"] += t2 - t1
            steps["commit"] += t3 - t2
            self._keys.append(kb)
        t4 = time.perf_counter()
        fsync_files([self.data_file])
        end = time.perf_counter()
        steps["sync"] = end - t4
        write_s = end - start

        drop_cache([self.data_file])
        start = time.perf_counter()
        got = []
        with self._env.begin(buffers=True) as reader:
            for kb in self._keys:
                stored = reader.get(kb)
                out = torch.empty(len(stored) if stored is not None else 0, dtype=torch.uint8)
                codec.byte_view(out)[:] = stored if stored is not None else b""
                got.append(out)
        read_s = time.perf_counter() - start
        for i, (frame, t, out) in enumerate(zip(frames, tensors, got, strict=True)):
            h = len(frame.header)
            same = out.numel() == frame.nbytes and bytes(codec.byte_view(out[:h])) == frame.header
            if not (same and torch.equal(out[h:].view(t.dtype), t.reshape(-1))):
                raise TierstoreError(
                    f"tierstore: bench storage: LMDB's write path read record {i} back "
                    "different from what it wrote"
                )
        return LmdbWritePass(
            steps,
            write_s,
            read_s,
            _new_memory_copy_s(frames),
            sum(t.numel() * t.element_size() for t in tensors),
            self.data_file.stat().st_size,
        )

    def close(self) -> None:
        """Close the environment and remove ``workdir``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._env.close()
            if self._joined is not None:
                self._joined.close()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _new_memory_copy_s(frames: Sequence[codec.Frame]) -> float:
    # What copying into heap memory that has never been touched costs (small
    # pages, faulted in one by one): the least a put that mallocs its pages
    # afresh pays (NOTE [ LMDB's write path ]).
    total = 0.0
    for frame in frames:
        payload = frame.payload
        start = time.perf_counter()
        out = torch.empty(payload.nbytes, dtype=torch.uint8)
        copy(codec.byte_view(out), payload)
        total += time.perf_counter() - start
        del out
    return total
