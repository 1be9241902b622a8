"""Deduplication: a storage, view and version saved again shares the entry that holds it.

The tier manager (:mod:`tierstore.tiers.manager`) looks a save up here under
its lock (:meth:`Dedupe.entry`) and registers each new entry in
:attr:`Dedupe.keys`; a release (:mod:`tierstore.tiers.release`) removes the
registration that is its own.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> mgr = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> t = torch.zeros(256)
    >>> a, b = mgr.put(t), mgr.put(t.view(16, 16).view(256))  # the same bytes, one entry
    >>> a.key == b.key, mgr.stats().deduplicated
    (True, 1)
    >>> mgr.close()
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tierstore.tiers.entry import Entry

__all__ = ["Dedupe", "dedupe_key_of"]

# NOTE [ Deduplication under threads ]
# The same storage, view and version saved again shares its entry: the
# lookup and the new reference are one step under the lock, and a release
# queued by a finalizer meanwhile is drained only after it (the entry then
# still has the new reference). put() may release the lock after a miss
# (backpressure waits for the write queue), and another thread may save the
# same tensor then: so put() looks again once it has the lock back, rather
# than store the bytes twice. Two entries can still share a dedupe key (a
# freed storage's address reused, the weak reference dead): a release then
# removes the registration only if it is its own.


def dedupe_key_of(t: torch.Tensor, storage: torch.UntypedStorage) -> tuple[Any, ...]:
    """What makes two saves the same bytes: storage address, view, dtype, device, version."""
    return (
        storage.data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
        t._version,
    )


class Dedupe:
    """The live entries by dedupe key, and how many saves shared one.

    ``entries`` is the tier manager's table, shared, not copied. Called under
    the manager's lock.
    """

    def __init__(self, entries: dict[int, Entry]) -> None:
        self._entries = entries
        #: A dedupe key's storage (weakly) and the key of the entry registered under it.
        self.keys: dict[tuple[object, ...], tuple[weakref.ref[object], int]] = {}
        self.hits = 0  # saves that shared an entry

    def entry(self, dedupe_key: tuple[Any, ...], storage: object) -> Entry | None:
        """The live entry already holding this storage, view and version, with one more ref."""
        hit = self.keys.get(dedupe_key)
        # The weak reference proves it is the same storage, not a new one
        # that happens to sit at a freed address.
        if hit is None or hit[0]() is not storage:
            return None
        entry = self._entries[hit[1]]
        entry.refs += 1
        self.hits += 1
        return entry
