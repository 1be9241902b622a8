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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiofiles.os
import torch

from tierstore import codec
from tierstore.backends import backend_class
from tierstore.backends.base import Backend
from tierstore.config import TierConfig
from tierstore.errors import CorruptDataError, StoreClosedError

__all__ = ["Pipeline", "Record"]

T = TypeVar("T")

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


@aiofiles.os.wrap  # type: ignore[untyped-decorator]
def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on the loop's executor (aiofiles' wrapper makes it awaitable)."""
    return fn(*args)


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
        >>> Pipeline(TierConfig(disk_budget=0)).to_host(torch.ones(2)).device
        device(type='cpu')
    """

    def __init__(self, config: TierConfig) -> None:
        self._config = config
        self._backend: Backend[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()
        self._closed = False

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

    def _running_loop(self) -> asyncio.AbstractEventLoop:
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
                    target=loop.run_forever, name="tierstore-loop", daemon=True
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
        if loop is not None and thread is not None and executor is not None:
            # Cancel what is still queued (a read waiting for a write, say), let
            # the cancellations run, then stop; started syscalls finish first.
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            executor.shutdown(wait=True, cancel_futures=True)
            loop.close()
        if backend is not None:
            backend.close()

    # -- host <-> device ---------------------------------------------------------

    def to_host(self, span: torch.Tensor) -> torch.Tensor:
        """A host-memory span with the same elements (the span itself on CPU)."""
        if span.device.type == "cpu":
            return span
        pin = torch.cuda.is_available()
        host = torch.empty(span.shape, dtype=span.dtype, pin_memory=pin)
        host.copy_(span)
        return host

    def to_device(self, span: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The span on ``device`` (no copy when it is already there)."""
        return span if span.device == device else span.to(device)

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
    ) -> concurrent.futures.Future[Record]:
        """Encode ``span`` and write it under ``key`` in the background.

        ``span`` must stay unchanged until the future is done. ``done``, if
        given, runs on the I/O thread when the write ends; it must not block.
        """
        future = asyncio.run_coroutine_threadsafe(self._write(key, span), self._running_loop())
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
        return asyncio.run_coroutine_threadsafe(self._read(key, record), self._running_loop())

    def delete(self, key: int) -> None:
        """Free the disk record under ``key`` (on the caller's thread: it is bookkeeping)."""
        self._backend_or_open().delete(key)

    async def _write(self, key: int, span: torch.Tensor) -> Record:
        backend = self._backend_or_open()
        compression = self._config.compression
        if compression == "none":  # a header and a view of the span: nothing to offload
            frame = codec.encode(span)
        else:
            frame = await _blocking(codec.encode, span, compression, self._config.compression_level)
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
            record = await asyncio.shield(asyncio.wrap_future(record))
        backend = self._backend_or_open()
        header = bytearray(len(record.header))
        payload = codec.payload_tensor(record.meta)
        await _blocking(backend.read_into, key, [memoryview(header), codec.byte_view(payload)])
        if header != record.header:
            raise CorruptDataError(
                f"tierstore: entry {key} on the disk tier came back with another header "
                f"(in {backend.directory}); its bytes were changed after they were written"
            )
        if record.meta.codec == "none":
            return codec.decode(record.meta, payload)
        span: torch.Tensor = await _blocking(codec.decode, record.meta, payload)
        return span
