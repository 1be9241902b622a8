"""``activation_budget="auto"``: the budget a step's saves get, read off the memory each step.

:class:`Room` turns a :class:`~tierstore.tiers.memory.MemoryProbe`'s
readings into a budget in bytes at each step's start, and measures the
step's own working memory as it runs (NOTE [ The room a step has ]). The
runner asks it, and decides when a plan must follow.

Example:
    >>> from tierstore import TierConfig
    >>> from tierstore.planning.room import Room
    >>> from tierstore.tiers.memory import MemoryReading
    >>> class Fake:
    ...     def read(self): return MemoryReading(1 << 30, 256 << 20, "fake")
    ...     def usage(self): return 256 << 20
    ...     def close(self): pass
    >>> room = Room(TierConfig(activation_budget="auto", memory_margin=0), Fake())
    >>> room.step_began().budget_bytes >> 20  # the first step: half the room is its reserve
    384
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierstore.config import TierConfig, human_bytes
from tierstore.tiers.host_pool import release_free_heap
from tierstore.tiers.memory import CudaMemory, HostMemory, MemoryProbe, filesystem_type

__all__ = ["GROW", "ROOM_STEPS", "Room", "RoomBudget"]

# NOTE [ The room a step has ]
# Under activation_budget="auto" the budget is, at each step's start,
#     room = capacity - in use - margin,   budget = room - working memory,
# where capacity and in use come from the memory probe (NOTE [ Reading a
# cgroup ] in tierstore/tiers/memory.py; on CUDA the driver and the caching
# allocator), the margin is memory_margin, and the working memory is what the
# step holds beyond its saves: gradients, which appear in backward while the
# saves are still held, and an op's outputs before autograd saves them. It is
# measured, not guessed: the process's own usage is sampled where the step's
# memory is highest and the samples cost nothing to take, at the step's start
# (u0), as backward begins (every save the step keeps is resident then, and
# the tier manager takes the saves' peak there) and as backward ends (every
# gradient made, the saves released):
#     working = max(at backward's start, at backward's end) - u0
#               - the saves' peak (0 at least).
# A sampler thread would catch an op's temporaries too, but costs a core's
# slice on every step and holds the interpreter lock; two reads a step do
# not, and the margin holds what falls between them. Usage is the resident
# set on a CPU (what the OOM killer counts; a heap the allocator keeps after
# free is counted, as the kernel does) and allocated bytes on CUDA: the
# reserved bytes that must fit exceed them by the allocator's fragmentation,
# which the margin holds too. Reserved bytes themselves would not do: the
# caching allocator keeps what an earlier, larger step reserved, so a plan
# that keeps less would look as if its working memory had grown, and the
# budget would shrink step after step. On a CPU the same holds of glibc's
# heap, which keeps the pages of what the last step freed resident: so the
# heap's free pages go back to the system (NOTE [ Handing the heap back ] in
# tierstore/tiers/host_pool.py) before the step's start is read. Backward's
# end is read before any hand-back: the heap keeps what backward freed until
# then, so the pages of the saves it released are still resident beside the
# gradients, and that is the step's high-water mark. The saves' peak is taken
# out of both samples: what is left is what the step needs beyond its saves.
# The first step has no measure: it runs the safe placement with a reserve
# held back for its working memory, the larger of half the room and the
# process's own usage at its start. The usage holds the parameters, so it
# holds room for gradients as large as them, appearing while the saves are
# held; half the room holds an op's temporaries and activations that
# autograd does not save. An optimizer's state appears after backward, when
# the saves are released, and is in use at the next step's start, which
# measures it; from that step on the measured working memory replaces the
# reserve. The budget and the working memory are each the lowest room and
# the largest measure of the last ROOM_STEPS steps: a room that jitters
# from step to step plans for its low point and does not remake plans.
# The plan follows the room (PlanRunner._follow_room in planning/runner.py):
#   * when this step's room falls by more than half the margin below what
#     the plan in use needs (its predicted peak plus the working memory), at
#     once: the steps run the safe placement within the new budget, which it
#     holds, while the plan is remade off the training thread;
#   * when the budget grows by GROW or more over the plan's, lazily: the plan
#     in use runs until the remade one is ready. A plan that keeps everything
#     has nothing to gain.
# Half the margin is the band a room may move in without a remake: a plan
# made at the room's lowest still has half the margin left when it is
# remade.

#: The steps whose lowest room and largest working memory the budget takes.
ROOM_STEPS = 4
#: A budget this much above the plan's remakes it, lazily.
GROW = 1.25


@dataclass(frozen=True)
class RoomBudget:
    """One step's budget under ``activation_budget="auto"``, and its parts.

    Attributes:
        budget_bytes: the budget: ``capacity - in_use - margin - working``,
            at the lowest of the last steps' rooms.
        capacity: the memory's capacity, bytes (this rank's share).
        in_use: in use at the step's start, bytes.
        margin: memory_margin, bytes.
        working: the step's working memory beyond its saves (measured), or
            the first step's reserve (``measured`` False).
        measured: whether ``working`` was measured.
        share: ranks sharing the capacity.
        source: where the capacity came from.
        now_bytes: the budget on this step's room alone (not the lowest).

    Example:
        >>> from tierstore.planning.room import RoomBudget
        >>> b = RoomBudget(3 << 30, 8 << 30, 2 << 30, 1 << 30, 2 << 30, True, 1, "fake", 3 << 30)
        >>> str(b)
        'auto 3.0 GiB = capacity 8.0 GiB (fake) - in use 2.0 GiB - working 2.0 GiB - margin 1.0 GiB'
    """

    budget_bytes: int
    capacity: int
    in_use: int
    margin: int
    working: int
    measured: bool
    share: int
    source: str
    now_bytes: int

    def __str__(self) -> str:
        working = "working" if self.measured else "first-step reserve"
        share = f", 1/{self.share} of the machine's" if self.share > 1 else ""
        return (
            f"auto {human_bytes(self.budget_bytes)} = capacity {human_bytes(self.capacity)} "
            f"({self.source}{share}) - in use {human_bytes(self.in_use)} - {working} "
            f"{human_bytes(self.working)} - margin {human_bytes(self.margin)}"
        )


class Room:
    """The room each step's saves have under ``activation_budget="auto"``.

    NOTE [ The room a step has ].

    Args:
        config: the store's configuration (``memory_margin``, and what the
            warnings check: ``disk_path``, ``host_budget``).
        probe: what the memory is read through; ``None``: chosen at the first
            step, :class:`~tierstore.tiers.memory.CudaMemory` where CUDA is
            initialised, else :class:`~tierstore.tiers.memory.HostMemory`.
            Tests set their own (``room.probe = ...``).

    Example:
        >>> from tierstore import TierConfig
        >>> from tierstore.planning.room import Room
        >>> room = Room(TierConfig(activation_budget="auto"))
        >>> room.step_began().budget_bytes > 0
        True
        >>> room.close()
    """

    def __init__(self, config: TierConfig, probe: MemoryProbe | None = None) -> None:
        self._config = config
        self.probe = probe
        #: Hands the heap's free pages back before a CPU reading (NOTE [ The room a step has ]).
        self.trim: Callable[[], object] | None = release_free_heap
        self.warnings: list[str] = []  # for the runner's caller, each once
        self._rooms: deque[int] = deque(maxlen=ROOM_STEPS)
        self._working: deque[int] = deque(maxlen=ROOM_STEPS)
        self._started = 0  # usage at the step's start
        self._backward: int | None = None  # usage as backward began
        self._ended: int | None = None  # usage as backward ended
        self.last: RoomBudget | None = None
        self._warned = False

    def _probe(self) -> MemoryProbe:
        probe = self.probe
        if probe is None:
            if torch.cuda.is_initialized():  # never initialises CUDA itself
                probe = CudaMemory(torch.cuda.current_device())
            else:
                probe = HostMemory()
            self.probe = probe
        return probe

    def step_began(self) -> RoomBudget:
        """Read the memory as a step begins: its budget (NOTE [ The room a step has ])."""
        probe = self._probe()
        if self.trim is not None and isinstance(probe, HostMemory):
            self.trim()
        reading = probe.read()
        self._started = probe.usage()
        self._backward = self._ended = None
        margin = self.margin_bytes(reading.capacity)
        room = reading.capacity - reading.in_use - margin
        self._rooms.append(room)
        low = min(self._rooms)
        if self._working:
            working, measured = max(self._working), True
        else:  # the first step's reserve
            working, measured = max(self._started, max(low, 0) // 2), False
        budget = RoomBudget(
            budget_bytes=max(0, low - working),
            capacity=reading.capacity,
            in_use=reading.in_use,
            margin=margin,
            working=working,
            measured=measured,
            share=reading.share,
            source=reading.source,
            now_bytes=max(0, room - working),
        )
        if not self._warned:
            self._warned = True
            self._warn(probe)
        self.last = budget
        return budget

    def margin_bytes(self, capacity: int) -> int:
        """memory_margin in bytes: a size as it is, a fraction of ``capacity``."""
        margin = self._config.memory_margin
        return int(margin * capacity) if isinstance(margin, float) else int(margin)

    def backward_began(self) -> None:
        """Sample the usage as the step's backward begins (its first in the step)."""
        if self._backward is None and self.probe is not None:
            self._backward = self.probe.usage()

    def backward_ended(self) -> None:
        """Sample the usage as a backward of the step ends (the last one counts)."""
        if self.probe is not None:
            self._ended = self.probe.usage()

    def step_ended(self, saves_peak: int) -> None:
        """The step ended with ``saves_peak`` saved bytes resident at most: its working memory.

        NOTE [ The room a step has ]: the higher of backward's two samples
        above the step's start, less the saves' peak.

        A step with no backward measures nothing.
        """
        began, ended = self._backward, self._ended
        if began is None or ended is None:
            return
        start = self._started
        self._working.append(max(max(began, ended) - start - saves_peak, 0))

    def _warn(self, probe: MemoryProbe) -> None:
        """Settings that cannot fit the memory "auto" reads, said once."""
        config = self._config
        if isinstance(probe, HostMemory) and int(config.disk_budget) > 0:
            kind = filesystem_type(config.disk_path)
            if kind in ("tmpfs", "ramfs"):
                self.warnings.append(
                    f"tierstore: disk_path={str(config.disk_path)!r} is on {kind}, which is "
                    "RAM: under activation_budget='auto' the bytes offloaded there take the "
                    "same memory the budget is measured in. Point disk_path "
                    "(TIERSTORE_DISK_PATH) at a disk"
                )
        if isinstance(probe, CudaMemory) and int(config.host_budget) > 0:
            level = HostMemory().tightest()
            if level is not None and int(config.host_budget) > level.limit - level.usage:
                self.warnings.append(
                    f"tierstore: host_budget={human_bytes(int(config.host_budget))} of pinned "
                    f"host memory does not fit the room left under the cgroup limit "
                    f"({human_bytes(level.limit)} at {level.path}, "
                    f"{human_bytes(level.limit - level.usage)} free); lower host_budget "
                    "(TIERSTORE_HOST_BUDGET)"
                )

    def close(self) -> None:
        """Release the probe. Idempotent."""
        probe, self.probe = self.probe, None
        if probe is not None:
            probe.close()
