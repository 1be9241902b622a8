"""The planner's types: a profiled step (:class:`Save`, :class:`Profile`), a :class:`Plan`.

With what a plan's choices mean beyond keep / offload / rebuild, which the
hooks layer reads as the planner does: the modules it replays natively
(:func:`replayed`), keeps whole (:func:`kept_whole`) or rebuilds from the
autograd graph (:func:`from_graph`). Pure, as the planner is (NOTE
[ Planning ] in tierstore/planning/planner.py): bytes, seconds and rates; the
planning process loads it by path beside the planner.

Example:
    >>> from tierstore.planning.plan_types import Profile, Save, replayed
    >>> saves = tuple(Save(10, "aten.mm", m, 0.0, 0.0, 0.1) for m in "aabb")
    >>> profile = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10)
    >>> profile.saved_bytes, profile.spans
    (40, (('a', 0, 2), ('b', 2, 4)))
    >>> replayed(profile, ("keep", "rebuild", "keep", "keep"))  # module a checkpointed
    (('a', 0, 2),)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

__all__ = [
    "ONE_AT_A_TIME",
    "SYNCHRONOUS",
    "Choice",
    "Plan",
    "Profile",
    "Save",
    "from_graph",
    "hands_heap_back",
    "is_default",
    "kept_whole",
    "offloaded_saves",
    "recorded_rebuilds",
    "replayed",
]

#: What the plan does with one saved tensor.
Choice = Literal["keep", "offload", "rebuild"]

#: A window of one byte: one copy in flight each way, each waited for before the next.
ONE_AT_A_TIME = 1
#: No window: each save waits for its own write, each use reads on demand.
SYNCHRONOUS = 0


def replayed(profile: Profile, choices: Sequence[Choice]) -> tuple[tuple[str, int, int], ...]:
    """The modules ``choices`` replays natively, each with its saves ``[first, end)``.

    NOTE [ Replayed modules ] in planning/planner.py.

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
    """How many saves ``choices`` rebuilds op by op.

    NOTE [ Replayed modules ] in planning/planner.py.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, recorded_rebuilds
        >>> saves = tuple(Save(10, "aten.mm", m, 0.0, 0.0, 0.1) for m in "aabb")
        >>> p = Profile(saves, 1.0, 1.0, 0.0, 1e9, 1e9, 10)
        >>> recorded_rebuilds(p, ("keep", "rebuild", "rebuild", "rebuild"))
        2
    """
    native = {j for _, first, end in replayed(profile, choices) for j in range(first + 1, end)}
    return sum(c == "rebuild" for c in choices) - len(native | from_graph(profile, choices))


def is_default(profile: Profile, choices: Sequence[Choice], window_bytes: int) -> bool:
    """Whether ``choices`` at ``window_bytes`` is what a store without a budget does.

    Every save offloaded, through the profile's own window: NOTE [ The
    default is a plan ] in planning/planner.py.

    Example:
        >>> from tierstore.planning.planner import Profile, Save, is_default
        >>> p = Profile((Save(10, "aten.mm", "m", 0.0, 0.0),) * 2, 1.0, 1.0, 0.0, 1e9, 1e9, 64)
        >>> is_default(p, ("offload", "offload"), 64), is_default(p, ("offload", "keep"), 64)
        (True, False)
    """
    return window_bytes == profile.window_bytes and all(c == "offload" for c in choices)


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
            over: never checkpointed (NOTE [ Replayed modules ] in planning/planner.py).
        root: the outermost module whose forward saved it (the model), which
            a plan that keeps all its saves keeps whole (NOTE [ Modules kept
            whole ] in autograd/regions.py).
        same_as: the earlier save of the same tensor (its index), when this
            one saves it again: no bytes of its own, and the plan's choice
            for it is that save's (NOTE [ A tensor saved twice ] in planning/planner.py).
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
    """One real step, as the planner needs it (NOTE [ Planning ] in planning/planner.py).

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
        overrun_bytes: of ``fixed_bytes``, what steps held beyond their
            plan's prediction, counted since as bytes that stay (NOTE [ A
            peak above the budget ] in planning/checker.py). Not saved
            bytes: a fractional budget is not raised by them
            (:attr:`saved_bytes`).
        shared_link: one link both ways (a disk: reads queue behind writes),
            rather than a copy engine each way (PCIe).
        recorded_rebuild_s: what each rebuild replayed op by op costs on top
            of its compute (NOTE [ Replayed modules ] in planning/planner.py).
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
        default_step_s: what a step offloading every save at ``window_bytes``
            (what a store without a budget does) measured, where one ran on
            trial beside the plan searched: the planner prices that plan at
            it, not at its simulation (NOTE [ The default is a plan ] in
            planning/planner.py); ``math.inf`` where it held more than its
            budget; ``None`` until measured.
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
    overrun_bytes: int = 0
    shared_link: bool = False
    recorded_rebuild_s: float = 0.0
    hand_back_s: float = 0.0
    stays_in: tuple[tuple[str, str, int, int], ...] = ()
    stored_in: tuple[str, ...] = ()
    between_s: float | None = None
    default_step_s: float | None = None

    @cached_property
    def spans(self) -> tuple[tuple[str, int, int], ...]:
        """The modules whose saves follow one another, each with ``[first, end)``, in order.

        Only such a module can be replayed natively (NOTE [ Replayed modules ]
        in planning/planner.py), and only one that ran outside every compiled
        region: checkpoint would replay eagerly what ran compiled, and save
        other tensors.
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
        return self.fixed_bytes - self.overrun_bytes + sum(s.nbytes for s in self.saves)

    @cached_property
    def replayable(self) -> tuple[tuple[str, int, int], ...]:
        """The :attr:`spans` whose rebuilds replay only the module's own ops.

        A module rebuilt whole from its first save replays natively unless a
        rebuild of it replays ops another module ran (NOTE [ Replayed modules ]
        in planning/planner.py).
        """
        saves = self.saves
        return tuple(
            (module, first, end)
            for module, first, end in self.spans
            if all(m == module for j in range(first + 1, end) for m in saves[j].made_in)
        )

    @cached_property
    def records_in(self) -> tuple[tuple[str, ...], ...]:
        """Per save, the modules a rebuild of it op by op records in.

        NOTE [ Replayed modules ] in planning/planner.py.
        """
        return tuple(save.made_in or (save.module,) for save in self.saves)

    @cached_property
    def graph_saves(self) -> tuple[int, ...]:
        """The saves the autograd graph can rebuild (NOTE [ Rebuilt from the graph ])."""
        return tuple(i for i, save in enumerate(self.saves) if save.graph)

    @cached_property
    def unrebuildable(self) -> tuple[int, ...]:
        """The saves no op can rebuild (``rebuild_s`` ``None``): only a native replay makes them.

        NOTE [ Replayed modules ] in planning/planner.py.
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
            (NOTE [ The floor ] in planning/planner.py); above the budget when
            the budget cannot be met.
        measured_step_s: the last step run under the plan (``None`` before),
            as its checks take it: on a CPU, with the profiled step's time
            between steps in place of its own (NOTE [ Like with like ] in
            tierstore/planning/runner.py).
        measured_peak_bytes: its measured peak of saved bytes resident.
        room: under ``activation_budget="auto"``, the latest step's budget and
            its parts (NOTE [ The room a step has ] in tierstore/planning/room.py);
            ``""`` otherwise.
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
    room: str = ""

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
        if self.room:
            lines.append(f"this step's budget: {self.room}")
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
