"""Resting places for bytes on disk: the ``file`` and ``lmdb`` backends.

A backend keeps keyed records in a private spill directory and knows nothing
about autograd, placement or streams (see :class:`Backend` for the contract).
``TierConfig.disk_backend`` names one; :func:`backend_class` maps the name to
the class. Importing this package opens nothing.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from tierstore.backends import backend_class
    >>> backend = backend_class("file")(Path(tempfile.mkdtemp()), capacity_bytes=1 << 20)
    >>> backend.write(0, [b"bytes at rest"])
    4096
    >>> backend.close()
"""

from __future__ import annotations

from typing import Any

from tierstore.backends.base import Backend
from tierstore.backends.file import FileBackend
from tierstore.backends.lmdb import LmdbBackend
from tierstore.errors import ConfigError

__all__ = ["Backend", "FileBackend", "LmdbBackend", "backend_class"]

_BACKENDS: dict[str, type[Backend[Any]]] = {cls.name: cls for cls in (FileBackend, LmdbBackend)}


def backend_class(name: str) -> type[Backend[Any]]:
    """The backend class that ``TierConfig.disk_backend=name`` selects.

    Args:
        name: ``"file"`` or ``"lmdb"``.

    Raises:
        ConfigError: ``name`` is not a backend.

    Example:
        >>> from tierstore.backends import LmdbBackend, backend_class
        >>> backend_class("lmdb") is LmdbBackend
        True
    """
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        expected = ", ".join(repr(n) for n in _BACKENDS)
        raise ConfigError(
            f"tierstore: disk_backend={name!r} is not a backend; expected one of {expected}"
        ) from None
