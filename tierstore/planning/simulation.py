"""A plan played through its profiled step: what the step costs and peaks at (:func:`simulate`).

The timeline NOTE [ Planning ] in tierstore/planning/planner.py describes:
copies out in save order through a window that makes forward wait, reads
back in use order, rebuilds charged in backward, and the bytes resident at
every save and use. Pure, as the planner is; the search plays each move it
prices through it.

Example:
    >>> from tierstore.planning.plan_types import SYNCHRONOUS, Profile, Save
    >>> from tierstore.planning.simulation import simulate
    >>> p = Profile((Save(100, "aten.mm", "m", 0.0, 1.0, 0.5),), 1.0, 1.0, 0.0, 100.0,
    ...             100.0, 1000)
    >>> simulate(p, ("offload",), 1000).step_s   # 1 s out, 1 s back: both hidden
    2.0
    >>> out = simulate(p, ("offload",), SYNCHRONOUS)  # waits for its write, reads at its use
    >>> out.step_s, out.peak_bytes, out.exposed_s
    (4.0, 100, (2.0,))
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tierstore.planning.plan_types import (
    SYNCHRONOUS,
    Choice,
    Profile,
    from_graph,
    hands_heap_back,
    is_default,
    replayed,
)

__all__ = ["YIELD_BETWEEN_SIMULATIONS", "Outcome", "simulate"]

#: Whether each simulation first lets other threads of the process run: where
#: a search runs beside the training thread (NOTE [ Planning off the training
#: thread ] in planning/checker.py). The planning process, which runs nothing else, sets
#: it to False: on a busy machine each yield also gave its core away.
YIELD_BETWEEN_SIMULATIONS = True


@dataclass(frozen=True)
class Outcome:
    """What :func:`simulate` predicts for one plan."""

    step_s: float
    peak_bytes: int
    exposed_s: tuple[float, ...]  # per save: waits and rebuild compute charged to it


def simulate(profile: Profile, choices: tuple[Choice, ...], window_bytes: int) -> Outcome:
    """Play a plan through the profiled step: its time and its peak.

    NOTE [ Planning ] in planning/planner.py.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, simulate
        >>> p = Profile((Save(100, "aten.mm", "m", 0.0, 1.0, 0.5),), 1.0, 1.0, 0.0, 100.0,
        ...             100.0, 1000)
        >>> simulate(p, ("keep",), 1000).step_s, simulate(p, ("rebuild",), 1000).step_s
        (2.0, 2.5)
        >>> out = simulate(p, ("offload",), 1000)   # 1 s out, hidden; 1 s back, hidden
        >>> out.step_s, out.peak_bytes
        (2.0, 100)
    """
    if YIELD_BETWEEN_SIMULATIONS:
        # Let the training thread run: NOTE [ Planning off the training thread ]
        # in planning/checker.py.
        time.sleep(0)
    saves = profile.saves
    exposed = [0.0] * len(saves)
    fixed = profile.fixed_bytes
    write_rate, read_rate = profile.write_bytes_per_s, profile.read_bytes_per_s
    # Forward: copies out in save order, forward waits while the queue is over the window.
    stall = 0.0
    link_out = -math.inf
    queue: deque[tuple[float, int]] = deque()  # (copy done at, bytes)
    queued = kept = peak = moved = n_moved = 0
    for i, (save, choice) in enumerate(zip(saves, choices, strict=True)):
        now = save.forward_s + stall
        while queue and queue[0][0] <= now:
            queued -= queue.popleft()[1]
        if choice == "keep":
            kept += save.nbytes
        elif choice == "offload":
            while queue and queued > window_bytes:  # the store's backpressure, then the save
                done, nbytes = queue.popleft()
                exposed[i] += done - now
                stall += done - now
                now, queued = done, queued - nbytes
            link_out = (link_out if link_out > now else now) + save.nbytes / write_rate
            moved += 2 * save.nbytes  # out and back
            n_moved += save.nbytes > 0  # a tensor saved again moves with its first save
            if window_bytes == SYNCHRONOUS:  # the save waits for its own write
                exposed[i] += link_out - now
                stall += link_out - now
            else:
                queue.append((link_out, save.nbytes))
                queued += save.nbytes
        # Not max(): a call, and simulate() is most of the planner's time.
        if fixed + kept + queued > peak:  # noqa: PLR1730
            peak = fixed + kept + queued
    end_forward = profile.forward_s + stall
    while queue and queue[0][0] <= end_forward:
        queued -= queue.popleft()[1]
    peak = max(peak, fixed + kept + queued)
    # Backward (NOTE [ Planning ] in planning/planner.py): what happens, in order, then when.
    events, reads = _backward_events(profile, choices)
    ready: dict[int, float] = {}
    ahead: set[int] = set()  # read ahead, not yet asked for
    held = rebuilt = 0  # held: read (ahead or on demand) and not yet used
    link_in = max(end_forward, link_out) if profile.shared_link else end_forward
    next_read = 0
    delay = 0.0
    now = end_forward

    def issue(at: float) -> None:
        nonlocal next_read, held, link_in
        while next_read < len(reads):
            j = reads[next_read]
            if j in ready:  # read on demand already
                next_read += 1
                continue
            # As the store tops up (NOTE [ Prefetch ] in tierstore/tiers/readahead.py):
            # while below the window, and one read in flight past a window full
            # of reads already asked for; SYNCHRONOUS: never.
            if held >= window_bytes and (ahead or window_bytes == SYNCHRONOUS):
                return
            link_in = (link_in if link_in > at else at) + saves[j].nbytes / read_rate
            ready[j] = link_in
            ahead.add(j)
            held += saves[j].nbytes
            next_read += 1

    def wait(j: int, charge: int) -> None:
        nonlocal now, delay, held
        if j not in ready:  # the window is full of reads not yet used: read it now
            issue(now)
        if j not in ready:  # held until its use, as a read ahead is
            ready[j] = now + saves[j].nbytes / profile.read_bytes_per_s
            held += saves[j].nbytes
        elif j in ahead:  # asked for: the store tops up behind it
            ahead.discard(j)
            issue(now)
        if ready[j] > now:
            exposed[charge] += ready[j] - now
            delay += ready[j] - now
            now = ready[j]

    issue(now)
    n_reads = len(reads)
    per_op = profile.recorded_rebuild_s
    native = _natively_rebuilt(profile, choices)
    for trigger, kind, i in events:
        save = saves[i]
        at = end_forward + saves[trigger].use_s + delay
        if at > now:  # noqa: PLR1730
            now = at
        if kind == "rebuild":
            for j in save.inputs:
                if choices[j] == "offload":
                    wait(j, trigger)
            cost = (save.rebuild_s or 0.0) + (0.0 if i in native else per_op)
            exposed[trigger] += cost
            delay += cost
            now += cost
            rebuilt += save.nbytes
            continue
        if choices[i] == "offload":
            wait(i, i)
        while queue and queue[0][0] <= now:  # copies out that forward left still going
            queued -= queue.popleft()[1]
        resident = fixed + kept + queued + held + rebuilt
        if resident > peak:  # noqa: PLR1730
            peak = resident
        if choices[i] == "keep":
            kept -= save.nbytes
        elif choices[i] == "offload":
            held -= save.nbytes
        else:
            rebuilt -= save.nbytes
        if next_read < n_reads:
            issue(now)
    step = (
        profile.other_s
        + end_forward
        + profile.backward_s
        + delay
        + moved * profile.moved_s_per_byte
        + n_moved * profile.moved_s_per_save
    )
    if hands_heap_back(profile, choices):
        step += profile.hand_back_s
    if not _runnable(profile, choices, native):  # NOTE [ Replayed modules ] in planning/planner.py
        step = math.inf
    elif profile.default_step_s is not None and is_default(profile, choices, window_bytes):
        step = profile.default_step_s  # measured: NOTE [ The default is a plan ] in planner.py
    return Outcome(step, peak, tuple(exposed))


_Event = tuple[int, Literal["rebuild", "use"], int]  # (the use that triggers it, kind, save)


def _backward_events(
    profile: Profile, choices: tuple[Choice, ...]
) -> tuple[list[_Event], list[int]]:
    """Backward's rebuilds and uses in order, and the order offloaded saves are first needed.

    A rebuild runs when its save, or a rebuilt save made from it, is first
    used; it needs its stored inputs then, before their own use.
    """
    saves = profile.saves
    events: list[_Event] = []
    reads: list[int] = []
    seen: set[int] = set()

    def need(i: int, trigger: int) -> None:
        if i in seen:
            return
        seen.add(i)
        if choices[i] == "offload":
            reads.append(i)
        elif choices[i] == "rebuild":
            for j in saves[i].inputs:
                if choices[j] != "keep":
                    need(j, trigger)
            events.append((trigger, "rebuild", i))

    for i in profile.use_order:
        if choices[i] != "keep":
            need(i, i)
        events.append((i, "use", i))
    return events, reads


def _runnable(profile: Profile, choices: Sequence[Choice], native: set[int]) -> bool:
    """Whether the store can carry ``choices`` out: no save no op can rebuild is rebuilt op by op.

    ``native``: the saves ``choices`` rebuilds natively (:func:`_natively_rebuilt`).
    NOTE [ Replayed modules ] in planning/planner.py.
    """
    return all(choices[i] != "rebuild" or i in native for i in profile.unrebuildable)


def _natively_rebuilt(profile: Profile, choices: Sequence[Choice]) -> set[int]:
    """The saves ``choices`` rebuilds with no recorder: natively, or from the graph.

    Empty where that changes nothing: no op-by-op rebuild is priced and no
    save only a native replay can make is rebuilt.
    """
    if not profile.recorded_rebuild_s and not any(
        choices[i] == "rebuild" for i in profile.unrebuildable
    ):
        return set()
    native = {j for _, first, end in replayed(profile, choices) for j in range(first + 1, end)}
    return native | from_graph(profile, choices)
