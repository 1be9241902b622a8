"""A weak-keyed map whose keys' deaths run no Python: NOTE [ Finalizers and interrupts ].

``weakref.WeakKeyDictionary`` removes a dead key in a callback written in
Python, which runs wherever the key dies: a ``KeyboardInterrupt`` that
lands there is printed as "Exception ignored" and dropped. :class:`WeakKeyMap`
queues the dead key's reference with ``deque.append`` instead, a C call, and
forgets it at its next use. Keys are compared by identity, as objects that
define neither ``__eq__`` nor ``__hash__`` (storages, handles) are.

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
from collections import deque
from typing import Any, Generic, TypeVar, overload

__all__ = ["WeakKeyMap"]

V = TypeVar("V")


class _KeyRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a key that carries the key's id, its place in the map."""

    __slots__ = ("ident",)
    ident: int


class WeakKeyMap(Generic[V]):
    """Values by key, held while the key lives; the key's death runs no Python.

    Not thread-safe: callers hold their own lock, as they did around a
    ``WeakKeyDictionary``'s lookups that must agree.
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[_KeyRef, V]] = {}
        self._dead: deque[_KeyRef] = deque()

    def _forget_dead(self) -> None:
        dead, items = self._dead, self._items
        while True:
            try:
                ref = dead.popleft()
            except IndexError:  # empty, or emptied by another thread meanwhile
                return
            item = items.get(ref.ident)
            if item is not None and item[0] is ref:  # not a newer key at the same id
                items.pop(ref.ident, None)

    @overload
    def get(self, key: Any) -> V | None: ...

    @overload
    def get(self, key: Any, default: V) -> V: ...

    def get(self, key: Any, default: V | None = None) -> V | None:
        """The value of ``key``, or ``default``."""
        if self._dead:
            self._forget_dead()
        item = self._items.get(id(key))
        if item is None or item[0]() is not key:
            return default
        return item[1]

    def __setitem__(self, key: Any, value: V) -> None:
        if self._dead:
            self._forget_dead()
        ref = _KeyRef(key, self._dead.append)
        ref.ident = id(key)
        self._items[ref.ident] = (ref, value)

    def setdefault(self, key: Any, value: V) -> V:
        """The value of ``key``, set to ``value`` first if it has none."""
        found = self.get(key)
        if found is not None:
            return found
        self[key] = value
        return value

    def __len__(self) -> int:
        if self._dead:
            self._forget_dead()
        return len(self._items)

    def __bool__(self) -> bool:
        return len(self) > 0

    def clear(self) -> None:
        """Forget every key."""
        self._items.clear()
        self._dead.clear()
