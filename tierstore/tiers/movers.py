"""Movers: the disk I/O, off the caller's thread, and the backend it drives.

The tier manager decides *what* moves where; this layer moves bytes between
host memory and the disk backend. See ``NOTE [ Movers ]``. Copies between
host and device are ``tierstore/tiers/transfers.py``'s.

Example:
    >>> import tempfile, torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.movers import Pipeline
    >>> pipe = Pipeline(TierConfig(disk_path=tempfile.mkdtemp(), disk_budget="1MiB"))
    >>> pipe.open_backend()
    >>> record = pipe.submit_write(1, torch.arange(10.0)).result()
    >>> pipe.submit_read(1, record).result().tolist()[:3]
    [0.0, 1.0, 2.0]
    >>> pipe.delete(1); pipe.close(); pipe.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiofiles.os
import torch

from tierstore import codec
from tierstore.backends import backend_class
from tierstore.backends.base import Backend
from tierstore.config import TierConfig
from tierstore.errors import (
    DISK_HINT,
    CorruptDataError,
    StoreClosedError,
    TierstoreError,
    quoted,
)
from tierstore.tiers.forks import forked_message, leave_to_parent
from tierstore.tiers.interrupts import alive, held

__all__ = ["LinkClock", "Pipeline", "Record"]

T = TypeVar("T")

# NOTE [ A dead I/O thread ]
# The loop thread runs only our coroutines and callbacks, but a BaseException
# raised on it (SystemExit, a KeyboardInterrupt delivered by a debugger, a
# MemoryError inside asyncio) ends run_forever, and with it every future the
# store waits on: a plain wait would hang the training step for good. So the
# store waits through Pipeline.wait, which looks at the thread every
# _LIVENESS_S seconds, and every new request checks it first; both raise a
# TierstoreError with the thread's exception as the cause. Entries whose
# writes never ran still have their bytes in memory and are read from there;
# entries already on disk are out of reach. close() still works, and removes
# the files. Whether the thread lives is a flag it sets as it starts serving
# and clears as it ends, not Thread.is_alive(), which an interrupt can
# make lie (NOTE [ Interrupts held ] in tiers/interrupts.py): this is asked
# before every request.
_LIVENESS_S = 0.25
#: The longest a wait holds Ctrl-C off (Pipeline.wait).
_WAIT_SLICE_S = 0.05

# NOTE [ Movers ]
# One event-loop thread per store runs the disk I/O as coroutines; each
# blocking step (encoding with zstd, a pwritev or preadv, an LMDB
# transaction) goes through aiofiles to the loop's executor, whose
# io_workers threads keep that many requests in flight. Both the syscalls
# and zstd release the GIL, so the copies overlap with forward and backward
# compute. Callers get concurrent.futures.Future objects and never block the
# loop: the tier manager waits on a future only after releasing its own lock,
# and the callbacks it passes here only assign attributes, so the loop thread
# never waits for the manager either.

# NOTE [ Checksums beside the I/O ]
# Every record's payload is hashed on the way out and checked on the way back
# in (NOTE [ Record integrity ] in codec.py). Done inside a record's executor
# job, the hash keeps that I/O worker from its next syscall, so the disk sees
# fewer requests in flight for as long (about a tenth of the file backend's
# write+read time). So uncompressed records
# hash on a thread of their own, the store's one hasher (tierstore-hash),
# beside the workers' I/O; xxh3 releases the GIL for large buffers, so the
# two run at once on two cores.
# * Write: the span is hashed as soon as its bytes are there (after `ready`),
#   while the write waits for a worker behind the writes ahead of it; the
#   worker frames the record with that digest. Safe because the caller may
#   not change the span until the write's future is done (submit_write), so
#   the digest is of exactly the bytes the worker writes.
# * Read: the worker reads the record and compares the header, then hands the
#   payload to the hasher and takes the next read; the hasher checks the
#   checksum, and only then is the read's future done. So nothing reaches the
#   caller unchecked, with the same CorruptDataError a worker's check raises, and a check
#   never waits behind other reads' I/O (one thread, and hashing is ten times
#   the disk's rate).
# A zstd record is hashed in its worker's job: its payload is made
# (or decompressed) there, and decompression is too slow to queue on one
# thread. Both jobs take their buffer out of a list, as _store does, so that
# the hasher keeps no reference once its future is done. close() shuts the
# hasher down after the workers, so that a worker never waits on a digest
# nobody computes.

# NOTE [ Deletes on the I/O thread ]
# A record is deleted when its entry is released, and a release runs under
# the tier manager's lock, on whichever thread takes it next (NOTE [ Deferred
# release ] in tiers/release.py). A delete may be I/O (an LMDB write
# transaction, which waits for the writer), so delete() only queues it on the
# loop thread and returns: the caller's lock guards bookkeeping, never a disk.
# The backend's capacity is the disk_budget the manager checks, and the
# manager counts a released record's bytes as free at once; so a write queued
# after a delete waits for that delete before it claims room in the backend,
# and settle_deletes() lets stats() show what backward freed. close() drops
# deletes still queued: the backend and its files go anyway.


# NOTE [ Tasks die on the loop ]
# asyncio keeps every task in a WeakSet, whose entry goes by a weak
# reference callback written in Python, run by whichever thread drops the
# task's last reference. asyncio's own chaining of a task to a
# concurrent.futures.Future has the future hold the task (for cancelling
# it), so the task would die wherever the future does: on the training
# thread, as a released entry lets go of its write. A Ctrl-C landing in that
# callback is printed as "Exception ignored" and lost: training goes on.
# _chain holds the task only weakly from the future, so it dies on the
# loop thread, where no signal handler runs.

# NOTE [ Requests that an interrupt cannot split ]
# The training thread hands the I/O thread its writes, reads and deletes,
# and Ctrl-C can stop it at any bytecode of that hand-off: with the request
# queued on the loop but its future never returned, a write would land that
# no one harvests (its host block and entry held for good), a delete could
# be lost (the backend's room with it). So a request's future is made, and
# its callbacks attached, before the request is queued; a caller may hold
# the future before the request exists (submit_write's `future`), and then
# queues it in a `finally`. A request runs once, claimed on the loop from a
# one-item list kept on its future (list.pop is atomic): if an interrupt
# lands while it is being queued and the loop has not claimed it, it is
# queued again (a second start finds nothing to claim) before the interrupt
# goes on. So a request that was asked for runs, and its future ends: the
# interrupt reaches the user, and the store's books stay whole. The
# bytecodes between a `finally` and the `try` of the call it makes are a
# window still (a write never queued, its future waited on for good); so
# the hand-off, from the future made to the request queued, runs in one
# hold (NOTE [ Interrupts held ] in tiers/interrupts.py) wherever Python's
# own SIGINT handler is in place.


def _launch(
    loop: asyncio.AbstractEventLoop,
    make: Callable[[], Any],
    future: concurrent.futures.Future[Any],
) -> None:
    """Run the coroutine ``make()`` on ``loop`` once per ``future``, its outcome in ``future``.

    NOTE [ Requests that an interrupt cannot split ]: called again for the
    same ``future``, it runs nothing more.
    """
    with held:  # NOTE [ Interrupts held ] in tiers/interrupts.py
        claim: list[bool] = future.__dict__.setdefault("_tierstore_claim", [True])

        def start() -> None:
            try:
                claim.pop()
            except IndexError:
                return  # queued twice: the first start ran it
            try:
                task = loop.create_task(make())
            except BaseException as exc:
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
                raise
            _chain(task, future, loop)

        try:
            loop.call_soon_threadsafe(start)
        except BaseException:
            if claim and not loop.is_closed():
                loop.call_soon_threadsafe(start)
            raise


def _chain(
    task: asyncio.Task[Any], future: concurrent.futures.Future[Any], loop: asyncio.AbstractEventLoop
) -> None:
    """``task``'s outcome into ``future``; cancelling ``future`` cancels ``task``.

    NOTE [ Tasks die on the loop ]: ``future`` never holds ``task``.
    """
    weak = weakref.ref(task)

    def cancelled(done: concurrent.futures.Future[Any]) -> None:  # any thread
        if done.cancelled():
            running = weak()
            if running is not None and not loop.is_closed():
                loop.call_soon_threadsafe(running.cancel)

    def ended(done: asyncio.Task[Any]) -> None:  # on the loop
        if done.cancelled():
            future.cancel()
        if not future.set_running_or_notify_cancel():
            return
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(done.result())

    future.add_done_callback(cancelled)
    task.add_done_callback(ended)


def _started_pool(workers: int, prefix: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose ``workers`` threads all run from now on.

    A pool starts a thread when work finds none idle: that can be in the
    middle of a step, when memory is shortest, and where a thread's stack
    cannot be had (``RLIMIT_AS``, a container's limit) the submit raises
    "can't start new thread" into the step. Started here, at the store's
    first disk write, they fail there if at all. Each start task waits
    until all of them run, so no thread is idle for the next to reuse.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    every = threading.Barrier(workers)
    try:
        concurrent.futures.wait([pool.submit(every.wait) for _ in range(workers)])
    except BaseException:
        every.abort()  # the threads that did start go on to the shutdown
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return pool


class LinkClock:
    """Bytes a link moved and the seconds it was busy moving them: its rate.

    Busy means at least one transfer under way, counted from when it was
    queued to when it ended, so a saturated link's rate is what it sustains.
    Thread-safe: transfers end on the I/O thread.

    Example:
        >>> from tierstore.tiers.movers import LinkClock
        >>> clock = LinkClock()
        >>> clock.started(); clock.ended(1000)
        >>> moved, busy = clock.snapshot(); moved
        1000
        >>> clock.rate_since((0, 0.0)) > 0
        True
    """

    __slots__ = ("_active", "_busy_s", "_bytes", "_lock", "_since")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy_s = 0.0
        self._bytes = 0

    def started(self) -> None:
        """A transfer was queued."""
        with self._lock:
            if not self._active:
                self._since = time.perf_counter()
            self._active += 1

    def ended(self, nbytes: int) -> None:
        """A transfer of ``nbytes`` ended (done, failed or cancelled)."""
        with self._lock:
            self._active -= 1
            self._bytes += nbytes
            if not self._active:
                self._busy_s += time.perf_counter() - self._since

    def add(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` that kept the link busy ``seconds`` (timed by the caller).

        Copies on one CUDA stream run one after another: their event-timed
        seconds add up to the stream's busy time (NOTE [ Copies on CUDA ] in
        tiers/transfers.py).
        """
        with self._lock:
            self._bytes += nbytes
            self._busy_s += seconds

    def snapshot(self) -> tuple[int, float]:
        """Bytes moved and busy seconds so far (a transfer under way counts its time)."""
        with self._lock:
            busy = self._busy_s
            if self._active:
                busy += time.perf_counter() - self._since
            return self._bytes, busy

    def rate_since(self, before: tuple[int, float]) -> float | None:
        """Bytes per second since ``before`` (a snapshot); ``None`` if nothing moved."""
        moved, busy = self.snapshot()
        moved -= before[0]
        busy -= before[1]
        return moved / busy if moved > 0 and busy > 0 else None


def _landed_bytes(future: concurrent.futures.Future[torch.Tensor]) -> int:
    if future.cancelled() or future.exception() is not None:
        return 0
    return future.result().nbytes


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@aiofiles.os.wrap  # type: ignore[untyped-decorator]
def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on the loop's executor (aiofiles' wrapper makes it awaitable)."""
    return fn(*args)


# The end of every message about a disk record that cannot be read back.
_LOST = (
    "The saved tensor it held is lost and this backward cannot finish; run the step "
    f"again, and {DISK_HINT}"
)


def _digest(spans: list[torch.Tensor]) -> str:
    """The checksum of the span in ``spans``, on the hasher (NOTE [ Checksums beside the I/O ])."""
    return codec.checksum(codec.byte_view(spans.pop()))


def _store(
    backend: Backend[Any],
    key: int,
    spans: list[torch.Tensor],
    config: TierConfig,
    alloc: codec.Alloc | None,
    *,
    headroom: bool = False,
    digest: concurrent.futures.Future[str] | None = None,
) -> Record:
    """Encode the span in ``spans`` and write it under ``key``: one executor job.

    On a worker: encoding reads every byte. ``digest``: the span's checksum,
    under way on the hasher (NOTE [ Checksums beside the I/O ]).
    The span is taken out of the list: the executor keeps its job's arguments a
    moment after the job ends, and the span's memory may be a leased buffer
    that should be back in its pool when the write's future is done.
    """
    frame = codec.encode(
        spans.pop(),
        config.compression,
        config.compression_level,
        alloc,
        headroom=headroom,
        digest=None if digest is None else digest.result(),
    )
    meta = codec.parse_header(frame.header)  # before the write: a bad frame leaves nothing
    footprint = backend.write(key, frame.views())
    return Record(frame.header, meta, footprint)


def _where(backend: Backend[Any], key: int) -> str:
    return f"entry {key} on the disk tier ({backend.name} backend, {backend.path})"


def _load(
    backend: Backend[Any], key: int, record: Record, alloc: codec.Alloc | None
) -> torch.Tensor:
    """Read ``key``'s record into memory from ``alloc``; its payload, not yet checked.

    The header is compared with the one written; :func:`_decode` checks the
    payload. A record with a padded header (NOTE [ Records in one buffer ]) is
    read as one view, header and payload in the same buffer, page-aligned.
    """
    where = _where(backend, key)
    if len(record.header) == codec.HEADROOM:
        payload = codec.payload_tensor(record.meta, alloc, headroom=True)
        whole = codec.record_view(payload)
        views, header = [whole], whole[: codec.HEADROOM]
    else:
        payload = codec.payload_tensor(record.meta, alloc)
        header = memoryview(bytearray(len(record.header)))
        views = [header, codec.byte_view(payload)]
    try:
        backend.read_into(key, views)
    except OSError as exc:  # the backends wrap theirs; this is for any that slips through
        raise TierstoreError(f"tierstore: reading {where} failed: {exc}. {_LOST}") from exc
    if header != record.header:
        raise CorruptDataError(
            f"tierstore: {where} came back with another header: its bytes were changed "
            f"after they were written. {_LOST}"
        )
    return payload


def _decode(
    backend: Backend[Any],
    key: int,
    record: Record,
    payloads: list[torch.Tensor],
    alloc: codec.Alloc | None,
) -> torch.Tensor:
    """Check the payload in ``payloads`` against its checksum and decode it.

    Taken out of the list, as :func:`_store` takes its span.
    """
    try:
        return codec.decode(record.meta, payloads.pop(), alloc)
    except CorruptDataError as exc:
        where = _where(backend, key)
        raise CorruptDataError(f"tierstore: {where} is corrupt: {quoted(exc)}. {_LOST}") from exc


def _load_and_decode(
    backend: Backend[Any], key: int, record: Record, alloc: codec.Alloc | None
) -> torch.Tensor:
    """Read and check ``key``'s record in one executor job (a compressed one)."""
    return _decode(backend, key, record, [_load(backend, key, record, alloc)], alloc)


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Record:
    """Where an entry rests on disk and how to read it back.

    ``header`` is kept to compare with what is read: a record that comes
    back with another header is corrupt, not silently decoded.

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> from tierstore.tiers.movers import Record
        >>> f = codec.encode(torch.zeros(2))
        >>> Record(f.header, codec.parse_header(f.header), 4096).meta.numel
        2
    """

    header: bytes
    meta: codec.FrameMeta
    footprint: int


class Pipeline:
    """Moves spans between host memory and the disk backend.

    Owns the disk backend and the I/O threads, all created on first use (a
    store that never spills starts no thread and touches no disk) and
    released by :meth:`close`, which is idempotent.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.movers import Pipeline
        >>> pipe = Pipeline(TierConfig(disk_budget="1MiB"))
        >>> pipe.footprint_bound(10) >= 10
        True
        >>> pipe.close()
    """

    def __init__(self, config: TierConfig) -> None:
        self._config = config
        self._backend: Backend[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # See NOTE [ Checksums beside the I/O ].
        self._hasher: concurrent.futures.ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._death: BaseException | None = None
        self._serving = False  # set and cleared by the loop thread: NOTE [ A dead I/O thread ]
        # NOTE [ Deletes on the I/O thread ]: queued deletes by key (any thread),
        # and those under way on the loop (the loop thread's own).
        self._deleting: dict[int, concurrent.futures.Future[None]] = {}
        self._deletes: set[asyncio.Task[Any]] = set()
        self._parent: int | None = None  # NOTE [ Forked children ] in tierstore/tiers/forks.py
        leave_to_parent(self)
        #: The disk's rates each way as the store runs (NOTE [ Planned steps ] in
        #: planning/runner.py).
        self.write_clock = LinkClock()
        self.read_clock = LinkClock()

    # -- resources -------------------------------------------------------------

    def _forked(self) -> None:
        # NOTE [ Forked children ]: the loop, its threads and the backend stay
        # the parent's; the child never stops, joins or closes them.
        if self._parent is None:
            self._parent = os.getppid()
        self._start_lock = threading.Lock()
        self._closed = True

    def open_backend(self) -> None:
        """Open the disk backend now, so that a bad ``disk_path`` fails in the caller."""
        self._backend_or_open()

    def _backend_or_open(self) -> Backend[Any]:
        with self._start_lock:
            self._check_usable()
            if self._backend is None:
                cls = backend_class(self._config.disk_backend)
                self._backend = cls(self._config.disk_path, int(self._config.disk_budget))
            return self._backend

    def io_cpu_s(self) -> float:
        """CPU seconds the I/O threads have used (the event loop's and its workers').

        On a CPU-only machine they share the cores with the step: the plan
        charges them to the bytes moved (NOTE [ Planned steps ] in planning/runner.py).
        0.0 where the platform cannot tell.
        """
        threads = [self._thread] if self._thread is not None else []
        for executor in (self._executor, self._hasher):
            if executor is not None:
                threads += list(executor._threads)
        total = 0.0
        for thread in threads:
            ident = thread.ident
            # A thread that has ended has no clock: its id may name freed memory.
            if ident is None or not alive(thread) or not hasattr(time, "pthread_getcpuclockid"):
                continue
            with contextlib.suppress(OSError, ProcessLookupError):
                total += time.clock_gettime(time.pthread_getcpuclockid(ident))
        return total

    @property
    def backend_if_open(self) -> Backend[Any] | None:
        """The disk backend if something has opened it, else ``None``."""
        return self._backend

    def trim(self) -> int:
        """Hand back the pages of the disk backend's idle I/O buffers; returns their bytes.

        At a step's start (NOTE [ Idle I/O buffers ] in tierstore/backends/_aligned.py).
        """
        backend = self._backend
        return backend.trim() if backend is not None else 0

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._serving = True
        try:
            loop.run_forever()
        except BaseException as exc:  # NOTE [ A dead I/O thread ]
            self._death = exc
            raise
        finally:
            self._serving = False

    def _check_usable(self) -> None:
        if self._parent is not None:
            raise StoreClosedError(forked_message("this store's disk tier", self._parent))
        if self._closed:
            raise StoreClosedError("tierstore: this store is closed; its disk tier is gone")

    def check_alive(self) -> None:
        """Raise if the I/O thread has died (NOTE [ A dead I/O thread ]).

        Raises:
            TierstoreError: the thread is gone; its exception is the ``__cause__``.
            StoreClosedError: this is a forked child (NOTE [ Forked children ]).
        """
        if self._parent is not None:  # the thread is the parent's: waiting would hang
            raise StoreClosedError(forked_message("this store's disk tier", self._parent))
        thread = self._thread
        if thread is None or self._serving or self._closed:
            return
        if alive(thread):  # not serving yet: still starting
            return
        death = self._death
        raise TierstoreError(
            "tierstore: the disk I/O thread of this store (tierstore-loop) has stopped"
            + (f" on {type(death).__name__}: {death}" if death is not None else "")
            + "; entries on the disk tier cannot be read back. Close this store "
            "(store.close()) and create a new one"
        ) from death

    def wait(self, futures: Iterable[concurrent.futures.Future[Any] | None]) -> None:
        """Wait until ``futures`` are done; raise if the I/O thread dies first.

        Futures of a dead I/O thread would never end: instead of hanging, the
        wait checks the thread every ``_LIVENESS_S`` seconds.

        Raises:
            TierstoreError: see :meth:`check_alive`.
        """
        # In slices, each in a hold: concurrent.futures.wait takes every
        # future's condition in Python code, and Ctrl-C landing there leaves
        # one held for good, and the I/O thread that ends that future stuck on
        # it. The interrupt comes as the slice ends, within _WAIT_SLICE_S; a
        # future that ends sooner ends the wait sooner.
        # NOTE [ Interrupts held ] in tiers/interrupts.py.
        with held:
            pending = [f for f in futures if f is not None and not f.done()]
        checked = time.monotonic()
        while pending:
            with held:
                _, not_done = concurrent.futures.wait(pending, timeout=_WAIT_SLICE_S)
            pending = list(not_done)
            if pending and time.monotonic() - checked >= _LIVENESS_S:
                self.check_alive()
                checked = time.monotonic()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        self.check_alive()
        with self._start_lock:
            self._check_usable()
            if self._loop is None:
                # In a hold: a start that Ctrl-C stops would leave a second loop
                # made, and pools whose threads no one shuts down.
                with held:
                    self._executor = _started_pool(self._config.io_workers, "tierstore-io")
                    self._hasher = _started_pool(1, "tierstore-hash")
                    loop = asyncio.new_event_loop()
                    loop.set_default_executor(self._executor)
                    self._thread = threading.Thread(
                        target=self._serve, args=(loop,), name="tierstore-loop", daemon=True
                    )
                    self._thread.start()
                    self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the I/O threads, close the backend, remove the spill directory. Idempotent.

        Requests still queued are cancelled; a write or read that has
        started runs to its end first.
        """
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            loop, thread, executor = self._loop, self._thread, self._executor
            hasher = self._hasher
            backend, self._backend = self._backend, None
        if loop is not None and thread is not None and executor is not None:
            # Cancel what is still queued (a read waiting for a write, say), let
            # the cancellations run, then stop; started syscalls finish first.
            # A dead loop thread (NOTE [ A dead I/O thread ]) runs nothing more.
            if alive(thread):
                cancelled = asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
                while alive(thread):
                    with contextlib.suppress(concurrent.futures.TimeoutError):
                        cancelled.result(timeout=_LIVENESS_S)
                        break
                loop.call_soon_threadsafe(loop.stop)
            thread.join()
            executor.shutdown(wait=True, cancel_futures=True)
            if hasher is not None:  # after the workers: one may wait on a digest
                hasher.shutdown(wait=True, cancel_futures=True)
            loop.close()
        if backend is not None:
            backend.close()

    # -- host <-> disk -------------------------------------------------------------

    def footprint_bound(self, nbytes: int) -> int:
        """The most disk a span of ``nbytes`` can take once framed (and compressed).

        Reserved before the write, when the real size is not known yet.
        """
        return self._backend_or_open().footprint(
            codec.record_bound(nbytes, self._config.compression)
        )

    def submit_write(
        self,
        key: int,
        span: torch.Tensor,
        done: Callable[[concurrent.futures.Future[Record]], None] | None = None,
        ready: torch.cuda.Event | None = None,
        alloc: codec.Alloc | None = None,
        *,
        headroom: bool = False,
        future: concurrent.futures.Future[Record] | None = None,
    ) -> concurrent.futures.Future[Record]:
        """Encode ``span`` and write it under ``key`` in the background.

        ``span`` must stay unchanged until the future is done. ``done``, if
        given, runs on the I/O thread when the write ends; it must not block.
        ``ready``: the D2H copy that fills ``span``; the write waits for it.
        ``alloc``: where compression's scratch goes (the heap if ``None``).
        ``headroom``: ``span`` has :data:`~tierstore.codec.HEADROOM` bytes of
        tierstore's own in front of it (NOTE [ Records in one buffer ]).
        ``future``: the one to return, made by the caller (who may keep it
        before the write is queued: NOTE [ Requests that an interrupt cannot
        split ]).
        """
        if future is None:
            future = concurrent.futures.Future()
        clock, nbytes = self.write_clock, span.nbytes
        loop: asyncio.AbstractEventLoop | None = None
        with held:
            try:  # NOTE [ Requests that an interrupt cannot split ]: set up, then queued
                loop = self._running_loop()  # it may raise: then nothing is queued
                if done is not None:
                    future.add_done_callback(done)
                future.add_done_callback(lambda _: clock.ended(nbytes))
                clock.started()
            finally:
                loop = loop if loop is not None else self._loop
                if loop is not None and not loop.is_closed():
                    _launch(loop, lambda: self._write(key, span, ready, alloc, headroom), future)
                else:  # no loop to run it: the caller's future ends all the same
                    future.cancel()
        return future

    def submit_read(
        self,
        key: int,
        record: Record | concurrent.futures.Future[Record],
        alloc: codec.Alloc | None = None,
    ) -> concurrent.futures.Future[torch.Tensor]:
        """Read the span written under ``key`` back into a new CPU tensor, in the background.

        ``record`` may be the future of a write still under way: the read then
        starts when the write ends. ``alloc(nbytes)`` gives the memory it
        lands in (the heap if ``None``).
        """
        loop = self._running_loop()  # first: it may raise, and then nothing is queued
        clock = self.read_clock
        with held:  # NOTE [ Requests that an interrupt cannot split ]
            future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            future.add_done_callback(lambda f: clock.ended(_landed_bytes(f)))
            clock.started()
            _launch(loop, lambda: self._read(key, record, alloc), future)
        return future

    def delete(self, key: int) -> None:
        """Free the disk record under ``key`` on the I/O thread; returns at once.

        Never blocks and never raises, so that a finalizer may call it under
        any lock (NOTE [ Deletes on the I/O thread ]). A write submitted after
        it waits for it; :meth:`settle_deletes` waits for those queued so far.
        """
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            return  # nothing was written, or close() removes every record
        with held:  # NOTE [ Requests that an interrupt cannot split ]
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            future.add_done_callback(lambda _: self._deleting.pop(key, None))
            self._deleting[key] = future
            try:
                _launch(loop, lambda: self._delete(key), future)
            except RuntimeError:  # the loop closed since the check: so did the backend
                self._deleting.pop(key, None)

    @property
    def deleting(self) -> bool:
        """Whether deletes are queued or under way."""
        return bool(self._deleting)

    def settle_deletes(self) -> None:
        """Wait for the deletes queued so far (none run once the I/O thread is dead)."""
        pending = [f for f in self._deleting.copy().values() if not f.done()]
        with contextlib.suppress(TierstoreError):  # a dead I/O thread: NOTE [ A dead I/O thread ]
            self.wait(pending)

    async def _delete(self, key: int) -> None:
        # Registered before the first await: a write queued after this delete
        # starts after this step, and finds it (NOTE [ Deletes on the I/O thread ]).
        task = asyncio.current_task()
        assert task is not None
        self._deletes.add(task)
        try:
            backend = self._backend
            if backend is not None:
                await _blocking(backend.delete, key)
        finally:
            self._deletes.discard(task)

    async def _write(
        self,
        key: int,
        span: torch.Tensor,
        ready: torch.cuda.Event | None,
        alloc: codec.Alloc | None,
        headroom: bool,
    ) -> Record:
        backend = self._backend_or_open()
        if self._deletes:  # the room they free is room this write may need
            await asyncio.wait(list(self._deletes))
        if ready is not None:  # NOTE [ Copies on CUDA ]: the bytes are still arriving
            await _blocking(ready.synchronize)
        digest = None
        if self._config.compression == "none" and self._hasher is not None:
            # NOTE [ Checksums beside the I/O ]: hashed while the write waits for a worker.
            digest = self._hasher.submit(_digest, [span.contiguous()])
        store = functools.partial(_store, headroom=headroom, digest=digest)
        record: Record = await _blocking(store, backend, key, [span], self._config, alloc)
        return record

    async def _read(
        self,
        key: int,
        record: Record | concurrent.futures.Future[Record],
        alloc: codec.Alloc | None,
    ) -> torch.Tensor:
        if isinstance(record, concurrent.futures.Future):
            # Shielded: cancelling this read must not cancel the write it
            # follows (wrap_future passes cancellation on), or a write whose
            # syscall still completes would be taken for one that never ran.
            # The write's own error is the store's to settle (NOTE [ Failed
            # writes ]); marked as seen here, so that a read cancelled before
            # the write failed does not make asyncio log it as never retrieved.
            written = asyncio.wrap_future(record)
            written.add_done_callback(_seen)
            record = await asyncio.shield(written)
        backend = self._backend_or_open()
        if self._config.compression != "none" or self._hasher is None:
            # One executor job reads, checks and decompresses: a decode queued
            # behind the reads ahead of it would make backward wait for those too.
            whole: torch.Tensor = await _blocking(_load_and_decode, backend, key, record, alloc)
            return whole
        # NOTE [ Checksums beside the I/O ]: the worker reads, the hasher checks.
        payload = await _blocking(_load, backend, key, record, alloc)
        check = self._hasher.submit(_decode, backend, key, record, [payload], alloc)
        del payload
        span: torch.Tensor = await asyncio.wrap_future(check)
        return span
