"""A plan's regions: the modules it rebuilds in, checkpoints whole, or keeps whole.

Example:
    >>> from tierstore.autograd.recompute import everything
    >>> from tierstore.autograd.regions import Regions
    >>> regions = Regions(everything, lambda t: False, lambda t: t)
    >>> regions.whole, regions.keeps   # before a plan: no module kept or checkpointed whole
    (False, False)
    >>> regions.remove()
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tierstore.autograd import state
from tierstore.autograd.blocks import tracing
from tierstore.autograd.recompute import Policy, never_traced
from tierstore.autograd.recorder import Recorder
from tierstore.autograd.state import local
from tierstore.planning.planner import Plan, from_graph, kept_whole, replayed

# NOTE [ Recording where a plan rebuilds ]
# A recipe needs the op that made its tensor, recorded as forward ran, and
# recording is a TorchDispatchMode: Python on every aten op, some 15 us each.
# A plan rebuilds saves of a few modules, so a planned step records only
# inside the modules whose forward ran the ops its rebuilds replay (the
# profiled step notes, per op, the module that ran it): forward pre- and
# post-hooks on those modules (module hooks, not global ones) push the
# block's recorder as the module's forward begins and pop it as it ends.
# What autograd packs is noted with that recorder everywhere in the block (a
# dict entry, no dispatch), since a save is often packed by the module after
# the one whose op made it. The modules are those the profiled step named
# (NOTE [ Naming modules ]). A plan that rebuilds what ran in no module
# the profile named (an op outside every module, a module gone since) records
# the whole block; one that rebuilds nothing records nothing. A
# save whose recipe cannot be made after all is offloaded instead, as any
# save that turns out not rebuildable.


#: Begin a module's native replay in the step under way: (plan, first save, end, its
#: first tensor input) -> whether the step is at the module's saves (NOTE [ Replayed modules ]).
BeginReplay = Callable[[Plan, int, int, torch.Tensor | None], bool]
#: Go past a module the plan keeps whole: (plan, first save, end, its saves outside the
#: plan as (why, count, bytes)) -> whether the step is at the module's saves, counted
#: kept if so (NOTE [ Modules kept whole ]).
BeginKept = Callable[[Plan, int, int, tuple[tuple[str, int, int], ...]], bool]
#: Backward reached a module kept whole: the bytes it kept (NOTE [ Modules kept whole ]).
KeptUsed = Callable[[int], None]

# NOTE [ Modules kept whole ]
# A save the plan keeps costs a trip through the pack hook and the unpack
# hook: Python, some microseconds each, which on a GPU bound by the CPU that
# launches its kernels is step time. Where a plan keeps every save of a module (kept_whole() in
# planning/planner.py: the profile's spans, a transformer block; or the outermost
# module, the model, under a plan that keeps everything it saves), its saves
# need no hook at all: autograd holds them as it does without tierstore. So a
# forward pre-hook on that module takes the store's hooks off this thread's
# stack of saved-tensor hooks, and a forward hook puts them back (first
# among the module's forward hooks, and also when forward raised): inside,
# no Python runs per save or per use. The version check, retain_graph,
# double backward and threads (the stack is per thread) are autograd's own.
# What the hooks would have done is done once per module instead:
#   * the step goes past the module's saves at once (PlanRunner.passes),
#     the way a native replay does, so the plan's kept saves are counted by
#     where the step is, as ever (NOTE [ Saves that stay ] in tiers/manager.py);
#   * the saves outside the plan (parameters, small ones), which the
#     profiled step wrote down per module (Profile.stays_in), are counted
#     as they were then, so stats() adds up as with the hooks;
#   * backward reaching the module (a pre-hook on its output's node) counts
#     its bytes used (the plan's peak) and a backward run (NOTE [ Step log ]).
#     Registering one costs a module some 8 us, and more in backward; a plan
#     that moves nothing reads nothing back, so its peak is all it kept, and
#     there only the first module kept whole is watched, to see a backward run.
# Only where nothing else needs the hooks: the store's hooks on top of the
# stack (not an inner offload(), checkpoint or a user's hooks) and nothing
# beneath them (an outer checkpoint's or user's hooks would take the saves
# the store's had hidden from them), no keep()
# region open (its tier is the hook's to carry out, and a module where the
# profile saw keep() store a save is never kept whole), no recorder noting
# saves for op-by-op rebuilds, no tracing, and a torch that can read the
# stack (torch.autograd's _top_saved_tensors_default_hooks, 2.8 and later).
# A module whose saves come out otherwise than profiled (a data-dependent
# branch inside it) is not seen doing so: all its saves stay on the device
# as autograd holds them, so gradients are exact; only the counts and the
# peak are the profile's.


#: How many ops a planned rebuild may replay in one chain.
MAX_PLANNED_DEPTH = 64


class Regions:
    """Hooks on the modules a plan rebuilds in: the recorder runs inside them only.

    The modules it rebuilds whole are checkpointed instead (NOTE [ Replayed
    modules ] in planning/planner.py).
    """

    def __init__(
        self,
        policy: Policy,
        stays: Callable[[torch.Tensor], bool],
        pack: Callable[[torch.Tensor], Any],
    ) -> None:
        self._policy = policy
        self._stays = stays
        self._pack = pack  # the store's pack hook: whether its hooks top the stack
        self.plan: Plan | None = None
        self._handles: list[Any] = []
        self._pushed = threading.local()
        self.whole = False  # the plan rebuilds where no hook can reach: record everything
        self.records = True  # some rebuild is replayed op by op: the recorder runs
        self.keeps = False  # some module is kept whole (NOTE [ Modules kept whole ])
        self._begin: BeginReplay | None = None
        self._begin_kept: BeginKept | None = None
        self._kept_used: KeptUsed | None = None

    def follow(
        self,
        plan: Plan,
        modules: dict[str, weakref.ref[torch.nn.Module]],
        begin: BeginReplay,
        begin_kept: BeginKept,
        kept_used: KeptUsed,
    ) -> None:
        """Hook the modules ``plan`` rebuilds in and keeps whole (once per plan)."""
        if plan is self.plan:
            return
        self.remove()
        self.plan = plan
        self._begin, self._begin_kept, self._kept_used = begin, begin_kept, kept_used
        spans = []
        for name, first, end in replayed(plan.profile, plan.choices) if _can_replay() else ():
            module = modules[name]() if name in modules else None
            if module is not None and getattr(module, "_compiled_call_impl", None) is None:
                spans.append((module, first, end))
        native = {j for _, first, end in spans for j in range(first + 1, end)}
        native |= from_graph(plan.profile, plan.choices)  # NOTE [ Rebuilt from the graph ]
        names = {
            module
            for i, (save, choice) in enumerate(zip(plan.profile.saves, plan.choices, strict=True))
            if choice == "rebuild" and i not in native
            for module in (save.made_in or (save.module,))
        }
        found = [modules[n]() if n in modules else None for n in sorted(names)]
        self.whole = any(m is None for m in found)
        self.records = bool(names)
        self.keeps = False
        if self.whole:
            return
        if not self.records and state.TOP_HOOKS is not None:  # NOTE [ Modules kept whole ]
            profile = plan.profile
            # A plan that moves nothing reads nothing back in backward: the
            # peak is all it kept, and one module's backward says a backward ran.
            moves = not plan.keeps_everything
            watched = False
            for name, first, end in kept_whole(profile, plan.choices):
                module = modules[name]() if name in modules else None
                if module is None or getattr(module, "_compiled_call_impl", None) is not None:
                    continue
                nbytes: int | None = None
                if moves or not watched:
                    nbytes = sum(s.nbytes for s in profile.saves[first:end]) if moves else 0
                    watched = True
                stays = tuple((why, n, b) for m, why, n, b in profile.stays_in if m == name)
                self._handles += [
                    module.register_forward_pre_hook(
                        functools.partial(self._keep, (plan, first, end, stays))
                    ),
                    module.register_forward_hook(
                        functools.partial(self._kept, nbytes), always_call=True, prepend=True
                    ),
                ]
                self.keeps = True
        for module, first, end in spans:
            self._handles += [
                module.register_forward_pre_hook(
                    functools.partial(self._replay, first, end), with_kwargs=True
                ),
                # Before any other: offload_module's hook closes the block around it.
                module.register_forward_hook(self._replayed, always_call=True, prepend=True),
            ]
        for module in found:
            assert module is not None
            self._handles += [
                module.register_forward_pre_hook(self._enter),
                module.register_forward_hook(self._leave, always_call=True),
            ]

    @never_traced
    def _replay(
        self, first: int, end: int, module: torch.nn.Module, args: Any, kwargs: Any = None
    ) -> None:
        # No kwargs: a hook of the last plan, taken off as offload_module's
        # pre-hook of this same call followed a new one (torch then calls it as
        # one without kwargs).
        if kwargs is None or local.regions is not self or local.replaying or tracing():
            return  # or not this store's planned block, or the replay itself in backward
        plan, begin = self.plan, self._begin
        if plan is None or begin is None:
            return
        checkpointing = _checkpointing(module, args, kwargs, self._replaying)
        # Checkpoint saves the module's inputs (and, on some torch, a dummy)
        # through the hooks outside it: kept as they are, counted by the plan,
        # which kept the module's first save, its input.
        outer, local.tier = local.tier, "as is"
        try:
            next(checkpointing)
        finally:
            local.tier = outer
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not begin(plan, first, end, tensor):
            checkpointing.close()  # type: ignore[attr-defined]
            return
        self._replays().append((module, checkpointing))

    @never_traced
    def _replayed(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        replays = self._replays()
        if replays and replays[-1][0] is module:
            next(replays.pop()[1], None)

    @never_traced
    def _keep(
        self,
        span: tuple[Plan, int, int, tuple[tuple[str, int, int], ...]],
        module: torch.nn.Module,
        args: Any,
    ) -> None:
        """A module kept whole begins: the store's hooks off (NOTE [ Modules kept whole ]).

        ``span``: the plan that keeps it, its saves ``[first, end)``, and the
        saves outside the plan in it.
        """
        planned, first, end, stays = span
        if (
            local.regions is not self
            or local.tier is not None
            or local.replaying
            or local.recorder is not None
            or tracing()
        ):
            return  # or not this store's planned block, or keep() or a recorder wants the hooks
        plan, begin = self.plan, self._begin_kept
        if plan is not planned or begin is None:
            # A hook of the last plan, taken off as offload_module's pre-hook
            # of this same call followed a new one: torch still calls it.
            return
        autograd = torch._C._autograd
        top = state.TOP_HOOKS(False)  # type: ignore[misc]
        if top is None or top[0] != self._pack:
            return  # another's hooks on top: theirs to run
        if not state.HOOKS_ENABLED():
            return  # no hook may be pushed back
        autograd._pop_saved_tensors_default_hooks()
        # Hooks beneath the store's (a checkpoint or a user's around the
        # block) would take the module's saves: the store's stay on top.
        if state.TOP_HOOKS(False) is not None or not begin(plan, first, end, stays):  # type: ignore[misc]
            autograd._push_saved_tensors_default_hooks(*top)
            return
        self._kept_stack().append((module, top))

    @never_traced
    def _kept(self, nbytes: int | None, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A module kept whole ended: the store's hooks back, and its backward watched for.

        ``nbytes``: what backward reaching it counts used; ``None``: not watched.
        """
        stack = self._kept_stack()
        if not stack or stack[-1][0] is not module:
            return  # _keep took nothing off for this call
        torch._C._autograd._push_saved_tensors_default_hooks(*stack.pop()[1])
        used = self._kept_used
        if nbytes is None or used is None:
            return
        node = _node_of(output)
        if node is not None:
            node.register_prehook(functools.partial(_reached, used, [nbytes]))

    def restore(self) -> None:
        """Put back this thread's hooks a module kept whole took off (a block closing inside it)."""
        stack = self._kept_stack()
        while stack:
            torch._C._autograd._push_saved_tensors_default_hooks(*stack.pop()[1])

    def _kept_stack(self) -> list[tuple[torch.nn.Module, tuple[Any, Any]]]:
        stack: list[tuple[torch.nn.Module, tuple[Any, Any]]] | None = getattr(
            self._pushed, "kept", None
        )
        if stack is None:
            stack = self._pushed.kept = []
        return stack

    def _replays(self) -> list[tuple[torch.nn.Module, Iterator[None]]]:
        replays: list[tuple[torch.nn.Module, Iterator[None]]] | None = getattr(
            self._pushed, "replays", None
        )
        if replays is None:
            replays = self._pushed.replays = []
        return replays

    @staticmethod
    @contextlib.contextmanager
    def _replaying() -> Iterator[None]:
        """Around backward's replay of a checkpointed module: this layer's hooks stand aside.

        offload_module's would push the store's hooks over checkpoint's.
        """
        outer = local.replaying
        local.replaying = True
        try:
            yield
        finally:
            local.replaying = outer

    def remove(self) -> None:
        """Take the hooks off. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.plan = None

    def _stack(self) -> list[tuple[torch.nn.Module, Recorder | None, bool]]:
        stack: list[tuple[torch.nn.Module, Recorder | None, bool]] | None = getattr(
            self._pushed, "stack", None
        )
        if stack is None:
            stack = self._pushed.stack = []
        return stack

    def recorder(self) -> Recorder:
        """A new recorder for a planned block: what it notes lasts the block, across regions."""
        return Recorder(self._policy, self._stays, max_depth=MAX_PLANNED_DEPTH)

    @never_traced
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        recorder = local.region_recorder
        if local.regions is not self or recorder is None or tracing():
            return  # this store's planned block is not open in this thread
        pushed = None
        if local.recorder is None:  # not inside another region (nested modules)
            recorder.__enter__()  # type: ignore[no-untyped-call]
            local.recorder = pushed = recorder
        self._stack().append((module, pushed, local.recompute))
        local.recompute = True

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Not "is this store's block open": a block may close first, as
        # offload_module's own forward hook on the same module does.
        stack = self._stack()
        if not stack or stack[-1][0] is not module:
            return  # _enter pushed nothing for this call
        _, pushed, local.recompute = stack.pop()
        if pushed is not None:
            local.recorder = None
            pushed.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def _node_of(output: Any) -> Any:
    """The autograd node of a module's output: its first tensor that has one, if any."""
    if isinstance(output, torch.Tensor):
        return output.grad_fn
    if isinstance(output, dict):
        output = tuple(output.values())
    if not isinstance(output, (tuple, list)):
        return None
    return next(
        (o.grad_fn for o in output if isinstance(o, torch.Tensor) and o.grad_fn is not None), None
    )


@never_traced
def _reached(used: KeptUsed, nbytes: list[int], grad_outputs: Any) -> None:
    """Backward reached a module kept whole: its bytes used, once (NOTE [ Modules kept whole ])."""
    if nbytes[0] >= 0:
        used(nbytes[0])
        nbytes[0] = -1


def _can_replay() -> bool:
    """Whether this torch checkpoints through hooks (NOTE [ Replayed modules ], planner.py)."""
    generator = getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None)
    return callable(generator)


def _checkpointing(
    module: torch.nn.Module,
    args: Any,
    kwargs: Any,
    replaying: Callable[[], contextlib.AbstractContextManager[None]],
) -> Iterator[None]:
    """torch.utils.checkpoint of ``module``'s call, as two halves around its forward.

    The generator composable checkpointing (torch.distributed._composable)
    drives from module hooks: ``next()`` before the forward takes its saves,
    ``next()`` after ends the region. Backward runs ``module`` again under
    ``replaying()``; the RNG state is restored, so dropout masks match.
    """
    generator: Callable[..., Iterator[None]]
    generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    contexts = functools.partial(_contexts, replaying)
    # fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop
    # (torch 2.4 has no early_stop): named before *args, so given in order.
    settings: tuple[Any, ...] = (module, True, contexts, "default", False, True)
    halves: Iterator[None] = generator(*settings[: _named_settings()], *args, **kwargs)
    return halves


@functools.cache
def _named_settings() -> int:
    generator = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    kinds = [p.kind for p in inspect.signature(generator).parameters.values()]
    return kinds.index(inspect.Parameter.VAR_POSITIONAL)


def _contexts(
    replaying: Callable[[], contextlib.AbstractContextManager[None]],
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), replaying()
