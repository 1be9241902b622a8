"""What the tier manager takes its limits from, and what it hands back to measure them.

The tiers never import planning: under ``activation_budget`` the public
``TierStore`` builds the plan's runner from the manager's :class:`Measures`
(its clocks and waits) and has the manager follow it as :class:`Limits`,
an object that answers in numbers. Nothing here imports the runner; any
object with these members will do (a test passes its own).

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> manager = TierManager(TierConfig(device_budget=0, disk_budget=0))
    >>> sorted(manager.measures())  # doctest: +NORMALIZE_WHITESPACE
    ['cpu_step_began', 'device_links', 'events', 'io_cpu', 'page_fault_s', 'reads',
     'waits', 'writes']
    >>> manager.limits is None  # follows nothing: the config's own limits
    True
    >>> manager.close()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypedDict

from tierstore.tiers.movers import LinkClock

__all__ = ["Limits", "Measures", "Timeline"]


class Measures(TypedDict):
    """The manager's clocks and waits, as keyword arguments of the plan's runner."""

    writes: LinkClock  # the disk link, each way
    reads: LinkClock
    waits: Callable[[], float]  # seconds the step waited: forward's and backward's
    io_cpu: Callable[[], float]  # the I/O threads' CPU seconds
    events: Callable[[], Callable[[], Any] | None]  # a timed event maker, where CUDA is
    device_links: tuple[LinkClock, LinkClock] | None  # the device link, each way
    cpu_step_began: Callable[[bool], None]  # hand back idle buffers (and the heap's pages)
    page_fault_s: Callable[[], float]  # seconds the process spent in page faults


class Timeline(Protocol):
    """The timer of a profiled step, as far as the copies back write to it."""

    @property
    def blocked(self) -> list[tuple[Any, Any]] | None:
        """Where the compute stream's waits on copies back are written down, if timed."""


class Limits(Protocol):
    """What a manager under ``activation_budget`` asks of the step under way.

    Each answer is a number (or ``None``: the config's own limit). The
    manager calls these under its lock, save by save, and :meth:`close` once.
    """

    #: Lines for the caller to issue once each; the manager hands them on and clears them.
    warnings: list[str]

    @property
    def planned(self) -> bool:
        """Whether the step under way follows a plan (and has not left it)."""

    @property
    def timer(self) -> Timeline | None:
        """The timer of the step under way, if it is a profile whose times are kept."""

    def safe_device_bytes(self) -> int:
        """The device tier's budget in a step that follows no plan."""

    def in_flight_bytes(self, adding: int = 0, held: int = 0) -> int | None:
        """What may be in flight before a save of ``adding`` bytes, ``held`` on the device tier."""

    def read_ahead_bytes(self, held: int) -> int | None:
        """What backward may read ahead, with ``held`` bytes resident already."""

    def window_bytes(self) -> int | None:
        """The largest window of the plans kept: the in-flight limits' bound."""

    def hands_back(self) -> bool:
        """Whether a CPU step hands the bytes its saves let go back to the system."""

    def budget_bytes_now(self) -> int:
        """The budget of the step under way, in bytes."""

    def kept(self) -> tuple[int, int]:
        """The saves the step under way kept as they are, and their bytes."""

    def kept_resident(self) -> int:
        """Of those, the bytes still resident (not yet used in backward)."""

    def step_ended(self, peak_bytes: int) -> str | None:
        """The step ended with ``peak_bytes`` resident at most: a line to log, if any."""

    def step_failed(self, excess: int | None) -> str | None:
        """The step under way raised, short of ``excess`` bytes if out of memory: a line to log.

        ``None``: another error (NOTE [ A step that raised ] in tierstore/tier_store.py).
        """

    def close(self) -> None:
        """Stop; called once, as the manager closes."""
