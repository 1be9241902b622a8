"""The small object autograd keeps in place of an offloaded saved tensor.

Example:
    >>> import torch, tierstore
    >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0, disk_budget=0))
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> with store.offload():
    ...     y = x.sin()
    >>> h = y.grad_fn._raw_saved_self  # what the graph holds
    >>> store.close()
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["Handle", "Saved"]


class Saved:
    """A saved tensor's metadata at pack time, and what the eager in-place check needs.

    The base of what autograd holds in its place: a :class:`Handle` (stored)
    or a recompute ``Recipe`` (rebuilt in backward).

    Attributes:
        shape, dtype, stride, device: the saved tensor's, at pack time.
        version: the saved tensor's version counter at pack time.

    Example:
        >>> import torch
        >>> from tierstore.tiers.handle import Saved
        >>> t = torch.zeros(2, 3)
        >>> saved = Saved(t.t())
        >>> saved.stride, saved.sources()[1] is t
        ((1, 3), True)
    """

    __slots__ = (
        "__weakref__",
        "_base",
        "_source",
        "device",
        "dtype",
        "shape",
        "stride",
        "version",
    )

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.dtype = t.dtype
        self.device = t.device
        self.version = t._version
        # Weak: holding the saved tensor would keep the memory offload frees.
        # While anyone else keeps it alive, it can be modified in place, and
        # that is what the version check at unpack must see.
        self._source = weakref.ref(t)
        # A view shares its base's version counter, and the base may outlive it.
        base = t._base
        self._base = weakref.ref(base) if base is not None else None

    def source(self) -> torch.Tensor | None:
        """The tensor that was saved, if something still keeps it alive."""
        return self._source()

    def sources(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The saved tensor and, for a view, its base: whichever are still alive."""
        return self._source(), self._base() if self._base is not None else None


class Handle(Saved):
    """A reference to one stored entry, with the tensor's metadata at pack time.

    When autograd drops the handle (after backward, or when a graph is
    discarded without one) its entry's reference count drops; the last
    handle of an entry frees it. Unpacking does not free anything, so a
    ``retain_graph=True`` backward can unpack again.

    Attributes:
        key: the entry this handle refers to.
        shape, dtype, stride, device, version: as :class:`Saved`.

    Example:
        >>> import torch
        >>> from tierstore.tiers.handle import Handle
        >>> t = torch.zeros(2, 3)
        >>> Handle(0, t).shape
        (2, 3)
    """

    __slots__ = ("key",)

    def __init__(self, key: int, t: torch.Tensor) -> None:
        super().__init__(t)
        self.key = key

    def __repr__(self) -> str:
        return (
            f"Handle(key={self.key}, shape={self.shape}, dtype={self.dtype}, device={self.device})"
        )
