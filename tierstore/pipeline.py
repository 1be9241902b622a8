"""Movers: the copies between tiers, and the disk backend they drive.

The tier manager decides *what* moves where; this layer does the moving. In
this version every move is synchronous. The seam is where DESIGN.md puts it:
background writers, the read-ahead schedule and CUDA copy streams replace the
bodies of these methods without changing the tier manager.

Example:
    >>> import tempfile, torch
    >>> from tierstore import TierConfig
    >>> from tierstore.pipeline import Pipeline
    >>> pipe = Pipeline(TierConfig(disk_path=tempfile.mkdtemp(), disk_budget="1MiB"))
    >>> frame = pipe.encode(torch.arange(10.0))
    >>> record = pipe.write(1, frame)
    >>> pipe.read(1, record).tolist()[:3]
    [0.0, 1.0, 2.0]
    >>> pipe.delete(1); pipe.close(); pipe.close()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierstore import codec
from tierstore.backends import backend_class
from tierstore.backends.base import Backend
from tierstore.config import TierConfig
from tierstore.errors import CorruptDataError, StoreClosedError

__all__ = ["Pipeline", "Record"]


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

    Owns the disk backend, which it opens on the first write (so a store
    that never spills never touches the disk) and closes in :meth:`close`.

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
        self._closed = False

    @property
    def backend(self) -> Backend[Any]:
        """The disk backend, opened on first use."""
        if self._closed:
            raise StoreClosedError("tierstore: this store is closed; its disk tier is gone")
        if self._backend is None:
            cls = backend_class(self._config.disk_backend)
            self._backend = cls(self._config.disk_path, int(self._config.disk_budget))
        return self._backend

    @property
    def backend_if_open(self) -> Backend[Any] | None:
        """The disk backend if a write has opened it, else ``None``."""
        return self._backend

    # -- host <-> device ---------------------------------------------------

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

    # -- host <-> disk -----------------------------------------------------

    def encode(self, span: torch.Tensor) -> codec.Frame:
        """Frame a span for the disk tier with the configured compression."""
        return codec.encode(
            self.to_host(span), self._config.compression, self._config.compression_level
        )

    def footprint(self, frame: codec.Frame) -> int:
        """Disk bytes ``frame`` would take."""
        return self.backend.footprint(frame.nbytes)

    def write(self, key: int, frame: codec.Frame) -> Record:
        """Write ``frame`` under ``key``; the backend raises TierFullError when it has no room."""
        footprint = self.backend.write(key, [frame.header, frame.payload])
        return Record(frame.header, codec.parse_header(frame.header), footprint)

    def read(self, key: int, record: Record) -> torch.Tensor:
        """Read the span written under ``key`` back into a new CPU tensor."""
        header = bytearray(len(record.header))
        payload = codec.payload_tensor(record.meta)
        self.backend.read_into(key, [memoryview(header), codec.byte_view(payload)])
        if header != record.header:
            raise CorruptDataError(
                f"tierstore: entry {key} on the disk tier came back with another header "
                f"(in {self.backend.directory}); its bytes were changed after they were written"
            )
        return codec.decode(record.meta, payload)

    def delete(self, key: int) -> None:
        """Free the disk record under ``key``."""
        self.backend.delete(key)

    def close(self) -> None:
        """Close the disk backend and remove its spill directory. Idempotent."""
        self._closed = True
        if self._backend is not None:
            self._backend.close()
            self._backend = None
