"""Forked children: what a child leaves to the parent that forked it.

NOTE [ Forked children ]

A process that forks while a store is open (a DataLoader worker, a helper
that calls ``os.fork``) gets a copy of every store object but only the
forking thread: the event loop's thread, the I/O workers and whatever locks
they held exist in the parent alone, while the spill files and the LMDB
environment are the parent's, shared. Left to themselves, the child's copies
would close at its exit (atexit, finalizers) a loop that no thread runs
(asyncio raises "Cannot close a running event loop"), wait for requests no
thread serves, and release the entries of the child's copy of a graph,
which on LMDB deletes the parent's records from the shared file.

So every object that owns such a resource registers with
:func:`leave_to_parent`, and in the child, right after the fork
(``os.register_at_fork``), each is told :meth:`ForkAware._forked`: it
marks itself closed without touching what it owns, and replaces the locks
a thread of the parent may have held at the fork. From then on, in the
child, ``close()`` does nothing and using the store raises
:class:`~tierstore.StoreClosedError` saying why; ``tierstore.offload()``
opens a store of the child's own. The spill directory needs no hook: only
the process that made it removes it (``NOTE [ Spill directory lifecycle ]``
in ``tierstore/backends/_spill.py``).

Example:
    >>> from tierstore.tiers.forks import leave_to_parent
    >>> class Owner:
    ...     closed = False
    ...     def _forked(self) -> None:  # in the child only
    ...         self.closed = True
    >>> owner = Owner(); leave_to_parent(owner); owner.closed
    False
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["ForkAware", "forked_message", "leave_to_parent"]


class ForkAware(Protocol):
    """An owner of threads, locks or files that a forked child must leave alone."""

    def _forked(self) -> None:
        """Runs in a forked child: mark closed, replace locks, touch nothing owned."""


_owners: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def leave_to_parent(owner: ForkAware) -> None:
    """Call ``owner._forked()`` in every child forked while ``owner`` lives (NOTE above).

    Example:
        >>> from tierstore.tiers.forks import leave_to_parent
        >>> class Owner:
        ...     def _forked(self) -> None:
        ...         pass
        >>> leave_to_parent(Owner())
    """
    _owners.add(owner)


def forked_message(what: str, parent: int) -> str:
    """The error for using, in a forked child, ``what`` that belongs to ``parent``.

    Example:
        >>> from tierstore.tiers.forks import forked_message
        >>> forked_message("this TierStore", 1).startswith("tierstore: this TierStore belongs")
        True
    """
    return (
        f"tierstore: {what} belongs to process {parent}, and this process ({os.getpid()}) "
        "is a fork of it: a forked child cannot use its parent's store or the saved tensors "
        "in it. Open a TierStore (or use tierstore.offload()) in the child"
    )


def _after_fork_in_child() -> None:
    # Runs with only this thread alive; each hook only assigns attributes.
    for owner in list(_owners):
        owner._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
