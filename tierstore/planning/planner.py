"""The planner: a profiled step and an activation budget in, keep / offload / rebuild out.

A pure function over numbers (NOTE [ Planning ]): it knows bytes, seconds and
rates, not tensors, streams, files or autograd. The store records a
:class:`Profile` of one real step, calls :func:`make_plan`, and carries the
:class:`Plan` out; the plan reports what it predicted beside what the store
measured.

This module is the search (:func:`make_plan`) and the place the package
imports the planner from: it re-exports the types of
:mod:`tierstore.planning.plan_types` (a profiled step, a plan, what a plan's
choices mean) and :func:`~tierstore.planning.simulation.simulate` (what a
plan costs and peaks at). All three are pure, standard library only, so the
planning process loads them by path (tierstore/planning/worker.py).

Example:
    >>> from tierstore.planning.planner import Profile, Save, make_plan
    >>> saves = tuple(Save(nbytes=100 << 20, op="aten.mm", module=f"block.{i}",
    ...                    forward_s=0.01 * (i + 1), use_s=0.02 * (3 - i), rebuild_s=0.01)
    ...               for i in range(4))
    >>> profile = Profile(saves=saves, forward_s=0.04, backward_s=0.08, other_s=0.0,
    ...                   write_bytes_per_s=10e9, read_bytes_per_s=10e9, window_bytes=64 << 20)
    >>> plan = make_plan(profile, 250 << 20)
    >>> plan.choices   # the third's copy would still be in flight when backward starts
    ('offload', 'offload', 'rebuild', 'keep')
    >>> plan.predicted_peak_bytes <= 250 << 20
    True
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from functools import cached_property

from tierstore.planning.plan_types import (
    ONE_AT_A_TIME,
    SYNCHRONOUS,
    Choice,
    Plan,
    Profile,
    Save,
    from_graph,
    hands_heap_back,
    is_default,
    kept_whole,
    offloaded_saves,
    recorded_rebuilds,
    replayed,
)
from tierstore.planning.simulation import Outcome, _natively_rebuilt, simulate

__all__ = [
    "ONE_AT_A_TIME",
    "SYNCHRONOUS",
    "Choice",
    "Outcome",
    "Plan",
    "Profile",
    "Save",
    "default_plan",
    "from_graph",
    "hands_heap_back",
    "is_default",
    "kept_whole",
    "make_plan",
    "offloaded_saves",
    "recorded_rebuilds",
    "replayed",
    "simulate",
    "tied",
]

# NOTE [ The floor ]
# The floor is a property of the step, not of a budget: the lowest peak of
# the plans that free everything (all offloaded; each module rebuilt from its
# first save), each played at every window make_plan tries, the last resorts
# included. A few dozen simulations, so every plan carries it. A search for
# a budget can end lower (its moves mix choices); then the floor is that
# plan's peak. Where a budget's plan stops above the budget though the floor
# is below it, the table and the warning say so apart from the floor.

# NOTE [ Planning ]
# The user states one number, activation_budget: the bytes of saved tensors
# that may rest in the memory of the device that made them at any moment of
# the step, tierstore's own bytes in flight included. Three ways free a
# saved tensor's bytes, each with its own cost:
#   * keep: costs memory, nothing else;
#   * offload (to host, and disk below it): costs link time each way, hidden
#     when the copy out fits in the forward compute after the save and the
#     copy back in the backward compute before the use; the copies go out in
#     save order and come back in use order through a window of at most
#     window_bytes, which the budget pays for;
#   * rebuild (replay the ops that made it, in backward): costs compute,
#     never hidden, and memory while the rebuilt tensor waits for its use.
# A profiled step gives, per saved tensor, its bytes, when forward saved it
# and when backward used it (compute time only: waits are taken out), and
# what a rebuild costs; the store measures the link's rates as it runs.
# simulate() plays one plan through that timeline: a write queue that makes
# forward wait when it is over the window, reads that start as the window
# frees, rebuilds that add their compute, and the bytes resident at every
# save and use (copies out that forward left going count until they land;
# a read made on demand, the window being full, counts until its use).
# make_plan() then, for each window size it tries (the profile's, halved
# down to a quarter of the largest save, and the largest save, one of those
# above every byte the step saves standing for all of them: a window
# below a save's size moves that save alone, which near the floor leaves
# the budget's room to a rebuilt block beside the reads; then, only when
# none of those fits, one copy at a time, ONE_AT_A_TIME, and on a disk's
# link SYNCHRONOUS: each save waits for its own write, from its own memory,
# and each use reads on demand, as a hook that writes to disk would. Only
# the read in use is resident then, not a staged write and a read ahead
# beside it: the lowest the step can go, at the price of every byte moved;
# not on CUDA, where copies off the device never make forward wait, NOTE
# [ Copies in flight ] in tierstore/tiers/inflight.py):
#   1. gives the link to the saves that are dearest to rebuild per byte
#      (those that cannot be rebuilt first), as long as it hides them;
#   2. rebuilds the rest, cheapest per byte first (elementwise ops and norms
#      before matmuls), until the peak fits;
#   3. offloads what still does not fit, exposed, earliest saves first;
# besides, it plays plans that free everything (all offloaded; each module
# rebuilt from its first save: checkpointing). The fastest plan that fits
# then goes through a second pass (_take_back) that moves any save to any
# choice that makes the step faster and still fits, most time per byte of
# peak first: near the floor, where freeing one save at a time gets stuck
# (a rebuilt block does not fit beside the reads in flight), it turns
# "everything offloaded" into rebuilds the budget has room for. Nothing
# fits: the plan that reaches the lowest peak, with that floor in bytes (the
# store warns once). Greedy, not optimal. Each move is an O(n) simulation,
# so planning n saves costs O(n^2) for each window size; the second pass
# skips without a simulation the moves that cannot pay (_MoveBounds: a move
# saves at most the cost it drops plus every wait on the link), which keeps
# every plan as it was and spares much of the time. So do pricing no move
# of a start that already fits, searching one window for all those that
# never fill, and taking a move with the outcome its price played (not
# playing it again).


# NOTE [ The default is a plan ]
# A store without a budget offloads every save through its default windows
# (prefetch_bytes, write_queue_bytes; the profile's window_bytes). That is a
# plan too (default_plan), and the profile prices it without running it:
# the link's rates and the per-byte and per-save costs the checks charge.
# make_plan counts it among its starts at that window, and where its peak
# (the bytes it holds, in flight included) fits the budget, no plan priced
# slower than it is returned: the search's best is compared with it after
# the last change of choices (tied()). Where it does not fit, no budget can
# match it: the budget is below what the default's windows hold in flight,
# and the plan pays for a smaller window or for rebuilds to get below it.
# A price is only as good as its profile, and the profile's errors do not
# fall alike on every plan: the profiled step's compute runs slowed by its
# recording, which every plan's price holds, while a block rebuilt runs
# slower than its forward's op times say, which only a plan that rebuilds
# pays. The two can cancel in a checkpointing plan's price and leave the
# default's too dear, and a check cannot see that: it judges the plan in
# use alone, against its own prediction. So the two are measured side by
# side (NOTE [ The default on trial ] in planning/checker.py), and once the
# default has run, simulate prices it at what it measured
# (Profile.default_step_s), for every search and check after.


# NOTE [ Replayed modules ]
# A plan's rebuilds are replayed one of two ways. Op by op: the recorder (a
# TorchDispatchMode) runs Python on every op of the modules it records in,
# in forward, and backward replays each rebuilt save's ops from Python.
# Natively: where a plan rebuilds every save of a module but its first,
# which it keeps (the module's input: checkpointing), and no other rebuild
# records in that module, the planned step checkpoints the module the way
# torch.utils.checkpoint does (hooks around the module's forward, its saves
# taken by checkpoint's own saved-tensor hooks; backward runs the module's
# forward again, dropout masks from the saved RNG state): no Python per op
# either way. replayed() (plan_types.py) names those modules; the hooks layer and the
# planner share it. The planner charges each rebuild replayed op by op
# Profile.recorded_rebuild_s on top of its compute, zero until a planned
# step measured it (NOTE [ Planned steps ] in tierstore/planning/runner.py: the
# profile times each op, not the Python around it), and tries
# plans that checkpoint the first modules with the link and op-by-op
# rebuilds making up the rest (_checkpointed). On a GPU the recorder's Python
# is what a step waits on (NOTE [ Charging a slow step ] in
# planning/checker.py).
# A save no op can rebuild (a random op's, rebuild_s None: dropout's mask) is
# rebuilt only natively, where checkpoint replays the RNG state. Op by op the
# store cannot rebuild it and offloads it instead, outside the plan: bytes in
# flight the plan did not count, which the peak check then counts as bytes
# that stay in every later plan, ruling out checkpointing every block. So
# simulate() prices such a plan at an infinite step, and no move of the
# search makes one: taking a checkpointed module's input or one of its
# rebuilds back leaves its random saves with nothing that can rebuild them
# (_runnable, simulation.py).


# NOTE [ A tensor saved twice ]
# Autograd often saves one tensor twice in a step: log_softmax saves its
# output and nll_loss saves it again as its input. The store keeps one entry
# for both, so the profile gives the second save no bytes (Save.same_as names
# the first). A choice made for it on its own was made on nothing: keeping
# it, offloading it, rebuilding it all cost the plan 0 bytes, and a search
# may leave it offloaded beside a first save it keeps (on a synthetic
# profile, one that starts from everything offloaded does). But in a planned
# step the first save, kept, has no entry to share, and the second then goes
# off the device in full: a GPT's log-probabilities go out as forward ends
# and come back as backward begins, with nothing to hide the copies behind,
# beside a plan that says it keeps them. So every plan gives the second
# save the first one's choice (tied()): kept beside it, or offloaded into
# the same entry.
# Except where checkpoint takes the saves (NOTE [ Replayed modules ]): a save
# inside a module replayed natively, or a save of a tensor made there (a
# block's last output, saved again as the next block's input), is never
# packed by the plan's choice; and the input of a replayed module stays kept,
# its boundary.


def _checkpointed(profile: Profile, budget: int, window: int) -> list[tuple[Choice, ...]]:
    """Plans that checkpoint the first modules, replayed natively (NOTE [ Replayed modules ]).

    The fewest first modules that fit, and one and two fewer, from which
    the greedy frees the rest with the link or op-by-op rebuilds. Fit is
    judged with the saves the graph rebuilds (NOTE [ Rebuilt from the
    graph ] in tierstore/autograd/graph.py) rebuilt besides, as the greedy
    takes them first: cheap per byte and no recorder; but only those whose
    inputs stay, as from_graph() takes them (one rebuilt from another's
    rebuild is the recorder's). Judged without them, the fit asks for more
    checkpointed blocks than the greedy needs, and the plans it starts from
    are slower than those it reaches from fewer. Judged with all of them,
    chains included (a profile whose first Linears' outputs the graph can
    rebuild as well as GELU's), it starts from too few blocks, and the
    greedy's plan from there is slower still. A random
    op's save is rebuilt too: checkpointing replays its RNG state (op by op
    it cannot be, and no move of the greedy leaves it so).
    """
    choices = list(_all(profile, "keep"))
    cheap = choices.copy()  # with the graph's rebuilds besides
    for i in profile.graph_saves:
        if all(cheap[j] != "rebuild" for j in profile.saves[i].inputs):
            cheap[i] = "rebuild"
    templates: list[tuple[Choice, ...]] = []
    for _, first, end in profile.spans:
        choices[first + 1 : end] = cheap[first + 1 : end] = ["rebuild"] * (end - first - 1)
        templates.append(tuple(choices))
        if simulate(profile, tuple(cheap), window).peak_bytes <= budget:
            return templates[-3:][::-1]
    return []


def _windows(profile: Profile) -> list[int]:
    """Window sizes to try, largest first: the bound, halved down to a quarter of the largest save.

    Windows below the largest save hold one such copy at a time each way
    and leave the budget's room to rebuilt blocks (NOTE [ Planning ]).
    """
    largest = max((s.nbytes for s in profile.saves), default=0)
    out = {profile.window_bytes}
    window = profile.window_bytes
    while window // 2 >= max(largest // 4, 1) and len(out) < _MOST_WINDOWS:
        window //= 2
        out.add(window)
    if largest < profile.window_bytes:
        out.add(largest)
    # A window above every byte the step saves never fills: each such window
    # plays every plan alike, so only the largest is searched.
    total = sum(s.nbytes for s in profile.saves)
    wider = [w for w in out if w > total]
    kept = {w for w in out if w <= total} | ({max(wider)} if wider else set())
    return sorted(kept, reverse=True)


_MOST_WINDOWS = 8


_Key = tuple[float, float]  # a move's price: lower goes first


def _greedy(
    choices: list[Choice],
    outcome: Outcome,
    *,
    moves: list[tuple[int, Choice]],
    price: Callable[[int, Choice, Outcome], tuple[_Key, Outcome] | None],
    done: Callable[[Outcome], bool],
) -> tuple[Outcome, bool]:
    """Take the cheapest move of ``moves`` on ``choices`` until ``done``; lazily priced.

    ``price`` gives a move's key and the outcome it plays to (``None``: not a
    move now); it is asked again when a move comes up: one that got dearer
    than the next goes back, one taken keeps that outcome (simulate() is
    pure: playing it again gives the same). Returns the outcome and whether
    any move was taken.
    """
    if done(outcome):
        return outcome, False  # a start that fits: pricing its moves would be for nothing
    heap: list[tuple[float, float, int, Choice]] = []
    for i, choice in moves:
        priced = price(i, choice, outcome)
        if priced is not None:
            heap.append((*priced[0], i, choice))
    heapq.heapify(heap)
    changed = False
    while heap and not done(outcome):
        _, _, i, choice = heapq.heappop(heap)
        priced = price(i, choice, outcome)
        if priced is None:
            continue
        key, tried = priced
        if heap and key > heap[0][:2]:
            heapq.heappush(heap, (*key, i, choice))  # dearer now than the next: look again
            continue
        choices[i] = choice
        outcome = tried
        changed = True
    return outcome, changed


def _plan_for_window(
    profile: Profile, budget: int, window: int, start: tuple[Choice, ...]
) -> tuple[list[Choice], Outcome]:
    """Lazy greedy from ``start``: free the bytes that cost the least time per byte first.

    A move takes a kept save to offload or rebuild and never raises the peak.
    """
    saves = profile.saves
    choices = list(start)

    def dearness(i: int) -> float:
        rebuild = saves[i].rebuild_s
        return math.inf if rebuild is None else rebuild / max(saves[i].nbytes, 1)

    def price(i: int, choice: Choice, outcome: Outcome) -> tuple[_Key, Outcome] | None:
        if choices[i] != "keep" or (choice == "rebuild" and _chains_across(saves, choices, i)):
            return None
        trial = choices.copy()
        trial[i] = choice
        tried = simulate(profile, tuple(trial), window)
        if tried.peak_bytes > outcome.peak_bytes or tried.step_s == math.inf:
            return None  # a higher peak; or not runnable (NOTE [ Replayed modules ])
        # Ties (copies the link hides) go to what is dearest to rebuild, earliest first.
        added = max(tried.step_s - outcome.step_s, 0.0) / max(saves[i].nbytes, 1)
        return (added, -dearness(i)), tried

    moves = [(i, c) for i in range(len(saves)) for c in _choices_of(saves[i])]
    outcome, _ = _greedy(
        choices,
        simulate(profile, tuple(choices), window),
        moves=moves,
        price=price,
        done=lambda o: o.peak_bytes <= budget,
    )
    return choices, outcome


def _take_back(
    profile: Profile, budget: int, window: int, start: list[Choice], outcome: Outcome
) -> tuple[list[Choice], Outcome]:
    """Lazy greedy the other way: from a plan that fits, undo what costs the most time.

    The first pass frees bytes one save at a time and cannot leave a corner
    (below the bytes one rebuilt block holds, only everything offloaded
    fits); from such a plan, a move to any other choice is taken when it
    makes the step faster and the peak still fits: the most time saved per
    byte it adds to the peak first (moves that add none before all others).
    Rounds repeat while a round changed something, at most a few.
    """
    saves = profile.saves
    choices = start.copy()
    bounds = _MoveBounds(profile, choices)

    def price(i: int, choice: Choice, now: Outcome) -> tuple[_Key, Outcome] | None:
        if choices[i] == choice or (
            choice == "rebuild"
            and (saves[i].rebuild_s is None or _chains_across(saves, choices, i))
        ):
            return None
        if choice == "keep" and bounds.kept_bytes(now) + saves[i].nbytes > budget:
            return None  # all that is kept rests at backward's start: it cannot fit
        if bounds.most_saved(i, choice, now) <= 0:
            return None
        trial = choices.copy()
        trial[i] = choice
        tried = simulate(profile, tuple(trial), window)
        saved = now.step_s - tried.step_s
        if tried.peak_bytes > budget or saved <= 0:
            return None
        added = tried.peak_bytes - now.peak_bytes
        return (float(added > 0), -saved / max(added, 1)), tried

    moves = [(i, c) for i in range(len(saves)) for c in _CHOICES]
    for _ in range(_ROUNDS):
        outcome, changed = _greedy(choices, outcome, moves=moves, price=price, done=lambda o: False)
        if not changed:
            break
    return choices, outcome


_ROUNDS = 3
_CHOICES: tuple[Choice, ...] = ("keep", "offload", "rebuild")


class _MoveBounds:
    """What one move can do at most, without a simulation (NOTE [ Planning ]).

    A step is its compute, plus the rebuilds' compute and the moved bytes'
    cost, plus waits on the link: a move saves at most the cost it drops
    and every wait, less the cost it adds. ``choices`` is the greedy's own
    list; figures are kept per outcome, so after a move they are worked out
    again.
    """

    def __init__(self, profile: Profile, choices: list[Choice]) -> None:
        self._profile = profile
        self._choices = choices
        self._per_byte = 2 * profile.moved_s_per_byte
        self._per_save = profile.moved_s_per_save
        self._of: tuple[Outcome, int, float] | None = None

    def _facts(self, now: Outcome) -> tuple[int, float]:
        if self._of is None or self._of[0] is not now:
            profile, kept, rebuild, moved, n_moved = self._profile, 0, 0.0, 0, 0
            per_op, native = profile.recorded_rebuild_s, _natively_rebuilt(profile, self._choices)
            for i, (save, choice) in enumerate(zip(profile.saves, self._choices, strict=True)):
                if choice == "keep":
                    kept += save.nbytes
                elif choice == "rebuild":
                    rebuild += (save.rebuild_s or 0.0) + (0.0 if i in native else per_op)
                else:
                    moved += save.nbytes
                    n_moved += save.nbytes > 0
            compute = profile.other_s + profile.forward_s + profile.backward_s
            waits = (
                now.step_s - compute - rebuild - moved * self._per_byte - n_moved * self._per_save
            )
            self._of = (now, profile.fixed_bytes + kept, max(waits, 0.0))
        return self._of[1], self._of[2]

    def kept_bytes(self, now: Outcome) -> int:
        """Bytes resident at backward's start whatever the link does: a floor of the peak."""
        return self._facts(now)[0]

    def _cost(self, i: int, choice: Choice) -> float:
        save = self._profile.saves[i]
        if choice == "rebuild":
            return save.rebuild_s or 0.0
        if choice != "offload":
            return 0.0
        return save.nbytes * self._per_byte + (self._per_save if save.nbytes else 0.0)

    @cached_property
    def _replay_slack(self) -> float:
        """The most one move changes the op-by-op charges of others: a module made or unmade.

        NOTE [ Replayed modules ]; the move's own charge is in it too.
        """
        profile = self._profile
        longest = max((end - first for _, first, end in profile.spans), default=1)
        return profile.recorded_rebuild_s * longest

    def most_saved(self, i: int, choice: Choice, now: Outcome) -> float:
        """The most time moving save ``i`` to ``choice`` can take off ``now``'s step."""
        waits = self._facts(now)[1]
        return self._cost(i, self._choices[i]) + waits - self._cost(i, choice) + self._replay_slack


def _choices_of(save: Save) -> tuple[Choice, ...]:
    return ("offload", "rebuild") if save.rebuild_s is not None else ("offload",)


def _chains_across(saves: tuple[Save, ...], choices: list[Choice], i: int) -> bool:
    """Whether rebuilding ``i`` would chain into a rebuild of another module.

    Such a chain is rebuilt in the later module's backward and waits there
    for its own use: two modules' activations at once (NOTE [ Planning ]).
    """
    module = saves[i].module
    if any(choices[j] == "rebuild" and saves[j].module != module for j in saves[i].inputs):
        return True
    return any(
        choices[k] == "rebuild" and saves[k].module != module and i in saves[k].inputs
        for k in range(i + 1, len(saves))
    )


def make_plan(profile: Profile, budget_bytes: int) -> Plan:
    """The fastest plan whose predicted peak fits ``budget_bytes`` (NOTE [ Planning ]).

    When no plan fits, the one with the lowest peak, whose ``floor_bytes``
    says how low the step can go.

    Args:
        profile: the profiled step.
        budget_bytes: saved bytes that may be resident at once, in-flight included.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, make_plan
        >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
        >>> plan = make_plan(p, 10)   # cannot be rebuilt, 1000 bytes in flight at least
        >>> plan.fits, plan.floor_bytes
        (False, 1000)
    """
    starts = [_all(profile, "keep"), *_lowest_templates(profile)]
    window = profile.window_bytes
    last = _last_resorts(profile)
    floor = floor_bytes(profile)
    kept = simulate(profile, starts[0], window)
    if kept.peak_bytes <= budget_bytes:
        # Everything fits: nothing is faster than keeping it, so no search.
        return Plan(
            profile=profile,
            choices=starts[0],
            budget_bytes=budget_bytes,
            window_bytes=window,
            predicted_step_s=kept.step_s,
            predicted_peak_bytes=kept.peak_bytes,
            floor_bytes=min(floor, kept.peak_bytes),
            exposed_s=kept.exposed_s,
        )
    tried: list[tuple[list[Choice], Outcome, int]] = []
    fits = False
    for window in [*_windows(profile), *last]:
        if window in last and fits:
            break
        first = [
            _plan_for_window(profile, budget_bytes, window, start)
            for start in (*starts, *_checkpointed(profile, budget_bytes, window))
        ]
        first += [(list(c), simulate(profile, c, window)) for c in starts[1:]]
        fitting = [t for t in first if t[1].peak_bytes <= budget_bytes]
        if fitting:
            fits = True
            first.append(_take_back(profile, budget_bytes, window, *min(fitting, key=_step)))
        tried += [(choices, outcome, window) for choices, outcome in first]
    best: tuple[list[Choice], Outcome, int] | None = None
    lowest: tuple[list[Choice], Outcome, int] | None = None
    for choices, outcome, window in tried:
        if outcome.step_s == math.inf:
            continue  # not runnable (NOTE [ Replayed modules ]); no move makes one
        if lowest is None or (outcome.peak_bytes, outcome.step_s) < (
            lowest[1].peak_bytes,
            lowest[1].step_s,
        ):
            lowest = (choices, outcome, window)
        if outcome.peak_bytes <= budget_bytes and (best is None or outcome.step_s < best[1].step_s):
            best = (choices, outcome, window)
    assert lowest is not None
    floor = min(floor, lowest[1].peak_bytes)
    if best is None:
        best = lowest
    choices, outcome, window = best
    if tuple(choices) != (chosen := tied(profile, choices)):  # NOTE [ A tensor saved twice ]
        choices, outcome = list(chosen), simulate(profile, chosen, window)
    default = default_plan(profile, budget_bytes, floor)  # NOTE [ The default is a plan ]
    if default is not None and (
        default.predicted_step_s < outcome.step_s or outcome.peak_bytes > budget_bytes
    ):
        return default
    return Plan(
        profile=profile,
        choices=tuple(choices),
        budget_bytes=budget_bytes,
        window_bytes=window,
        predicted_step_s=outcome.step_s,
        predicted_peak_bytes=outcome.peak_bytes,
        floor_bytes=min(floor, outcome.peak_bytes),
        exposed_s=outcome.exposed_s,
    )


def default_plan(profile: Profile, budget_bytes: int, floor_bytes: int) -> Plan | None:
    """What a store without a budget does, as a plan: ``None`` where it does not fit.

    Every save offloaded through the profile's window, priced by simulation
    or at what it measured (NOTE [ The default is a plan ]).

    Example:
        >>> from tierstore.planning.planner import Profile, Save, default_plan
        >>> p = Profile((Save(100, "aten.mm", "m", 0.0, 1.0),) * 4, 1.0, 1.0, 0.0, 1e4, 1e4, 200)
        >>> default_plan(p, 400, 100).predicted_peak_bytes  # its window and one copy more
        300
        >>> default_plan(p, 200, 100) is None
        True
    """
    choices = _all(profile, "offload")
    outcome = simulate(profile, choices, profile.window_bytes)
    if outcome.peak_bytes > budget_bytes or outcome.step_s == math.inf:
        return None
    return Plan(
        profile=profile,
        choices=choices,
        budget_bytes=budget_bytes,
        window_bytes=profile.window_bytes,
        predicted_step_s=outcome.step_s,
        predicted_peak_bytes=outcome.peak_bytes,
        floor_bytes=min(floor_bytes, outcome.peak_bytes),
        exposed_s=outcome.exposed_s,
    )


def tied(profile: Profile, choices: Sequence[Choice]) -> tuple[Choice, ...]:
    """``choices`` with each save of a tensor saved before given that save's choice.

    NOTE [ A tensor saved twice ].

    Example:
        >>> from tierstore.planning.planner import Profile, Save, tied
        >>> saves = (Save(64, "aten._log_softmax", "m", 0.0, 1.0),
        ...          Save(0, "aten._log_softmax", "m", 0.0, 1.0, same_as=0))
        >>> tied(Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 64), ("keep", "offload"))
        ('keep', 'keep')
    """
    spans = replayed(profile, choices)
    native = {j for _, first, end in spans for j in range(first + 1, end)}
    inputs = {first for _, first, _ in spans}
    out = list(choices)
    for i, save in enumerate(profile.saves):
        first = save.same_as
        if first is None or i in native or first in native:
            continue  # checkpoint takes those saves, whatever the plan says of them
        if i in inputs and out[first] != "keep":
            continue  # a replayed module's input is its boundary: kept
        out[i] = out[first]
    return tuple(out)


def fits_everything(profile: Profile, budget_bytes: int) -> bool:
    """Whether keeping every save fits ``budget_bytes``: a plan made without a search.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, fits_everything
        >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
        >>> fits_everything(p, 1000), fits_everything(p, 999)
        (True, False)
    """
    return simulate(profile, _all(profile, "keep"), profile.window_bytes).peak_bytes <= budget_bytes


def floor_bytes(profile: Profile) -> int:
    """The lowest peak the step can reach, whatever the budget (NOTE [ The floor ]).

    Example:
        >>> from tierstore.planning.planner import Profile, Save, floor_bytes
        >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
        >>> floor_bytes(p)   # cannot be rebuilt: in flight, or in use
        1000
    """
    return min(
        simulate(profile, choices, window).peak_bytes
        for window in (*_windows(profile), *_last_resorts(profile))
        for choices in _lowest_templates(profile)
    )


def _last_resorts(profile: Profile) -> tuple[int, ...]:
    """The windows for budgets no larger window meets (NOTE [ Planning ]).

    Forward waits for a write only on a disk's link.
    """
    return (ONE_AT_A_TIME, SYNCHRONOUS) if profile.shared_link else (ONE_AT_A_TIME,)


def _step(plan: tuple[list[Choice], Outcome]) -> float:
    return plan[1].step_s


def _all(profile: Profile, choice: Choice) -> tuple[Choice, ...]:
    return (choice,) * len(profile.saves)


def _lowest_templates(profile: Profile) -> list[tuple[Choice, ...]]:
    """Plans that free everything, for low budgets where one save at a time gets stuck.

    All offloaded; and each module rebuilt from its first save, which is
    kept or offloaded: checkpointing, found without the user wrapping a block.
    """
    saves = profile.saves
    firsts = {s.module: i for i, s in reversed(list(enumerate(saves)))}
    rebuild: Choice = "rebuild"
    out = [_all(profile, "offload")]
    for boundary in ("keep", "offload"):
        edge: Choice = "keep" if boundary == "keep" else "offload"
        out.append(
            tuple(
                edge if firsts[s.module] == i or s.rebuild_s is None else rebuild
                for i, s in enumerate(saves)
            )
        )
    return out
