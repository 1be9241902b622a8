"""The contract every disk backend keeps.

A backend is a resting place for bytes. It knows nothing about autograd,
placement or streams: the store hands it a record as a list of buffers and a
key, and later asks for the same bytes back, scattered into buffers it owns.

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
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

__all__ = ["Backend", "Buffer"]

#: Anything that exposes the buffer protocol: ``bytes``, ``bytearray``,
#: ``memoryview``, or a memoryview onto a tensor's memory.
Buffer = bytes | bytearray | memoryview


class Backend(abc.ABC):
    """A disk tier: one private spill directory holding keyed records.

    A backend owns its spill directory (created on construction under
    ``root``, mode 0700, removed by :meth:`close` and at interpreter exit)
    and everything in it. Keys are non-negative integers chosen by the
    caller; a key is written once and deleted once.

    Capacity is accounted in *footprint* bytes, the space a record really
    takes (alignment, pages), so that the caller can check a budget before
    writing.

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

    @abc.abstractmethod
    def __init__(self, root: Path, capacity_bytes: int) -> None:
        """Create the spill directory under ``root``, with room for ``capacity_bytes``.

        Every backend is built this way: the pipeline calls the class that
        :func:`tierstore.backends.backend_class` returns as
        ``cls(disk_path, disk_budget)``.
        """

    @property
    @abc.abstractmethod
    def directory(self) -> Path:
        """The private spill directory this backend owns."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Footprint bytes this backend can hold at most."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Footprint bytes held now by live records."""

    @abc.abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Bytes a record of ``nbytes`` would take from :attr:`capacity_bytes`."""

    @abc.abstractmethod
    def write(self, key: int, chunks: Sequence[Buffer]) -> int:
        """Store the concatenation of ``chunks`` under ``key``.

        Returns the record's footprint. Raises
        :class:`~tierstore.TierFullError` (naming ``disk_budget``) when there
        is no room, and leaves nothing behind for ``key`` in that case.
        """

    @abc.abstractmethod
    def read_into(self, key: int, views: Sequence[memoryview]) -> None:
        """Fill ``views``, in order, with the record's bytes.

        The views' lengths must add up to the record's length; a record that
        is shorter or longer raises :class:`~tierstore.CorruptDataError`.
        """

    @abc.abstractmethod
    def delete(self, key: int) -> None:
        """Free the record under ``key``; its space can be reused at once."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of live records."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every file handle and remove the spill directory.

        Idempotent: calling it again does nothing.
        """
