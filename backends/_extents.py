"""Extents of a fixed-size region: the allocator of the file backend and the host pool.

NOTE [ Extent allocation ]

Backward frees saved tensors newest first, so space is managed as a stack:
a bump pointer ``top`` hands out new extents, and freeing the extent that
ends at ``top`` just lowers it; both are O(1). Anything freed out of order
goes to a free list of coalesced extents below ``top``. When ``top`` comes
down to the highest free extent, that extent is folded back into the stack.

A new extent comes from the free list first (first fit, lowest offset),
and from ``top`` only when no free extent fits. Freed in the order they
were taken (a queue: the write staging of forward, the read-ahead window
of backward), extents would otherwise walk ``top`` across the whole region
while little of it is in use, and every page they pass stays resident
(NOTE [ Leased buffers ] in host.py) or grows the spill file. Reusing the
lowest free space keeps the touched part of the region near the most that
was ever in use at once. In the stack pattern the free list is empty, so
both paths stay O(1) there.
"""

from __future__ import annotations

import bisect

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Extents of a fixed-size region: a stack plus a coalesced free list.

    See ``NOTE [ Extent allocation ]``. Not thread-safe: its owner (the file
    backend, the pinned host pool) holds a lock around every call.

    Example:
        >>> from tierstore.backends._extents import ExtentAllocator
        >>> a = ExtentAllocator(16)
        >>> a.allocate(8), a.allocate(8), a.allocate(1)
        (0, 8, None)
        >>> a.free(8, 8)
        >>> a.top
        8
    """

    __slots__ = ("_lengths", "_offsets", "capacity", "top")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.top = 0
        # Free extents below top, sorted by offset, never adjacent to each
        # other nor ending at top (those are merged / folded into the stack).
        self._offsets: list[int] = []
        self._lengths: list[int] = []

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """The free list as ``(offset, length)`` pairs, lowest offset first."""
        return list(zip(self._offsets, self._lengths, strict=True))

    def free_bytes(self) -> int:
        """All free bytes: the free list plus the room above ``top``."""
        return self.capacity - self.top + sum(self._lengths)

    def largest_free(self) -> int:
        """The longest extent :meth:`allocate` could hand out now."""
        return max([self.capacity - self.top, *self._lengths])

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new extent of ``nbytes``, or ``None`` if none fits."""
        for i, length in enumerate(self._lengths):
            if length >= nbytes:
                offset = self._offsets[i]
                if length == nbytes:
                    del self._offsets[i]
                    del self._lengths[i]
                else:
                    self._offsets[i] = offset + nbytes
                    self._lengths[i] = length - nbytes
                return offset
        if self.top + nbytes <= self.capacity:
            offset = self.top
            self.top += nbytes
            return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent ``[offset, offset + nbytes)``.

        Raises:
            ValueError: The extent is not inside the allocated space, or
                overlaps a free one (a double free).
        """
        if nbytes == 0:
            return
        end = offset + nbytes
        if offset < 0 or end > self.top:
            raise ValueError(f"extent [{offset}, {end}) is not below top={self.top}")
        offsets, lengths = self._offsets, self._lengths
        if end == self.top:
            # The hot path: backward frees newest first.
            if offsets and offsets[-1] + lengths[-1] > offset:
                raise ValueError(f"extent [{offset}, {end}) overlaps a free extent")
            self.top = offset
            if offsets and offsets[-1] + lengths[-1] == offset:
                # Coalescing keeps free extents apart, so one fold is enough.
                self.top = offsets.pop()
                lengths.pop()
            return
        i = bisect.bisect_left(offsets, offset)
        if (i > 0 and offsets[i - 1] + lengths[i - 1] > offset) or (
            i < len(offsets) and offsets[i] < end
        ):
            raise ValueError(f"extent [{offset}, {end}) overlaps a free extent")
        joins_prev = i > 0 and offsets[i - 1] + lengths[i - 1] == offset
        joins_next = i < len(offsets) and offsets[i] == end
        if joins_prev and joins_next:
            lengths[i - 1] += nbytes + lengths[i]
            del offsets[i]
            del lengths[i]
        elif joins_prev:
            lengths[i - 1] += nbytes
        elif joins_next:
            offsets[i] = offset
            lengths[i] += nbytes
        else:
            offsets.insert(i, offset)
            lengths.insert(i, nbytes)
