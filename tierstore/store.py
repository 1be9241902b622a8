"""Deprecated: the tier manager moved to tierstore.tiers.manager.

``tierstore.store`` keeps working for a release: each name read from it
warns with a :class:`DeprecationWarning` and comes from ``tierstore.tiers.manager``.

Example:
    >>> import warnings
    >>> import tierstore.store
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = tierstore.store.__getattr__  # the stub's own name: no warning
    >>> caught
    []
"""

from tierstore._moved import moved_to

# The old names, as they were; each resolves through __getattr__ below.
__all__ = ["TierManager", "resting_nbytes"]  # noqa: F822

__getattr__ = moved_to(__name__, "tierstore.tiers.manager")
