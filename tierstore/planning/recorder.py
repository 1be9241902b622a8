"""The profile recorder: what a profiled step saved, timed and used, made into a Profile.

The runner writes a profiled step down as it runs (each save's bytes, op
and module, when forward saved it and backward first used it); as the step
begins, :class:`ProfileRecorder` reads the link's clocks and gives the step
its timer, and as it ends, turns what was written down into the
:class:`~tierstore.planning.planner.Profile` the planner plans from (NOTE
[ Planned steps ] in planning/runner.py).

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.planning.recorder import ProfileRecorder
    >>> from tierstore.tiers.movers import LinkClock
    >>> recorder = ProfileRecorder(TierConfig(activation_budget=0.5), LinkClock(), LinkClock(),
    ...                            lambda: 0.0)
    >>> recorder.recorded_rebuild_s, recorder.moved_s_per_save  # nothing measured yet
    (0.0, 0.0)
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tierstore.config import TierConfig
from tierstore.planning.carry import Carry
from tierstore.planning.planner import Profile, Save
from tierstore.planning.timers import BusyTimer, HostTimer, Timer
from tierstore.tiers.movers import LinkClock

__all__ = ["ProfileRecorder", "RebuildTime"]

# NOTE [ Pricing the recorder first ]
# A device's profile times the ops on the device (NOTE [ Timing a profile ]
# in planning/timers.py), so it holds nothing of the recorder's Python, and
# a first plan that prices the rebuilds it replays op by op at their compute
# alone runs well over its prediction until a check charges the excess.
# The profiled step itself ran the recorder over every op: what its host
# added to the device's busy time, per save it recorded, is the first price
# of a save rebuilt op by op. It errs dear, and no check lowers it: it holds
# all the profiled step's time beyond its ops, the host's time around every
# save the step moved included. On a GPU a step that records is host-bound
# (NOTE [ Charging a slow step ] in planning/checker.py), and the first
# plans made so checkpoint natively and offload. Only where the profile was
# timed on the device; a CPU's profile times the recorder with the ops.

# NOTE [ Pricing a moved save first ]
# Likewise a moved save's host time: on a GPU the copies run on their own
# streams, timed with events, but the put and the get that start them run
# on the training thread (benchmarks/gpu_host.py times them alone), and a
# step near the host's limit pays them in full. Priced at nothing until a
# check charges them (NOTE [ Charging a slow step ] in planning/checker.py),
# first plans offload many saves and run over their predictions by less
# than a check acts on, each time. So a profile timed on the device prices
# a moved save first at the host time its own puts and gets took, the
# store's waits for the link taken out, per save it moved. It errs dear for
# a step the device binds, where that time hides behind the kernels; a
# check that finds the step faster rescales the prediction.

# NOTE [ Checkpoint's first call ]
# A planned step that checkpoints a module natively (NOTE [ Replayed modules ]
# in planning/planner.py) drives torch.utils.checkpoint's generator, whose
# first call in a process imports torch._dynamo: that call takes seconds,
# the next ones milliseconds. A step that slow is one the user sees, and one
# no check of the plan can take as a measurement. So the import comes at
# the end of a profiled step whose plan may checkpoint: a warm-up step,
# already slow, and only once.

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
    graph: bool = False  # NOTE [ Rebuilt from the graph ] in autograd/graph.py


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
    # perf_counter as its last backward ended (NOTE [ Like with like ] in planning/runner.py)
    ended: float | None = None
    task: int = -2  # the graph task of its latest backward so far (-1: a read by hand)
    timer: Timer | None = (
        None  # a profiled step's marks (NOTE [ Timing a profile ] in planning/timers.py)
    )
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
    # bytes of plan-kept saves backward has used (NOTE [ Saves that stay ] in tiers/manager.py)
    kept_used: int = 0
    leaving: int = 0  # a backward's first kept save used, counted used at the next use
    compiled_bytes: int = (
        0  # by compiled regions (NOTE [ A peak above the budget ] in planning/checker.py)
    )
    compiled_in: set[str] = field(default_factory=set)  # the modules of those saves
    waiting: bool = False  # the safe placement while the first plan is made off the thread
    largest: int = 0  # the largest save so far
    passed: set[int] = field(default_factory=set)  # the first saves of the modules gone past
    # A profiled step's saves outside the plan, per (module, why): [count, bytes];
    # and the modules where keep() stored one (NOTE [ Modules kept whole ] in autograd/regions.py).
    stays_in: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    stored_in: set[str] = field(default_factory=set)
    # A profiled step's saves' (dtype, shape), in save order (NOTE [ Plans across shapes ]
    # in planning/carry.py); a carried step's plan, and what it kept and moved so far.
    shapes: list[tuple[object, tuple[int, ...]]] = field(default_factory=list)
    carry: Carry | None = None
    carry_kept: tuple[int, int] = (0, 0)  # saves, bytes (a tensor saved again: none)
    carry_added: int = 0  # the bytes the last save kept added (kept_new)
    carry_out: int = 0  # bytes offloaded so far
    carry_offloaded: set[int] = field(default_factory=set)  # kept saves the check offloaded
    chosen: bool = False  # a save of the step took a plan's choice


class ProfileRecorder:
    """Turns a profiled step into a :class:`~tierstore.planning.planner.Profile`.

    Args:
        config: the store's configuration (its ``prefetch_bytes``: the profile's window).
        writes, reads: the link's clocks, each way.
        waits: the seconds forward and backward have waited on the store so far.
        io_cpu: the I/O threads' CPU seconds so far, if known.
        events: () -> a factory of recorded device events when a device is in use
            (:class:`~tierstore.planning.timers.BusyTimer`).
        device_links: the device link's clocks (device to host, host to device).
        page_fault_s: what a page handed back costs when used again.

    Attributes:
        recorded_rebuild_s: the price of a save rebuilt op by op the next profile
            starts at (NOTE [ Pricing the recorder first ]; a check's charge raises it).
        moved_s_per_save: the host's time around a moved save, likewise
            (NOTE [ Pricing a moved save first ]).

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.planning.recorder import ProfileRecorder
        >>> from tierstore.tiers.movers import LinkClock
        >>> recorder = ProfileRecorder(TierConfig(activation_budget=0.5), LinkClock(),
        ...                            LinkClock(), lambda: 0.25)
        >>> recorder.waits()
        0.25
    """

    def __init__(
        self,
        config: TierConfig,
        writes: LinkClock,
        reads: LinkClock,
        waits: Callable[[], float],
        io_cpu: Callable[[], float] | None = None,
        *,
        events: Callable[[], Callable[[], Any] | None] | None = None,
        device_links: tuple[LinkClock, LinkClock] | None = None,
        page_fault_s: Callable[[], float] | None = None,
    ) -> None:
        self._config = config
        self._writes = writes
        self._reads = reads
        self._waits = waits
        self._io_cpu = io_cpu  # the I/O threads' CPU seconds, where they are timed
        # () -> a factory of recorded device events when a device is in use (BusyTimer)
        self._events = events
        # The device link's clocks (device to host, host to device): timed copies.
        self._device_links = device_links
        # What a page handed back costs when used again (0.0: none is handed back).
        self._page_fault_s = page_fault_s
        self.recorded_rebuild_s = 0.0  # measured (NOTE [ Replayed modules ] in planning/planner.py)
        self.moved_s_per_save = (
            0.0  # measured on CUDA (NOTE [ Charging a slow step ] in planning/checker.py)
        )

    def waits(self) -> float:
        """The store's waits so far, seconds (NOTE [ Timing a profile ] in planning/timers.py)."""
        return self._waits()

    def begin(self, step: _Step) -> None:
        """The clocks as ``step`` begins, and a profiled step's timer."""
        if step.profiling:  # NOTE [ Timing a profile ] in planning/timers.py
            event = self._events() if self._events is not None else None
            step.timer = HostTimer(self.waits) if event is None else BusyTimer(self.waits, event)
        step.written = self._writes.snapshot()
        step.read = self._reads.snapshot()
        if self._device_links is not None:
            step.device_written = self._device_links[0].snapshot()
            step.device_read = self._device_links[1].snapshot()
        step.io_cpu = self._io_cpu() if self._io_cpu is not None else 0.0

    def profile(self, step: _Step, total: float) -> Profile | None:
        """The profile of ``step``, which took ``total`` seconds; ``None`` if it saw no backward."""
        rows = step.rows
        if not rows or step.backward_at is None or step.timer is None:
            return None
        seconds = (
            step.timer.seconds
        )  # NOTE [ Timing a profile ] in planning/timers.py: read once, here
        busy = isinstance(step.timer, BusyTimer) and step.timer.device
        forward = seconds(step.backward_at)
        backward = max(seconds(step.last_use) - forward, 1e-9)
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
        io_cpu = (self._io_cpu() if self._io_cpu is not None else 0.0) - step.io_cpu
        # A device's profile sees only forward and backward: what the step
        # does around them is left to the first check (NOTE [ Timing a profile ] in
        # planning/timers.py).
        # Taken before the I/O's share comes out of forward and backward: that
        # share is charged to the moved bytes, not left in the rest of the step.
        other = 0.0 if busy else max(0.0, total - waits - forward - backward)
        # NOTE [ Like with like ] in planning/runner.py: of it, what came after backward.
        ended = step.ended
        between = None if busy or ended is None else min(other, step.started + total - ended)
        per_byte = 0.0
        if not step.cuda and moved and io_cpu > 0:
            # A CPU's own cores did the I/O: charge it to the bytes, and take it
            # out of the compute it slowed down (NOTE [ Planned steps ] in planning/runner.py).
            per_byte = io_cpu / moved
            compute = forward + backward
            factor = max(0.5, (compute - min(io_cpu, compute)) / compute)
            saves = tuple(_scaled_save(s, factor) for s in saves)  # rebuilds ran slowed too
            forward, backward = forward * factor, backward * factor
        saved = step.fixed_bytes + sum(save.nbytes for save in saves)
        if busy and not self.recorded_rebuild_s:  # NOTE [ Pricing the recorder first ]
            host = max(0.0, total - waits - forward - backward)
            self.recorded_rebuild_s = host / len(rows)
        if busy and not self.moved_s_per_save and step.moved_saves:
            # NOTE [ Pricing a moved save first ]: per save moved, its waits taken out
            self.moved_s_per_save = step.moved_host_s / step.moved_saves
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
            recorded_rebuild_s=self.recorded_rebuild_s,
            moved_s_per_save=self.moved_s_per_save,
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
        return profile


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
