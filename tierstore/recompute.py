"""Deprecated: rebuild recipes moved to tierstore.autograd.recompute.

``tierstore.recompute`` keeps working for a release: each name read from it
warns with a :class:`DeprecationWarning` and comes from ``tierstore.autograd.recompute``.

Example:
    >>> import warnings
    >>> import tierstore.recompute
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = tierstore.recompute.__getattr__  # the stub's own name: no warning
    >>> caught
    []
"""

from tierstore._moved import moved_to

# The old names, as they were; each resolves through __getattr__ below.
__all__ = [  # noqa: F822
    "CHEAP_OPS",
    "GRAPH_OPS",
    "GraphOp",
    "Policy",
    "Recipe",
    "Recorder",
    "cheap",
    "everything",
    "graph_op",
    "graph_recipe",
    "never_traced",
]

__getattr__ = moved_to(
    __name__,
    "tierstore.autograd.recompute",
    "tierstore.autograd.recorder",
    "tierstore.autograd.recipes",
    "tierstore.autograd.graph",
)
