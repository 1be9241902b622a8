"""``keep()`` and ``keep_module()``: saves sent to a named tier, the device by default.

Example:
    >>> import tierstore
    >>> from tierstore.autograd.state import local
    >>> with tierstore.keep(tier="disk"):
    ...     local.tier
    'disk'
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from tierstore.autograd.quiet import Quiet, asleep, woken
from tierstore.autograd.recompute import never_traced
from tierstore.autograd.state import local
from tierstore.errors import ConfigError
from tierstore.stats import TIERS, Tier

__all__ = ["keep", "keep_module"]

# NOTE [ Named tiers ]
# keep(tier=...) and keep_module(..., tier=...) set a thread-local requested
# tier, the innermost one winning. "device" keeps the tensor as it is, outside
# every budget (what keep() has always meant). "host" and "disk" still pass the
# filter of NOTE [ What stays on the device ] and then ask the tier manager to
# place the entry starting at that tier instead of the fastest one: budgets
# hold downward as placement always does (a tier over budget demotes its
# oldest entries, a tier with budget 0 is skipped). This layer passes a tier
# name and nothing else; where the bytes go is the tier manager's business.


def requested_tier() -> Tier | None:
    """The tier the innermost keep() asks for, ``None`` outside any (NOTE [ Named tiers ])."""
    tier = local.tier  # "as is" lasts only while checkpoint saves a module's inputs
    return "device" if tier == "as is" else tier


def checked_tier(tier: object, where: str) -> Tier:
    """``tier`` if it names a tier, else a ConfigError that names ``where``."""
    for name in TIERS:
        if tier == name:
            return name
    raise ConfigError(
        f"tierstore: {where}(tier={tier!r}) names no tier; use one of "
        + ", ".join(repr(t) for t in TIERS)
    )


class _Keeping:
    """A :func:`keep` block: ``tier`` asked for while it lasts, then what was asked before.

    NOTE [ Hooks and Dynamo ]: never traced, so that in a function
    torch.compile'd whole the block runs as the code reaches it (a traced
    block would guard on the thread-local tier it sets, and fail that guard
    in the frame that set it), and a module compiled inside it saves into it.
    """

    __slots__ = ("_before", "_tier")

    def __init__(self, tier: Tier) -> None:
        self._tier = tier
        self._before: list[tuple[Tier | None, Quiet | None]] = []  # one per entry: it nests

    @never_traced
    def __enter__(self) -> None:
        self._before.append((requested_tier(), woken()))
        local.tier = self._tier

    @never_traced
    def __exit__(self, *exc: object) -> None:
        local.tier, quiet = self._before.pop()
        asleep(quiet)


def keep(tier: Tier = "device") -> contextlib.AbstractContextManager[None]:
    """Send every tensor saved inside this block to ``tier``, even under ``offload()``.

    ``tier="device"`` (the default) keeps them on the device as they are,
    outside every budget: use it for the last layers, whose saved tensors
    backward needs first, or for anything you know fits. ``"host"`` or
    ``"disk"`` place them starting at that tier instead of the fastest one
    with room; budgets still hold downward, as placement always does (a tier
    with budget 0 is skipped, one that is full demotes its oldest entries).
    Parameters and tensors under ``min_offload_bytes`` stay on the device
    either way. Nests (the innermost wins); thread-local; outside an
    ``offload()`` block it changes nothing.

    Args:
        tier: ``"device"``, ``"host"`` or ``"disk"``.

    Raises:
        ConfigError: ``tier`` names no tier.

    Example:
        >>> import tempfile, torch, tierstore
        >>> head = torch.nn.Linear(16, 4)
        >>> store = tierstore.TierStore(tierstore.TierConfig(
        ...     device_budget="1GiB", disk_path=tempfile.mkdtemp(), min_offload_bytes=0))
        >>> h = torch.randn(8, 16, requires_grad=True)
        >>> with store.offload():
        ...     z = h.exp()                      # within device_budget: stays
        ...     with tierstore.keep(tier="disk"):
        ...         y = (z * 2).sin()            # asked for the disk
        ...     with tierstore.keep():
        ...         logits = head(y)             # kept as it is
        >>> store.stats().tiers["disk"].entries, store.stats().kept > 0
        (1, True)
        >>> logits.sum().backward(); store.close()
    """
    return _Keeping(checked_tier(tier, "tierstore.keep"))


class _KeepModule:
    """The hooks :func:`keep_module` put on a module; :meth:`remove` takes them off."""

    def __init__(self, module: torch.nn.Module, tier: Tier) -> None:
        self._tier = tier
        self._at_entry = threading.local()
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            # always_call: a forward that raises still leaves the keep() block.
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _stack(self) -> list[tuple[Tier | None, Quiet | None]]:
        stack: list[tuple[Tier | None, Quiet | None]] | None = getattr(
            self._at_entry, "stack", None
        )
        if stack is None:
            stack = self._at_entry.stack = []
        return stack

    # NOTE [ Hooks and Dynamo ]: under a whole-model torch.compile these run
    # as the compiled code reaches the module, not traced into its graph (a
    # traced hook would guard on the thread-local it sets, then fail it).
    @never_traced
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._stack().append((requested_tier(), woken()))
        local.tier = self._tier

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            local.tier, quiet = stack.pop()
            asleep(quiet)

    def remove(self) -> None:
        """Stop sending this module's saved tensors to the tier. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def keep_module(module: torch.nn.Module, tier: Tier = "device") -> _KeepModule:
    """Send every tensor saved inside ``module``'s forward to ``tier``, as :func:`keep` does.

    With the default ``tier="device"``: for modules whose saved tensors
    backward needs first or that are cheap to keep, such as the output head.
    ``"host"`` or ``"disk"`` place them starting at that tier (NOTE [ Named
    tiers ]). Returns a handle whose ``remove()`` undoes it. Thread-local,
    like :func:`keep`: it applies to the thread that runs the forward.

    Args:
        module: the module whose forward's saves go to ``tier``.
        tier: ``"device"``, ``"host"`` or ``"disk"``.

    Raises:
        ConfigError: ``tier`` names no tier.

    Example:
        >>> import torch, tierstore
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
        ...                             torch.nn.Linear(16, 4))
        >>> handle = tierstore.keep_module(model[2])
        >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0, disk_budget=0))
        >>> with store.offload():
        ...     out = model(torch.randn(8, 16))
        >>> store.stats().kept  # the head's input stays; its weight is a parameter
        2
        >>> out.sum().backward(); handle.remove(); store.close()
    """
    return _KeepModule(module, checked_tier(tier, "tierstore.keep_module"))
