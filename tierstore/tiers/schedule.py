"""The unpack schedule: in which order backward will want the saved tensors.

PyTorch does not specify the order of unpack calls. So the store *records*
the order it observes in each backward and, when the next step packs the
same sequence (same count, shapes and dtypes), plans its prefetch in that
recorded order; otherwise it falls back to reverse pack order, which is
reverse-topological for a chain. See ``NOTE [ Steps ]``.

Example:
    >>> from tierstore.tiers.schedule import Schedule
    >>> s = Schedule()
    >>> for key in (10, 11, 12):
    ...     s.packed(key, ((4,), "float32"))
    >>> s.unpacked(11)               # backward starts: a plan is made
    >>> s.plan_source
    'reverse'
    >>> [s.next_planned() for _ in range(3)]
    [12, 11, 10]
    >>> s.unpacked(12); s.unpacked(10)
    >>> for key in (20, 21, 22):     # the next step packs the same sequence
    ...     s.packed(key, ((4,), "float32"))
    >>> s.unpacked(21)
    >>> s.plan_source, [s.next_planned() for _ in range(3)]
    ('recorded', [21, 22, 20])
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Schedule"]

# NOTE [ Steps ]
# A step is the packs of a forward pass followed by the unpacks of its
# backward. The first unpack after packing starts backward: the plan is made
# then, from the packs seen so far. The first pack after unpacking starts the
# next step: the unpack order just observed becomes the recording, kept with
# the signature (shape and dtype of every pack) it belongs to. Only first
# unpacks are recorded, so a retain_graph=True second backward or a tensor
# saved by several ops does not disturb the order.


class Schedule:
    """Pack order, observed unpack order, and the plan for the next prefetch.

    Not thread-safe: the tier manager calls it under its lock.

    Example:
        >>> from tierstore.tiers.schedule import Schedule
        >>> s = Schedule()
        >>> s.packed(1, "a"); s.packed(2, "b")
        >>> s.unpacked(2)
        >>> s.next_planned(), s.next_planned(), s.next_planned()
        (2, 1, None)
    """

    def __init__(self) -> None:
        self._keys: list[int] = []
        self._signature: list[Hashable] = []
        self._index: dict[int, int] = {}
        self._order: list[int] = []  # pack indices, in order of first unpack
        self._recorded: tuple[tuple[Hashable, ...], list[int]] | None = None
        self._plan: list[int] = []
        self._cursor = 0
        self.unpacking = False
        #: ``"recorded"`` or ``"reverse"``: where the current plan came from.
        self.plan_source = "reverse"

    def packed(self, key: int, signature: Hashable) -> None:
        """A new entry was stored (dedupe hits are not new entries)."""
        if self.unpacking:
            self._end_step()
        self._index[key] = len(self._keys)
        self._keys.append(key)
        self._signature.append(signature)

    def begin(self) -> None:
        """Backward begins: make the plan, unless this backward has begun already."""
        if not self.unpacking:
            self.unpacking = True
            self._plan = self._make_plan()
            self._cursor = 0

    def unpacked(self, key: int) -> None:
        """An entry was asked for; the first call of a backward makes the plan (:meth:`begin`)."""
        self.begin()
        index = self._index.pop(key, None)
        if index is not None:  # first unpack of an entry of this step
            self._order.append(index)

    def next_planned(self) -> int | None:
        """The next key in the plan, or ``None`` when the plan is used up."""
        if self._cursor >= len(self._plan):
            return None
        key = self._plan[self._cursor]
        self._cursor += 1
        return key

    def _make_plan(self) -> list[int]:
        n = len(self._keys)
        rec = self._recorded
        if rec is not None and rec[0] == tuple(self._signature):
            order = rec[1]
            seen = set(order)
            # Entries the recording never saw unpacked go last, newest first.
            order = order + [i for i in range(n - 1, -1, -1) if i not in seen]
            self.plan_source = "recorded"
            return [self._keys[i] for i in order]
        self.plan_source = "reverse"
        return self._keys[::-1]

    def abandon(self) -> None:
        """The step under way raised: its packs and unpacks are no recording.

        The recording of the last step that ended stays.
        """
        self._keys, self._signature, self._order = [], [], []
        self._index.clear()
        self._plan, self._cursor = [], 0
        self.unpacking = False

    def _end_step(self) -> None:
        self._recorded = (tuple(self._signature), self._order)
        self._keys, self._signature, self._order = [], [], []
        self._index.clear()
        self._plan, self._cursor = [], 0
        self.unpacking = False
