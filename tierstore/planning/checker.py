"""The checker: a plan's prediction against each step's measurement, and the corrections.

:class:`PlanChecker` makes the runner's plans (at once, or off the training
thread in the planning process), checks each planned step's time and peak
against the plan's prediction, and refits: charges a slow step's excess to
what the profile could not price and remakes the plan, or rescales the
prediction (NOTE [ Planned steps ] in planning/runner.py).

Example:
    >>> from tierstore.planning.checker import budget_bytes
    >>> budget_bytes(0.25, saved_bytes=4000), budget_bytes(1000, saved_bytes=4000)
    (1000, 1000)
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tierstore.config import ENV_PREFIX, human_bytes
from tierstore.planning.planner import (
    Plan,
    Profile,
    default_plan,
    fits_everything,
    is_default,
    make_plan,
    offloaded_saves,
    recorded_rebuilds,
    simulate,
)
from tierstore.planning.process import PlanningProcess
from tierstore.planning.recorder import _scaled_save
from tierstore.tiers.interrupts import alive

if TYPE_CHECKING:
    from tierstore.planning.runner import PlanRunner

__all__ = [
    "FAR_OFF",
    "FIRST_PLAN_WAIT",
    "REFIT_STEPS",
    "REFIT_TOLERANCE",
    "STALLED",
    "PlanChecker",
    "budget_bytes",
]

#: How often wait() looks for the plan being made.
_POLL_S = 0.02

# NOTE [ Charging a slow step ]
# A slow step's excess goes to what the profile could not price. On a CPU
# both the moved bytes (copies and checksums on the step's own cores) and
# the op-by-op rebuilds (the recorder's Python) may be it, and each is
# charged in full, so the remade plan does without both at once. On CUDA
# the copies run on their own streams, each timed with events, and what no
# profile sees is the host: the recorder runs Python on every op of the
# modules it records in, while the GPU runs each op in microseconds, so a
# plan that rebuilds op by op leaves the compute stream waiting for the
# host to launch the next kernel, not for a copy (benchmarks/gpu_trace.py
# shows where a step's stream waits). Charging the moved bytes as well
# would take every offload out of the remade plans. So there a plan that
# replays op by op charges its excess to that alone, and the moved saves
# pay only once a plan that records nothing runs slow: per save, not per
# byte (Profile.moved_s_per_save): the host's time around a moved save is
# the same for SDPA's small statistics as for a large activation, and a
# price per byte makes the small ones look free. benchmarks/gpu_host.py
# times a moved save's host cost alone.

# NOTE [ A peak above the budget ]
# A planned step's peak is checked before its time, against the budget in
# bytes. One above it by more than REFIT_TOLERANCE means the step holds bytes
# the profile did not see (a link slower than the profile's keeps more copies
# in flight; tensors tierstore does not place), and under a hard limit the
# steps that overshoot are the ones killed. So the next step runs the safe
# placement (PlanRunner.fall_back: a waiting step, NOTE [ Planned steps ] in
# planning/runner.py), which holds the budget without a plan, while the plan
# is remade off the training thread with the excess over its prediction
# counted as bytes that stay (fixed_bytes), against the same budget: not as
# saved bytes, so a fractional budget (a share of what the step saves, for a
# remake after an out-of-memory step too) is not raised by them
# (Profile.overrun_bytes); the steps follow the remade plan from the step
# boundary where it is ready. A plan whose own prediction is above the
# budget (the floor's warning said so) is held to that prediction instead,
# until one is remade for a peak.
# The peak compared is what the step held, counted as the prediction counts
# it: the saves the plan keeps, each tensor once (NOTE [ A tensor saved
# twice ] in planning/planner.py), all of them at backward's first use
# (PlanRunner.used), the saves that stay whatever the plan (keep(), small
# saves), the device tier and the bytes in flight. A count that took a
# tensor saved twice twice remade plans for bytes no step held.
# A plan that counts an excess and still breaks the budget warns once, at
# that step's end: the second planned step after the overshoot, the first
# having waited for the remade plan (sooner where plans are made at once).
# The warning says why: where the saves came from a torch.compile'd region,
# no plan can help (a compiled graph runs its whole forward before it hands
# autograd its saves: the pack hooks run as the region ends, so the region
# holds all of them at once; the profile notes those saves, whose stack
# shows the compiled function's runtime, tier_store.py), and the fixes are
# to compile per block, whose saves come back a block at a time, or to give
# the compiled region PyTorch's own activation_memory_budget; for compiled
# blocks, room for one block's saves at once; otherwise, a lower budget.
# Such a plan is corrected again the same way while it predicts the budget
# met: each remake counts only what the plan in use did not predict, so the
# corrections end once a plan holds what the step holds, or predicts more
# than the budget (no plan meets it: that plan stays). A fraction of 1.0 or
# more asks for all the step saves: its peak is not held to anything.

# NOTE [ Planning off the training thread ]
# make_plan searches: each move it weighs is a simulation of the whole step,
# seconds for a step of hundreds of saves. A step must never wait for that.
# A plan that keeps everything needs no search (nothing is faster than
# keeping), so it is made at once, where the profile ends. Any other plan,
# the first of a shape of step as well as a remade one, is made in a process
# of its own (PlanningProcess in planning/process.py, which runs
# planning/worker.py: the planner module alone, the profile in and the plan
# out as JSON, at a lower priority after the first plan) while the steps go on: under the plan
# they have, or, before the first, on the safe placement (NOTE [ Planned
# steps ] in planning/runner.py) without the profile's recording and
# timing; the runner switches to the new plan at the first step boundary
# after it is ready, and only then says so (its INFO line, and the floor's
# warning where it cannot meet the budget): what the caller issues never
# comes from another thread, nor for a plan made again before it ran. Not a
# thread: a search holds the interpreter lock for
# milliseconds at a time, and the training thread, which gives the lock up
# around every torch op, waits up to the switch interval (5 ms) to get it
# back after each one, so its steps run several times slower beside a
# planning thread than beside the process. A thread of the store's waits on
# the process's pipe, which holds no lock; where no process can be started,
# it plans itself, giving the lock up between simulations (time.sleep(0)).
# The process does not: it runs nothing else, and on a busy machine each
# yield gives its core to the training process and puts the first plan off
# by steps. A check that finds the
# prediction off re-plans only when the choices could change: a step slower
# than predicted because the moved bytes cost more than the profile said
# (moved_s_per_byte) reweighs offload against rebuild; a step faster or
# slower by its compute alone, or a plan that moves nothing, only rescales
# the prediction (one simulation of the same choices, on the training thread,
# between steps). And a check acts only when the step is off by more than
# the tolerance *and* by more than the spread of the steps it judged, twice
# in a row (at once if off by FAR_OFF): a machine whose steps jitter by 15%
# does not re-plan on jitter.
# The thread is a daemon that holds nothing but numbers; close() drops its
# result and ends the process, which also ends when its input closes (the
# store's process gone). Tests pass background=False to make plans where the
# check runs, or set first_plan_at_once to count steps to the first plan.

# NOTE [ The first plan ]
# The docs promise a plan from the third step: the first warms up, the
# second is profiled, and the profile ends where the third begins. A search
# there takes a fraction of a second to seconds (make_plan on a GPT of 6
# blocks, 100 saves: about 0.5 s in the process, alone; more beside the
# step), and the third step would otherwise run on the safe placement
# beside it, on the same cores: on a CPU machine a step beside the search
# runs slower than the profiled one. So where no plan of any shape exists
# yet, the step after the profile waits for its plan, up to FIRST_PLAN_WAIT
# times the profiled step's time, and runs planned when it came: the first
# plan costs at most a step once. Past that the steps go on as below, and
# the plan is taken up at the first step boundary after it is ready. Only
# the first plan: once a plan exists, a new shape's or a remade one never
# holds a step up. The planning process is started as the store's first
# step begins (the warm-up, whose time counts for nothing), so that an
# interpreter's start is not in the first plan's time; a budget of all the
# step saves (1.0 or more) never searches and starts none. It makes the
# first plan at the training's priority (the step waits for it; niced, on a
# machine whose cores other work shares, it got none of them and came
# seconds late) and lowers its own after it. TierStore.plan()
# waits the same way, for as long as its timeout, where a profile ended and
# its plan is on its way, and never once a plan exists (a logging callback
# may call it every step).

# NOTE [ A stalled first step ]
# The first planned step of a shape is checked alone, and a check far off
# acts at once (NOTE [ Planned steps ] in planning/runner.py): the excess is
# charged to what the plan moves or records. But a first step can stall on
# what no plan chose: an import (NOTE [ Checkpoint's first call ] in
# planning/recorder.py), the allocator's first segments of a new pattern.
# Charged to the plan, a stall of seconds against a prediction of
# milliseconds prices each moved save so dear that no later plan of that
# budget offloads. So a first planned step at STALLED times its prediction
# or more is not judged; the step after it is, alone, as the first would
# have been; a plan slow on both is charged the excess, as above.

# NOTE [ The default on trial ]
# Where a shape's plan was searched (it rebuilds, or keeps part and offloads
# the rest) and what a store without a budget does, every save offloaded at
# the profile's window, fits the plan's budget, the two are measured side by
# side once (NOTE [ The default is a plan ] in planning/planner.py says why
# a price alone cannot settle it): after the plan's first check has let it
# stand, the next step of the shape runs the default (_try_default), held
# to the same budget, and is judged against the searched plan's step just
# before it (_judge_trial). Two plans measured fit two unknowns of the
# profile (_calibrated). The default rebuilds nothing, and its moves are
# priced from what the profiled step's own I/O measured (the link's clocks,
# the I/O threads' CPU time), so its time fits the compute: the profiled
# step's compute ran slowed by its recording, which every plan's price
# held. What the searched plan is then off by goes to what it does that the
# default does not: its rebuilds (a block rebuilt runs slower than its
# forward did), or else keeping what the default moves (the price of a
# moved byte, per byte on a CPU, per save on a device: NOTE [ Charging a
# slow step ]; never below nothing, the compute fitted again). Each scale
# stays within 4x of the profile's: two steps are noisy. The default is
# priced at what it measured (Profile.default_step_s). The faster of the
# two runs while the plan is remade on the fitted profile: a search that
# prices both as they ran finds the plans between them (the default
# keeping what its window leaves room for) that neither price found; the
# search is greedy, so the faster of the two stays where the search's best
# is predicted slower. The plan remade is checked as any new plan, its
# first step alone. A trial step that held more than the budget prices
# the default at math.inf. The default in use is checked as any plan: a
# check that finds it off takes its median as the default's price, and
# one slower than before searches again against it. Only the shape's own
# steps judge a trial: its plan stays the searched one among the kept
# plans meanwhile, so a step of another shape carries that over, and a
# step that ran any plan but the trial's ends the trial unjudged, to be
# tried after the next check. Once per profile: a step of one more, at
# most, where the default is slower, and the same budget held.

#: The least a trial scales the profile's compute or rebuilds by, and 1/it the most
#: (NOTE [ The default on trial ]): a fit to two noisy steps, not a new profile.
_LEAST_SCALE = 0.25

#: How far a prediction may be off before the plan is made again.
REFIT_TOLERANCE = 0.10
#: How far off a check acts on at once, without waiting for the next to agree.
FAR_OFF = 0.5
#: A first planned step this many times its prediction or more stalled on something
#: else: it is checked again on the next step (NOTE [ A stalled first step ]).
STALLED = 5.0
#: The planned steps whose median each check after the first compares with the prediction.
REFIT_STEPS = 3
#: How long, in profiled steps' time, the step after the store's first profile waits for
#: its plan (NOTE [ The first plan ]).
FIRST_PLAN_WAIT = 1.0


def budget_bytes(budget: int | float, saved_bytes: int) -> int:
    """The budget in bytes: a size as it is, a fraction of the bytes the step saves.

    Example:
        >>> from tierstore.planning.checker import budget_bytes
        >>> budget_bytes(0.5, saved_bytes=4000)
        2000
    """
    if isinstance(budget, float):
        return int(budget * saved_bytes)
    return int(budget)


@dataclass
class _Checks:
    """A shape's checks of its plan's prediction so far (NOTE [ Planned steps ] in runner.py)."""

    times: list[float] = field(default_factory=list)  # steps since the last check
    checked: bool = False  # the first planned step was checked alone
    stalled: bool = False  # the first planned step stalled: the next was checked alone
    off: float = 0.0  # how far the last check found the prediction off, if it let it be
    # NOTE [ The default on trial ]: whether the default was tried; while its step
    # runs, (the plan searched, that plan's step time, the default on trial).
    tried: bool = False
    trial: tuple[Plan, float, Plan] | None = None


class PlanChecker:
    """Makes a runner's plans and checks them against its steps.

    NOTE [ Planned steps ] in planning/runner.py says when.

    It reads the runner's plan under way and the sizes of its saves, puts
    the plans it makes in use through the runner, and appends the warnings
    it has for the user to the runner's ``warnings``.

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.planning.runner import PlanRunner
        >>> from tierstore.tiers.movers import LinkClock
        >>> runner = PlanRunner(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
        ...                     lambda: 0.0)
        >>> runner._checker.making()  # no plan on its way
        False
    """

    def __init__(self, runner: PlanRunner) -> None:
        self._runner = runner
        self._remaking: threading.Thread | None = None
        self._planning: PlanningProcess | None = None  # NOTE [ Planning off the training thread ]
        #: A plan made off the thread, ready for the runner: (its sizes, the plan,
        #: the verb of its INFO line). The line and any floor warning are the
        #: training thread's, said as it adopts the plan (``announce``).
        self.remade: tuple[tuple[int, ...], Plan, str] | None = None
        self._closed = False
        self._checks: dict[
            tuple[int, ...], _Checks
        ] = {}  # NOTE [ Planned steps ] in planning/runner.py
        self._warned = False
        self._peak_warned = False
        # Bytes compiled regions handed over, by shape (NOTE [ A peak above the budget ]).
        self._compiled: dict[tuple[int, ...], tuple[int, int]] = {}

    def making(self) -> bool:
        """Whether a plan is being made off the training thread."""
        return self._remaking is not None and alive(self._remaking)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the plan being made; whether one is ready.

        NOTE [ The first plan ]. Returns at once where none is on its way.
        """
        remaking = self._remaking
        deadline = time.monotonic() + max(timeout, 0.0)
        # Polled, not joined: a join that Ctrl-C stops can mark a live thread
        # ended for good (NOTE [ Interrupts held ] in tierstore/tiers/interrupts.py).
        while self.remade is None and remaking is not None and alive(remaking):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, _POLL_S))
        return self.remade is not None

    def warm(self) -> None:
        """Start the planning process ahead of the first plan (NOTE [ The first plan ])."""
        if not self._closed:
            self._process().start()

    def forget(self, expected: tuple[int, ...]) -> None:
        """The shape of ``expected`` fell out of the runner's kept plans."""
        self._checks.pop(expected, None)

    def profiled(
        self, profile: Profile, expected: tuple[int, ...], compiled: tuple[int, int]
    ) -> str | None:
        """A new profile of the shape ``expected``: its plan, checked afresh; its INFO line.

        ``compiled``: the bytes compiled regions handed over, and how many modules.
        """
        self._checks.pop(expected, None)  # a new profile: its plan is checked afresh
        self._compiled[expected] = compiled
        return self.make(profile, "made", expected=expected)

    def ended(self, measured: float, peak_bytes: int) -> str | None:
        """A step on the runner's plan measured ``measured`` seconds and ``peak_bytes``.

        The peak first: a step above the budget is corrected whatever its
        time, which is then judged on the plan remade (NOTE [ A peak above
        the budget ]).
        """
        runner = self._runner
        checks = self._checks.setdefault(runner._expected, _Checks())
        if checks.trial is not None:
            if runner.plan is checks.trial[2]:
                return self._judge_trial(checks, measured, peak_bytes)
            # It ran another plan: unjudged, tried again (NOTE [ The default on trial ]).
            checks.trial, checks.tried = None, False
        plan = runner.plan
        if self.over_budget(peak_bytes):
            line = self.check_peak(peak_bytes)
            if runner._falling_back or runner.plan is not plan:
                return line
        return self.refit(measured) or self._try_default(checks, measured)

    def _try_default(self, checks: _Checks, measured: float) -> str | None:
        """Put the default on trial for the next step, where due: its INFO line.

        NOTE [ The default on trial ]. ``measured``: the step just ended, on
        the plan in use.
        """
        runner = self._runner
        plan = runner.plan
        assert plan is not None
        if (
            checks.tried
            or not checks.checked
            or self.making()
            or self.remade is not None
            or runner._falling_back
            or plan.keeps_everything
            or is_default(plan.profile, plan.choices, plan.window_bytes)
        ):
            return None
        checks.tried = True
        if plan.profile.default_step_s is not None:
            return None  # it ran already
        default = default_plan(plan.profile, plan.budget_bytes, plan.floor_bytes)
        if default is None:
            return None  # it does not fit
        checks.trial = (plan, measured, default)
        runner._use(runner._expected, default, kept=False)
        by = plan.bytes_by_choice()
        return (
            f"tierstore: trying for one step every save offloaded, as without a budget, "
            f"predicted {default.predicted_step_s:.3f} s, peak "
            f"{human_bytes(default.predicted_peak_bytes)}, beside the plan that keeps "
            f"{human_bytes(by['keep'])}, offloads {human_bytes(by['offload'])} and rebuilds "
            f"{human_bytes(by['rebuild'])}, measured {measured:.3f} s"
        )

    def _judge_trial(self, checks: _Checks, measured: float, peak_bytes: int) -> str:
        """The default's trial step ended: the profile calibrated, the plan remade; its INFO line.

        NOTE [ The default on trial ]: the faster of the two measured runs
        until the plan remade on the calibrated profile is ready.
        """
        assert checks.trial is not None
        searched, searched_s, default = checks.trial
        checks.trial = None
        runner = self._runner
        head = f"tierstore: plan kept for activation_budget={runner.asked!r}: "
        if self.over_budget(peak_bytes):
            searched.profile = replace(searched.profile, default_step_s=math.inf)
            runner._use(runner._expected, searched)
            return head + (
                f"every save offloaded held {human_bytes(peak_bytes)}, above the budget "
                f"({human_bytes(default.budget_bytes)}); the plan searched runs"
            )
        profile = _calibrated(searched, searched_s, default, measured)
        faster = default if measured < searched_s else searched
        outcome = simulate(profile, faster.choices, faster.window_bytes)
        faster.profile, faster.predicted_step_s = profile, outcome.step_s
        runner._use(runner._expected, faster)
        checks.times.clear()  # the plan remade is checked afresh, its first step alone
        checks.checked, checks.off = False, 0.0
        line = head + (
            f"every save offloaded, as without a budget, measured {measured:.3f} s a step, "
            f"the plan searched {searched_s:.3f} s; "
            + ("the default runs" if faster is default else "the plan searched runs")
        )
        remade = self.make(profile, "remade", searched.budget_bytes, beside=faster)
        return line if remade is None else f"{line}\n{remade}"

    def close(self) -> None:
        """Drop a plan still being made and end the planning process. Idempotent.

        NOTE [ Planning off the training thread ].
        """
        self._closed = True
        self.remade = None
        planning, self._planning = self._planning, None
        if planning is not None:
            planning.close()

    def _process(self) -> PlanningProcess:
        """The planning process, created on first use."""
        if self._planning is None:
            self._planning = PlanningProcess()
        return self._planning

    def make(
        self,
        profile: Profile,
        verb: str,
        budget: int | None = None,
        expected: tuple[int, ...] | None = None,
        beside: Plan | None = None,
    ) -> str | None:
        """A plan for ``profile`` (NOTE [ Planning off the training thread ]): its INFO line.

        At once where everything fits (no search) or without a background
        thread; otherwise off the thread, the steps going on meanwhile
        (``None``: the line comes when the plan is adopted). ``expected``:
        the sizes of the profile's saves, where not the plan's under way.
        ``beside``: a plan on ``profile`` the search's must beat, or it is
        made again (the search is greedy: NOTE [ The default on trial ]).
        """
        if expected is None:
            expected = self._runner._expected
        # Less what a step of the shape was short of (NOTE [ A step that raised ]
        # in tierstore/tier_store.py), whoever asks: a remake for a peak or for
        # time, of a plan made before that step, passes the plan's own budget.
        allowed = budget_bytes(self._runner.budget, profile.saved_bytes)
        allowed = max(allowed - self._runner.short_of.get(expected, 0), 0)
        budget = allowed if budget is None else min(budget, allowed)
        elsewhere = (
            self._runner.wait_for_plans and self._runner.background
        )  # the process, waited for
        at_once = not self._runner.background or (
            verb == "made" and self._runner.first_plan_at_once
        )
        fits = fits_everything(profile, budget)
        if not (elsewhere or at_once or fits):
            if self._remaking is not None and alive(self._remaking):
                return None  # one at a time: the check after it judges the new plan
            if self._remake_off_thread(profile, budget, expected, verb, beside):
                return None
            elsewhere = True  # no thread to be had (memory short): made here, waited for
        if elsewhere and not fits:
            plan = self._plan_in_process(profile, budget)
        else:
            plan = make_plan(profile, budget)  # no search, or one here
        plan = _no_slower(plan, beside)
        self._runner._use(expected, plan)
        return self.announce(plan, verb)

    def _remake_off_thread(
        self,
        profile: Profile,
        budget: int,
        expected: tuple[int, ...],
        verb: str,
        beside: Plan | None,
    ) -> bool:
        """Make the plan on a thread, ready in ``remade``; whether the thread started."""

        def in_process() -> None:
            try:
                plan = _no_slower(self._plan_in_process(profile, budget), beside)
            except (OSError, RuntimeError, ValueError):
                return  # closed meanwhile: the process with it
            if not self._closed:
                self.remade = (expected, plan, verb)

        remaking = threading.Thread(target=in_process, name="tierstore-plan", daemon=True)
        try:
            remaking.start()
        except RuntimeError:  # "can't start new thread"
            return False
        self._remaking = remaking
        return True

    def _plan_in_process(self, profile: Profile, budget: int) -> Plan:
        """``make_plan`` in the planning process; in this thread where none can be had.

        Raises what the process raised once the runner is closed.
        """
        try:
            return self._process().plan(profile, budget)
        except (OSError, RuntimeError, ValueError):
            if self._closed:
                raise
            return make_plan(profile, budget)

    def remake(self, profile: Profile, budget: int | None = None) -> str | None:
        """Make the plan again (NOTE [ Planning off the training thread ])."""
        return self.make(profile, "remade", budget)

    def over_budget(self, peak: int) -> bool:
        """Whether a step on the runner's plan that peaked at ``peak`` bytes broke the budget.

        More than REFIT_TOLERANCE above it; for a plan that predicted more
        and counts no excess yet, above that prediction (NOTE [ A peak above
        the budget ]).
        """
        plan = self._runner.plan
        assert plan is not None
        if isinstance(self._runner.budget, float) and self._runner.budget >= 1.0:
            return False  # all the step saves: nothing to hold it to
        allowed = plan.budget_bytes
        if not self._counts_excess(plan):
            allowed = max(allowed, plan.predicted_peak_bytes)
        return peak > allowed * (1 + REFIT_TOLERANCE)

    @staticmethod
    def _counts_excess(plan: Plan) -> bool:
        """Whether ``plan`` was remade counting the excess of a peak above the budget.

        Such a plan that is over still warns (NOTE [ A peak above the budget ]).
        """
        return plan.profile.overrun_bytes > 0

    def check_peak(self, peak: int) -> str | None:
        """NOTE [ A peak above the budget ]: the safe placement now, a plan remade; a warning.

        ``peak``: the measured peak of a step over the budget
        (:meth:`over_budget`). Returns the INFO line of a plan remade at once.
        """
        runner = self._runner
        plan = runner.plan
        assert plan is not None
        checks = self._checks.setdefault(runner._expected, _Checks())
        if self._counts_excess(plan):
            self._warn_peak(peak, plan)
            if not plan.fits:
                return None  # no plan holds it: the closest stays, and the floor said so
        checks.times.clear()  # the time checks start again on the plan remade
        unseen = max(peak - plan.predicted_peak_bytes, 0)
        was = plan.profile
        profile = replace(
            was, fixed_bytes=was.fixed_bytes + unseen, overrun_bytes=was.overrun_bytes + unseen
        )
        runner.fall_back()  # until the remade plan is in use: made at once, that is now
        return self.remake(profile, plan.budget_bytes)

    def _warn_peak(self, peak: int, plan: Plan) -> None:
        """A plan remade counting what steps held beyond their plan is over still: warn, once."""
        if self._peak_warned:
            return
        self._peak_warned = True
        compiled, regions = self._compiled.get(self._runner._expected, (0, 0))
        head = (
            f"tierstore: the step's peak, measured {human_bytes(peak)}, is above "
            f"activation_budget={self._runner.asked!r} ({human_bytes(plan.budget_bytes)}): "
        )
        if compiled and regions > 1:
            cause = (
                f"{human_bytes(compiled)} of its saves came from torch.compile'd regions, "
                "each of which hands its saves over together as it ends, so the budget "
                "needs room for a whole region's saves at once. Compile smaller regions, "
                f"or raise activation_budget ({ENV_PREFIX}ACTIVATION_BUDGET)"
            )
        elif compiled:
            cause = (
                f"{human_bytes(compiled)} of its saves came from a torch.compile'd region, "
                "which hands them over only as it ends, after its forward has held them "
                "all, so no plan can bring that region under the budget. Compile each "
                "block instead of the whole model (block.compile() for each block: "
                "tierstore then places each block's saves as it ends), or give the "
                "compiled region PyTorch's own budget "
                "(torch._functorch.config.activation_memory_budget)"
            )
        else:
            cause = (
                f"the plan predicted {human_bytes(plan.predicted_peak_bytes)}, counting as "
                f"bytes that stay the {human_bytes(plan.profile.overrun_bytes)} an earlier "
                "step held beyond its plan, and the step holds more still: a link slower "
                "than the profile's keeps more copies in flight, or the step holds tensors "
                f"tierstore does not place. Lower activation_budget ({ENV_PREFIX}"
                "ACTIVATION_BUDGET) by the difference"
            )
        self._runner.warnings.append(head + cause)

    def _rescaled(self, profile: Profile) -> str | None:
        """The plan under way with its prediction made on ``profile``: the same choices."""
        plan = self._runner.plan
        assert plan is not None
        outcome = simulate(profile, plan.choices, plan.window_bytes)
        if plan.fits and outcome.peak_bytes > plan.budget_bytes:
            # On the new times the choices no longer fit: search again.
            return self.remake(profile, plan.budget_bytes)
        plan.profile = profile
        plan.predicted_step_s = outcome.step_s
        plan.predicted_peak_bytes = outcome.peak_bytes
        plan.exposed_s = outcome.exposed_s
        return self.announce(plan, "rescaled")

    def announce(self, plan: Plan, verb: str) -> str:
        """The INFO line of a plan put in use; the floor warning is set for the caller, once.

        On the training thread: a plan remade off it is announced as the
        runner adopts it, so a warning never races the caller's reading of
        ``PlanRunner.warnings``, nor comes for a plan that is not run.
        """
        budget, profile, asked = plan.budget_bytes, plan.profile, self._runner.asked
        if not plan.fits and not self._warned:
            self._warned = True
            peak = plan.predicted_peak_bytes
            if plan.floor_bytes > budget:
                self._runner.warnings.append(
                    f"tierstore: activation_budget={asked!r} ({human_bytes(budget)}) is "
                    f"below the lowest this step can reach, {plan.floor_bytes} bytes "
                    f"({human_bytes(plan.floor_bytes)}); the step runs at {human_bytes(peak)}. "
                    f"Raise activation_budget ({ENV_PREFIX}ACTIVATION_BUDGET) to at least "
                    f"{plan.floor_bytes}"
                )
            else:  # NOTE [ The floor ] in planning/planner.py
                self._runner.warnings.append(
                    f"tierstore: no plan found meets activation_budget={asked!r} "
                    f"({human_bytes(budget)}), though the step's floor is "
                    f"{human_bytes(plan.floor_bytes)}; the closest runs at {human_bytes(peak)}. "
                    f"Raise activation_budget ({ENV_PREFIX}ACTIVATION_BUDGET) to at least {peak}"
                )
        by = plan.bytes_by_choice()
        return (
            f"tierstore: plan {verb} for activation_budget={asked!r} "
            f"({human_bytes(budget)} of {human_bytes(profile.saved_bytes)} saved): "
            f"keep {human_bytes(by['keep'])}, offload {human_bytes(by['offload'])}, "
            f"rebuild {human_bytes(by['rebuild'])}; predicted step "
            f"{plan.predicted_step_s:.3f} s, peak {human_bytes(plan.predicted_peak_bytes)}"
        )

    def refit(self, measured: float) -> str | None:
        """The checks of a plan's prediction, and the corrections.

        NOTE [ Planned steps ] in planning/runner.py says when a check runs.

        NOTE [ Planning off the training thread ]: a check acts on a step
        off by more than the tolerance and the spread of what it judged, the
        second time in a row; only a dearer link re-plans.
        """
        plan = self._runner.plan
        assert plan is not None
        checks = self._checks.setdefault(self._runner._expected, _Checks())
        if measured <= 0:
            return None
        checks.times.append(measured)
        if len(checks.times) == 1 and not checks.checked:
            if measured >= STALLED * plan.predicted_step_s and not checks.stalled:
                checks.stalled = True  # NOTE [ A stalled first step ]: the next one, once
                checks.times.clear()
                return None
            checks.checked = True
            basis, spread = measured, 0.0
        elif len(checks.times) == REFIT_STEPS:
            basis = statistics.median(checks.times)
            spread = (max(checks.times) - min(checks.times)) / basis
            checks.times.clear()
        else:
            return None
        off = (basis - plan.predicted_step_s) / basis
        if abs(off) <= max(REFIT_TOLERANCE, spread):
            checks.off = 0.0
            return None
        if checks.off * off <= 0 and abs(off) < FAR_OFF:
            checks.off = off  # once: the next check must find it off the same way
            return None
        checks.off = 0.0
        checks.times.clear()
        profile = plan.profile
        if profile.default_step_s is not None and is_default(
            profile, plan.choices, plan.window_bytes
        ):
            # The default kept on trial: its price is what it measures, and a
            # dearer one is weighed against the search again (NOTE [ The default on trial ]).
            profile = replace(profile, default_step_s=basis)
            if basis > plan.predicted_step_s:
                return self.remake(profile)
            return self._rescaled(profile)
        if basis > plan.predicted_step_s:
            # Slower than predicted: the excess is charged to the moved bytes
            # and to the rebuilds replayed op by op (NOTE [ Replayed modules ]
            # in planning/planner.py), each as if it alone were the cause, so that the
            # next plan does without what cost more than priced. Except on a
            # device with a copy engine each way: NOTE [ Charging a slow step ].
            excess = basis - plan.predicted_step_s
            recorded = recorded_rebuilds(profile, plan.choices)
            if profile.shared_link:  # a CPU: both in full (NOTE [ Charging a slow step ])
                moved_bytes, moved_saves = 2 * plan.bytes_by_choice()["offload"], 0
            else:  # CUDA: the recorder first, else each moved save
                moved_bytes = 0
                moved_saves = 0 if recorded else offloaded_saves(profile, plan.choices)
            if recorded or moved_bytes or moved_saves:
                if recorded:
                    self._runner._recorder.recorded_rebuild_s = (
                        profile.recorded_rebuild_s + excess / recorded
                    )
                    profile = replace(
                        profile, recorded_rebuild_s=self._runner._recorder.recorded_rebuild_s
                    )
                if moved_bytes:
                    per_byte = profile.moved_s_per_byte + excess / moved_bytes
                    profile = replace(profile, moved_s_per_byte=per_byte)
                if moved_saves:
                    self._runner._recorder.moved_s_per_save = (
                        profile.moved_s_per_save + excess / moved_saves
                    )
                    profile = replace(
                        profile, moved_s_per_save=self._runner._recorder.moved_s_per_save
                    )
                return self.remake(profile)
        return self._rescaled(_scaled(profile, basis / plan.predicted_step_s))


def _no_slower(plan: Plan, beside: Plan | None) -> Plan:
    """``plan``, or ``beside`` where that fits its budget and is predicted no slower."""
    if (
        beside is None
        or beside.predicted_peak_bytes > plan.budget_bytes
        or beside.predicted_step_s > plan.predicted_step_s
    ):
        return plan
    return replace(beside, budget_bytes=plan.budget_bytes, floor_bytes=plan.floor_bytes)


def _calibrated(searched: Plan, searched_s: float, default: Plan, default_s: float) -> Profile:
    """``searched``'s profile fitted to the two steps measured side by side.

    NOTE [ The default on trial ]: the compute scaled to the default's time,
    its moves priced as the profiled step's I/O measured them; then what the
    searched plan is off by, charged to what it does that the default does
    not: its rebuilds, or else keeping what the default moves (the price of
    a moved byte, never below nothing, the compute fitted again). The
    default is priced at what it measured.
    """
    profile = _compute_fitted(searched.profile, default, default_s)
    left = searched_s - simulate(profile, searched.choices, searched.window_bytes).step_s
    rebuilt = sum(
        s.rebuild_s or 0.0
        for s, choice in zip(profile.saves, searched.choices, strict=True)
        if choice == "rebuild"
    )
    if rebuilt > 0:
        dearer = max(1 + left / rebuilt, _LEAST_SCALE)
        saves = tuple(
            s if s.rebuild_s is None else replace(s, rebuild_s=s.rebuild_s * dearer)
            for s in profile.saves
        )
        profile = replace(profile, saves=saves)
    elif profile.shared_link:  # a CPU: the copies' and checksums' time is its cores'
        more = 2 * (default.bytes_by_choice()["offload"] - searched.bytes_by_choice()["offload"])
        if more > 0:  # the bytes the default moves and the searched plan does not
            per_byte = max(0.0, profile.moved_s_per_byte - left / more)
            profile = replace(profile, moved_s_per_byte=per_byte)
            profile = _compute_fitted(profile, default, default_s)
    else:  # NOTE [ Charging a slow step ]: per save
        more = offloaded_saves(profile, default.choices) - offloaded_saves(
            profile, searched.choices
        )
        if more > 0:
            per_save = max(0.0, profile.moved_s_per_save - left / more)
            profile = replace(profile, moved_s_per_save=per_save)
            profile = _compute_fitted(profile, default, default_s)
    return replace(profile, default_step_s=default_s)


def _compute_fitted(profile: Profile, default: Plan, default_s: float) -> Profile:
    """``profile`` with its compute scaled so that ``default`` plays ``default_s`` seconds.

    Within _LEAST_SCALE of the profile's: the rest of the default's price
    (its moves, its waits) as the profile has it.
    """
    compute = profile.forward_s + profile.backward_s + profile.other_s - (profile.between_s or 0.0)
    if compute <= 0:
        return profile
    rest = simulate(profile, default.choices, default.window_bytes).step_s - compute
    factor = min(max((default_s - rest) / compute, _LEAST_SCALE), 1 / _LEAST_SCALE)
    return _scaled(profile, factor)


def _scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every compute time times ``factor`` (NOTE [ Planned steps ])."""
    saves = tuple(_scaled_save(s, factor) for s in profile.saves)
    between = (
        profile.between_s or 0.0
    )  # not the step's compute (NOTE [ Like with like ] in planning/runner.py)
    return replace(
        profile,
        saves=saves,
        forward_s=profile.forward_s * factor,
        backward_s=profile.backward_s * factor,
        other_s=between + (profile.other_s - between) * factor,
    )
