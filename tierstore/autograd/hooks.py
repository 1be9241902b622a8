"""The saved-tensor hooks of one store: the filter, one decision, one call to carry it out.

:class:`SaveHooks` holds the pack and unpack hooks a :class:`~tierstore.TierStore`
pushes in each offload() block. A save that stays never leaves this module and
the filters; one that is stored goes down to the tier manager once and comes
back with a handle; one that is rebuilt becomes a recipe.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.autograd.hooks import SaveHooks
    >>> from tierstore.tiers.manager import TierManager
    >>> manager = TierManager(TierConfig(device_budget=0, disk_budget=0, min_offload_bytes=0))
    >>> hooks = SaveHooks(manager, None, min_bytes=0)
    >>> x = torch.ones(256, requires_grad=True)
    >>> with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
    ...     y = x.exp()
    >>> y.sum().backward()
    >>> hooks.unpacks, bool(torch.equal(x.grad, x.detach().exp()))
    (1, True)
    >>> manager.close()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tierstore.autograd.blocks import active_recorder
from tierstore.autograd.filters import (
    Kept,
    held,
    kept_as_is,
    offload_nbytes,
    placeholders,
    sized,
    unusual,
)
from tierstore.autograd.graph import graph_op, graph_recipe
from tierstore.autograd.names import module_name
from tierstore.autograd.recipes import Recipe, shared_fetch
from tierstore.autograd.recompute import never_traced
from tierstore.autograd.recorder import Recorder
from tierstore.autograd.regions import BeginKept, BeginReplay, KeptUsed
from tierstore.autograd.state import ENGINE, graph_task, local, unrecorded
from tierstore.errors import modified_in_place, out_of_memory
from tierstore.planning.planner import Choice, Plan
from tierstore.planning.runner import PlanRunner
from tierstore.stats import Placement, Tier
from tierstore.tiers.handle import Handle
from tierstore.tiers.manager import TierManager

__all__ = ["SaveHooks"]

_R = TypeVar("_R")


def _moving(runner: Any, out: bool, fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)``: a profiled step moving a save out (``out``) or back, its host time told.

    NOTE [ Pricing a moved save first ] in planning/recorder.py: the store's waits for
    the link are taken out.
    """
    began, waited = time.perf_counter(), runner.waits()
    try:
        return fn(*args)
    finally:
        runner.moved(time.perf_counter() - began - (runner.waits() - waited), out)


# NOTE [ Planned saves ]
# With activation_budget set, the pack hook asks the store's plan runner
# what to do with each save it would offload (NOTE [ Planned steps ]
# in planning/runner.py): keep it in the device tier, offload it (the host tier, the
# disk below it), or hand autograd a recipe that rebuilds it. The recorder
# then records every op it may (recompute.everything): the plan, not a list
# of cheap ops, picks what is rebuilt, and chains may run MAX_PLANNED_DEPTH
# ops deep (a block rebuilt from its input is checkpointing). In a profiled
# step the recorder also times each op, and the stack names the module of
# each save (the outermost numbered one: a transformer block; NOTE [ Naming
# modules ]); the pack hook writes down each save, the unpack hook each first
# use. The naming and the timing run in that step only.


#: Where a planned choice sends a save (None: the safe placement).
_PLACED: dict[Choice | None, Tier | None] = {"keep": "device", "offload": "host", None: None}


# NOTE [ One decision, one call ]
# The pack hook reads top to bottom as: the filter every save pays
# (sized, then unusual for one that may move), one decision (keep()'s
# tier, else the plan's choice, else device_budget's room), and one call
# that carries it out, returning one kind of packed object per decision:
#   * keep    -> the tensor detached with its version: a plain tuple, built
#                in C, or a Kept where a recorder notes it or a plan's peak
#                counts it until its first use (kept_as_is);
#   * store   -> a Handle from the tier manager (_store, _planned);
#   * rebuild -> a Recipe (_planned, or _store under recompute="cheap").
# A save that stays touches this hook and its decision only (NOTE [ Saves
# that stay ] in tiers/manager.py); one that moves goes down to the tier
# manager once and comes back with its handle. Unpack takes the short way
# for a kept save and asks the manager (or the recipe) otherwise.


class SaveHooks:
    """The pack and unpack hooks of one store, and what they tell its plan.

    Args:
        manager: the tier manager that stores what moves.
        runner: the plan's runner under ``activation_budget``, else ``None``.
        min_bytes: ``min_offload_bytes``: smaller saves stay.

    Example:
        >>> import torch
        >>> from tierstore import TierConfig
        >>> from tierstore.tiers.manager import TierManager
        >>> manager = TierManager(TierConfig(min_offload_bytes=0))
        >>> hooks = SaveHooks(manager, None, min_bytes=1 << 20)
        >>> packed = hooks.pack(torch.ones(4))     # under min_offload_bytes: kept as it is
        >>> type(packed).__name__, hooks.unpack(packed).tolist()
        ('tuple', [1.0, 1.0, 1.0, 1.0])
        >>> manager.close()
    """

    def __init__(self, manager: TierManager, runner: PlanRunner | None, min_bytes: int) -> None:
        self._manager = manager
        self._runner = runner
        self._min_bytes = min_bytes
        #: Unpack calls so far: a backward ran since a count was read (NOTE [ Step log ]).
        self.unpacks = 0
        #: What an out-of-memory error raised in a fetch asked for, till the step ends
        #: (NOTE [ A step that raised ] in tierstore/tier_store.py); the error itself
        #: is not kept: its frames hold the graph.
        self.short_of: int | None = None

    def regions_hooks(self) -> tuple[BeginReplay, BeginKept, KeptUsed]:
        """What a plan's regions tell this store (NOTE [ Modules kept whole ])."""
        return self.begin_replay, self.begin_kept, self.kept_used

    def begin_replay(self, plan: Plan, first: int, end: int, tensor: torch.Tensor | None) -> bool:
        """A module of ``plan`` checkpointed here, if the step is at its saves; they count rebuilt.

        NOTE [ Replayed modules ] in planning/planner.py.
        """
        runner = self._runner
        passes = "no" if runner is None else runner.passes(plan, first, end)
        if passes != "past":
            return passes == "again"
        device = tensor.device if tensor is not None else None
        rebuilt = plan.profile.saves[first + 1 : end]
        self._manager.count_recomputed(sum(save.nbytes for save in rebuilt), device, len(rebuilt))
        return True

    def begin_kept(
        self, plan: Plan, first: int, end: int, stays: tuple[tuple[str, int, int], ...]
    ) -> bool:
        """Go past a module ``plan`` keeps whole, if the step is at its saves; count them.

        NOTE [ Modules kept whole ]: the plan's by where the step is, ``stays``
        (the saves outside the plan) as the profile saw them.
        """
        runner = self._runner
        passes = "no" if runner is None else runner.passes(plan, first, end)
        if passes != "past":
            return passes == "again"
        for why, n, nbytes in stays:
            self._manager.count_kept(nbytes, why, n)  # type: ignore[arg-type]
        return True

    def backward_began(self, ended: Callable[[], None]) -> None:
        """A backward of a timed step used its first save: the peak, and ``ended()`` as it ends.

        NOTE [ Like with like ] in planning/runner.py: autograd's engine calls ``ended``
        as this backward ends. An unpack outside a backward (a saved tensor
        read off its node by hand) has no end to time.
        """
        # NOTE [ Reads from backward's start ] in tiers/manager.py: only in a backward
        # (not a saved tensor read by hand), its copies tierstore's own ops,
        # and a profiled step's host time for them a moved save's (NOTE
        # [ Pricing a moved save first ] in planning/recorder.py).
        reads = graph_task() != -1
        runner = self._runner
        if runner is not None and runner.profiling:
            _moving(runner, False, unrecorded, self._manager.backward_began, reads)
        else:
            unrecorded(self._manager.backward_began, reads)
        with contextlib.suppress(RuntimeError):  # "only during backward pass"
            ENGINE.queue_callback(ended)

    def kept_used(self, nbytes: int) -> None:
        """Backward reached a module kept whole (NOTE [ Modules kept whole ])."""
        self.unpacks += 1  # NOTE [ Step log ]: a backward ran
        runner = self._runner
        if runner is not None and (ended := runner.used(-1, nbytes, graph_task())):
            self.backward_began(ended)

    def stays(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays on the device if saved: a recipe may hold it as it is."""
        return isinstance(offload_nbytes(t, self._min_bytes), str)

    # NOTE [ Hooks and Dynamo ] in autograd/recompute.py.
    @never_traced
    def pack(self, t: torch.Tensor) -> Handle | Kept | tuple[torch.Tensor, int] | Recipe:
        """The pack hook: what autograd keeps for ``t`` (NOTE [ One decision, one call ])."""
        tier = local.tier
        if tier is None:
            nbytes = sized(t, self._min_bytes)
            if type(nbytes) is int:
                runner = self._runner
                if runner is None:
                    if self._manager.stays(nbytes):
                        return kept_as_is(t)
                    nbytes = unusual(t) or nbytes
                    if type(nbytes) is int:
                        return self._store(t, nbytes, None)
                else:
                    nbytes = unusual(t) or nbytes
                    if type(nbytes) is int:
                        # Its signature beside its bytes: NOTE [ Plans across shapes ]
                        choice = runner.choose(nbytes, t.dtype, t.shape)
                        if choice == "keep":  # counted by the runner, not here
                            return kept_as_is(t, runner.kept_new())
                        return self._planned(t, nbytes, choice)
        else:
            if tier == "as is":  # a replayed module's inputs: NOTE [ Replayed modules ]
                return kept_as_is(t, t.numel() * t.element_size())
            nbytes = "keep" if tier == "device" else offload_nbytes(t, self._min_bytes)
            if type(nbytes) is int:
                runner = self._runner
                if runner is not None and runner.profiling:  # NOTE [ Modules kept whole ]
                    runner.beside(module_name()[:2], "stored", nbytes)
                return self._store(t, nbytes, tier)
        return self._keep_filtered(t, nbytes)  # type: ignore[arg-type]

    def _keep_filtered(self, t: torch.Tensor, why: Placement) -> Kept | tuple[torch.Tensor, int]:
        """Keep a save the filters or keep() leave on the device, counted under ``why``."""
        if why == "layout" and isinstance(t, placeholders()):
            # make_fx, FakeTensorMode: no data, and a size that may be
            # symbolic: nothing to count. Not detached: torch 2.11 refuses
            # a FunctionalTensor op here.
            return Kept(t, t._version)
        size = t.numel() * t.element_size()
        self._manager.count_kept(size, why)
        runner = self._runner
        if runner is not None:
            if why in ("keep", "min_offload_bytes"):
                runner.kept_fixed(size)  # activations it keeps
            if runner.profiling:  # NOTE [ Modules kept whole ]
                runner.beside(module_name()[:2], why, size)
        return kept_as_is(t)

    def _store(self, t: torch.Tensor, nbytes: int, tier: Tier | None) -> Handle | Recipe:
        """The full path: an entry in the tier manager, or a recipe (NOTE [ Recompute ])."""
        recorder = active_recorder()
        if recorder is None:
            if tier is None:  # the common case; also what wrappers of put() in tests expect
                return self._manager.put(t, nbytes)
            return self._manager.put(t, nbytes, tier)
        packed: Handle | Recipe | None = None
        if tier is None:  # keep(tier="host" or "disk") asks for storage
            packed = recorder.recipe_for(t, nbytes)
            if packed is not None:
                self._manager.count_recomputed(nbytes, t.device)
        if packed is None:
            packed = unrecorded(self._manager.put, t, nbytes, tier)
            recorder.note_packed(t, packed, self._manager.get)
        else:
            recorder.note_packed(t, packed, None)
        return packed

    def _planned(self, t: torch.Tensor, nbytes: int, choice: Choice | None) -> Handle | Recipe:
        """NOTE [ Planned saves ]: one the plan does not keep (``None``: the safe placement)."""
        runner = self._runner
        assert runner is not None
        recorder = active_recorder()
        if choice == "rebuild":
            recipe = recorder.recipe_for(t, nbytes) if recorder is not None else None
            if recipe is None:  # not recorded: NOTE [ Rebuilt from the graph ]
                recipe = graph_recipe(t, nbytes, held, self._manager.get)
            if recipe is not None:
                if recorder is not None:
                    recorder.note_packed(t, recipe, None)
                self._manager.count_recomputed(nbytes, t.device)
                return recipe
            choice = "offload"  # not rebuildable this time: its bytes still leave
        handle: Handle
        if runner.profiling and t.is_cuda:
            handle = _moving(
                runner, True, unrecorded, self._manager.put, t, nbytes, _PLACED[choice]
            )
        else:
            handle = unrecorded(self._manager.put, t, nbytes, _PLACED[choice])
        if recorder is not None:
            recorder.note_packed(t, handle, self._manager.get)
        if runner.profiling:
            self._profiled(runner, recorder, t, handle, nbytes)
        return handle

    @staticmethod
    def _profiled(
        runner: PlanRunner, recorder: Recorder | None, t: torch.Tensor, handle: Handle, nbytes: int
    ) -> None:
        """A profiled step wrote ``t`` down as stored: its op, module and inputs."""
        op, cost, inputs, made_in = (
            recorder.describe(t) if recorder is not None else ("", None, [], ())
        )
        module, root, compiled = module_name()
        runner.saved(
            handle.key,
            nbytes=nbytes,
            op=op,
            module=module,
            root=root,
            compiled=compiled,
            rebuild_s=cost,
            input_keys=tuple(p.key for p in inputs if type(p) is Handle),
            cuda=t.is_cuda,
            made_in=made_in,
            graph=graph_op(t, held) is not None,
        )

    @never_traced
    def unpack(self, packed: Handle | Kept | tuple[torch.Tensor, int] | Recipe) -> torch.Tensor:
        """The unpack hook: the tensor ``packed`` stands for, checked for in-place changes."""
        self.unpacks += 1  # NOTE [ Step log ]; a lost update under threads only delays a line
        if isinstance(packed, tuple):  # no recorder, no plan's peak: NOTE [ Saves that stay ]
            t, version = packed
            if t._version != version:
                raise modified_in_place(tuple(t.shape), t.dtype, t._version, version)
            return t
        runner = self._runner
        if isinstance(packed, Kept):  # the short way (NOTE [ Saves that stay ] in tiers/manager.py)
            if runner is not None:  # a plan-kept save leaves the peak at its first use
                if ended := runner.used(-1, packed.planned, graph_task()):
                    self.backward_began(ended)
                packed.planned = 0
            t = packed.tensor
            if t._version != packed.version:
                raise modified_in_place(tuple(t.shape), t.dtype, t._version, packed.version)
            return t
        if runner is not None and (
            ended := runner.used(packed.key if type(packed) is Handle else -1, 0, graph_task())
        ):
            self.backward_began(ended)
        cuda = type(packed) is Handle and packed.device.type == "cuda"
        try:
            if cuda and runner is not None and runner.profiling:
                # NOTE [ Pricing a moved save first ] in planning/recorder.py
                return _moving(runner, False, self.fetch, packed)
            return self.fetch(packed)
        except BaseException as error:  # NOTE [ A step that raised ] in tierstore/tier_store.py
            asked = out_of_memory(error)
            if asked is not None:
                self.short_of = max(self.short_of or 0, asked)
            raise

    def fetch(self, packed: Handle | Recipe) -> torch.Tensor:
        """The tensor a stored or rebuilt save stands for (a kept one is unpack's short way)."""
        if type(packed) is Recipe:
            return packed.rebuild(self._manager.empty)
        assert isinstance(packed, Handle)
        # Read once for this unpack and the recipes that take it as an input.
        shared = shared_fetch(packed)
        return shared if shared is not None else unrecorded(self._manager.get, packed)
