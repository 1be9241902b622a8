"""The exceptions tierstore raises.

Every message starts with ``tierstore:``, gives the values involved and names
the setting to change. A failure on a background thread is re-raised at the
next call that depends on it, with the original exception as ``__cause__``.

Example:
    >>> import tierstore
    >>> try:
    ...     tierstore.TierConfig(disk_backend="tape")
    ... except tierstore.ConfigError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    ConfigError True
"""

from __future__ import annotations

import re

__all__ = [
    "DISK_HINT",
    "ConfigError",
    "CorruptDataError",
    "StoreClosedError",
    "TierFullError",
    "TierstoreError",
    "TierstoreWarning",
    "out_of_memory",
    "quoted",
]

#: The advice that ends every message about a failing disk.
DISK_HINT = "check the disk under disk_path (TIERSTORE_DISK_PATH)"


def quoted(exc: BaseException) -> str:
    """An error's message for quoting inside another: no prefix, no trailing :data:`DISK_HINT`.

    The message that quotes it gives its own advice.

    Example:
        >>> from tierstore.errors import DISK_HINT, TierstoreError, quoted
        >>> quoted(TierstoreError(f"tierstore: writing entry 3 failed: EIO; {DISK_HINT}"))
        'writing entry 3 failed: EIO'
    """
    return str(exc).removeprefix("tierstore: ").removesuffix(f"; {DISK_HINT}")


# NOTE [ Out of memory ]
# An allocation that fails raises torch.OutOfMemoryError on CUDA (and MPS),
# MemoryError from Python's own allocator, and on a CPU a RuntimeError from
# the default allocator ("DefaultCPUAllocator: can't allocate memory", the
# form RLIMIT_AS gives). Each can be caught, and a training loop that catches
# one and retries the step smaller is a common pattern. The messages of the
# first and the last say how much the failed allocation asked for: that is
# the least the step was short of, and what the store counts against the
# plan that ran it (NOTE [ A step that raised ] in tierstore/tier_store.py).
# A cgroup's limit is not one of these: the kernel kills the process
# (SIGKILL), which nothing in it can catch.
_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")
_ASKED = re.compile(r"tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)\b", re.IGNORECASE)
_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def out_of_memory(error: BaseException) -> int | None:
    """Whether ``error`` is an allocation that failed: the bytes it asked for, else ``None``.

    0 where the message does not say (NOTE [ Out of memory ]). An error that
    carries another as its ``__cause__`` (a read on the I/O thread that
    failed, re-raised at the unpack) is judged by that one.

    Example:
        >>> import torch
        >>> from tierstore.errors import out_of_memory
        >>> out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
        2097152
        >>> out_of_memory(RuntimeError(
        ...     "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"))
        4096
        >>> out_of_memory(MemoryError()), out_of_memory(ValueError("bad shape"))
        (0, None)
    """
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error)
    named = type(error).__name__ == "OutOfMemoryError" or isinstance(error, MemoryError)
    if not named and not (
        isinstance(error, RuntimeError) and any(t in text.lower() for t in _OOM_TEXTS)
    ):
        return None
    asked = _ASKED.search(text)
    if asked is None:
        return 0
    return int(float(asked.group(1)) * _UNITS[asked.group(2).lower()])


class TierstoreError(RuntimeError):
    """Root of every error tierstore raises on purpose.

    Example:
        >>> import tierstore
        >>> issubclass(tierstore.TierFullError, tierstore.TierstoreError)
        True
    """


def modified_in_place(
    shape: tuple[int, ...] | list[int], dtype: object, version: int, expected: int
) -> TierstoreError:
    """The error eager autograd raises for a saved tensor modified in place.

    One text for every kind of save: kept, stored, or rebuilt (NOTE [ Version check ]).

    Example:
        >>> err = modified_in_place((2, 3), "torch.float32", 1, 0)
        >>> print(err)  # doctest: +NORMALIZE_WHITESPACE
        tierstore: one of the variables needed for gradient computation has been modified by an
        inplace operation: a saved tensor of shape [2, 3] and dtype torch.float32 is at version 1;
        expected version 0 instead. Hint: clone the tensor before modifying it in place, or modify
        it before it is saved
    """
    return TierstoreError(
        "tierstore: one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: a saved tensor of shape {list(shape)} and dtype {dtype} is at "
        f"version {version}; expected version {expected} instead. Hint: clone the tensor "
        "before modifying it in place, or modify it before it is saved"
    )


class ConfigError(TierstoreError, ValueError):
    """A setting has a bad value, an unknown name, or conflicts with another.

    The message names the setting, where the value came from (argument,
    environment variable, TOML file and key) and the form expected.

    Example:
        >>> import tierstore
        >>> issubclass(tierstore.ConfigError, ValueError)
        True
    """


class TierFullError(TierstoreError):
    """No tier has room for a saved tensor; the message says which budget to raise.

    tierstore never drops an entry to make room: the tensor that did not fit
    raises this error in the operation that saved it.

    Example:
        >>> import tierstore
        >>> issubclass(tierstore.TierFullError, RuntimeError)
        True
    """


class StoreClosedError(TierstoreError):
    """The store was used after ``close()`` (``stats()`` still answers).

    Example:
        >>> import tierstore
        >>> store = tierstore.TierStore()
        >>> store.close()
        >>> try:
        ...     with store.offload():
        ...         pass
        ... except tierstore.StoreClosedError:
        ...     print("closed")
        closed
    """


class CorruptDataError(TierstoreError):
    """Bytes read back from a tier are not the bytes that were written.

    tierstore raises this instead of returning wrong data; the message names
    the entry, the tier and the file.

    Example:
        >>> import tierstore
        >>> issubclass(tierstore.CorruptDataError, tierstore.TierstoreError)
        True
    """


class TierstoreWarning(UserWarning):
    """Something went wrong that tierstore worked around without failing the step.

    Issued at most once per store for each kind of trouble (a failed disk
    write whose entry stayed in host memory, say); ``stats()`` counts the rest.

    Example:
        >>> import tierstore, warnings
        >>> issubclass(tierstore.TierstoreWarning, UserWarning)
        True
    """
