"""Deprecated: the public store, offload() and keep() are imported from tierstore.

``tierstore.hooks`` keeps working for a release: each name read from it
warns with a :class:`DeprecationWarning` and comes from ``tierstore``.

Example:
    >>> import warnings
    >>> import tierstore.hooks
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = tierstore.hooks.__getattr__  # the stub's own name: no warning
    >>> caught
    []
"""

from tierstore._moved import moved_to

# The old names, as they were; each resolves through __getattr__ below.
__all__ = ["TierStore", "keep", "keep_module", "offload", "offload_module"]  # noqa: F822

__getattr__ = moved_to(
    __name__,
    "tierstore",
    "tierstore.offloading",
    "tierstore.autograd.quiet",
    "tierstore.autograd.regions",
    "tierstore.tier_store",
)
