"""Carrying out an activation budget: profile a step, plan, apply the plan, measure it.

Part of the tier manager's layer: it knows bytes, budgets and seconds, not
autograd. The autograd boundary asks :meth:`PlanRunner.choose` what to do
with each saved tensor and tells it about saves and uses while a step is
profiled; the planner (``tierstore.planning.planner``) decides; the tier manager
places what the plan says. NOTE [ Planned steps ] says how a step goes.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.planning.runner import PlanRunner, budget_bytes
    >>> budget_bytes(0.25, saved_bytes=4000), budget_bytes(1000, saved_bytes=4000)
    (1000, 1000)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from tierstore.config import ENV_PREFIX, TierConfig, human_bytes
from tierstore.planning import planner
from tierstore.planning.planner import (
    Choice,
    Plan,
    Profile,
    Save,
    fits_everything,
    make_plan,
    offloaded_saves,
    recorded_rebuilds,
    simulate,
)
from tierstore.tiers.movers import LinkClock

__all__ = ["HostTimer", "PlanRunner", "PlanningProcess", "Timer", "budget_bytes"]

# NOTE [ Planned steps ]
# With activation_budget set, every step is one of two kinds:
#   * profiled (the first steps, and the one after a step that did not match
#     the plan): the safe placement, which meets any budget without knowing
#     the step (the newest saves kept up to a budget given in bytes less the
#     bytes in flight, the rest offloaded; with a fraction, whose bytes are
#     not known yet, everything offloaded, with the write queue and the reads
#     ahead bounded by the fraction of what the step has saved so far: a
#     save that would take the queue past it waits for its own write, and
#     backward reads on demand where one read more would pass it),
#     while each save is written down:
#     its bytes, the op and module that made it, what a rebuild would cost
#     and read, and when forward saved it and backward first used it, with
#     the waits taken out. The link's rates come from the I/O it did.
#   * planned: each save does what the plan says, in save order, with the
#     plan's window bounding the write queue and the reads ahead alike.
# Plans are kept per shape: the runner keeps the last PLANS_KEPT plans by the
# sizes of their profile's saves. A save that differs from the plan's at its
# place (another size, another branch, more saves) moves the step to a kept
# plan that saved the same sizes so far and chose the same for them (a step
# of another sequence length differs at its first save, where nothing was
# chosen yet). With none, the plan ends for the rest of the step: the tier
# manager returns to the safe placement, counting what the plan kept so
# far, and a later step of that shape is profiled: the next one that matches
# no kept plan at its first save, or the next one at all when the step that
# left the plan had matched one there. So steps whose shapes come and go
# (buckets of sequence lengths) are each profiled once, then planned.
# On a machine without an accelerator the disk I/O runs on the step's own
# cores: the CPU time of the I/O threads in the profiled step is charged to
# the bytes it moved (Profile.moved_s_per_byte) and taken out of the compute
# it slowed down, and so out of the step: not left in what the profile holds
# for the rest of the step (other_s), where every plan, offloading or not,
# would pay it again (on the small CPU model, 0.19 s of a 0.75 s profile).
# A step ends where the store sees the next step begin (NOTE [ Step log ] in
# tier_store.py): the first block after a backward. There the profile becomes a
# plan, or the plan gets its measured time and peak beside the predicted.
# The store's first step only warms up (lazy initialisation and first
# allocations make it slower than any other); the one after it is profiled.
# A prediction more than 10% off is corrected and the plan made again. The
# first planned step of a shape is checked alone (a profile far off is
# corrected at once); after that, the median of each REFIT_STEPS steps in a
# row under the plan in use (one step is noisy). The checks go on for as
# long as the plan runs: a machine's steps can keep getting faster for
# minutes after the profile (bench train's floor, in one process: 13.4 s
# at the first planned step, 9.9-10.6 at the next three, 9.4-10.1 at the
# three after), and a prediction checked only on the first four of those
# ended at 1.21x the measured step. A step slower than predicted charges
# the difference to the bytes it moved (moved_s_per_byte: on a CPU, copies
# and checksums share its cores with the step) and to the rebuilds it
# replayed op by op (recorded_rebuild_s: the recorder's Python, which the
# profile's op times do not hold; NOTE [ Replayed modules ] in planning/planner.py),
# each in full, and remakes the plan; a faster one scales the profile's
# compute times down to it. On the H200 a budget's first plan, which rebuilt
# a few saves in every block and offloaded a little, ran at 2x its
# prediction, and on bench train's small CPU model at 1.2-1.3x; the plans
# remade from them checkpoint the first blocks natively. Once a prediction holds, a plan is
# remade only when three steps' median leaves it by 10%: re-planning costs
# time, and a plan that keeps changing cannot be measured.

# NOTE [ Like with like ]
# A step's time, as the runner measures it, runs from its start to the
# next step's: the optimizer, the data loader, an evaluation, whatever the
# loop does between two forwards, are in it, and the profile holds what the
# profiled step spent there in other_s, which every prediction includes.
# Were the time between steps to change after the profile, a check would
# charge the difference to the moved bytes and remake the plan for it: in
# bench overhead, whose rows take turns with steps of no hooks between
# them, a check found budget=0.5's step 50% slow once the turns began,
# remade the plan (7 s of a planning process on the second of two cores,
# its steps up to 30% slower meanwhile) and then predicted 94 ms for a 58
# ms step. So the hooks have autograd's engine tell the runner as each
# backward of a timed step ends (a final callback queued at the first
# unpack in each of autograd's graph tasks; used() returns it, tied to its
# step), and the step ends with its last backward: timed to its first, a
# step that ran two (two losses, a multi-task head) measured 0.011 s of
# its 0.22 and had its plan rescaled to that. The profile keeps the part of other_s after
# that end (between_s), and a check on a CPU takes the step as its own
# span, start to the end of its last backward, plus the profile's
# between_s: the same time outside the step on both sides. On CUDA the
# host reaches the end of backward long before the device does, so there a
# check still takes the step from start to start (a device profile's
# other_s is 0 and its first check fits the prediction to what the step
# does around it: NOTE [ Timing a profile ]).

# NOTE [ Charging a slow step ]
# A slow step's excess goes to what the profile could not price. On a CPU
# both the moved bytes (copies and checksums on the step's own cores) and
# the op-by-op rebuilds (the recorder's Python) may be it, and each is
# charged in full, so the remade plan does without both at once. On CUDA
# the copies run on their own streams, each timed with events, and what no
# profile sees is the host: the recorder runs Python on every op of the
# modules it records in, while the GPU runs each op in microseconds. On an
# H200 a budget's first plans (32 MiB rebuilt op by op in every block, 64 to
# 128 MiB offloaded) took 127 to 166 ms for a step whose kernels took 57:
# the compute stream sat 63 to 102 ms waiting for the host to launch the
# next kernel, and never for a copy (benchmarks/gpu_trace.py on two
# profiled steps). Charging the moved bytes as well took every offload out
# of the remade plans, which settled on checkpointing alone. So there a
# plan that replays op by op charges its excess to that alone, and the
# moved saves pay only once a plan that records nothing runs slow: per
# save, not per byte (Profile.moved_s_per_save): the host's time around a
# moved save is the same for SDPA's 0.5 MiB statistics as for a 32 MiB
# activation, and a price per byte made the small ones look free (a third
# of the 25 saves one such plan moved). That plan ran 29 ms over its
# prediction, which read as 1.1 ms of host time a save; most of it was the
# loss's 512 MiB log-probabilities going out and back unplanned (NOTE [ A
# tensor saved twice ] in planning/planner.py). With that fixed, on an H200, a plan
# that offloads 484 MiB in 24 saves and checkpoints four blocks natively
# ran within 2% of its prediction, with no charge (another, 774 MiB in 36
# saves and one block, ran at its prediction for five steps, then 10-15%
# over it, unexplained); benchmarks/gpu_host.py times a moved save's host
# cost alone at 0.17-0.20 ms out and back.

# NOTE [ Pricing the recorder first ]
# A device's profile times the ops on the device (NOTE [ Timing a profile ]),
# so it holds nothing of the recorder's Python, and a first plan priced the
# rebuilds it replays op by op at their compute alone. On an H200 a budget's
# first plan (57 saves rebuilt op by op, 966 MiB offloaded) predicted 67.5
# ms and ran 98 to 125 ms for nine steps, until a check charged the excess
# and the plan remade from it checkpointed natively (73 ms). The profiled
# step itself ran the recorder over every op: what its host added to the
# device's busy time, per save it recorded, is the first price of a save
# rebuilt op by op. It errs dear, and no check lowers it: it holds all the
# profiled step's time beyond its ops, the host's time around every save
# the step moved included (an H200's profiled steps took 3.7 to 5.0 s,
# which priced a save rebuilt op by op at 24 to 33 ms, against the 0.7 ms a
# check charged once a plan ran; offline, on those profiles, a price of 1.5
# ms makes the same plans). On a GPU a step that records is
# host-bound (NOTE [ Charging a slow step ]), and the first plans made so
# on an H200, which checkpoint natively and offload, were the plans each
# budget kept: at 0.68 and 0.52 within 3% of their predictions. Only where
# the profile was timed on the device; a CPU's profile times the recorder
# with the ops.

# NOTE [ Pricing a moved save first ]
# Likewise a moved save's host time: on a GPU the copies run on their own
# streams, timed with events, but the put and the get that start them run
# on the training thread, about 0.17-0.20 ms out and back on an H200's host
# (benchmarks/gpu_host.py), and a step near the host's limit pays them in
# full. Priced at nothing until a check charged them (NOTE [ Charging a
# slow step ]), the first plans offloaded 1 GiB in 43 saves and ran 5-11%
# over their predictions, each time less than a check acts on, while a
# plan that offloaded nothing and rebuilt GELU's outputs from the graph ran
# at its own (64.7 ms predicted 64.4). So a profile timed on the device
# prices a moved save first at the host time its own puts and gets took,
# the store's waits for the link taken out, per save it moved. It errs dear
# for a step the device binds, where that time hides behind the kernels;
# a check that finds the step faster rescales the prediction.

# NOTE [ A peak above the budget ]
# A planned step's peak is checked as its time is. One above the budget (and
# the prediction) by more than REFIT_TOLERANCE, and by more than the largest
# save (which one copy's timing can move), means the step holds bytes the
# profile did not see. A fraction of 1.0 or more asks for all the step saves:
# its peak is not held to anything. Where they came from a torch.compile'd region, no plan
# can help: a compiled graph runs its whole forward before it hands autograd
# its saves (the pack hooks run as the region ends), so the region holds all
# of them at once whatever is done with them after. The profile notes those
# saves (the stack shows the compiled function's runtime; tier_store.py). The
# plan is remade once with the excess counted as bytes that stay
# (fixed_bytes) against the same budget in bytes: a link slower than the
# profile's, say, kept more copies in flight. A peak still above the budget
# under the remade plan warns once, with the cause and the fixes: for a
# whole compiled model, compile per block, whose saves come back a block at
# a time, or PyTorch's own activation_memory_budget for the compiled region;
# for compiled blocks, room for one block's saves at once.

# NOTE [ Planning off the training thread ]
# make_plan searches: each move it weighs is a simulation of the whole step,
# seconds for a step of hundreds of saves. A step must never wait for that.
# A plan that keeps everything needs no search (nothing is faster than
# keeping), so it is made at once, where the profile ends. Any other plan,
# the first of a shape of step as well as a remade one, is made in a process
# of its own (PlanningProcess: the planner module alone, the profile in and
# the plan out as JSON, at a lower priority) while the steps go
# on: under the plan they have, or, before the first, on the safe placement
# (NOTE [ Planned steps ]) without the profile's recording and timing; the
# runner switches to the new plan at the first step boundary after it is
# ready. Not a thread: a search holds the interpreter lock for milliseconds
# at a time, and the training thread, which gives the lock up around every
# torch op, waited up to the switch interval (5 ms) to get it back after
# each one. On the 2-core VM, the 600-save chain of bench overhead ran its
# steps at 1.5-2.6 s beside a planning thread, 0.5-0.7 s beside the
# process, 0.13 s planned. A thread of the store's waits on the process's
# pipe, which holds no lock; where no process can be started, it plans
# itself, giving the lock up between simulations (time.sleep(0)). The process
# does not: it runs nothing else, and on a busy machine each yield gave its
# core to the training process (bench train's small model had its first
# plan at steps 9-23 with the yields, 6-8 without). A check that finds the
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

# NOTE [ Timing a profile ]
# A profile's times are when each save was made and first used, and what
# each op that could rebuild it took. On a CPU they are perf_counter seconds
# with the store's own waits taken out (HostTimer). On a GPU the host runs
# ahead of the device in a real step, and the profiled step is not a real
# step: it moves every save, waits on the link, and runs the recorder's
# Python on every op, so the device idles between kernels. A sync around
# each op made small ops several times slower than in a real step (a 99 ms
# H200 step predicted at 486 ms); events on the stream alone still counted
# the idle gaps (a 58 ms step predicted at 317 ms). So a GPU profile's clock
# is the device's own work (BusyTimer):
#   * forward: CUDA events around each op the recorder runs, summed. Where
#     the stream has run dry before an op (the host is slow in a profile),
#     a spin is queued first (CudaEvents.keep_busy): the op's start event
#     waits behind it while the host launches the op, so the span is the
#     op's kernels, not the launch (measured on an H200: forward came out
#     at 10.6 ms for 7.9 ms of kernels without it). Ops
#     that launch nothing (views, allocations) are not timed: their span
#     would be the host's time alone (an allocation that waited on the
#     device took 340 ms of one profile). tierstore's own ops in its hooks
#     (the copy off the device, a detach) are not the step's: the recorder
#     is paused while the hooks run them (hooks._unrecorded).
#   * backward: an event at each use, less the time the compute stream
#     waited on copies back (an event pair around each wait, written down
#     by Transfers.consume while the profiled step runs).
# The seconds are read once, when the profile becomes a plan; an op's time
# not yet known travels as a function that reads it. What the step does
# outside forward and backward (the optimizer, the loader) is not seen on a
# device: the first check rescales the prediction to the measured step.

#: How far a prediction may be off before the plan is made again.
REFIT_TOLERANCE = 0.10
#: How far off a check acts on at once, without waiting for the next to agree.
FAR_OFF = 0.5
#: A first planned step this many times its prediction or more stalled on something
#: else: it is checked again on the next step (NOTE [ A stalled first step ]).
STALLED = 5.0
#: The planned steps whose median each check after the first compares with the prediction.
REFIT_STEPS = 3
#: How many plans, one per shape of step, the runner keeps (NOTE [ Planned steps ]).
PLANS_KEPT = 8


def budget_bytes(budget: int | float, saved_bytes: int) -> int:
    """The budget in bytes: a size as it is, a fraction of the bytes the step saves."""
    if isinstance(budget, float):
        return int(budget * saved_bytes)
    return int(budget)


class Timer(Protocol):
    """Marks on a step's timeline, read as seconds since it began (NOTE [ Timing a profile ])."""

    @property
    def blocked(self) -> list[tuple[Any, Any]] | None:
        """Where the compute stream's waits on copies back are written down (a device's)."""

    def mark(self, backward: bool = False) -> object:
        """Now, on the step's timeline (``backward``: a use in backward)."""

    def seconds(self, mark: object) -> float:
        """Seconds from the step's start to ``mark``."""

    def begin(self) -> Any:
        """The start of a span of the step's own work (a forward op)."""

    def end(self) -> Any:
        """The end of the span under way."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between a span's start and end."""


class HostTimer:
    """perf_counter marks with the store's waits taken out (NOTE [ Timing a profile ]).

    Example:
        >>> from tierstore.planning.runner import HostTimer
        >>> timer = HostTimer(lambda: 0.0)
        >>> timer.seconds(timer.mark()) >= 0
        True
    """

    blocked = None

    def __init__(self, waits: Callable[[], float]) -> None:
        self._waits = waits
        self._origin = time.perf_counter() - waits()

    def mark(self, backward: bool = False) -> float:
        """perf_counter less the waits so far."""
        return time.perf_counter() - self._waits()

    def seconds(self, mark: object) -> float:
        """Compute seconds since the timer began."""
        assert isinstance(mark, float)
        return mark - self._origin

    @staticmethod
    def begin() -> float:
        """perf_counter."""
        return time.perf_counter()

    end = begin

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        """``end - start``."""
        return float(end - start)


class BusyTimer:
    """A profile's device time: forward's op spans summed, backward's marks less its waits.

    NOTE [ Timing a profile ]. ``event()`` records an event on the current
    stream (``torch.cuda.Event`` with ``enable_timing``, recorded; a test
    passes its own); if it has ``keep_busy()``, that is called before an op
    whose stream has run dry (the last span's end has completed). Until
    :attr:`device` is set (the step saved a CUDA tensor), it answers as a
    :class:`HostTimer` does: a CPU model on a machine whose CUDA is
    initialised.

    Example:
        >>> from tierstore.planning.runner import BusyTimer
        >>> class Event:
        ...     def __init__(self, t): self.t = t
        ...     def synchronize(self): pass
        ...     def elapsed_time(self, end): return (end.t - self.t) * 1e3
        >>> now = [0.0]
        >>> timer = BusyTimer(lambda: 0.0, lambda: Event(now[0]))
        >>> timer.device = True
        >>> _ = timer.begin(); now[0] = 0.002; _ = timer.end()  # an op: 2 ms
        >>> now[0] = 0.050                                       # idle: not counted
        >>> _ = timer.begin(); now[0] = 0.053; _ = timer.end()  # 3 ms
        >>> round(timer.seconds(timer.mark()), 6)
        0.005
        >>> first = timer.mark(backward=True)                    # backward: 10 ms, a 4 ms wait
        >>> timer.blocked.append((Event(0.055), Event(0.059))); now[0] = 0.063
        >>> round(timer.seconds(timer.mark(backward=True)), 6)
        0.011
    """

    def __init__(self, waits: Callable[[], float], event: Callable[[], Any]) -> None:
        self.host = HostTimer(waits)
        self.device = False
        #: The compute stream's waits on copies back, as event pairs (Transfers.consume).
        self.blocked: list[tuple[Any, Any]] = []
        self._event = event
        self._keep_busy: Callable[[], None] | None = getattr(event, "keep_busy", None)
        self._last: Any = None  # the last span's end event
        self._spans: list[tuple[Any, Any]] = []
        self._open: tuple[Any, float] | None = None
        self._backward: tuple[Any, int, int] | None = None  # backward's first mark
        self._busy: list[float] | None = None  # forward seconds before each span, read once
        self._waited: list[float] | None = None  # backward's waits before each, read once

    def begin(self) -> tuple[Any, float]:
        """Open a forward op's span, behind a spin if the stream has run dry."""
        if self._keep_busy is not None and (self._last is None or self._last.query()):
            self._keep_busy()
        self._open = self._event(), time.perf_counter()
        return self._open

    def end(self) -> tuple[Any, float]:
        """Close the span under way: forward's compute."""
        end = self._event(), time.perf_counter()
        self._last = end[0]
        if self._open is not None:
            self._spans.append((self._open, end))
            self._open = None
        return end

    def mark(self, backward: bool = False) -> tuple[int, Any, int, float]:
        """Forward: the spans so far. Backward: an event now, and the waits so far."""
        host = self.host.mark()
        if not backward:
            return len(self._spans), None, 0, host
        event = self._event()
        if self._backward is None:
            self._backward = (event, len(self._spans), len(self.blocked))
        return len(self._spans), event, len(self.blocked), host

    def seconds(self, mark: object) -> float:
        """Device seconds before ``mark`` (waits for its events)."""
        assert isinstance(mark, tuple)
        spans, event, blocked, host = mark
        if not self.device:
            return self.host.seconds(host)
        if self._busy is None or len(self._busy) <= len(self._spans):  # read once, at the end
            self._busy = _prefix(self.elapsed(a, b) for a, b in self._spans)
        if self._waited is None or len(self._waited) <= len(self.blocked):
            self._waited = _prefix(self._seconds(a, b) for a, b in self.blocked)
        if event is None or self._backward is None:
            return self._busy[spans]
        assert self._waited is not None
        origin, origin_spans, origin_blocked = self._backward
        waited = self._waited[blocked] - self._waited[origin_blocked]
        return self._busy[origin_spans] + max(0.0, self._seconds(origin, event) - waited)

    def elapsed(self, start: Any, end: Any) -> float:
        """A span's seconds: the events' on the device, else the host's."""
        if not self.device:
            return float(end[1] - start[1])
        return self._seconds(start[0], end[0])

    @staticmethod
    def _seconds(start: Any, end: Any) -> float:
        end.synchronize()
        return max(0.0, float(start.elapsed_time(end)) / 1e3)


def _prefix(values: Iterable[float]) -> list[float]:
    out, total = [0.0], 0.0
    for value in values:
        total += value
        out.append(total)
    return out


#: A row's rebuild time: seconds, a function that reads them (event-timed), or None.
RebuildTime = float | Callable[[], float] | None


@dataclass
class _Row:
    nbytes: int
    again: int | None  # the same entry saved again: the first save's row; no new bytes
    op: str
    module: str
    saved_at: object  # the Timer's mark when forward saved it
    rebuild_s: RebuildTime
    inputs: tuple[int, ...]
    used_at: object = None  # the Timer's mark when backward first used it
    made_in: tuple[str, ...] = ()  # the modules that ran a rebuild's ops
    root: str = ""  # the outermost module that saved it
    graph: bool = False  # NOTE [ Rebuilt from the graph ] in autograd/recompute.py


@dataclass
class _Step:
    """What the runner knows of the step under way."""

    started: float
    profiling: bool
    index: int = 0
    rows: list[_Row] = field(default_factory=list)
    row_of_key: dict[int, int] = field(default_factory=dict)
    fixed_bytes: int = 0
    saved_bytes: int = 0  # new bytes saved so far, fixed ones included
    waits_at_start: float = 0.0
    backward_at: object = None  # the mark of backward's first use of a save
    last_use: object = None  # the mark of backward's latest use
    ended: float | None = None  # perf_counter as its last backward ended (NOTE [ Like with like ])
    task: int = -2  # the graph task of its latest backward so far (-1: a read by hand)
    timer: Timer | None = None  # a profiled step's marks (NOTE [ Timing a profile ])
    following: bool = False  # on its plan so far: choose() takes the short way
    deviated_at: int | None = None  # the save that left the plan, matching no kept one
    written: tuple[int, float] = (0, 0.0)
    read: tuple[int, float] = (0, 0.0)
    device_written: tuple[int, float] = (0, 0.0)  # the device link's clocks, each way
    device_read: tuple[int, float] = (0, 0.0)
    io_cpu: float = 0.0  # the I/O threads' CPU seconds when the step began
    cuda: bool = False  # a save was a CUDA tensor
    moved_host_s: float = 0.0  # the host's time moving saves out and back, waits taken out
    moved_saves: int = 0  # the saves it moved out (NOTE [ Pricing a moved save first ])
    kept_used: int = 0  # bytes of plan-kept saves backward has used (NOTE [ Saves that stay ])
    compiled_bytes: int = 0  # handed over by compiled regions (NOTE [ A peak above the budget ])
    compiled_in: set[str] = field(default_factory=set)  # the modules of those saves
    waiting: bool = False  # the safe placement while the first plan is made off the thread
    largest: int = 0  # the largest save so far
    passed: set[int] = field(default_factory=set)  # the first saves of the modules gone past
    # A profiled step's saves outside the plan, per (module, why): [count, bytes];
    # and the modules where keep() stored one (NOTE [ Modules kept whole ] in tier_store.py).
    stays_in: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    stored_in: set[str] = field(default_factory=set)


def _backward_ended(step: _Step) -> None:
    """A backward of ``step`` ended (NOTE [ Like with like ]): the last one's end counts."""
    step.ended = time.perf_counter()


#: What the planning process runs: the planner module alone, without the
#: package's __init__ (which imports torch). It reads a profile and a budget
#: as JSON lines and writes the plan's choices and figures back, one at a
#: time, until its input closes. JSON, not pickle: nothing tierstore reads
#: can run code (tests/test_security.py).
_WORKER = r"""
import json, os, sys, types
package = types.ModuleType("tierstore")
package.__path__ = [sys.argv[1]]
sys.modules["tierstore"] = package
from tierstore.planning import planner
from tierstore.planning.planner import Profile, Save, make_plan
planner.YIELD_BETWEEN_SIMULATIONS = False  # nothing else runs here
try:
    os.nice(10)
except OSError:
    pass
for line in sys.stdin:
    request = json.loads(line)
    fields = request["profile"]
    saves = tuple(
        Save(**{**save, "inputs": tuple(save["inputs"]), "made_in": tuple(save["made_in"])})
        for save in fields.pop("saves")
    )
    plan = make_plan(Profile(saves=saves, **fields), request["budget"])
    out = {
        name: getattr(plan, name)
        for name in ("choices", "window_bytes", "predicted_step_s", "predicted_peak_bytes",
                     "floor_bytes", "exposed_s")
    }
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""


#: Profile fields the planning process is not sent (the planner reads none).
_HOOKS_ONLY = ("stays_in", "stored_in", "between_s")


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields by name, as they are: no deep copy.

    ``dataclasses.asdict`` took 7 ms for bench overhead's 600 saves, on a
    thread that holds the interpreter lock the training thread needs.
    """
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}


class PlanningProcess:
    """A process of its own that makes plans (NOTE [ Planning off the training thread ]).

    Started on first use; :meth:`close` ends it (idempotent). ``plan`` blocks
    the calling thread, not the interpreter: it waits on a pipe.

    Example:
        >>> from tierstore.planning.planner import Profile, Save
        >>> from tierstore.planning.runner import PlanningProcess
        >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
        >>> worker = PlanningProcess()
        >>> worker.plan(p, 10).floor_bytes
        1000
        >>> worker.close(); worker.close()
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._ender: weakref.finalize[Any, Any] | None = None  # ends it, closed or collected
        self._lock = threading.Lock()
        self._closed = False

    def plan(self, profile: Profile, budget: int) -> Plan:
        """``make_plan(profile, budget)``, made in the planning process."""
        with self._lock:
            if self._closed:
                raise RuntimeError("tierstore: the planning process was closed")
            process = self._process
            if process is None or process.poll() is not None:
                if self._ender is not None:
                    self._ender()  # one that ended: its pipes, before another's
                process = self._process = subprocess.Popen(
                    [sys.executable, "-c", _WORKER, os.path.dirname(planner.__file__)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    close_fds=True,
                )
                self._ender = weakref.finalize(self, _end, process)
            assert process.stdin is not None and process.stdout is not None
            fields = _fields(profile, _HOOKS_ONLY)  # not the hooks layer's
            fields["saves"] = [_fields(save) for save in profile.saves]
            request = {"profile": fields, "budget": budget}
            process.stdin.write(json.dumps(request).encode() + b"\n")
            process.stdin.flush()
            line = process.stdout.readline()
            if not line:
                raise RuntimeError("tierstore: the planning process ended without a plan")
            made = json.loads(line)
        return Plan(
            profile=profile,
            choices=tuple(made["choices"]),
            budget_bytes=budget,
            window_bytes=made["window_bytes"],
            predicted_step_s=made["predicted_step_s"],
            predicted_peak_bytes=made["predicted_peak_bytes"],
            floor_bytes=made["floor_bytes"],
            exposed_s=tuple(made["exposed_s"]),
        )

    def close(self) -> None:
        """End the process. Idempotent."""
        self._closed = True
        self._process = None
        if self._ender is not None:
            self._ender()


def _end(process: subprocess.Popen[bytes]) -> None:
    """Close a planning process's pipes and end it: at ``close``, or for one nobody closed."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    if process.poll() is None:
        process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


class PlanRunner:
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
        waits: object,
        io_cpu: object = None,
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
        # What a page handed back costs when used again (0.0: none is handed back).
        self._page_fault_s = page_fault_s
        self.background = background  # NOTE [ Planning off the training thread ]
        # () -> a factory of recorded device events when a device is in use (BusyTimer)
        self._events = events
        # The device link's clocks (device to host, host to device): timed copies.
        self._device_links = device_links
        self._remaking: threading.Thread | None = None
        self._planning: PlanningProcess | None = None  # NOTE [ Planning off the training thread ]
        self._remade: tuple[tuple[int, ...], Plan, str] | None = None
        self._closed = False
        self.budget = config.activation_budget
        self._config = config
        self._writes = writes
        self._reads = reads
        self._waits = waits  # () -> float
        self._io_cpu = io_cpu  # () -> float: the I/O threads' CPU seconds
        self.plan: Plan | None = None
        self._expected: tuple[int, ...] = ()  # each save's bytes in the plan's profile
        # The plan's kept saves before each save: (count, bytes) (NOTE [ Saves that stay ]).
        self._kept_before: list[tuple[int, int]] = [(0, 0)]
        # NOTE [ Planned steps ]: the kept plans, by their saves' bytes, newest last
        self._plans: OrderedDict[tuple[int, ...], Plan] = OrderedDict()
        # A step left its plan and matched no kept one: "first" profiles the
        # next step that matches none at its first save, "any" the next step.
        self._unseen: Literal["first", "any"] | None = None
        self._step: _Step | None = None
        self._checks: dict[tuple[int, ...], _Checks] = {}  # NOTE [ Planned steps ]
        self._recorded_rebuild_s = (
            0.0  # measured (NOTE [ Replayed modules ] in planning/planner.py)
        )
        self._moved_s_per_save = 0.0  # measured on CUDA (NOTE [ Charging a slow step ])
        self._warmed = False  # the store's first step warms up; the next is the profile
        self.warnings: list[str] = []  # for the caller to issue, each once
        self._warned = False
        self._peak_warned = False
        # Bytes compiled regions handed over, by shape (NOTE [ A peak above the budget ]).
        self._compiled: dict[tuple[int, ...], tuple[int, int]] = {}

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
        tier_store.py): no dispatch mode runs on the ops of a step that rebuilds
        nothing.
        """
        return self.plan is not None and "rebuild" in self.plan.choices

    def window_bytes(self) -> int | None:
        """The most any kept plan holds in flight each way; ``None`` before the first plan."""
        return max((plan.window_bytes for plan in self._plans.values()), default=None)

    def safe_device_bytes(self) -> int:
        """What the safe placement keeps on the device (NOTE [ Planned steps ])."""
        if isinstance(self.budget, float):
            return 0
        in_flight = int(self._config.prefetch_bytes) + int(self._config.write_queue_bytes)
        return max(0, int(self.budget) - in_flight)

    def in_flight_bytes(self, adding: int = 0) -> int | None:
        """What the step under way may hold in flight each way, or ``None``: the limits' own.

        A planned step: its plan's window (the store's limits are bounded by
        the largest kept plan's). A profiled step under a fractional budget:
        that share of what it saved so far, less ``adding`` (a save about to
        join the write queue). The step's saved bytes are known only as it
        runs, and the budget is at least its share of them: the safe
        placement keeps nothing, and this bounds what it holds in flight
        (the write queue in forward, the reads ahead in backward). At 0 a
        save waits for its own write and backward reads on demand
        (NOTE [ Write staging ] in tierstore/tiers/writebehind.py): a save larger
        than the share so far never sits in the queue beside it.
        """
        step = self._step
        if step is None:
            return None
        if self.planned:
            assert self.plan is not None
            return self.plan.window_bytes
        if not (step.profiling or step.waiting) or not isinstance(self.budget, float):
            return None
        return max(int(self.budget * step.saved_bytes) - adding, 0)

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
        """The bound on reads ahead as backward begins, ``held`` bytes being resident already.

        A planned step: its plan's window. The safe placement: its share
        less ``held`` and less the largest save, as the window lets one read
        past its limit (NOTE [ Prefetch ] in tierstore/tiers/readahead.py); at 0
        backward reads on demand.
        """
        bound = self.in_flight_bytes()
        step = self._step
        if bound is None or self.planned or step is None:
            return bound
        return max(bound - held - step.largest, 0)

    def _profile_next(self) -> bool:
        """Whether a step beginning now is profiled (NOTE [ Planned steps ])."""
        # A plan ready or on its way is waited for (NOTE [ Planning off the training thread ]).
        if self._remade is not None or (self._remaking is not None and self._remaking.is_alive()):
            return False
        return self.plan is None or self._unseen is not None

    def _begin(self) -> _Step:
        profiling = self._profile_next()
        step = _Step(time.perf_counter(), profiling, waits_at_start=self.waits())
        step.waiting = not profiling and self.plan is None
        if profiling:  # NOTE [ Timing a profile ]
            event = self._events() if self._events is not None else None
            step.timer = HostTimer(self.waits) if event is None else BusyTimer(self.waits, event)
        step.written = self._writes.snapshot()
        step.read = self._reads.snapshot()
        if self._device_links is not None:
            step.device_written = self._device_links[0].snapshot()
            step.device_read = self._device_links[1].snapshot()
        step.io_cpu = self._io_cpu() if callable(self._io_cpu) else 0.0
        self._step = step
        plan = self.plan
        if (
            self._cpu_step_began is not None
            and not profiling
            and plan is not None
            and plan.profile.shared_link  # a CPU's profile
        ):
            self._cpu_step_began(plan.hands_back)
        return step

    def waits(self) -> float:
        """The store's waits so far, seconds (NOTE [ Timing a profile ])."""
        waits: float = self._waits()  # type: ignore[operator]
        return waits

    def choose(self, nbytes: int) -> Choice | None:
        """What to do with the next save of the step; ``None``: the safe placement.

        The first save of a step begins it.
        """
        step = self._step if self._step is not None else self._begin()
        index = step.index
        step.index = index + 1
        if step.following:  # the common case, first: a planned step on its plan
            expected = self._expected
            if index < len(expected) and expected[index] == nbytes and step.backward_at is None:
                return self.plan.choices[index]  # type: ignore[union-attr]
        if step.profiling and index == 0 and self._unseen == "first" and self._switch(0, nbytes):
            step.profiling = False  # a kept shape after all: no profile needed
        if step.waiting:  # NOTE [ Planning off the training thread ]: the safe placement
            step.saved_bytes += nbytes
            step.largest = max(step.largest, nbytes)
            return None
        if step.profiling or step.deviated_at is not None:
            return None
        assert self.plan is not None
        expected = self._expected
        if step.backward_at is not None or (
            (index >= len(expected) or expected[index] != nbytes)
            and not self._switch(index, nbytes)
        ):
            step.deviated_at = index
            step.following = False
            return None
        step.following = True
        return self.plan.choices[index]

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

    def _use(self, expected: tuple[int, ...], plan: Plan) -> None:
        replaced = self._plans.get(expected)
        if replaced is not None and replaced is not plan and plan.measured_step_s is None:
            # Until a step runs on it, the table shows what the last one measured.
            plan.measured_step_s = replaced.measured_step_s
            plan.measured_peak_bytes = replaced.measured_peak_bytes
            plan.measured_before = plan.measured_step_s is not None
        if plan is not self.plan or expected != self._expected:
            n = nbytes = 0
            before = [(0, 0)]
            for size, choice in zip(expected, plan.choices, strict=True):
                if choice == "keep":
                    n, nbytes = n + 1, nbytes + size
                before.append((n, nbytes))
            self._kept_before = before
        self.plan, self._expected = plan, expected
        self._plans[expected] = plan
        self._plans.move_to_end(expected)
        while len(self._plans) > PLANS_KEPT:
            self._checks.pop(self._plans.popitem(last=False)[0], None)

    def passes(self, plan: Plan, first: int, end: int) -> Literal["no", "past", "again"]:
        """Whether the step goes past a module whose saves are ``plan``'s ``[first, end)``.

        Its saves then never reach the pack hook: a module checkpointed
        natively (NOTE [ Replayed modules ] in planning/planner.py; checkpoint's own
        hooks take them, the first, its input, kept), or one the plan keeps
        whole (NOTE [ Modules kept whole ] in tier_store.py). Only a planned step
        on ``plan``, at the module's first save, goes past (``"past"``); a
        module called again in the step (the saves of all its calls one span
        in the profile, all counted the first time) goes past ``"again"``.
        """
        step = self._step if self._step is not None else self._begin()
        if (
            self.plan is not plan
            or step.profiling
            or step.waiting
            or step.deviated_at is not None
            or step.backward_at is not None
        ):
            return "no"
        if first in step.passed:
            return "again"
        if step.index != first:
            return "no"
        step.index = end
        step.following = True
        step.passed.add(first)
        return "past"

    def beside(self, modules: tuple[str, ...], why: str, nbytes: int) -> None:
        """A save outside the plan, in ``modules``: one that stays (``why``), or ``"stored"``.

        Written down, for each of the (distinct) modules, in a profiled step
        only (NOTE [ Modules kept whole ] in tier_store.py).
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
        if step.profiling:
            step.fixed_bytes += nbytes
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
        [ Rebuilt from the graph ] in tierstore/autograd/recompute.py).
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

        NOTE [ Pricing a moved save first ]; waits for the link taken out by the caller.
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
        if not step.profiling:
            step.kept_used += planned
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
            return None
        step.task = task
        return functools.partial(_backward_ended, step)

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
        step = self._step
        if step is None or step.profiling:
            return 0, 0
        upto = step.deviated_at if step.deviated_at is not None else step.index
        return self._kept_before[min(upto, len(self._kept_before) - 1)]

    def kept_resident(self) -> int:
        """Bytes the plan kept in the step under way that backward has not used yet."""
        step = self._step
        return 0 if step is None else self.kept()[1] - step.kept_used

    def step_ended(self, peak_bytes: int) -> str | None:
        """The step under way ended; returns the INFO line of a plan made or remade."""
        step, self._step = self._step, None
        if step is None or step.waiting:  # waiting: on the safe placement, for the first plan
            return self._adopt()
        total = time.perf_counter() - step.started
        if step.profiling:
            self._adopt()
            if not self._warmed:
                self._warmed = True  # lazy initialisation, first allocations: not the step
                return None
            return self._plan_from(step, total)
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
        if self._remade is not None:
            return self._adopt()
        line = self._refit(total)
        if self.plan is plan:  # not remade for its time: its peak is checked too
            line = self._check_peak(peak_bytes) or line
        return line or self._adopt()

    def _process(self) -> PlanningProcess:
        """The planning process, created on first use."""
        if self._planning is None:
            self._planning = PlanningProcess()
        return self._planning

    def close(self) -> None:
        """Drop a plan still being made and end the planning process. Idempotent.

        NOTE [ Planning off the training thread ].
        """
        self._closed = True
        self._remade = None
        planning, self._planning = self._planning, None
        if planning is not None:
            planning.close()

    def _adopt(self) -> str | None:
        """Switch to a plan remade off the training thread, if one is ready: its INFO line."""
        remade, self._remade = self._remade, None
        if remade is None:
            return None
        expected, plan, line = remade
        if expected == self._expected or expected not in self._plans:
            self._use(expected, plan)  # a new shape's first plan, too
        else:
            self._plans[expected] = plan
        return line

    # -- planning --------------------------------------------------------------------

    def _plan_from(self, step: _Step, total: float) -> str | None:
        rows = step.rows
        if not rows or step.backward_at is None or step.timer is None:
            return None
        seconds = step.timer.seconds  # NOTE [ Timing a profile ]: read once, here
        busy = isinstance(step.timer, BusyTimer) and step.timer.device
        forward = seconds(step.backward_at)
        backward = max(seconds(step.last_use) - forward, 1e-9)
        # Not the runner's until its plan is: a plan made off the thread comes later.
        expected = tuple(r.nbytes for r in rows)
        self._checks.pop(expected, None)  # a new profile: its plan is checked afresh
        self._compiled[expected] = (step.compiled_bytes, len(step.compiled_in))
        self._unseen = None
        saves = tuple(
            Save(
                nbytes=0 if r.again is not None else r.nbytes,
                op=r.op,
                module=r.module,
                forward_s=seconds(r.saved_at),
                use_s=(seconds(r.used_at) - forward if r.used_at is not None else backward),
                rebuild_s=r.rebuild_s() if callable(r.rebuild_s) else r.rebuild_s,
                inputs=r.inputs,
                made_in=r.made_in,
                compiled=r.module in step.compiled_in,
                root=r.root,
                same_as=r.again,
                graph=r.graph,
            )
            for r in rows
        )
        waits = self.waits() - step.waits_at_start
        write = self._writes.rate_since(step.written)
        read = self._reads.rate_since(step.read)
        if step.cuda and self._device_links is not None:
            # A device's budget is met over its own link; the disk behind the
            # host runs off the device's timeline (NOTE [ Copies on CUDA ] in
            # tiers/transfers.py).
            d2h, h2d = self._device_links
            write = d2h.rate_since(step.device_written) or write
            read = h2d.rate_since(step.device_read) or read
        moved = (
            self._writes.snapshot()[0] - step.written[0] + self._reads.snapshot()[0] - step.read[0]
        )
        io_cpu = (self._io_cpu() if callable(self._io_cpu) else 0.0) - step.io_cpu
        # A device's profile sees only forward and backward: what the step
        # does around them is left to the first check (NOTE [ Timing a profile ]).
        # Taken before the I/O's share comes out of forward and backward: that
        # share is charged to the moved bytes, not left in the rest of the step.
        other = 0.0 if busy else max(0.0, total - waits - forward - backward)
        # NOTE [ Like with like ]: of it, what came after backward.
        ended = step.ended
        between = None if busy or ended is None else min(other, step.started + total - ended)
        per_byte = 0.0
        if not step.cuda and moved and io_cpu > 0:
            # A CPU's own cores did the I/O: charge it to the bytes, and take it
            # out of the compute it slowed down (NOTE [ Planned steps ]).
            per_byte = io_cpu / moved
            compute = forward + backward
            factor = max(0.5, (compute - min(io_cpu, compute)) / compute)
            saves = tuple(_scaled_save(s, factor) for s in saves)  # rebuilds ran slowed too
            forward, backward = forward * factor, backward * factor
        saved = step.fixed_bytes + sum(save.nbytes for save in saves)
        if busy and not self._recorded_rebuild_s:  # NOTE [ Pricing the recorder first ]
            host = max(0.0, total - waits - forward - backward)
            self._recorded_rebuild_s = host / len(rows)
        if busy and not self._moved_s_per_save and step.moved_saves:
            # NOTE [ Pricing a moved save first ]
            self._moved_s_per_save = step.moved_host_s / step.moved_saves
        faults = self._page_fault_s
        profile = Profile(
            saves=saves,
            forward_s=forward,
            backward_s=backward,
            other_s=other,
            write_bytes_per_s=write or 1e9,
            read_bytes_per_s=read or write or 1e9,
            window_bytes=int(self._config.prefetch_bytes),
            fixed_bytes=step.fixed_bytes,
            moved_s_per_byte=per_byte,
            shared_link=not step.cuda,
            # What a planned step measured (NOTE [ Replayed modules ] in planning/planner.py).
            recorded_rebuild_s=self._recorded_rebuild_s,
            moved_s_per_save=self._moved_s_per_save,
            # NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py: the
            # pages a step that hands back uses again, as many as it saves.
            hand_back_s=0.0 if step.cuda or faults is None else faults() * saved / mmap.PAGESIZE,
            stays_in=tuple(
                (module, why, n, nbytes) for (module, why), (n, nbytes) in step.stays_in.items()
            ),
            stored_in=tuple(sorted(step.stored_in)),
            between_s=between,
        )
        _ready_to_checkpoint(profile)
        return self._make(profile, "made", expected=expected)

    def _make(
        self,
        profile: Profile,
        verb: str,
        budget: int | None = None,
        expected: tuple[int, ...] | None = None,
    ) -> str | None:
        """A plan for ``profile`` (NOTE [ Planning off the training thread ]): its INFO line.

        At once where everything fits (no search) or without a background
        thread; otherwise off the thread, the steps going on meanwhile
        (``None``: the line comes when the plan is adopted). ``expected``:
        the sizes of the profile's saves, where not the plan's under way.
        """
        if budget is None:
            budget = budget_bytes(self.budget, profile.saved_bytes)
        if expected is None:
            expected = self._expected
        elsewhere = self.wait_for_plans and self.background  # the process, waited for
        at_once = not self.background or (verb == "made" and self.first_plan_at_once)
        fits = fits_everything(profile, budget)
        if elsewhere or at_once or fits:
            if elsewhere and not fits:
                plan = self._plan_in_process(profile, budget)
            else:
                plan = make_plan(profile, budget)  # no search, or one here
            self._use(expected, plan)
            return self._made(plan, verb)
        if self._remaking is not None and self._remaking.is_alive():
            return None  # one at a time: the check after it judges the new plan

        def make() -> None:
            try:
                plan = self._plan_in_process(profile, budget)
            except (OSError, RuntimeError, ValueError):
                return  # closed meanwhile: the process with it
            if not self._closed:
                self._remade = (expected, plan, self._made(plan, verb))

        self._remaking = threading.Thread(target=make, name="tierstore-plan", daemon=True)
        self._remaking.start()
        return None

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

    def _remake(self, profile: Profile, budget: int | None = None) -> str | None:
        """Make the plan again (NOTE [ Planning off the training thread ])."""
        return self._make(profile, "remade", budget)

    def _check_peak(self, peak: int) -> str | None:
        """NOTE [ A peak above the budget ]: re-plan once, then warn once."""
        plan = self.plan
        assert plan is not None
        if isinstance(self.budget, float) and self.budget >= 1.0:
            return None  # all the step saves: nothing to hold it to
        checks = self._checks.setdefault(self._expected, _Checks())
        # Past a plan that predicted more than the budget (the floor's warning
        # says so) only until one was remade for it; then past the budget.
        allowed = plan.budget_bytes
        if checks.peak_remade_from is None:
            allowed = max(allowed, plan.predicted_peak_bytes)
        largest = max((save.nbytes for save in plan.profile.saves), default=0)
        if peak <= allowed + max(REFIT_TOLERANCE * allowed, largest):
            return None  # within what one save, in flight or not, can move it
        compiled, regions = self._compiled.get(self._expected, (0, 0))
        if checks.peak_remade_from is None:
            checks.peak_remade_from = plan
            unseen = peak - plan.predicted_peak_bytes
            profile = replace(plan.profile, fixed_bytes=plan.profile.fixed_bytes + unseen)
            return self._remake(profile, plan.budget_bytes)
        if plan is checks.peak_remade_from:
            return None  # the plan remade for it is not in use yet
        if not self._peak_warned:
            self._peak_warned = True
            head = (
                f"tierstore: the step's peak, measured {human_bytes(peak)}, is above "
                f"activation_budget={self.budget!r} ({human_bytes(plan.budget_bytes)}): "
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
                    f"the plan predicted {human_bytes(plan.predicted_peak_bytes)}, and remade "
                    "once counting the excess it still does not hold. A link slower than the "
                    "profile's keeps more copies in flight, or the step holds tensors tierstore "
                    "does not place. Lower activation_budget "
                    f"({ENV_PREFIX}ACTIVATION_BUDGET) by the difference"
                )
            self.warnings.append(head + cause)
        return None

    def _rescaled(self, profile: Profile) -> str | None:
        """The plan under way with its prediction made on ``profile``: the same choices."""
        plan = self.plan
        assert plan is not None
        outcome = simulate(profile, plan.choices, plan.window_bytes)
        if plan.fits and outcome.peak_bytes > plan.budget_bytes:
            # On the new times the choices no longer fit: search again.
            return self._remake(profile, plan.budget_bytes)
        plan.profile = profile
        plan.predicted_step_s = outcome.step_s
        plan.predicted_peak_bytes = outcome.peak_bytes
        plan.exposed_s = outcome.exposed_s
        return self._made(plan, "rescaled")

    def _made(self, plan: Plan, verb: str) -> str:
        """The INFO line of a plan made; the floor warning is set for the caller, once."""
        budget, profile = plan.budget_bytes, plan.profile
        if not plan.fits and not self._warned:
            self._warned = True
            peak = plan.predicted_peak_bytes
            if plan.floor_bytes > budget:
                self.warnings.append(
                    f"tierstore: activation_budget={self.budget!r} ({human_bytes(budget)}) is "
                    f"below the lowest this step can reach, {plan.floor_bytes} bytes "
                    f"({human_bytes(plan.floor_bytes)}); the step runs at {human_bytes(peak)}. "
                    f"Raise activation_budget ({ENV_PREFIX}ACTIVATION_BUDGET) to at least "
                    f"{plan.floor_bytes}"
                )
            else:  # NOTE [ The floor ] in planning/planner.py
                self.warnings.append(
                    f"tierstore: no plan found meets activation_budget={self.budget!r} "
                    f"({human_bytes(budget)}), though the step's floor is "
                    f"{human_bytes(plan.floor_bytes)}; the closest runs at {human_bytes(peak)}. "
                    f"Raise activation_budget ({ENV_PREFIX}ACTIVATION_BUDGET) to at least {peak}"
                )
        by = plan.bytes_by_choice()
        return (
            f"tierstore: plan {verb} for activation_budget={self.budget!r} "
            f"({human_bytes(budget)} of {human_bytes(profile.saved_bytes)} saved): "
            f"keep {human_bytes(by['keep'])}, offload {human_bytes(by['offload'])}, "
            f"rebuild {human_bytes(by['rebuild'])}; predicted step "
            f"{plan.predicted_step_s:.3f} s, peak {human_bytes(plan.predicted_peak_bytes)}"
        )

    def _refit(self, measured: float) -> str | None:
        """NOTE [ Planned steps ]: the checks of a plan's prediction, and the corrections.

        NOTE [ Planning off the training thread ]: a check acts on a step
        off by more than the tolerance and the spread of what it judged, the
        second time in a row; only a dearer link re-plans.
        """
        plan = self.plan
        assert plan is not None
        checks = self._checks.setdefault(self._expected, _Checks())
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
                    self._recorded_rebuild_s = profile.recorded_rebuild_s + excess / recorded
                    profile = replace(profile, recorded_rebuild_s=self._recorded_rebuild_s)
                if moved_bytes:
                    per_byte = profile.moved_s_per_byte + excess / moved_bytes
                    profile = replace(profile, moved_s_per_byte=per_byte)
                if moved_saves:
                    self._moved_s_per_save = profile.moved_s_per_save + excess / moved_saves
                    profile = replace(profile, moved_s_per_save=self._moved_s_per_save)
                return self._remake(profile)
        return self._rescaled(_scaled(profile, basis / plan.predicted_step_s))


@dataclass
class _Checks:
    """A shape's checks of its plan's prediction so far (NOTE [ Planned steps ])."""

    times: list[float] = field(default_factory=list)  # steps since the last check
    checked: bool = False  # the first planned step was checked alone
    stalled: bool = False  # the first planned step stalled: the next was checked alone
    off: float = 0.0  # how far the last check found the prediction off, if it let it be
    peak_remade_from: Plan | None = None  # a peak above the budget remade this plan, once


# NOTE [ A stalled first step ]
# The first planned step of a shape is checked alone, and a check far off
# acts at once (NOTE [ Planned steps ]): the excess is charged to what the
# plan moves or records. But a first step can stall on what no plan chose:
# an import (NOTE [ Checkpoint's first call ]), the allocator's first
# segments of a new pattern. On the H200 a 5.3 s stall against a 69 ms
# prediction was charged to 30 moved saves as 0.17 s each, and every later
# plan of that budget offloaded nothing. So a first planned step at STALLED
# times its prediction or more is not judged; the step after it is, alone,
# as the first would have been; a plan slow on both is charged as before.


# NOTE [ Checkpoint's first call ]
# A planned step that checkpoints a module natively (NOTE [ Replayed modules ]
# in planning/planner.py) drives torch.utils.checkpoint's generator, whose first call
# in a process imports torch._dynamo: that call takes 1.4 s on a 2-vCPU VM
# and the next 0.04 s. On the H200 the first planned step of each budget
# that checkpointed took 3.7 to 5.3 s against a median of 70 ms, and plain
# checkpointing's first step 4.4 s against 0.4 s for the hooks alone. A
# step that slow is one the user sees, and one no check of the plan can
# take as a measurement. So the import comes at the end of a profiled step
# whose plan may checkpoint: a warm-up step, already slow, and only once.


def _ready_to_checkpoint(profile: Profile) -> None:
    """Import torch._dynamo now if ``profile``'s plan may checkpoint.

    NOTE [ Checkpoint's first call ].
    """
    if profile.replayable and "torch._dynamo" not in sys.modules:
        import torch._dynamo  # noqa: F401, PLC0415


def _scaled_save(save: Save, factor: float) -> Save:
    """``save`` with its compute times times ``factor``."""
    return replace(
        save,
        forward_s=save.forward_s * factor,
        use_s=save.use_s * factor,
        rebuild_s=None if save.rebuild_s is None else save.rebuild_s * factor,
    )


def _scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every compute time times ``factor`` (NOTE [ Planned steps ])."""
    saves = tuple(_scaled_save(s, factor) for s in profile.saves)
    between = profile.between_s or 0.0  # not the step's compute (NOTE [ Like with like ])
    return replace(
        profile,
        saves=saves,
        forward_s=profile.forward_s * factor,
        backward_s=profile.backward_s * factor,
        other_s=between + (profile.other_s - between) * factor,
    )
