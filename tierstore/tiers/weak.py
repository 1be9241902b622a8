"""A weak-keyed map whose keys' deaths run no Python: NOTE [ Finalizers and interrupts ].

``weakref.WeakKeyDictionary`` removes a dead key in a callback written in
Python, which runs wherever the key dies: a ``KeyboardInterrupt`` that
lands there is printed as "Exception ignored" and dropped. :class:`WeakKeyMap`
files each value under its key's weak reference, whose callback is the
table's ``dict.pop``, a C call: the value goes as its key dies. Keys are
compared by identity, as objects that define neither ``__eq__`` nor
``__hash__`` (storages, handles) are.

Example:
    >>> import gc
    >>> from tierstore.tiers.weak import WeakKeyMap
    >>> class Key: ...
    >>> k, m = Key(), WeakKeyMap()
    >>> m.setdefault(k, []).append(1); m.get(k)
    [1]
    >>> del k; _ = gc.collect(); len(m)
    0
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar, overload

__all__ = ["WeakKeyMap"]

V = TypeVar("V")


class _KeyRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a key; hashed while the key lives, as the key hashes."""

    __slots__ = ()


class WeakKeyMap(Generic[V]):
    """Values by key, held while the key lives; the key's death runs no Python.

    Each value sits under the weak reference to its key, whose callback is
    the map's own ``dict.pop``: as the key dies, the C runtime drops the
    value with it (no Python runs, and nothing waits for the map's next
    use, so a value holding memory lets it go with its key). Not
    thread-safe: callers hold their own lock, as they did around a
    ``WeakKeyDictionary``'s lookups that must agree.
    """

    def __init__(self) -> None:
        self._items: dict[_KeyRef, V] = {}

    @overload
    def get(self, key: Any) -> V | None: ...

    @overload
    def get(self, key: Any, default: V) -> V: ...

    def get(self, key: Any, default: V | None = None) -> V | None:
        """The value of ``key``, or ``default``."""
        # A live reference equals another to the same key, and hashes as it.
        probe: Any = weakref.ref(key)
        return self._items.get(probe, default)

    def __getitem__(self, key: Any) -> V:
        probe: Any = weakref.ref(key)
        return self._items[probe]

    def __contains__(self, key: Any) -> bool:
        return weakref.ref(key) in self._items

    def __setitem__(self, key: Any, value: V) -> None:
        # Hashed here, while the key lives: its dead reference finds its place.
        # A key already there keeps its reference; this one goes unused, and a
        # reference that dies before its key never calls back.
        items = self._items
        items[_KeyRef(key, items.pop)] = value

    def setdefault(self, key: Any, value: V) -> V:
        """The value of ``key``, set to ``value`` first if it has none."""
        found = self.get(key)
        if found is not None:
            return found
        self[key] = value
        return value

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def clear(self) -> None:
        """Forget every key.

        The old table goes to its keys' callbacks, each of which pops its
        own from it as its key dies: none finds its key missing.
        """
        self._items = {}
