"""What the tier manager is told of the step under way: its budget and bounds, in bytes.

:class:`StepLimits` is a base of :class:`~tierstore.planning.runner.PlanRunner`:
its methods read the runner's own step and plan, with no object between
(the tier manager asks some of them for every save it moves). The tiers
never import planning: what they get from these is numbers.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.planning.runner import PlanRunner
    >>> from tierstore.tiers.movers import LinkClock
    >>> runner = PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
    ...                     lambda: 0.0)
    >>> runner.window_bytes(), runner.in_flight_bytes()  # no plan, no step yet
    (None, None)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from tierstore.config import TierConfig
from tierstore.planning.checker import budget_bytes
from tierstore.planning.planner import Plan
from tierstore.planning.recorder import _Step

__all__ = ["StepLimits"]


class StepLimits:
    """The limits of the step under way, read off a runner's plan and step.

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.planning.runner import PlanRunner
        >>> from tierstore.tiers.movers import LinkClock
        >>> runner = PlanRunner(TierConfig(activation_budget="1MiB"), LinkClock(), LinkClock(),
        ...                     lambda: 0.0)
        >>> runner.safe_device_bytes() <= 1 << 20
        True
    """

    # The runner's own, set by PlanRunner.__init__.
    budget: int | float
    plan: Plan | None
    _config: TierConfig
    _plans: OrderedDict[tuple[int, ...], Plan]
    _step: _Step | None
    excess_bytes: int

    if TYPE_CHECKING:

        @property
        def planned(self) -> bool:
            """Whether the step under way follows a plan (PlanRunner's)."""

    def window_bytes(self) -> int | None:
        """The most any kept plan holds in flight each way; ``None`` before the first plan."""
        return max((plan.window_bytes for plan in self._plans.values()), default=None)

    def safe_device_bytes(self) -> int:
        """What the safe placement keeps on the device (NOTE [ Planned steps ]).

        The budget so far less a window for the bytes in flight, sized from
        the budget: half of it (at most the settings' prefetch_bytes plus
        write_queue_bytes), and at least the largest save so far, so that the
        next save of that size joins the device tier's within the budget.

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> runner = PlanRunner(TierConfig(activation_budget="24MiB"), LinkClock(),
            ...                     LinkClock(), lambda: 0.0)
            >>> runner.safe_device_bytes() >> 20  # half of it; the rest is in flight
            12
        """
        budget = self.budget_bytes_now()
        step = self._step
        largest = step.largest if step is not None else 0
        cap = int(self._config.prefetch_bytes) + int(self._config.write_queue_bytes)
        # Less what steps short of memory were short of (NOTE [ A step that raised ]
        # in tierstore/tier_store.py).
        return max(budget - max(min(budget // 2, cap), largest) - self.excess_bytes, 0)

    def in_flight_bytes(self, adding: int = 0, held: int = 0) -> int | None:
        """What the step under way may hold in flight each way, or ``None``: the limits' own.

        A planned step: its plan's window (the store's limits are bounded by
        the largest kept plan's). A step on the safe placement (profiled, or
        waiting for its first plan): the budget so far (``budget_bytes_now``)
        less ``held`` (the device tier's bytes) and ``adding`` (a save about
        to join the write queue), whatever the kind of budget. So the device
        tier, the write queue (on CUDA the copies off the device too) and the
        save all stay within the budget. At 0 a save waits for its own write
        and backward reads on demand (NOTE [ Write staging ] in
        tierstore/tiers/writebehind.py), as the floor does: a save larger
        than the room left never sits in the queue beside it.

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> runner = PlanRunner(TierConfig(activation_budget="8MiB"), LinkClock(),
            ...                     LinkClock(), lambda: 0.0)
            >>> runner.choose(1 << 20)  # the first save begins the step: the safe placement
            >>> runner.in_flight_bytes(adding=1 << 20, held=4 << 20) >> 20
            3
        """
        step = self._step
        if step is None:
            return None
        if self.planned:
            assert self.plan is not None
            return self.plan.window_bytes
        if not (step.profiling or step.waiting):
            return None
        return max(self.budget_bytes_now() - held - adding, 0)

    def budget_bytes_now(self) -> int:
        """The budget in bytes for the step under way.

        A planned step: its plan's. Otherwise a size as it is, a fraction as
        that share of what the step saved so far (0 between steps).

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> PlanRunner(TierConfig(activation_budget="1MiB"), LinkClock(), LinkClock(),
            ...            lambda: 0.0).budget_bytes_now()
            1048576
        """
        if self.planned:
            assert self.plan is not None
            return self.plan.budget_bytes
        step = self._step
        return budget_bytes(self.budget, step.saved_bytes if step is not None else 0)

    def hands_back(self) -> bool:
        """Whether the step under way hands the heap back as it lets bytes go.

        Every step but a planned one whose plan frees what it drops where
        checkpointing does (NOTE [ Handing the heap back ] in
        tierstore/tiers/host_pool.py).

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
            ...            lambda: 0.0).hands_back()
            True
        """
        return not self.planned or self.plan is None or self.plan.hands_back

    def read_ahead_bytes(self, held: int) -> int | None:
        """The bound on reads ahead in backward, ``held`` bytes being resident already.

        A planned step: its plan's window. The safe placement: the budget
        less ``held`` (the device tier, the writes still queued, the copies
        off the device) and less the largest save, as the window lets one
        read past its limit (NOTE [ Prefetch ] in tierstore/tiers/readahead.py);
        at 0 backward reads on demand. Asked again as backward frees the
        device tier's entries.
        """
        step = self._step
        if step is None or self.planned:
            return self.in_flight_bytes()
        bound = self.in_flight_bytes(held=held)
        return None if bound is None else max(bound - step.largest, 0)
