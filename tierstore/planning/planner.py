"""The planner: a profiled step and an activation budget in, keep / offload / rebuild out.

A pure function over numbers (NOTE [ Planning ]): it knows bytes, seconds and
rates, not tensors, streams, files or autograd. The store records a
:class:`Profile` of one real step, calls :func:`make_plan`, and carries the
:class:`Plan` out; the plan reports what it predicted beside what the store
measured.

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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

__all__ = [
    "Choice",
    "Plan",
    "Profile",
    "Save",
    "from_graph",
    "hands_heap_back",
    "kept_whole",
    "make_plan",
    "offloaded_saves",
    "recorded_rebuilds",
    "replayed",
    "simulate",
    "tied",
]

#: What the plan does with one saved tensor.
Choice = Literal["keep", "offload", "rebuild"]

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
# [ Copies in flight ] in tierstore/tiers/manager.py):
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
# either way. replayed() names those modules; the hooks layer and the
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
# (_runnable).


def replayed(profile: Profile, choices: Sequence[Choice]) -> tuple[tuple[str, int, int], ...]:
    """The modules ``choices`` replays natively, each with its saves ``[first, end)``.

    NOTE [ Replayed modules ].

    Example:
        >>> from tierstore.planning.planner import Profile, Save, replayed
        >>> saves = tuple(Save(10, "aten.mm", m, 0.0, 0.0, 0.1) for m in "aabb")
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10)
        >>> replayed(p, ("keep", "rebuild", "keep", "keep"))
        (('a', 0, 2),)
    """
    # Slices and counts, not a loop per save: simulate() asks this of most plans it plays.
    out = tuple(
        (module, first, end)
        for module, first, end in profile.replayable
        if choices[first] == "keep" and choices[first + 1 : end].count("rebuild") == end - first - 1
    )
    if not out or list(choices).count("rebuild") == sum(end - first - 1 for _, first, end in out):
        return out  # no other rebuild records anywhere
    native = {j for _, first, end in out for j in range(first, end)} | from_graph(profile, choices)
    records_in = profile.records_in
    recorded = {
        m
        for i, choice in enumerate(choices)
        if choice == "rebuild" and i not in native
        for m in records_in[i]
    }
    return tuple(span for span in out if span[0] not in recorded)


def hands_heap_back(profile: Profile, choices: Sequence[Choice]) -> bool:
    """Whether a CPU step under ``choices`` hands the heap back (NOTE [ Handing the heap back ]).

    Not one that moves nothing and rebuilds only natively: it frees what it
    drops where checkpointing does. ``False`` wherever ``hand_back_s`` is 0.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, hands_heap_back
        >>> saves = tuple(Save(10, "aten.mm", m, 0.0, 0.0, 0.1) for m in "aab")
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10, hand_back_s=0.01)
        >>> hands_heap_back(p, ("keep", "rebuild", "keep"))  # module a checkpointed
        False
        >>> hands_heap_back(p, ("keep", "keep", "offload"))
        True
    """
    if not profile.hand_back_s:
        return False
    return "offload" in choices or recorded_rebuilds(profile, choices) > 0


def kept_whole(profile: Profile, choices: Sequence[Choice]) -> tuple[tuple[str, int, int], ...]:
    """The modules ``choices`` keeps every save of, each with its saves ``[first, end)``.

    NOTE [ Modules kept whole ] in autograd/regions.py: their saves need no hook. The
    outermost modules first (a plan that keeps everything keeps the model
    whole), then the blocks outside them. Not a module where keep() stored
    a save: the hook carries that out. Nor one that holds an input of a
    save rebuilt from the graph (:func:`from_graph`): that rebuild reads the
    input as the pack hook packed it. Below, blocks ``a`` and ``b`` of a model ``m``.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, kept_whole
        >>> saves = [Save(10, "aten.mm", block, 0.0, 0.0, root="m") for block in "aabb"]
        >>> p = Profile(tuple(saves), 1.0, 1.0, 0.0, 1e9, 1e9, 10)
        >>> kept_whole(p, ("keep",) * 4), kept_whole(p, ("keep", "keep", "keep", "offload"))
        ((('m', 0, 4),), (('a', 0, 2),))
    """
    stored = set(profile.stored_in)
    read = {j for i in from_graph(profile, choices) for j in profile.saves[i].inputs}

    def whole(spans: tuple[tuple[str, int, int], ...]) -> list[tuple[str, int, int]]:
        return [
            (module, first, end)
            for module, first, end in spans
            if module not in stored
            and choices[first:end].count("keep") == end - first
            and not any(first <= j < end for j in read)
        ]

    roots = whole(profile.root_spans)
    covered = {i for _, first, end in roots for i in range(first, end)}
    return (*roots, *(span for span in whole(profile.spans) if span[1] not in covered))


def recorded_rebuilds(profile: Profile, choices: Sequence[Choice]) -> int:
    """How many saves ``choices`` rebuilds op by op (NOTE [ Replayed modules ]).

    Example:
        >>> from tierstore.planning.planner import Profile, Save, recorded_rebuilds
        >>> saves = tuple(Save(10, "aten.mm", m, 0.0, 0.0, 0.1) for m in "aabb")
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10)
        >>> recorded_rebuilds(p, ("keep", "rebuild", "rebuild", "rebuild"))
        2
    """
    native = {j for _, first, end in replayed(profile, choices) for j in range(first + 1, end)}
    return sum(c == "rebuild" for c in choices) - len(native | from_graph(profile, choices))


def from_graph(profile: Profile, choices: Sequence[Choice]) -> set[int]:
    """The saves ``choices`` rebuilds from the autograd graph, with no recorder.

    NOTE [ Rebuilt from the graph ] in tierstore/autograd/graph.py.

    Those whose op the graph can run again, with no input rebuilt: each is
    kept, or stored and read back once for the rebuild and its own use.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, from_graph
        >>> saves = (Save(10, "aten.mm", "a", 0.0, 0.0, 0.1),
        ...          Save(40, "aten.gelu", "a", 0.0, 0.0, 0.01, inputs=(0,), graph=True))
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10)
        >>> from_graph(p, ("keep", "rebuild")), from_graph(p, ("offload", "rebuild"))
        ({1}, {1})
        >>> from_graph(p, ("rebuild", "rebuild"))
        set()
    """
    return {
        i
        for i in profile.graph_saves
        if choices[i] == "rebuild" and all(choices[j] != "rebuild" for j in profile.saves[i].inputs)
    }


def _runnable(profile: Profile, choices: Sequence[Choice], native: set[int]) -> bool:
    """Whether the store can carry ``choices`` out: no save no op can rebuild is rebuilt op by op.

    ``native``: the saves ``choices`` rebuilds natively (:func:`_natively_rebuilt`).
    NOTE [ Replayed modules ].
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


@dataclass(frozen=True)
class Save:
    """One saved tensor of a profiled step, in the order forward saved it.

    Attributes:
        nbytes: the bytes it rests in.
        op: the op that made it (``"aten.mm"``), for the plan's table.
        module: the module whose forward saved it (a block), for the table.
        forward_s: forward compute from the step's first save to this save.
        use_s: backward compute from backward's start to its first use.
        rebuild_s: compute to rebuild it from what is stored; ``None`` when it
            cannot be rebuilt (a random op, an input that is not stored).
        inputs: the saves (indices) a rebuild reads; rebuilt ones are rebuilt
            first and live until their own use.
        made_in: the modules whose forward ran the ops a rebuild replays
            (where the store records them; empty: ``module``).
        compiled: ``module`` ran in a compiled region, which handed its saves
            over: never checkpointed (NOTE [ Replayed modules ]).
        root: the outermost module whose forward saved it (the model), which
            a plan that keeps all its saves keeps whole (NOTE [ Modules kept
            whole ] in tier_store.py).
        same_as: the earlier save of the same tensor (its index), when this
            one saves it again: no bytes of its own, and the plan's choice
            for it is that save's (NOTE [ A tensor saved twice ]).
        graph: its op runs again from what the autograd graph holds, with
            no recorder, where the plan rebuilds none of its ``inputs``
            (:func:`from_graph`; NOTE [ Rebuilt from the graph ] in
            tierstore/autograd/graph.py).
    """

    nbytes: int
    op: str
    module: str
    forward_s: float
    use_s: float
    rebuild_s: float | None = None
    inputs: tuple[int, ...] = ()
    made_in: tuple[str, ...] = ()
    compiled: bool = False
    root: str = ""
    same_as: int | None = None
    graph: bool = False


@dataclass(frozen=True)
class Profile:
    """One real step, as the planner needs it (NOTE [ Planning ]).

    Attributes:
        saves: the saved tensors the plan decides on, in save order.
        forward_s: forward compute from the first save to backward's start.
        backward_s: backward compute, waits taken out.
        other_s: the rest of the step (before the first save, the optimizer).
        write_bytes_per_s: the link out (device to host, or to disk).
        read_bytes_per_s: the link back.
        window_bytes: the most bytes that may be in flight each way.
        moved_s_per_byte: compute time each byte moved costs the step on top
            of the link (a CPU's copies and checksums run on its own cores).
        moved_s_per_save: host time each offloaded save costs the step, its
            trip through the store out and back (on CUDA, where the copies
            are timed on their own streams: NOTE [ Charging a slow step ]
            in tierstore/planning/checker.py); 0 until a planned step measured it.
        fixed_bytes: saved bytes that stay whatever the plan (kept tensors,
            saves under ``min_offload_bytes``): counted in every peak.
        shared_link: one link both ways (a disk: reads queue behind writes),
            rather than a copy engine each way (PCIe).
        recorded_rebuild_s: what each rebuild replayed op by op costs on top
            of its compute (NOTE [ Replayed modules ]).
        hand_back_s: what handing the heap back costs a CPU step whose plan
            does (:func:`hands_heap_back`): the pages it uses again, faulted
            back in (NOTE [ Handing the heap back ] in
            tierstore/tiers/host_pool.py); 0 where nothing is handed back.
        stays_in: the saves outside the plan (parameters, small ones, kept
            ones) per module: ``(module, why, count, bytes)``; and
        stored_in: the modules where keep() stored a save. The hooks layer's
            (NOTE [ Modules kept whole ]); the planner reads neither.
        between_s: of ``other_s``, the time from the end of backward to the
            next step's start (the optimizer, the data): what the runner's
            checks on a CPU hold to the profile's (NOTE [ Like with like ]
            in tierstore/planning/runner.py); ``None`` where the profiled step's backward
            was not seen to end. The planner does not read it.
    """

    saves: tuple[Save, ...]
    forward_s: float
    backward_s: float
    other_s: float
    write_bytes_per_s: float
    read_bytes_per_s: float
    window_bytes: int
    moved_s_per_byte: float = 0.0
    moved_s_per_save: float = 0.0
    fixed_bytes: int = 0
    shared_link: bool = False
    recorded_rebuild_s: float = 0.0
    hand_back_s: float = 0.0
    stays_in: tuple[tuple[str, str, int, int], ...] = ()
    stored_in: tuple[str, ...] = ()
    between_s: float | None = None

    @cached_property
    def spans(self) -> tuple[tuple[str, int, int], ...]:
        """The modules whose saves follow one another, each with ``[first, end)``, in order.

        Only such a module can be replayed natively (NOTE [ Replayed modules ]),
        and only one that ran outside every compiled region: checkpoint would
        replay eagerly what ran compiled, and save other tensors.
        """
        return self._spans_of(tuple(save.module for save in self.saves))

    @cached_property
    def root_spans(self) -> tuple[tuple[str, int, int], ...]:
        """:attr:`spans` by outermost module (NOTE [ Modules kept whole ], autograd/regions.py)."""
        return self._spans_of(tuple(save.root for save in self.saves))

    def _spans_of(self, modules: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
        bounds: dict[str, list[int]] = {}
        count: dict[str, int] = {}
        compiled: set[str] = set()
        for i, (module, save) in enumerate(zip(modules, self.saves, strict=True)):
            bounds.setdefault(module, [i, i])[1] = i + 1
            count[module] = count.get(module, 0) + 1
            if save.compiled:
                compiled.add(module)
        return tuple(
            (module, first, end)
            for module, (first, end) in bounds.items()
            if module
            and end - first == count[module]
            and end - first > 1
            and module not in compiled
        )

    @property
    def saved_bytes(self) -> int:
        """Every byte the step saves: what a fraction of a budget is a fraction of."""
        return self.fixed_bytes + sum(s.nbytes for s in self.saves)

    @cached_property
    def replayable(self) -> tuple[tuple[str, int, int], ...]:
        """The :attr:`spans` whose rebuilds replay only the module's own ops.

        A module rebuilt whole from its first save replays natively unless a
        rebuild of it replays ops another module ran (NOTE [ Replayed modules ]).
        """
        saves = self.saves
        return tuple(
            (module, first, end)
            for module, first, end in self.spans
            if all(m == module for j in range(first + 1, end) for m in saves[j].made_in)
        )

    @cached_property
    def records_in(self) -> tuple[tuple[str, ...], ...]:
        """Per save, the modules a rebuild of it op by op records in (NOTE [ Replayed modules ])."""
        return tuple(save.made_in or (save.module,) for save in self.saves)

    @cached_property
    def graph_saves(self) -> tuple[int, ...]:
        """The saves the autograd graph can rebuild (NOTE [ Rebuilt from the graph ])."""
        return tuple(i for i, save in enumerate(self.saves) if save.graph)

    @cached_property
    def unrebuildable(self) -> tuple[int, ...]:
        """The saves no op can rebuild (``rebuild_s`` ``None``): only a native replay makes them.

        NOTE [ Replayed modules ].
        """
        return tuple(i for i, save in enumerate(self.saves) if save.rebuild_s is None)

    @cached_property
    def use_order(self) -> tuple[int, ...]:
        """The saves in the order backward first uses them (each simulation walks it)."""
        return tuple(sorted(range(len(self.saves)), key=lambda i: self.saves[i].use_s))


@dataclass
class Plan:
    """What to do with each saved tensor of a step, and what it should cost.

    ``str(plan)`` is a table, one row per module, with the bytes kept,
    offloaded and rebuilt, and the predicted exposed time; the last lines
    give the step's predicted time and peak beside the measured ones once
    the store has run a step under the plan.

    Attributes:
        choices: one :data:`Choice` per save of the profile.
        budget_bytes: the budget planned for.
        window_bytes: the in-flight bound the plan assumes.
        predicted_step_s: the step time the plan predicts.
        predicted_peak_bytes: the most saved bytes resident at once, predicted.
        floor_bytes: the lowest peak the step can reach, whatever the budget
            (NOTE [ The floor ]); above the budget when the budget cannot be met.
        measured_step_s: the last step run under the plan (``None`` before),
            as its checks take it: on a CPU, with the profiled step's time
            between steps in place of its own (NOTE [ Like with like ] in
            tierstore/planning/runner.py).
        measured_peak_bytes: its measured peak of saved bytes resident.
    """

    profile: Profile
    choices: tuple[Choice, ...]
    budget_bytes: int
    window_bytes: int
    predicted_step_s: float
    predicted_peak_bytes: int
    floor_bytes: int
    exposed_s: tuple[float, ...] = ()
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None
    steps: int = field(default=0)
    #: The measured figures are those of the plan this one replaced, shown
    #: until a step runs on this one.
    measured_before: bool = False

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget."""
        return self.predicted_peak_bytes <= self.budget_bytes

    @cached_property
    def keeps_everything(self) -> bool:
        """Whether every save stays: nothing offloaded, nothing rebuilt."""
        return self.choices.count("keep") == len(self.choices)

    @cached_property
    def hands_back(self) -> bool:
        """Whether a CPU step under this plan hands the heap back (:func:`hands_heap_back`)."""
        return hands_heap_back(self.profile, self.choices)

    def bytes_by_choice(self) -> dict[Choice, int]:
        """Bytes kept, offloaded and rebuilt.

        Example:
            >>> from tierstore.planning.planner import Profile, Save, make_plan
            >>> p = Profile((Save(64, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 64)
            >>> make_plan(p, 1 << 20).bytes_by_choice()
            {'keep': 64, 'offload': 0, 'rebuild': 0}
        """
        out: dict[Choice, int] = {"keep": 0, "offload": 0, "rebuild": 0}
        for save, choice in zip(self.profile.saves, self.choices, strict=True):
            out[choice] += save.nbytes
        return out

    def __str__(self) -> str:
        rows: dict[str, list[float]] = {}
        for i, (save, choice) in enumerate(zip(self.profile.saves, self.choices, strict=True)):
            row = rows.setdefault(save.module or "(no module)", [0, 0, 0, 0.0])
            row[("keep", "offload", "rebuild").index(choice)] += save.nbytes
            row[3] += self.exposed_s[i] if self.exposed_s else 0.0
        width = max([len("module"), *(len(m) for m in rows)])
        lines = [
            f"{'module':<{width}}  {'kept':>10}  {'offloaded':>10}  {'rebuilt':>10}  {'exposed':>9}"
        ]
        for module, (kept, offloaded, rebuilt, exposed) in rows.items():
            lines.append(
                f"{module:<{width}}  {_size(kept):>10}  {_size(offloaded):>10}  "
                f"{_size(rebuilt):>10}  {exposed * 1e3:>7.1f}ms"
            )
        profile = self.profile
        budget = _size(self.budget_bytes)
        if not self.fits:  # the plan stops above the budget: said apart from the floor
            budget += f" (not met: this plan's peak is {_size(self.predicted_peak_bytes)})"
        lines.append(
            f"budget {budget}, window {_window(self.window_bytes)}, "
            f"floor {_size(self.floor_bytes)}; link out {_rate(profile.write_bytes_per_s)}, "
            f"back {_rate(profile.read_bytes_per_s)}"
        )
        measured_step = "-" if self.measured_step_s is None else f"{self.measured_step_s:.4g} s"
        measured_peak = "-" if self.measured_peak_bytes is None else _size(self.measured_peak_bytes)
        if self.measured_before and self.measured_step_s is not None:
            measured_step += " (the plan this one replaced; none on this one yet)"
        lines.append(
            f"step: predicted {self.predicted_step_s:.4g} s, measured {measured_step}; "
            f"peak: predicted {_size(self.predicted_peak_bytes)}, measured {measured_peak}"
        )
        lines.append(_TABLE_HELP)
        return "\n".join(lines)


#: Whether each simulation first lets other threads of the process run: where
#: a search runs beside the training thread (NOTE [ Planning off the training
#: thread ] in planning/checker.py). The planning process, which runs nothing else, sets
#: it to False: on a busy machine each yield also gave its core away.
YIELD_BETWEEN_SIMULATIONS = True

#: The last line of a plan's table: what its columns mean.
_TABLE_HELP = (
    "(kept / offloaded / rebuilt: the bytes each module saves, by the plan's choice; exposed: "
    "the step time the plan charges to them, link waits and rebuild compute; window: copies "
    "in flight each way; floor: the lowest peak the step can reach)"
)


def _window(n: int) -> str:
    if n == SYNCHRONOUS:
        return "none (synchronous)"
    return "one copy at a time" if n == ONE_AT_A_TIME else _size(n)


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Outcome:
    """What :func:`simulate` predicts for one plan."""

    step_s: float
    peak_bytes: int
    exposed_s: tuple[float, ...]  # per save: waits and rebuild compute charged to it


def simulate(profile: Profile, choices: tuple[Choice, ...], window_bytes: int) -> Outcome:
    """Play a plan through the profiled step: its time and its peak (NOTE [ Planning ]).

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
        time.sleep(0)  # let the training thread run: NOTE [ Planning off the training thread ]
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
    # Backward (NOTE [ Planning ]): what happens, in order, then when.
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
    if not _runnable(profile, choices, native):  # NOTE [ Replayed modules ]
        step = math.inf
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


#: A window of one byte: one copy in flight each way, each waited for before the next.
ONE_AT_A_TIME = 1
#: No window: each save waits for its own write, each use reads on demand.
SYNCHRONOUS = 0


def _checkpointed(profile: Profile, budget: int, window: int) -> list[tuple[Choice, ...]]:
    """Plans that checkpoint the first modules, replayed natively (NOTE [ Replayed modules ]).

    The fewest first modules that fit, and one and two fewer, from which
    the greedy frees the rest with the link or op-by-op rebuilds. Fit is
    judged with the saves the graph rebuilds (NOTE [ Rebuilt from the
    graph ] in tierstore/autograd/recompute.py) rebuilt besides, as the greedy
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


def offloaded_saves(profile: Profile, choices: Sequence[Choice]) -> int:
    """The saves ``choices`` moves off the device: a tensor saved again moves with its first.

    What a moved save's host time is charged per (Profile.moved_s_per_save).

    Example:
        >>> from tierstore.planning.planner import Profile, Save, offloaded_saves
        >>> saves = (Save(64, "aten.mm", "m", 0.0, 1.0),
        ...          Save(0, "aten.mm", "m", 0.0, 1.0, same_as=0))
        >>> offloaded_saves(Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 64), ("offload",) * 2)
        1
    """
    return sum(c == "offload" and s.nbytes > 0 for s, c in zip(profile.saves, choices, strict=True))


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
