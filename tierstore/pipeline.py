"""Movers: the copies between tiers, and the disk backend they drive.

The tier manager decides *what* moves where; this layer does the moving, off
the caller's thread. See ``NOTE [ Movers ]``.

Example:
    >>> import tempfile, torch
    >>> from tierstore import TierConfig
    >>> from tierstore.pipeline import Pipeline
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
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiofiles.os
import torch

from tierstore import codec
from tierstore.backends import backend_class
from tierstore.backends.base import Backend
from tierstore.backends.host import HostBlock, HostPool
from tierstore.config import TierConfig
from tierstore.errors import (
    DISK_HINT,
    CorruptDataError,
    StoreClosedError,
    TierstoreError,
    quoted,
)

__all__ = ["DeviceCopy", "HostBlock", "HostCopy", "Pipeline", "Record"]

T = TypeVar("T")

# NOTE [ Copies on CUDA ]
# D2H (a saved tensor leaves the device): the d2h stream waits on the
# producer's stream, read at call time, then copies into a pooled pinned
# block and records an event. Pack returns at once; the caller keeps the span
# copied from (for a view with gaps, a compact temporary that nothing else
# holds) and the saved tensor referenced until that event has completed
# (HostCopy.ready),
# so the caching allocator cannot hand its memory to a new tensor while the
# copy still reads it. A disk write of the block first waits for the event
# on the I/O thread.
# H2D (backward needs it back): the destination is allocated on the
# consumer's stream, and the h2d stream waits on that stream before it writes
# there, because the caching allocator hands the consumer's freed blocks out
# in that stream's order; it also waits on the entry's D2H event if that copy
# is still under way. The consumer's stream then waits on the H2D event
# (DeviceCopy.ready): no host synchronisation anywhere, and no
# record_stream. Prefetched copies are issued at earlier unpacks, so they run
# on the h2d stream while the consumer computes.
# A pool block goes back only once every copy issued before the release, on
# both copy streams, has completed (an event recorded on each at release).

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
# the files.
_LIVENESS_S = 0.25

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


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class HostCopy:
    """A span's bytes in host memory, and the copy that fills them (NOTE [ Copies on CUDA ]).

    ``ready`` is ``None`` when the bytes are there already (always on CPU);
    otherwise the event of the D2H copy. ``block`` is the pool block holding
    them, to be given back with :meth:`Pipeline.free_host`.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.pipeline import Pipeline
        >>> copy = Pipeline(TierConfig(disk_budget=0)).host_copy(torch.ones(2))
        >>> copy.ready is None and copy.block is None
        True
    """

    tensor: torch.Tensor
    ready: torch.cuda.Event | None = None
    block: HostBlock | None = None


@dataclass(frozen=True)
class DeviceCopy:
    """A span copied back to its device on the h2d stream; ``ready`` is that copy's event.

    Example:
        >>> import torch
        >>> from tierstore.pipeline import DeviceCopy
        >>> DeviceCopy(torch.ones(2), None).ready is None
        True
    """

    tensor: torch.Tensor
    ready: torch.cuda.Event | None


class _Streams:
    """The copy streams of one CUDA device, created on first use."""

    __slots__ = ("d2h", "h2d")

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)


@dataclass(frozen=True)
class Record:
    """Where an entry rests on disk and how to read it back.

    ``header`` is kept to compare with what is read: a record that comes
    back with another header is corrupt, not silently decoded.

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> from tierstore.pipeline import Record
        >>> f = codec.encode(torch.zeros(2))
        >>> Record(f.header, codec.parse_header(f.header), 4096).meta.numel
        2
    """

    header: bytes
    meta: codec.FrameMeta
    footprint: int


class Pipeline:
    """Moves spans between the device, host memory and the disk backend.

    Owns the disk backend and the I/O threads, all created on first use (a
    store that never spills starts no thread and touches no disk) and
    released by :meth:`close`, which is idempotent.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.pipeline import Pipeline
        >>> pipe = Pipeline(TierConfig(disk_budget=0))
        >>> pipe.host_copy(torch.ones(2)).tensor.device
        device(type='cpu')
        >>> pipe.close()
    """

    def __init__(self, config: TierConfig) -> None:
        self._config = config
        self._backend: Backend[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._death: BaseException | None = None
        # CUDA only (NOTE [ Copies on CUDA ]): the pinned pool, the copy
        # streams per device, and pool blocks waiting for their copies to end.
        self._pool: HostPool | None = None
        self._streams: dict[torch.device, _Streams] = {}
        self._returns: deque[tuple[list[torch.cuda.Event], HostBlock]] = deque()

    # -- resources -------------------------------------------------------------

    def open_backend(self) -> None:
        """Open the disk backend now, so that a bad ``disk_path`` fails in the caller."""
        self._backend_or_open()

    def _backend_or_open(self) -> Backend[Any]:
        with self._start_lock:
            if self._closed:
                raise StoreClosedError("tierstore: this store is closed; its disk tier is gone")
            if self._backend is None:
                cls = backend_class(self._config.disk_backend)
                self._backend = cls(self._config.disk_path, int(self._config.disk_budget))
            return self._backend

    @property
    def backend_if_open(self) -> Backend[Any] | None:
        """The disk backend if something has opened it, else ``None``."""
        return self._backend

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_forever()
        except BaseException as exc:  # NOTE [ A dead I/O thread ]
            self._death = exc
            raise

    def check_alive(self) -> None:
        """Raise if the I/O thread has died (NOTE [ A dead I/O thread ]).

        Raises:
            TierstoreError: the thread is gone; its exception is the ``__cause__``.
        """
        thread = self._thread
        if thread is None or thread.is_alive() or self._closed:
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
        pending = [f for f in futures if f is not None and not f.done()]
        while pending:
            _, not_done = concurrent.futures.wait(pending, timeout=_LIVENESS_S)
            pending = list(not_done)
            if pending:
                self.check_alive()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        self.check_alive()
        with self._start_lock:
            if self._closed:
                raise StoreClosedError("tierstore: this store is closed; its disk tier is gone")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._config.io_workers, thread_name_prefix="tierstore-io"
                )
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
            backend, self._backend = self._backend, None
            pool, self._pool = self._pool, None
        if pool is not None:
            # Copies still using a block would read or write freed memory.
            for events, _ in self._returns:
                for event in events:
                    event.synchronize()
            self._returns.clear()
            pool.close()
        if loop is not None and thread is not None and executor is not None:
            # Cancel what is still queued (a read waiting for a write, say), let
            # the cancellations run, then stop; started syscalls finish first.
            # A dead loop thread (NOTE [ A dead I/O thread ]) runs nothing more.
            if thread.is_alive():
                cancelled = asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
                while thread.is_alive():
                    with contextlib.suppress(concurrent.futures.TimeoutError):
                        cancelled.result(timeout=_LIVENESS_S)
                        break
                loop.call_soon_threadsafe(loop.stop)
            thread.join()
            executor.shutdown(wait=True, cancel_futures=True)
            loop.close()
        if backend is not None:
            backend.close()

    # -- host <-> device (NOTE [ Copies on CUDA ]) -----------------------------------

    @property
    def pool_if_open(self) -> HostPool | None:
        """The host pool if a CUDA copy has created it, else ``None``."""
        return self._pool

    def _streams_of(self, device: torch.device) -> _Streams:
        streams = self._streams.get(device)
        if streams is None:
            streams = self._streams[device] = _Streams(device)
        return streams

    def host_copy(self, span: torch.Tensor) -> HostCopy:
        """Start copying a span to host memory; on CPU the span itself is the copy.

        Called with the tier manager's lock held (the pool and the list of
        blocks to give back have no lock of their own beyond the pool's).
        """
        if span.device.type == "cpu":
            return HostCopy(span)
        if span.device.type != "cuda":  # other accelerators: a plain synchronous copy
            return HostCopy(span.to("cpu"))
        self.reclaim()
        nbytes = span.numel() * span.element_size()
        block = self._host_pool().take(nbytes)
        if block is not None:
            host = block.tensor.view(span.dtype).view(span.shape)
        else:
            host = torch.empty(span.shape, dtype=span.dtype, pin_memory=self._config.pin_memory)
        streams = self._streams_of(span.device)
        producer = torch.cuda.current_stream(span.device)  # at call time, never cached
        with torch.profiler.record_function("tierstore::d2h"):
            streams.d2h.wait_stream(producer)
            with torch.cuda.stream(streams.d2h):
                host.copy_(span, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(streams.d2h)
        return HostCopy(host, ready, block)

    def _host_pool(self) -> HostPool:
        if self._pool is None:
            with self._start_lock:
                if self._closed:
                    raise StoreClosedError("tierstore: this store is closed; its host pool is gone")
                # Queued disk writes hold blocks too, beyond the host tier's own.
                self._pool = HostPool(
                    int(self._config.host_budget) + int(self._config.write_queue_bytes),
                    int(self._config.host_pool_step),
                    pin=self._config.pin_memory,
                )
        return self._pool

    def device_copy(
        self, span: torch.Tensor, device: torch.device, after: torch.cuda.Event | None = None
    ) -> DeviceCopy:
        """Start copying a host span to ``device``; ``after``: the D2H that fills ``span``.

        On CPU (or when the span is already there) no copy is made.
        """
        if span.device == device:
            return DeviceCopy(span, None)
        if device.type != "cuda":
            return DeviceCopy(span.to(device), None)
        streams = self._streams_of(device)
        consumer = torch.cuda.current_stream(device)
        with torch.profiler.record_function("tierstore::h2d"):
            out = torch.empty(span.shape, dtype=span.dtype, device=device)  # consumer's pool
            streams.h2d.wait_stream(consumer)
            if after is not None:
                streams.h2d.wait_event(after)
            with torch.cuda.stream(streams.h2d):
                out.copy_(span, non_blocking=span.is_pinned())
                ready = torch.cuda.Event()
                ready.record(streams.h2d)
        return DeviceCopy(out, ready)

    @staticmethod
    def consume(copy: DeviceCopy) -> torch.Tensor:
        """The copied tensor, usable on the current stream (which waits for the copy)."""
        if copy.ready is not None:
            torch.cuda.current_stream(copy.tensor.device).wait_event(copy.ready)
        return copy.tensor

    @staticmethod
    def done(event: torch.cuda.Event | None) -> bool:
        """Whether a copy's event has completed (``None``: there was nothing to wait for)."""
        return event is None or event.query()

    def free_host(self, block: HostBlock | None) -> None:
        """Give a pool block back once the copies issued so far have ended."""
        if block is None:
            return
        events = []
        for streams in self._streams.values():
            for stream in (streams.d2h, streams.h2d):
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        self._returns.append((events, block))

    def reclaim(self) -> None:
        """Give back the pool blocks whose copies have all ended (cheap when none wait)."""
        pool = self._pool
        while self._returns and all(e.query() for e in self._returns[0][0]):
            _, block = self._returns.popleft()
            if pool is not None:
                pool.give(block)

    # -- host <-> disk -------------------------------------------------------------

    def footprint_bound(self, nbytes: int) -> int:
        """The most disk a span of ``nbytes`` can take once framed (and compressed).

        Reserved before the write, when the real size is not known yet.
        """
        bound = nbytes + 1024  # the header: JSON of a few fields, well under 1 KiB
        if self._config.compression == "zstd":
            # zstd's worst case on incompressible input (ZSTD_compressBound).
            bound += (nbytes >> 8) + 128
        return self._backend_or_open().footprint(bound)

    def submit_write(
        self,
        key: int,
        span: torch.Tensor,
        done: Callable[[concurrent.futures.Future[Record]], None] | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> concurrent.futures.Future[Record]:
        """Encode ``span`` and write it under ``key`` in the background.

        ``span`` must stay unchanged until the future is done. ``done``, if
        given, runs on the I/O thread when the write ends; it must not block.
        ``ready``: the D2H copy that fills ``span``; the write waits for it.
        """
        loop = self._running_loop()  # first: it may raise, and then no coroutine is made
        future = asyncio.run_coroutine_threadsafe(self._write(key, span, ready), loop)
        if done is not None:
            future.add_done_callback(done)
        return future

    def submit_read(
        self, key: int, record: Record | concurrent.futures.Future[Record]
    ) -> concurrent.futures.Future[torch.Tensor]:
        """Read the span written under ``key`` back into a new CPU tensor, in the background.

        ``record`` may be the future of a write still under way: the read then
        starts when the write ends.
        """
        loop = self._running_loop()  # first: it may raise, and then no coroutine is made
        return asyncio.run_coroutine_threadsafe(self._read(key, record), loop)

    def delete(self, key: int) -> None:
        """Free the disk record under ``key`` (on the caller's thread: it is bookkeeping)."""
        self._backend_or_open().delete(key)

    async def _write(self, key: int, span: torch.Tensor, ready: torch.cuda.Event | None) -> Record:
        backend = self._backend_or_open()
        if ready is not None:  # NOTE [ Copies on CUDA ]: the bytes are still arriving
            await _blocking(ready.synchronize)
        # On a worker even uncompressed: the checksum reads every byte (NOTE [ Record integrity ]).
        frame = await _blocking(
            codec.encode, span, self._config.compression, self._config.compression_level
        )
        meta = codec.parse_header(frame.header)  # before the write: a bad frame leaves nothing
        footprint = await _blocking(backend.write, key, [frame.header, frame.payload])
        return Record(frame.header, meta, footprint)

    async def _read(
        self, key: int, record: Record | concurrent.futures.Future[Record]
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
        header = bytearray(len(record.header))
        payload = codec.payload_tensor(record.meta)
        where = f"entry {key} on the disk tier ({backend.name} backend, {backend.path})"
        try:
            await _blocking(backend.read_into, key, [memoryview(header), codec.byte_view(payload)])
        except OSError as exc:  # the backends wrap theirs; this is for any that slips through
            raise TierstoreError(f"tierstore: reading {where} failed: {exc}. {_LOST}") from exc
        if header != record.header:
            raise CorruptDataError(
                f"tierstore: {where} came back with another header: its bytes were changed "
                f"after they were written. {_LOST}"
            )
        try:
            span: torch.Tensor = await _blocking(codec.decode, record.meta, payload)
        except CorruptDataError as exc:
            raise CorruptDataError(
                f"tierstore: {where} is corrupt: {quoted(exc)}. {_LOST}"
            ) from exc
        return span
