"""A plan carried over to a step of another shape: its saves' sizes and its peak predicted.

The runner keeps each plan's saves' shapes (its profiled step's); a step
whose saves follow a kept plan's by signature (dtype and rank, save for
save) but not by size runs that plan from its first save (NOTE [ Plans
across shapes ]). :func:`carry_over` maps the profiled shapes to the step's,
predicts each save's bytes and the plan's peak there, and where the peak
would not fit the budget in force, offloads more of the earliest kept saves
(:func:`cheaper`). Pure, as the planner is: shapes, bytes and seconds.

Example:
    >>> from tierstore.planning.carry import dim_map, predicted_shape
    >>> dims = dim_map((8, 192, 256), (5, 128, 256))
    >>> predicted_shape((8, 4, 192, 192), dims), predicted_shape((1536, 256), dims)
    ((5, 4, 128, 128), (640, 256))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tierstore.planning.plan_types import (
    ONE_AT_A_TIME,
    SYNCHRONOUS,
    Choice,
    Plan,
    Profile,
    replayed,
)
from tierstore.planning.planner import simulate, tied
from tierstore.planning.simulation import Outcome

__all__ = [
    "Carry",
    "Shape",
    "carry_over",
    "cheaper",
    "dim_map",
    "predicted_shape",
    "unfolded",
]

# NOTE [ Plans across shapes ]
# A save's signature is what does not depend on its size: its place in the
# step, its dtype and the rank of its shape (the op and module are known
# only in a profiled step: NOTE [ Naming modules ] in autograd/names.py). A
# step whose first save matches no kept plan by size, but a kept plan by
# signature, runs that plan from its first save: another sequence length,
# another batch size, the last partial batch. Its sizes are predicted, not
# profiled: the dims that changed between the plan's first save and the
# step's (192 -> 128, 8 -> 5) are applied to every profiled shape, a dim
# that is a product of changed ones (a Linear's folded batch times length)
# by the product, and a save's bytes scale with its elements (S x S
# attention then grows as S squared). A first save whose changed dim is
# itself a fold (batch times length, as a Linear that opens the model saves
# it) cannot tell which of the two changed: each reading that splits it into
# two dims the profile has is played, and the one that saves the most is
# taken. Times scale with the step's saved bytes, the nearest measure of its
# work the step has before it runs. The carried plan's peak is simulated on
# that profile before the step runs; one that would not fit the budget in
# force offloads more of its kept saves, the earliest first (forward holds
# them longest), the fewest that fit found by halving: no profile, no
# search, no planning process. As the step runs each save is its own size,
# and a kept save that would take what the step keeps past the budget, the
# plan's in-flight bytes counted, is offloaded (the runner's check). A dim
# of the plan's first save that takes two new values (a batch of 256 beside
# a length of 256 that changes) cannot be mapped: that plan is not carried
# over. Carried plans are cached by their source plan, the step's shape and
# the budget in force, so a budget that changes ("auto") gets its own.

#: A save's dtype (any value the hook reads off the tensor; compared, never read) and shape.
Shape = tuple[object, tuple[int, ...]]


@dataclass
class Carry:
    """A kept plan carried over to one shape of step (NOTE [ Plans across shapes ]).

    Attributes:
        source: the kept plan, made for its profiled shape.
        plan: the plan for this shape: the source's choices (more offloaded
            where it would not fit) on the source's profile scaled to it.
        signatures: each save's (dtype, rank), in save order.
        sizes: each save's predicted bytes (the same tensor saved again
            included, which the profile holds at 0).
    """

    source: Plan
    plan: Plan
    signatures: tuple[tuple[object, int], ...]
    sizes: tuple[int, ...]


def dim_map(profiled: tuple[int, ...], now: tuple[int, ...]) -> dict[int, int] | None:
    """Each dim value of ``profiled`` to its value in ``now``; ``None`` where one has two.

    With the products of its leading dims (a batch and a length folded into
    one, as a Linear or a loss reshapes them) where they changed and name
    no dim of their own.

    Example:
        >>> from tierstore.planning.carry import dim_map
        >>> dim_map((8, 192), (5, 128)), dim_map((256, 256), (256, 128))
        ({8: 5, 192: 128, 1536: 640}, None)
    """
    if len(profiled) != len(now):
        return None
    out: dict[int, int] = {}
    for old, new in zip(profiled, now, strict=True):
        if out.setdefault(old, new) != new:
            return None
    for k in range(2, len(profiled) + 1):
        old_product, new_product = math.prod(profiled[:k]), math.prod(now[:k])
        if old_product != new_product:
            out.setdefault(old_product, new_product)
    return out


def predicted_shape(shape: tuple[int, ...], dims: dict[int, int]) -> tuple[int, ...]:
    """``shape`` with ``dims`` (from :func:`dim_map`) applied; a dim it does not name is kept.

    Example:
        >>> from tierstore.planning.carry import predicted_shape
        >>> predicted_shape((4, 768, 31), {4: 2, 31: 15})
        (2, 768, 15)
    """
    return tuple(dims.get(d, d) for d in shape)


def carry_over(
    source: Plan,
    shapes: Sequence[Shape],
    index: int,
    shape: tuple[int, ...],
    budget: int | float,
) -> Carry | None:
    """``source`` carried over to a step whose save ``index`` has ``shape``; ``None``: it can't.

    ``shapes``: the source profile's saves' (dtype, shape); ``budget``: the
    budget in force (bytes, or a fraction of what the step saves).

    Example:
        >>> from tierstore.planning.carry import carry_over
        >>> from tierstore.planning.planner import Profile, Save, make_plan
        >>> saves = tuple(Save(4 * 8 * 16, "aten.mm", "m", 0.1 * i, 0.1) for i in range(3))
        >>> plan = make_plan(Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 0), 1 << 20)
        >>> carry = carry_over(plan, [("f32", (8, 16))] * 3, 0, (8, 32), 1 << 20)
        >>> carry.sizes, carry.plan.choices
        ((1024, 1024, 1024), ('keep', 'keep', 'keep'))
    """
    dims = dim_map(shapes[index][1], shape)
    if dims is None:
        return None
    known = {d for _, s in shapes for d in s}
    sizes = max(
        (_predicted(source, shapes, m) for m in unfolded(dims, known)), key=sum
    )  # the largest reading: NOTE [ Plans across shapes ]
    profile = _scaled_to(source.profile, sizes)
    allowed = int(budget * profile.saved_bytes) if isinstance(budget, float) else int(budget)
    choices, window, outcome = cheaper(profile, source.choices, source.window_bytes, allowed)
    plan = Plan(
        profile=profile,
        choices=choices,
        budget_bytes=allowed,
        window_bytes=window,
        predicted_step_s=outcome.step_s,
        predicted_peak_bytes=outcome.peak_bytes,
        floor_bytes=min(
            outcome.peak_bytes, int(_ratio(source.profile, profile) * source.floor_bytes)
        ),
        exposed_s=outcome.exposed_s,
    )
    signatures = tuple((dtype, len(s)) for dtype, s in shapes)
    return Carry(source, plan, signatures, tuple(sizes))


def unfolded(dims: dict[int, int], known: set[int]) -> list[dict[int, int]]:
    """``dims``, and each reading of a changed dim as two dims of ``known`` folded into one.

    A first save of ``(batch * length, width)`` tells that the product
    changed, not which of the two did: each reading scales one of them.

    Example:
        >>> from tierstore.planning.carry import unfolded
        >>> [[m.get(2, 2), m.get(128, 128)] for m in unfolded({256: 512, 32: 32}, {2, 128, 32})]
        [[2, 128], [4, 128], [2, 256]]
    """
    out = [dims]
    for old, new in dims.items():
        if old == new:
            continue
        for a in sorted(known):
            b = old // a
            if a < 2 or b < 2 or a * b != old or b not in known:
                continue
            if new % b == 0 and dims.get(a, new // b) == new // b:
                out.append({**dims, a: new // b})
    return out


def _predicted(source: Plan, shapes: Sequence[Shape], dims: dict[int, int]) -> list[int]:
    """Each save's bytes with ``dims`` applied to its profiled shape."""
    sizes = []
    for expected, (_, old) in zip(_sizes(source), shapes, strict=True):
        elements = math.prod(old)
        new = math.prod(predicted_shape(old, dims))
        sizes.append(expected if elements == 0 else expected // elements * new)
    return sizes


def _sizes(plan: Plan) -> list[int]:
    """Each save's bytes in ``plan``'s profile, a tensor saved again at its first save's."""
    saves = plan.profile.saves
    return [s.nbytes if s.same_as is None else saves[s.same_as].nbytes for s in saves]


def _ratio(before: Profile, after: Profile) -> float:
    return after.saved_bytes / before.saved_bytes if before.saved_bytes else 1.0


def _scaled_to(profile: Profile, sizes: Sequence[int]) -> Profile:
    """``profile`` at ``sizes``: its compute times and fixed bytes scaled with its saved bytes."""
    before = sum(s.nbytes for s in profile.saves)
    after = sum(n for s, n in zip(profile.saves, sizes, strict=True) if s.same_as is None)
    factor = after / before if before else 1.0
    saves = tuple(
        replace(
            s,
            nbytes=0 if s.same_as is not None else n,
            forward_s=s.forward_s * factor,
            use_s=s.use_s * factor,
            rebuild_s=None if s.rebuild_s is None else s.rebuild_s * factor,
        )
        for s, n in zip(profile.saves, sizes, strict=True)
    )
    between = profile.between_s or 0.0  # not the step's compute (NOTE [ Like with like ])
    return replace(
        profile,
        saves=saves,
        forward_s=profile.forward_s * factor,
        backward_s=profile.backward_s * factor,
        other_s=between + (profile.other_s - between) * factor,
        fixed_bytes=int(profile.fixed_bytes * factor),
        overrun_bytes=int(profile.overrun_bytes * factor),
        stays_in=tuple((m, why, n, int(b * factor)) for m, why, n, b in profile.stays_in),
        default_step_s=None if profile.default_step_s is None else profile.default_step_s * factor,
    )


def cheaper(
    profile: Profile, choices: tuple[Choice, ...], window: int, budget: int
) -> tuple[tuple[Choice, ...], int, Outcome]:
    """``choices``, or the fewest of its earliest kept saves offloaded that fit ``budget``.

    Not a replayed module's input (its boundary), nor a tensor saved again
    (it follows its first save). At ``window``, then at the narrower windows
    the planner ends on (the largest save, one copy at a time, and on a
    shared link none), the fastest that fits; where none fits, the lowest
    peak. Returns the choices, their window and their simulated outcome.

    Example:
        >>> from tierstore.planning.carry import cheaper
        >>> from tierstore.planning.planner import Profile, Save
        >>> saves = tuple(Save(100, "aten.mm", "m", 0.1 * i, 0.1 * (3 - i)) for i in range(3))
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 0)
        >>> cheaper(p, ("keep",) * 3, 100, 250)[:2]  # one copy in flight beside what it keeps
        (('offload', 'offload', 'keep'), 1)
    """
    window = _room(profile, choices, window, budget)
    outcome = simulate(profile, choices, window)
    if outcome.peak_bytes <= budget:
        return choices, window, outcome
    inputs = {first for _, first, _ in replayed(profile, choices)}
    kept = [
        i
        for i, c in enumerate(choices)
        if c == "keep"
        and i not in inputs
        and profile.saves[i].same_as is None
        and profile.saves[i].nbytes
    ]
    largest = max((s.nbytes for s in profile.saves), default=0)
    last = (ONE_AT_A_TIME, SYNCHRONOUS) if profile.shared_link else (ONE_AT_A_TIME,)
    windows = sorted({window, min(window, largest), *last}, reverse=True)
    best = (choices, window, outcome)
    for width in windows:
        trial, result = _fewest(profile, choices, kept, width, budget)
        if _better(result, best[2], budget):
            best = (trial, _room(profile, trial, width, budget), result)
    return best


def _room(profile: Profile, choices: Sequence[Choice], window: int, budget: int) -> int:
    """``window``, at most the budget's room beside what ``choices`` keeps (one copy at least).

    The profile's link may be faster than the step's: a window the
    simulation never fills could fill as the step runs, past the budget.
    """
    kept = profile.fixed_bytes + sum(
        s.nbytes for s, c in zip(profile.saves, choices, strict=True) if c == "keep"
    )
    if window <= ONE_AT_A_TIME:
        return window
    return max(min(window, budget - kept), ONE_AT_A_TIME)


def _better(a: Outcome, b: Outcome, budget: int) -> bool:
    """Whether ``a`` beats ``b``: it fits where ``b`` does not, or is faster, or peaks lower."""
    fits = a.peak_bytes <= budget, b.peak_bytes <= budget
    if fits[0] != fits[1]:
        return fits[0]
    return a.step_s < b.step_s if fits[0] else a.peak_bytes < b.peak_bytes


def _fewest(
    profile: Profile, choices: tuple[Choice, ...], kept: list[int], window: int, budget: int
) -> tuple[tuple[Choice, ...], Outcome]:
    """The fewest of ``kept`` offloaded, earliest first, that fit at ``window``, found by halving.

    Where none fits, all of them offloaded.
    """

    def flipped(k: int) -> tuple[Choice, ...]:
        out = list(choices)
        for i in kept[:k]:
            out[i] = "offload"
        return tied(profile, out)

    def played(trial: tuple[Choice, ...]) -> Outcome:
        return simulate(profile, trial, _room(profile, trial, window, budget))

    low, high = 0, len(kept)  # the fewest that fit is in (low, high]
    best = flipped(high)
    outcome = played(best)
    if outcome.peak_bytes > budget:
        return best, outcome
    while high - low > 1:
        mid = (low + high) // 2
        trial = flipped(mid)
        result = played(trial)
        if result.peak_bytes <= budget:
            high, best, outcome = mid, trial, result
        else:
            low = mid
    return best, outcome
