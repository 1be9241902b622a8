"""The runner: what the plan says for each save of a step, and the step's life.

The autograd boundary asks :meth:`PlanRunner.choose` what to do with each
saved tensor and tells it about saves and uses while a step is profiled;
the planner (``tierstore.planning.planner``) decides; the tier manager
places what the plan says. The runner keeps the plans, one per shape of
step; its :class:`~tierstore.planning.recorder.ProfileRecorder` turns a
profiled step into a profile, and its
:class:`~tierstore.planning.checker.PlanChecker` makes the plans and checks
them against the steps. NOTE [ Planned steps ] says how a step goes.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.planning.runner import PlanRunner
    >>> from tierstore.tiers.movers import LinkClock
    >>> runner = PlanRunner(TierConfig(activation_budget="1MiB"), LinkClock(), LinkClock(),
    ...                     lambda: 0.0)
    >>> runner.budget_bytes_now(), runner.planned
    (1048576, False)
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

from tierstore.config import AUTO, TierConfig
from tierstore.planning.carry import Carry, Shape, carry_over
from tierstore.planning.checker import FIRST_PLAN_WAIT, PlanChecker
from tierstore.planning.limits import StepLimits
from tierstore.planning.planner import Choice, Plan
from tierstore.planning.recorder import ProfileRecorder, RebuildTime, _Row, _Step
from tierstore.planning.room import GROW, Room
from tierstore.planning.timers import BusyTimer, Timer
from tierstore.tiers.host_pool import map_large_allocations_apart
from tierstore.tiers.memory import HostMemory
from tierstore.tiers.movers import LinkClock

__all__ = ["CARRIED_KEPT", "PLANS_KEPT", "PlanRunner"]

# NOTE [ Planned steps ]
# With activation_budget set, every step is one of two kinds:
#   * profiled (the first steps, and the one after a step that did not match
#     the plan): the safe placement, which meets any budget without knowing
#     the step. One rule for both kinds of budget: B is the budget so far (a
#     size as it is, a fraction as that share of what the step has saved so
#     far), and what the placement holds (the device tier, the write queue
#     with its staged copies, on CUDA the copies off the device, the save
#     waiting for its own write, and in backward the reads ahead) stays
#     within B. The device tier keeps the newest saves up to B less a
#     window sized from B (half of it, at most prefetch_bytes plus
#     write_queue_bytes, and at least the largest save so far); the bytes in
#     flight get what the device tier leaves (StepLimits.in_flight_bytes): a
#     save that finds no room waits for its own write, and backward reads
#     on demand where one read more would pass B, as at the floor. Each
#     save is written down: its bytes, the op and module that made it,
#     what a rebuild would cost and read, and when forward saved it and
#     backward first used it, with the waits taken out. The link's rates
#     come from the I/O it did. The steps waiting for a first plan run the
#     same placement, unprofiled.
#   * planned: each save does what the plan says, in save order, with the
#     plan's window bounding the write queue and the reads ahead alike.
# A step that is neither (waiting) runs the safe placement unrecorded: while
# the first plan is made off the training thread, and after a step above the
# budget until its remade plan is ready (NOTE [ A peak above the budget ] in
# planning/checker.py).
# Plans are kept per shape: the runner keeps the last PLANS_KEPT plans by the
# sizes of their profile's saves, and each profile's saves' shapes. A save
# that differs from the plan's at its place (another size, another branch,
# more saves) moves the step to a kept plan that saved the same sizes so far
# and chose the same for them. A step whose first save matches none by size
# but a kept plan by signature (another sequence length, batch size, the
# last partial batch) runs that plan carried over to its shape, from its
# first save (NOTE [ Plans across shapes ] in planning/carry.py), as does a
# step of a plan's own shape under a budget in bytes the plan was not made
# for. Otherwise the plan ends for the rest of the step: the tier manager
# returns to the safe placement, counting what the plan kept so far, and a
# later step of that shape is profiled: the next one that matches no kept
# plan at its first save, or the next one at all when the step that left
# the plan had matched one there. So a run profiles each model and branch
# once, whatever its lengths, then plans every step.
# On a machine without an accelerator the disk I/O runs on the step's own
# cores: the CPU time of the I/O threads in the profiled step is charged to
# the bytes it moved (Profile.moved_s_per_byte) and taken out of the compute
# it slowed down, and so out of the step: not left in what the profile holds
# for the rest of the step (other_s), where every plan, offloading or not,
# would pay it again (ProfileRecorder in planning/recorder.py).
# A step ends where the store sees the next step begin (NOTE [ Step log ] in
# tier_store.py): the first block after a backward. There the profile becomes a
# plan, or the plan gets its measured time and peak beside the predicted
# (PlanChecker in planning/checker.py).
# The store's first step only warms up (lazy initialisation and first
# allocations make it slower than any other); the one after it is profiled,
# and the third waits a while for the first plan (NOTE [ The first plan ] in
# planning/checker.py). A prediction more than 10% off is corrected and the
# plan made again. The first planned step of a shape is checked alone (a profile far off is
# corrected at once); after that, the median of each REFIT_STEPS steps in a
# row under the plan in use (one step is noisy). The checks go on for as
# long as the plan runs: a machine's steps can keep getting faster for
# minutes after the profile, and a prediction checked only on the first few
# planned steps ends well off the steps after. A step slower than predicted
# charges the difference to the bytes it moved (moved_s_per_byte: on a CPU,
# copies and checksums share its cores with the step) and to the rebuilds
# it replayed op by op (recorded_rebuild_s: the recorder's Python, which the
# profile's op times do not hold; NOTE [ Replayed modules ] in
# planning/planner.py), each in full (NOTE [ Charging a slow step ] in
# planning/checker.py), and remakes the plan: a first plan that rebuilds a
# few saves in every block op by op gives way to one that checkpoints the
# first blocks natively. A faster step scales the profile's compute times
# down to it. Once a prediction holds, a plan is remade only when three
# steps' median leaves it by 10%: re-planning costs time, and a plan that
# keeps changing cannot be measured.

# NOTE [ Like with like ]
# A step's time, as the runner measures it, runs from its start to the
# next step's: the optimizer, the data loader, an evaluation, whatever the
# loop does between two forwards, are in it, and the profile holds what the
# profiled step spent there in other_s, which every prediction includes.
# Were the time between steps to change after the profile (a benchmark
# whose rows take turns with steps of no hooks between them, an
# evaluation), a check would charge the difference to the moved bytes and
# remake the plan for time no plan spends. So the hooks have autograd's
# engine tell the runner as each backward of a timed step ends (a final
# callback queued at the first unpack in each of autograd's graph tasks;
# used() returns it, tied to its step), and the step ends with its last
# backward: timed to its first, a step that runs two (two losses, a
# multi-task head) would measure a fraction of itself and have its plan
# rescaled to that. The profile keeps the part of other_s after that end
# (between_s), and a check on a CPU takes the step as its own span, start
# to the end of its last backward, plus the profile's between_s: the same
# time outside the step on both sides. On CUDA the host reaches the end of
# backward long before the device does, so there a check still takes the
# step from start to start (a device profile's other_s is 0 and its first
# check fits the prediction to what the step does around it: NOTE [ Timing
# a profile ] in planning/timers.py).

#: How many plans, one per shape of step, the runner keeps (NOTE [ Planned steps ]).
PLANS_KEPT = 8
#: How many plans carried over to other shapes the runner keeps (NOTE [ Plans across
#: shapes ] in planning/carry.py): each is derived again, in milliseconds, when it is gone.
CARRIED_KEPT = 32


def _backward_ended(step: _Step) -> None:
    """A backward of ``step`` ended (NOTE [ Like with like ]): the last one's end counts."""
    step.ended = time.perf_counter()


def _kept_before(expected: tuple[int, ...], plan: Plan) -> list[tuple[int, int, int]]:
    """What ``plan`` keeps before each of its saves (sizes ``expected``): saves, bytes, resident.

    Saves and bytes count every save kept, as the counters do (NOTE
    [ Saves that stay ] in tiers/manager.py); the bytes resident count a
    tensor saved twice and kept both times once (NOTE [ A tensor saved
    twice ] in planning/planner.py): the profile's second save rests in no
    new bytes, though its size is the tensor's, for matching steps.
    """
    n = nbytes = resident = 0
    before = [(0, 0, 0)]
    counted: set[int] = set()
    for i, (size, choice, save) in enumerate(
        zip(expected, plan.choices, plan.profile.saves, strict=True)
    ):
        if choice == "keep":
            n, nbytes = n + 1, nbytes + size
            first = i if save.same_as is None else save.same_as
            if first not in counted:
                counted.add(first)
                resident += size
        before.append((n, nbytes, resident))
    return before


class PlanRunner(StepLimits):
    """Profiles, plans and applies an activation budget (NOTE [ Planned steps ]).

    Args:
        config: the store's configuration (``activation_budget`` set).
        writes, reads: the link's clocks, each way.
        waits: the seconds forward and backward have waited on the store so far.

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.planning.runner import PlanRunner
        >>> from tierstore.tiers.movers import LinkClock
        >>> runner = PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
        ...                     lambda: 0.0)
        >>> runner.plan is None, runner.choose(1024)
        (True, None)
    """

    #: Make a shape's first plan where its profile ends, even one that needs a
    #: search (the steps wait for it): for tests that count steps to it.
    first_plan_at_once = False
    #: Make every plan where it is asked for, in the planning process, and
    #: wait for it: a benchmark's steps then follow each plan from the step
    #: it counts on, and its process runs no search, as a user's does not.
    wait_for_plans = False

    def __init__(
        self,
        config: TierConfig,
        writes: LinkClock,
        reads: LinkClock,
        waits: Callable[[], float],
        io_cpu: Callable[[], float] | None = None,
        *,
        background: bool = True,
        events: Callable[[], Callable[[], Any] | None] | None = None,
        device_links: tuple[LinkClock, LinkClock] | None = None,
        cpu_step_began: Callable[[bool], None] | None = None,
        page_fault_s: Callable[[], float] | None = None,
    ) -> None:
        assert config.activation_budget is not None
        # Called as a planned step on a CPU begins, before its first save is
        # placed, with whether its plan hands the heap back; idle buffers go
        # whatever the plan, as a step that stores nothing never reaches the
        # tier manager's step start (NOTE [ Handing the heap back ] in
        # tierstore/tiers/host_pool.py).
        self._cpu_step_began = cpu_step_began
        # NOTE [ Large allocations mapped apart ] in tierstore/tiers/host_pool.py.
        if HostMemory().tightest() is not None:  # under a memory limit
            map_large_allocations_apart()
        self.background = background  # NOTE [ Planning off the training thread ] in checker.py
        #: The budget as the user asked for it, for messages: bytes, a fraction or "auto".
        self.asked: int | float | str = config.activation_budget
        #: Under "auto", the room each step has (NOTE [ The room a step has ] in
        #: planning/room.py); ``None`` under a budget of bytes or a fraction.
        self.room: Room | None = Room(config) if self.asked == AUTO else None
        # The budget of the step under way, in bytes or a fraction: "auto" resolves to
        # bytes at each step's start (_follow_room); 0 until the first.
        asked = config.activation_budget
        self.budget: int | float = asked if not isinstance(asked, str) else 0
        self._said: str | None = None  # a plan remade at once as a step began: its INFO line
        self._config = config
        self.plan: Plan | None = None
        self._expected: tuple[int, ...] = ()  # each save's bytes in the plan's profile
        # The plan's kept saves before each save: (count, bytes, bytes resident)
        # (NOTE [ Saves that stay ] in tiers/manager.py; _kept_before).
        self._kept_before: list[tuple[int, int, int]] = [(0, 0, 0)]
        # NOTE [ Planned steps ]: the kept plans, by their saves' bytes, newest last
        self._plans: OrderedDict[tuple[int, ...], Plan] = OrderedDict()
        # Their profiled saves' (dtype, shape), and the plans carried over to other shapes,
        # by (sizes, save, shape, budget) (NOTE [ Plans across shapes ] in planning/carry.py).
        self._shapes: dict[tuple[int, ...], tuple[Shape, ...]] = {}
        self._carries: OrderedDict[tuple[object, ...], Carry] = OrderedDict()
        #: Steps that ran under a plan (made for their shape or carried over), and
        #: what the last step was: "profiled", "planned", "carried", "safe".
        self.planned_steps = 0
        self.step_kind = ""
        # A step left its plan and matched no kept one: "first" profiles the
        # next step that matches none at its first save, "any" the next step.
        self._unseen: Literal["first", "any"] | None = None
        self._step: _Step | None = None
        # NOTE [ A peak above the budget ] in planning/checker.py: the steps run the
        # safe placement until a plan is put in use (fall_back).
        self._falling_back = False
        self._warmed = False  # the store's first step warms up; the next is the profile
        # What steps short of memory were short of: the safe placement keeps it
        # off the device (NOTE [ A step that raised ] in tierstore/tier_store.py).
        self.excess_bytes = 0
        # And per shape: its plans are made for that much less (PlanChecker.make).
        self.short_of: dict[tuple[int, ...], int] = {}
        self._short_since: set[tuple[int, ...]] = set()  # of plans being made meanwhile
        self.warnings: list[str] = []  # for the caller to issue, each once
        self._recorder = ProfileRecorder(
            config,
            writes,
            reads,
            waits,
            io_cpu,
            events=events,
            device_links=device_links,
            page_fault_s=page_fault_s,
        )
        self._checker = PlanChecker(self)

    # -- the step --------------------------------------------------------------------

    @property
    def profiling(self) -> bool:
        """Whether the step under way is written down (saves and uses reported)."""
        step = self._step
        return step is not None and step.profiling

    @property
    def planned(self) -> bool:
        """Whether the step under way follows a plan (and has not left it)."""
        step = self._step
        return (
            step is not None
            and not step.profiling
            and not step.waiting
            and step.deviated_at is None
        )

    @property
    def will_profile(self) -> bool:
        """Whether the step under way, or the next one to begin, is profiled."""
        step = self._step
        return step.profiling if step is not None else self._profile_next()

    @property
    def will_time(self) -> bool:
        """Whether the step under way, or the next, is a profile whose op times are kept.

        The store's first step only warms up: what it would time is thrown
        away, so it times nothing (NOTE [ Planned steps ]).
        """
        return self._warmed and self.will_profile

    @property
    def rebuilds(self) -> bool:
        """Whether the plan the next step starts on rebuilds anything (the recorder must run).

        A step that switches mid-way to a plan that rebuilds finds no recipe
        for those saves and offloads them instead (NOTE [ Planned saves ] in
        autograd/hooks.py): no dispatch mode runs on the ops of a step that rebuilds
        nothing.
        """
        return self.plan is not None and "rebuild" in self.plan.choices

    def _profile_next(self) -> bool:
        """Whether a step beginning now is profiled (NOTE [ Planned steps ])."""
        # A plan ready or on its way is waited for (NOTE [ Planning off the training
        # thread ] in planning/checker.py).
        checker = self._checker
        if checker.remade is not None or checker.making():
            return False
        return self.plan is None or self._unseen is not None

    def _follow_room(self, room: Room) -> None:
        """Under "auto": this step's budget, and the plan following it.

        NOTE [ The room a step has ] in planning/room.py.

        Where the room fell below what the plan in use needs, the step runs the
        safe placement within the new budget while the plan is remade; where it
        grew by GROW, the plan is remade lazily and runs meanwhile.
        """
        budget = room.step_began()
        self.budget = budget.budget_bytes
        self.warnings.extend(room.warnings)
        room.warnings.clear()
        plan = self.plan
        if plan is None:
            return
        plan.room = str(budget)
        checker = self._checker
        if self._profile_next() or checker.making() or checker.remade is not None:
            return  # no plan runs this step, or one is on its way already
        over = budget.now_bytes + budget.margin // 2 < plan.predicted_peak_bytes
        if over and budget.budget_bytes < plan.budget_bytes:
            self._forget_plans_over(budget.budget_bytes)
            self._said = self._remake_meanwhile_safe(plan, budget.budget_bytes)
        elif budget.budget_bytes >= GROW * plan.budget_bytes and not plan.keeps_everything:
            self._said = checker.remake(plan.profile, budget.budget_bytes)

    def _forget_plans_over(self, budget: int) -> None:
        """Drop the kept plans of other shapes whose peak no longer fits ``budget``.

        A step of their shape is profiled again, on the safe placement.
        """
        for expected, plan in list(self._plans.items()):
            if plan is not self.plan and plan.predicted_peak_bytes > budget:
                del self._plans[expected]
                self._checker.forget(expected)

    def _begin(self) -> _Step:
        if self.room is not None:
            self._follow_room(self.room)
        profiling = self._profile_next()
        if profiling and not self._warmed and self._may_search():
            self._checker.warm()  # NOTE [ The first plan ] in planning/checker.py
        step = _Step(time.perf_counter(), profiling, waits_at_start=self.waits())
        step.waiting = not profiling and (self.plan is None or self._falling_back)
        self._recorder.begin(step)
        self._step = step
        plan = self.plan
        if (
            self._cpu_step_began is not None
            and not profiling
            and not step.waiting
            and plan is not None
            and plan.profile.shared_link  # a CPU's profile
        ):
            self._cpu_step_began(plan.hands_back)
        return step

    def _may_search(self) -> bool:
        """Whether the first plan may be searched in the planning process."""
        all_saves = isinstance(self.budget, float) and self.budget >= 1.0
        return self.background and not self.first_plan_at_once and not all_saves

    def plan_now(self, timeout: float) -> Plan | None:
        """The plan in use; before the first, the one on its way, waited for up to ``timeout``.

        NOTE [ The first plan ] in planning/checker.py: never waits once a
        plan exists. A plan that came while a step runs is the next step's:
        it is returned, and taken up at the step boundary.
        """
        if self.plan is None:
            self._checker.wait(timeout)
            remade = self._checker.remade
            if self.plan is None and remade is not None:
                return remade[1]
        return self.plan

    def fall_back(self) -> None:
        """Run the safe placement from the next step on, until a remade plan is in use.

        The steps run as while the first plan is made (``waiting``: NOTE
        [ Planned steps ]), the plan kept for when the next one comes:
        :meth:`_adopt` (a plan remade off the training thread) or
        :meth:`_use` (one made at once) ends it. NOTE [ A peak above the
        budget ] in planning/checker.py.

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> runner = PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
            ...                     lambda: 0.0)
            >>> runner.fall_back()
            >>> runner.choose(1024), runner.planned  # the safe placement, not a plan
            (None, False)
        """
        self._falling_back = True

    def waits(self) -> float:
        """The store's waits so far, seconds (NOTE [ Timing a profile ] in planning/timers.py)."""
        return self._recorder.waits()

    def choose(
        self, nbytes: int, dtype: object = None, shape: tuple[int, ...] = ()
    ) -> Choice | None:
        """What to do with the next save of the step; ``None``: the safe placement.

        ``dtype`` and ``shape``: the tensor's, as the hook reads them: its
        signature (NOTE [ Plans across shapes ] in planning/carry.py). The
        first save of a step begins it.
        """
        step = self._step if self._step is not None else self._begin()
        index = step.index
        step.index = index + 1
        if step.following:  # the common case, first: a planned step on its plan
            expected = self._expected
            if index < len(expected) and expected[index] == nbytes and step.backward_at is None:
                return self.plan.choices[index]  # type: ignore[union-attr]
        if step.carry is not None:  # on a plan carried over to this shape
            return self._carried(step, index, nbytes, dtype, len(shape))
        if step.profiling:
            if index == 0 and self._unseen == "first" and self._switch(0, nbytes):
                step.profiling = False  # a kept shape after all: no profile needed
            else:
                step.shapes.append((dtype, tuple(shape)))
        if (
            step.waiting
        ):  # NOTE [ Planning off the training thread ] in planning/checker.py: the safe placement
            step.saved_bytes += nbytes
            step.largest = max(step.largest, nbytes)
            expected = self._expected  # a plan's shape until a size leaves it (step_failed)
            if step.deviated_at is None and (index >= len(expected) or expected[index] != nbytes):
                step.deviated_at = index
            return None
        if step.profiling or step.deviated_at is not None:
            return None
        assert self.plan is not None
        expected = self._expected
        if step.backward_at is None and index < len(expected) and expected[index] == nbytes:
            if not step.chosen and self._rebudgeted(step, index, dtype, shape):
                return self._carried(step, index, nbytes, dtype, len(shape))
        elif step.backward_at is not None or not self._switch(index, nbytes):
            first = step.backward_at is None and not step.chosen
            if first and self._carry(step, index, dtype, shape):
                return self._carried(step, index, nbytes, dtype, len(shape))
            step.deviated_at = index
            step.following = False
            return None
        step.chosen = step.following = True
        return self.plan.choices[index]

    def _rebudgeted(self, step: _Step, index: int, dtype: object, shape: tuple[int, ...]) -> bool:
        """A step of the plan's own shape, under a budget in bytes the plan was not made for.

        Re-checked against the budget in force: carried over to its own
        shape (NOTE [ Plans across shapes ] in planning/carry.py).
        """
        budget, plan = self.budget, self.plan
        if isinstance(budget, float) or plan is None or plan.budget_bytes == int(budget):
            return False
        return self._carry(step, index, dtype, shape, within=((self._expected, plan),))

    def _carry(
        self,
        step: _Step,
        index: int,
        dtype: object,
        shape: tuple[int, ...],
        within: tuple[tuple[tuple[int, ...], Plan], ...] | None = None,
    ) -> bool:
        """Put the step, at its first save ``index``, on a kept plan carried over to its shape.

        NOTE [ Plans across shapes ] in planning/carry.py: of the kept plans
        whose save ``index`` has this signature, the carried plan that fits
        the budget in force and is predicted fastest; ``within``: those only.
        """
        shape = tuple(shape)
        if not shape and within is None:
            return False  # no shape to map another size by
        best: Carry | None = None
        for expected, plan in within if within is not None else tuple(self._plans.items()):
            carry = self._carried_plan(expected, plan, index, dtype, shape)
            if carry is None:
                continue
            rank = (not carry.plan.fits, carry.plan.predicted_step_s)
            if best is None or rank < (not best.plan.fits, best.plan.predicted_step_s):
                best = carry
        if best is None:
            return False
        step.carry = best
        step.following = False  # each save is checked: NOTE [ Plans across shapes ]
        saves, choices = best.plan.profile.saves, best.plan.choices
        kept = [i for i in range(index) if choices[i] == "keep" and saves[i].same_as is None]
        step.carry_kept = (len(kept), sum(best.sizes[i] for i in kept))  # modules gone past
        self.plan = best.plan
        return True

    def _carried_plan(
        self,
        expected: tuple[int, ...],
        plan: Plan,
        index: int,
        dtype: object,
        shape: tuple[int, ...],
    ) -> Carry | None:
        """``plan`` carried over to a step whose save ``index`` is ``dtype`` and ``shape``."""
        shapes = self._shapes.get(expected)
        if (
            shapes is None
            or index >= len(shapes)
            or shapes[index][0] != dtype
            or len(shapes[index][1]) != len(shape)
        ):
            return None
        key = (expected, index, shape, self.budget)
        carry = self._carries.get(key)
        if carry is None or carry.source is not plan:
            carry = carry_over(plan, shapes, index, shape, self.budget)
            if carry is None:
                return None
            self._carries[key] = carry
            while len(self._carries) > CARRIED_KEPT:
                self._carries.popitem(last=False)
        self._carries.move_to_end(key)
        return carry

    def _carried(
        self, step: _Step, index: int, nbytes: int, dtype: object, rank: int
    ) -> Choice | None:
        """A save of a step on a carried plan: the plan's choice, checked against the budget.

        NOTE [ Plans across shapes ] in planning/carry.py: a kept save that
        would take what the step keeps past the budget, with the plan's
        in-flight bytes, is offloaded.
        """
        carry = step.carry
        assert carry is not None
        plan = carry.plan
        if (
            step.backward_at is not None
            or step.deviated_at is not None
            or index >= len(carry.signatures)
            or carry.signatures[index] != (dtype, rank)
        ):
            if step.deviated_at is None:
                step.deviated_at = index
            return None
        step.chosen = True
        choice = plan.choices[index]
        first = plan.profile.saves[index].same_as
        if first is not None:  # the same tensor again: its first save's lot
            step.carry_added = 0  # kept already, if kept (kept_new)
            return "offload" if first in step.carry_offloaded else choice
        if choice == "keep":
            n, kept = step.carry_kept
            # In flight: the window, or one copy of the largest save it let through.
            in_flight = min(step.carry_out, max(plan.window_bytes, step.largest))
            if step.fixed_bytes + kept + nbytes + in_flight <= plan.budget_bytes:
                step.carry_kept = (n + 1, kept + nbytes)
                step.carry_added = nbytes
                return choice
            step.carry_offloaded.add(index)
            choice = "offload"
        if choice == "offload":
            step.carry_out += nbytes
            step.largest = max(step.largest, nbytes)
        return choice

    def _switch(self, index: int, nbytes: int) -> bool:
        """Move the step, at save ``index`` of ``nbytes``, to a kept plan that chose alike.

        The saves before it matched the plan under way: their sizes are its.
        """
        sizes = (*self._expected[:index], nbytes)
        chosen = self.plan.choices[:index] if self.plan is not None else ()
        for expected, plan in reversed(self._plans.items()):
            if expected[: index + 1] == sizes and plan.choices[:index] == chosen:
                self._use(expected, plan)
                return True
        return False

    def _use(self, expected: tuple[int, ...], plan: Plan, *, kept: bool = True) -> None:
        """Run ``plan`` for the shape ``expected`` from the next step.

        ``kept``: as that shape's kept plan; not a plan on trial, which
        other shapes do not carry over (NOTE [ The default on trial ] in
        planning/checker.py).
        """
        replaced = self._plans.get(expected)
        if replaced is not None and replaced is not plan and plan.measured_step_s is None:
            # Until a step runs on it, the table shows what the last one measured.
            plan.measured_step_s = replaced.measured_step_s
            plan.measured_peak_bytes = replaced.measured_peak_bytes
            plan.measured_before = plan.measured_step_s is not None
        if plan is not self.plan or expected != self._expected:
            self._kept_before = _kept_before(expected, plan)
        self._falling_back = False  # a plan in use (fall_back)
        self.plan, self._expected = plan, expected
        if not kept:
            return
        self._plans[expected] = plan
        self._plans.move_to_end(expected)
        while len(self._plans) > PLANS_KEPT:
            forgotten = self._plans.popitem(last=False)[0]
            self.short_of.pop(forgotten, None)
            self._checker.forget(forgotten)
            self._shapes.pop(forgotten, None)

    def passes(self, plan: Plan, first: int, end: int) -> Literal["no", "past", "again"]:
        """Whether the step goes past a module whose saves are ``plan``'s ``[first, end)``.

        Its saves then never reach the pack hook: a module checkpointed
        natively (NOTE [ Replayed modules ] in planning/planner.py; checkpoint's own
        hooks take them, the first, its input, kept), or one the plan keeps
        whole (NOTE [ Modules kept whole ] in autograd/regions.py). Only a planned step
        on ``plan``, at the module's first save, goes past (``"past"``); a
        module called again in the step (the saves of all its calls one span
        in the profile, all counted the first time) goes past ``"again"``.
        """
        step = self._step if self._step is not None else self._begin()
        carry = step.carry
        if carry is not None and (
            plan is not carry.source or carry.plan.choices[first:end] != plan.choices[first:end]
        ):
            return "no"  # carried over, and more offloaded there: each save is placed
        if (
            (self.plan is not plan and carry is None)
            or step.profiling
            or step.waiting
            or step.deviated_at is not None
            or step.backward_at is not None
        ):
            return "no"
        if carry is None and not step.chosen and self._carries:
            # Shapes vary (NOTE [ Plans across shapes ] in planning/carry.py): a save must
            # show the step's shape before a module's saves go unseen.
            return "no"
        if first in step.passed:
            return "again"
        if step.index != first:
            return "no"
        step.index = end
        step.passed.add(first)
        if carry is None:
            step.following = True
            return "past"
        saves, n, kept = plan.profile.saves, *step.carry_kept
        for i in range(first, end):
            if plan.choices[i] == "keep" and saves[i].same_as is None:
                n, kept = n + 1, kept + carry.sizes[i]
        step.carry_kept = (n, kept)
        return "past"

    def beside(self, modules: tuple[str, ...], why: str, nbytes: int) -> None:
        """A save outside the plan, in ``modules``: one that stays (``why``), or ``"stored"``.

        Written down, for each of the (distinct) modules, in a profiled step
        only (NOTE [ Modules kept whole ] in autograd/regions.py).
        """
        step = self._step
        if step is None or not step.profiling:
            return
        for module in dict.fromkeys(modules):
            if why == "stored":
                step.stored_in.add(module)
                continue
            tally = step.stays_in.setdefault((module, why), [0, 0])
            tally[0] += 1
            tally[1] += nbytes

    def kept_fixed(self, nbytes: int) -> None:
        """A save that stays whatever the plan (keep(), small): in every peak."""
        step = self._step if self._step is not None else self._begin()
        step.fixed_bytes += nbytes  # the profile's, and a planned step's measured peak
        if step.profiling or step.waiting:
            step.saved_bytes += nbytes

    def saved(
        self,
        key: int,
        *,
        nbytes: int,
        op: str,
        module: str,
        rebuild_s: RebuildTime,
        input_keys: tuple[int, ...],
        cuda: bool = False,
        made_in: tuple[str, ...] = (),
        compiled: bool = False,
        root: str = "",
        graph: bool = False,
    ) -> None:
        """Write down a save of a profiled step (``key``: its entry's).

        A save of an entry already saved (the same tensor twice) rests in no
        new bytes: it is written down with none. ``compiled``: a compiled
        region handed it over as the region ended (NOTE [ A peak above the
        budget ]). ``graph``: the autograd graph can rebuild it (NOTE
        [ Rebuilt from the graph ] in tierstore/autograd/graph.py).
        """
        step = self._step
        assert step is not None and step.profiling
        if cuda and not step.cuda:
            step.cuda = True
            if isinstance(step.timer, BusyTimer):
                step.timer.device = True
        inputs = tuple(step.row_of_key[k] for k in input_keys if k in step.row_of_key)
        again = step.row_of_key.get(key)
        if again is None:
            step.row_of_key[key] = len(step.rows)
            step.saved_bytes += nbytes
            step.largest = max(step.largest, nbytes)
            if compiled:
                step.compiled_bytes += nbytes
                step.compiled_in.add(module)
        assert step.timer is not None
        mark = step.timer.mark()
        row = _Row(nbytes, again, op, module, mark, rebuild_s, inputs, None, made_in, root, graph)
        step.rows.append(row)

    def moved(self, seconds: float, out: bool) -> None:
        """A profiled step's host spent ``seconds`` moving a save out (``out``) or back in.

        NOTE [ Pricing a moved save first ] in planning/recorder.py; waits for the link
        taken out by the caller.
        """
        step = self._step
        if step is not None and step.profiling:
            step.moved_host_s += seconds
            step.moved_saves += out

    def used(self, key: int, planned: int = 0, task: int = -1) -> Callable[[], None] | None:
        """Backward used the save of entry ``key`` (-1: a save that is no entry).

        ``planned``: the bytes of a save the plan kept, at its first use.
        ``task``: the autograd graph task the use is in (-1: none, a saved
        tensor read by hand). Returns, at the first use in each backward of
        a step the runner times, planned or profiled, what to call as that
        backward ends (NOTE [ Like with like ]): the step ends with its last
        backward. ``None`` at any other use. The caller takes a planned
        step's peak there too: at the first, all the plan kept is resident.

        Example:
            >>> from tierstore import TierConfig
            >>> from tierstore.planning.runner import PlanRunner
            >>> from tierstore.tiers.movers import LinkClock
            >>> runner = PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
            ...                     lambda: 0.0)
            >>> runner.used(0, task=7) is None  # no step under way: nothing to time
            True
        """
        step = self._step
        if step is None:
            return None
        if self.room is not None and step.backward_at is None:
            self.room.backward_began()  # NOTE [ The room a step has ]
        if not step.profiling:
            step.kept_used += step.leaving
            step.leaving = 0
            if step.backward_at is None:
                step.backward_at = True  # no save after this one follows the plan
        else:
            assert step.timer is not None
            now = step.timer.mark(backward=True)
            if step.backward_at is None:
                step.backward_at = now
            step.last_use = now
            row = step.row_of_key.get(key)
            if row is not None and step.rows[row].used_at is None:
                step.rows[row].used_at = now
        if task == step.task:
            step.kept_used += planned
            return None
        step.task = task
        # The caller takes the peak at a backward's first use, with all the plan
        # kept still resident: this save leaves the count at the next use.
        step.leaving = planned
        if task != -1:  # a backward under way, not ended (NOTE [ A step that raised ])
            step.ended = None
        if self.room is not None:
            return functools.partial(self._backward_ended, step)
        return functools.partial(_backward_ended, step)

    def _backward_ended(self, step: _Step) -> None:
        """Under "auto": a backward of ``step`` ended; its usage sampled."""
        _backward_ended(step)
        if self.room is not None and step is self._step:
            self.room.backward_ended()  # NOTE [ The room a step has ]

    def profile_timer(self) -> Timer:
        """The profiled step's timer, beginning the step: its forward begins with the block."""
        step = self._step if self._step is not None else self._begin()
        assert step.timer is not None
        return step.timer

    @property
    def timer(self) -> Timer | None:
        """The timer of the step under way, if it is a profile whose times are kept."""
        step = self._step
        return step.timer if step is not None and step.profiling and self._warmed else None

    def kept(self) -> tuple[int, int]:
        """Saves the plan kept in the step under way, and their bytes.

        Counted by where the step left its plan, not save by save: every
        save before that took the plan's choice (NOTE [ Saves that stay ]
        in tiers/manager.py).
        """
        n, nbytes, _ = self._kept_upto()
        return n, nbytes

    def _kept_upto(self) -> tuple[int, int, int]:
        """The plan's kept saves so far in the step under way: saves, bytes, bytes resident."""
        step = self._step
        if step is None or step.profiling or step.waiting:
            return 0, 0, 0
        if step.carry is not None:  # actual bytes: a tensor kept twice counts once
            n, nbytes = step.carry_kept
            return n, nbytes, nbytes
        upto = step.deviated_at if step.deviated_at is not None else step.index
        return self._kept_before[min(upto, len(self._kept_before) - 1)]

    def kept_new(self) -> int:
        """The bytes the save the plan just kept adds: 0 for a tensor the step kept already.

        What the pack hook hands :func:`~tierstore.autograd.filters.kept_as_is`
        for backward's first use to take off (:meth:`used`; NOTE [ A tensor
        saved twice ] in planning/planner.py).
        """
        step = self._step
        assert step is not None
        if step.carry is not None:  # its own bytes, not the profile's
            return step.carry_added
        before, i = self._kept_before, step.index
        return before[i][2] - before[i - 1][2]

    def kept_resident(self) -> int:
        """Bytes kept as they are in the step under way that backward has not used yet.

        What the plan kept, and the saves that stay whatever the plan
        (:meth:`kept_fixed`), which every predicted peak holds too.
        """
        step = self._step
        if step is None or step.profiling:
            return 0
        return self._kept_upto()[2] - step.kept_used + step.fixed_bytes

    def step_ended(self, peak_bytes: int) -> str | None:
        """The step under way ended; returns the INFO line of a plan made or remade."""
        step, self._step = self._step, None
        if self.room is not None and step is not None:
            self.room.step_ended(peak_bytes)  # NOTE [ The room a step has ] in planning/room.py
        self.step_kind = "" if step is None else _kind(step)
        if self.step_kind in ("planned", "carried"):
            self.planned_steps += 1
        if step is None or step.waiting:  # waiting: on the safe placement, for the first plan
            return self._adopt()
        total = time.perf_counter() - step.started
        if step.carry is not None:  # NOTE [ Plans across shapes ] in planning/carry.py
            return self._carried_ended(step, total, peak_bytes)
        if step.profiling:
            self._adopt()
            if not self._warmed:
                self._warmed = True  # lazy initialisation, first allocations: not the step
                return None
            return self._profiled(step, total)
        if step.deviated_at is not None:  # a shape no kept plan has (NOTE [ Planned steps ])
            self._unseen = "first" if step.deviated_at == 0 else "any"
            self._adopt()
            return None
        plan = self.plan
        assert plan is not None
        between = plan.profile.between_s
        if step.ended is not None and between is not None:  # NOTE [ Like with like ]
            total = step.ended - step.started + between
        # The step is the plan's it ran on, not one remade meanwhile: that one
        # is judged by its own steps, from the next.
        plan.measured_step_s = total
        plan.measured_peak_bytes = peak_bytes
        plan.measured_before = False
        plan.steps += 1
        if self._checker.remade is not None:
            return self._adopt()
        return self._checker.ended(total, peak_bytes) or self._adopt()

    def backward_raised(self) -> bool:
        """Whether the step under way began a backward that did not end: one that raised.

        Autograd's engine runs the callback :meth:`used` hands out only as a
        backward ends, not when it raises (NOTE [ A step that raised ] in
        tierstore/tier_store.py).
        """
        step = self._step
        return step is not None and step.task >= 0 and step.ended is None

    def step_failed(self, excess: int | None) -> str | None:
        """The step under way raised: dropped (NOTE [ A step that raised ] in tier_store.py).

        ``excess``: the bytes an out-of-memory error showed the step short of,
        0 where it did not say; ``None``: another error. Returns the INFO line
        of a plan made or remade.
        """
        step, self._step = self._step, None
        if step is None or excess is None:
            return self._adopt()
        plan = self.plan
        # The plan's shape: a step on it, or on the safe placement while it is
        # remade (fall_back, not the wait for a first plan) whose sizes had
        # not left it.
        planned = (
            plan is not None
            and not step.profiling
            and step.deviated_at is None
            and (not step.waiting or self._falling_back)
        )
        largest = step.largest
        if planned and plan is not None:
            largest = max((save.nbytes for save in plan.profile.saves), default=0)
        excess = max(excess, largest)  # one save fewer on the device at least
        self.excess_bytes += excess
        if not planned or plan is None:
            return self._adopt()
        expected = self._expected
        self.short_of[expected] = self.short_of.get(expected, 0) + excess
        checker = self._checker
        if checker.making() or checker.remade is not None:
            # One at a time, and a plan made before this step counts none of
            # it: made again once it is ready (_adopt), the safe placement until.
            self.fall_back()
            self._short_since.add(expected)
            return self._adopt()
        return self._remake_meanwhile_safe(plan) or self._adopt()

    def _remake_meanwhile_safe(self, plan: Plan, budget: int | None = None) -> str | None:
        """Remake ``plan``, the steps on the safe placement until it is in use: its INFO line.

        A plan made at once (no search) is in use already: ``_use`` ends the fall-back.
        """
        self.fall_back()
        return self._checker.remake(plan.profile, budget)

    def _carried_ended(self, step: _Step, total: float, peak_bytes: int) -> str | None:
        """A step on a carried plan ended: its figures on that plan; the kept plan back.

        Its checks are the kept plan's own steps' (NOTE [ Plans across shapes ]
        in planning/carry.py).
        """
        carry = step.carry
        assert carry is not None
        self.plan = carry.source
        if step.deviated_at is not None:  # a shape no kept plan has (NOTE [ Planned steps ])
            self._unseen = "first" if step.deviated_at == 0 else "any"
            return self._adopt()
        plan = carry.plan
        plan.measured_step_s = total
        plan.measured_peak_bytes = peak_bytes
        plan.steps += 1
        return self._adopt()

    def _profiled(self, step: _Step, total: float) -> str | None:
        """A profiled step ended: its profile's plan (NOTE [ Planned steps ]); its INFO line."""
        profile = self._recorder.profile(step, total)
        if profile is None:
            return None
        # Not the runner's until its plan is: a plan made off the thread comes later.
        expected = tuple(r.nbytes for r in step.rows)
        if len(step.shapes) == len(step.rows):  # NOTE [ Plans across shapes ] in planning/carry.py
            self._shapes[expected] = tuple(step.shapes)
        self._unseen = None
        compiled = (step.compiled_bytes, len(step.compiled_in))
        line = self._checker.profiled(profile, expected, compiled)
        if line is None and self.plan is None and self._checker.wait(FIRST_PLAN_WAIT * total):
            line = self._adopt()  # NOTE [ The first plan ] in planning/checker.py
        return line

    def close(self) -> None:
        """Drop a plan still being made and end the planning process. Idempotent.

        NOTE [ Planning off the training thread ] in planning/checker.py.
        """
        self._checker.close()
        if self.room is not None:
            self.room.close()

    def _adopt(self) -> str | None:
        """Switch to a plan remade off the training thread, if one is ready: its INFO line."""
        checker = self._checker
        remade, checker.remade = checker.remade, None
        said, self._said = self._said, None  # a plan remade at once as the step began
        if remade is None:
            return said
        expected, plan, verb = remade
        if expected in self._short_since:  # made for more than there is: again
            self._short_since.discard(expected)
            return checker.make(plan.profile, "remade", expected=expected)
        line = checker.announce(plan, verb)
        self._falling_back = False  # NOTE [ The room a step has ] in planning/room.py
        if self.room is not None and self.room.last is not None:
            plan.room = str(self.room.last)
        if expected == self._expected or expected not in self._plans:
            self._use(expected, plan)  # a new shape's first plan, too
        else:
            self._plans[expected] = plan
        if self._short_since:  # a shape that ran short waits for its plan: made now
            again = self._short_since.pop()
            if again in self._plans:
                return checker.make(self._plans[again].profile, "remade", expected=again) or line
        return line


def _kind(step: _Step) -> str:
    """What ``step`` was: "profiled", "planned" (its shape's plan), "carried" or "safe"."""
    if step.profiling:
        return "profiled"
    if step.waiting or step.deviated_at is not None:
        return "safe"
    return "carried" if step.carry is not None else "planned"
