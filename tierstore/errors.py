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

__all__ = [
    "DISK_HINT",
    "ConfigError",
    "CorruptDataError",
    "StoreClosedError",
    "TierFullError",
    "TierstoreError",
    "TierstoreWarning",
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
