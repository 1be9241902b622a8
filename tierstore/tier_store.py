"""The autograd boundary: saved-tensor hooks, what not to offload, and the public store.

This layer knows autograd and nothing about bytes. Its pack hook decides
whether a saved tensor is worth offloading and hands it to the tier manager;
its unpack hook asks for it back.

Example:
    >>> import torch, tierstore
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    >>> x = torch.randn(32, 64)
    >>> with tierstore.TierStore(tierstore.TierConfig(
    ...         device_budget=0, disk_budget=0, min_offload_bytes=0)) as store:
    ...     with store.offload():
    ...         loss = model(x).square().sum()
    ...     loss.backward()
    ...     store.stats().tiers["host"].peak_bytes > 0
    True
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.autograd.recompute import (
    Policy,
    Recipe,
    RecomputeSetting,
    Recorder,
    everything,
    graph_op,
    graph_recipe,
    never_traced,
    policy_of,
    shared_fetch,
)
from tierstore.config import TierConfig, load_config, with_overrides
from tierstore.errors import ConfigError, TierstoreWarning, modified_in_place
from tierstore.planning.planner import Choice, Plan, from_graph, kept_whole, replayed
from tierstore.stats import TIERS, PackTally, Placement, Stats, Tier, step_summary
from tierstore.tiers.handle import Handle
from tierstore.tiers.manager import TierManager, resting_nbytes

__all__ = ["TierStore", "keep", "keep_module", "offload", "offload_module"]

#: The ``tierstore`` logger: one INFO line per training step (NOTE [ Step log ]).
log = logging.getLogger("tierstore")

# NOTE [ What stays on the device ]
# Offloading a tensor pays only if the copy lets its memory go. These are kept
# as they are (returned detached, so the graph holds no reference cycle):
#   * parameters and views of them (nn.Linear saves weight.t()), and module
#     buffers and views of them: their modules keep them alive anyway;
#   * tensors under min_offload_bytes: the copy costs more than it frees;
#   * anything but a plain strided torch.Tensor: sparse and nested layouts,
#     subclasses (FakeTensor and FunctionalTensor while torch.compile traces,
#     DTensor), meta tensors, and lazily conjugated/negated views whose bits a
#     byte copy would lose;
#   * everything saved inside tierstore.keep() (tier="device", the default).
# Buffers cannot be told from inputs by looking at a tensor (register_buffer
# stores a plain tensor), so see NOTE [ Buffer watch ].

# NOTE [ Buffer watch ]
# A global buffer-registration hook, installed when tierstore is imported,
# keeps a weak set of the modules that register a buffer (torch calls it from
# register_buffer and from assigning to a buffer attribute). When the first
# offload() block opens, the storages of those modules' buffers, as they are
# then, are noted (Module.to() and .cuda() replace buffers without
# registering them); pack looks a saved tensor's storage up there, and the
# notes are dropped when the last block closes. A buffer registered while a
# block is open (a cache grown in forward) is noted at once. This sees the
# buffers a torch.compile'd graph saves, too: the graph runs on the real ones.
# Not a global forward hook, which noted the buffers of each module that ran:
# torch.compile(module) warns at every call while any global forward hook
# exists (in the user's code, for a hook that is ours), and Dynamo inlines
# such a hook into every module call it traces. Not seen: buffers of modules
# built before tierstore was imported, unless offload_module() wraps them (it
# watches its module's tree); saved, they are offloaded: a wasted copy, exact
# gradients.

# NOTE [ Version check ]
# Eager autograd raises if a saved tensor was modified in place before
# backward. Under saved_tensors_hooks PyTorch leaves that check to the hooks,
# so tierstore does it: kept tensors here, stored ones in the tier manager.

# NOTE [ Named tiers ]
# keep(tier=...) and keep_module(..., tier=...) set a thread-local requested
# tier, the innermost one winning. "device" keeps the tensor as it is, outside
# every budget (what keep() has always meant). "host" and "disk" still pass the
# filter of NOTE [ What stays on the device ] and then ask the tier manager to
# place the entry starting at that tier instead of the fastest one: budgets
# hold downward as placement always does (a tier over budget demotes its
# oldest entries, a tier with budget 0 is skipped). This layer passes a tier
# name and nothing else; where the bytes go is the tier manager's business.

# NOTE [ Step log ]
# A step ends when a backward has run (the store saw an unpack) and then the
# next offload() block starts, or the store closes: the first point after a
# backward where the hooks run again without being inside autograd. Only then
# is the tierstore logger asked whether INFO is on, so a disabled logger costs
# one integer comparison per block. Moved bytes, hits and waits in a line are
# those since the previous line; peaks are the store's.


class _Local(threading.local):
    """This thread's hook state.

    Class defaults: a missing attribute of a threading.local raises inside
    getattr, which costs a save microseconds.
    """

    tier: Tier | Literal["as is"] | None = None
    recompute = False
    recorder: Recorder | None = None
    names: _ModuleNames | None = None  # a profiled block's (NOTE [ Naming modules ])
    active = 0
    # NOTE [ Recording where a plan rebuilds ]: the open planned block's regions
    # and the recorder they push.
    regions: _Regions | None = None
    region_recorder: Recorder | None = None
    # Backward replays a checkpointed module here: the module's hooks of this
    # layer stand aside (NOTE [ Replayed modules ] in planning/planner.py).
    replaying = False
    # NOTE [ Quiet blocks ]: the store's hooks a quiet block took off, which a
    # keep() region inside it puts back; whether a keep() region ran.
    quiet: _Quiet | None = None
    keeps = False


_local = _Local()


class _BufferWatch:
    """Storages of module buffers while any offload() block is open (NOTE [ Buffer watch ])."""

    def __init__(self) -> None:
        self.storages: weakref.WeakSet[Any] = weakref.WeakSet()
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._users = 0

    def registered(self, module: torch.nn.Module, name: str, buffer: Any) -> None:
        """The buffer-registration hook: returns None, so torch keeps the buffer as given."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            self._add(module)
            if self._users and isinstance(buffer, torch.Tensor):
                self.storages.add(buffer.untyped_storage())

    def watch(self, module: torch.nn.Module) -> None:
        """Watch ``module`` and its submodules, whenever their buffers were registered."""
        with self._lock:
            for m in module.modules():
                if m._buffers:
                    self._add(m)
            if self._users:
                self._note_all()

    def _add(self, module: torch.nn.Module) -> None:
        # A module class with __eq__ and no __hash__: its buffers go unseen (a
        # wasted copy if saved); a user's register_buffer must not fail.
        with contextlib.suppress(TypeError):
            self._modules.add(module)

    def use(self, delta: int) -> None:
        with self._lock:
            self._users += delta
            if delta > 0 and self._users == delta:  # the first block opens
                self._note_all()
            elif not self._users:
                self.storages.clear()

    def _note_all(self) -> None:
        for module in list(self._modules):
            for buf in module._buffers.values():
                if isinstance(buf, torch.Tensor):
                    self.storages.add(buf.untyped_storage())


_buffers = _BufferWatch()
torch.nn.modules.module.register_module_buffer_registration_hook(_buffers.registered)


def _requested_tier() -> Tier | None:
    """The tier the innermost keep() asks for, ``None`` outside any (NOTE [ Named tiers ])."""
    tier = _local.tier  # "as is" lasts only while checkpoint saves a module's inputs
    return "device" if tier == "as is" else tier


def _checked_tier(tier: object, where: str) -> Tier:
    for name in TIERS:
        if tier == name:
            return name
    raise ConfigError(
        f"tierstore: {where}(tier={tier!r}) names no tier; use one of "
        + ", ".join(repr(t) for t in TIERS)
    )


class _Quiet:
    """A quiet block's hooks, off the stack (NOTE [ Quiet blocks ]).

    ``woken``: a keep() region put them back on top; ``open``: the block is.
    """

    __slots__ = ("hooks", "open", "woken")

    def __init__(self, hooks: tuple[Any, Any]) -> None:
        self.hooks = hooks
        self.open = True
        self.woken = False


def _woken() -> _Quiet | None:
    """A keep() region begins: a quiet block's hooks back on for it (NOTE [ Quiet blocks ]).

    Only where nothing was pushed over the block since (an inner offload()
    or a checkpoint takes the saves, as it would over the store's hooks).
    """
    _local.keeps = True
    quiet = _local.quiet
    if (
        quiet is None
        or quiet.woken
        or not quiet.open
        or _TOP_HOOKS(False) is not None  # type: ignore[misc]
        or not _HOOKS_ENABLED()
    ):
        return None
    torch._C._autograd._push_saved_tensors_default_hooks(*quiet.hooks)
    quiet.woken = True
    return quiet


def _asleep(quiet: _Quiet | None) -> None:
    """A keep() region ends: the hooks :func:`_woken` put back come off, if still ours to pop."""
    if quiet is not None and quiet.woken:
        quiet.woken = False
        if quiet.open:  # else the block's close took them off
            torch._C._autograd._pop_saved_tensors_default_hooks()


class _Keeping:
    """A :func:`keep` block: ``tier`` asked for while it lasts, then what was asked before.

    NOTE [ Hooks and Dynamo ]: in a function torch.compile'd whole, Dynamo
    traced the generator this was, guarded on the thread-local tier it set,
    and failed that guard in the frame that made it ("Guard failed on the
    same frame it was created"). Never traced, the block runs as the code
    reaches it, and a module compiled inside it saves into it.
    """

    __slots__ = ("_before", "_tier")

    def __init__(self, tier: Tier) -> None:
        self._tier = tier
        self._before: list[tuple[Tier | None, _Quiet | None]] = []  # one per entry: it nests

    @never_traced
    def __enter__(self) -> None:
        self._before.append((_requested_tier(), _woken()))
        _local.tier = self._tier

    @never_traced
    def __exit__(self, *exc: object) -> None:
        _local.tier, quiet = self._before.pop()
        _asleep(quiet)


def keep(tier: Tier = "device") -> contextlib.AbstractContextManager[None]:
    """Send every tensor saved inside this block to ``tier``, even under ``offload()``.

    ``tier="device"`` (the default) keeps them on the device as they are,
    outside every budget: use it for the last layers, whose saved tensors
    backward needs first, or for anything you know fits. ``"host"`` or
    ``"disk"`` place them starting at that tier instead of the fastest one
    with room; budgets still hold downward, as placement always does (a tier
    with budget 0 is skipped, one that is full demotes its oldest entries).
    Parameters and tensors under ``min_offload_bytes`` stay on the device
    either way. Nests (the innermost wins); thread-local; outside an
    ``offload()`` block it changes nothing.

    Args:
        tier: ``"device"``, ``"host"`` or ``"disk"``.

    Raises:
        ConfigError: ``tier`` names no tier.

    Example:
        >>> import tempfile, torch, tierstore
        >>> head = torch.nn.Linear(16, 4)
        >>> store = tierstore.TierStore(tierstore.TierConfig(
        ...     device_budget="1GiB", disk_path=tempfile.mkdtemp(), min_offload_bytes=0))
        >>> h = torch.randn(8, 16, requires_grad=True)
        >>> with store.offload():
        ...     z = h.exp()                      # within device_budget: stays
        ...     with tierstore.keep(tier="disk"):
        ...         y = (z * 2).sin()            # asked for the disk
        ...     with tierstore.keep():
        ...         logits = head(y)             # kept as it is
        >>> store.stats().tiers["disk"].entries, store.stats().kept > 0
        (1, True)
        >>> logits.sum().backward(); store.close()
    """
    return _Keeping(_checked_tier(tier, "tierstore.keep"))


class _KeepModule:
    """The hooks :func:`keep_module` put on a module; :meth:`remove` takes them off."""

    def __init__(self, module: torch.nn.Module, tier: Tier) -> None:
        self._tier = tier
        self._at_entry = threading.local()
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            # always_call: a forward that raises still leaves the keep() block.
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _stack(self) -> list[tuple[Tier | None, _Quiet | None]]:
        stack: list[tuple[Tier | None, _Quiet | None]] | None = getattr(
            self._at_entry, "stack", None
        )
        if stack is None:
            stack = self._at_entry.stack = []
        return stack

    # NOTE [ Hooks and Dynamo ]: under a whole-model torch.compile these run
    # as the compiled code reaches the module, not traced into its graph
    # (Dynamo guarded on the thread-local they set, then failed that guard).
    @never_traced
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._stack().append((_requested_tier(), _woken()))
        _local.tier = self._tier

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            _local.tier, quiet = stack.pop()
            _asleep(quiet)

    def remove(self) -> None:
        """Stop sending this module's saved tensors to the tier. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def keep_module(module: torch.nn.Module, tier: Tier = "device") -> _KeepModule:
    """Send every tensor saved inside ``module``'s forward to ``tier``, as :func:`keep` does.

    With the default ``tier="device"``: for modules whose saved tensors
    backward needs first or that are cheap to keep, such as the output head.
    ``"host"`` or ``"disk"`` place them starting at that tier (NOTE [ Named
    tiers ]). Returns a handle whose ``remove()`` undoes it. Thread-local,
    like :func:`keep`: it applies to the thread that runs the forward.

    Args:
        module: the module whose forward's saves go to ``tier``.
        tier: ``"device"``, ``"host"`` or ``"disk"``.

    Raises:
        ConfigError: ``tier`` names no tier.

    Example:
        >>> import torch, tierstore
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
        ...                             torch.nn.Linear(16, 4))
        >>> handle = tierstore.keep_module(model[2])
        >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0, disk_budget=0))
        >>> with store.offload():
        ...     out = model(torch.randn(8, 16))
        >>> store.stats().kept  # the head's input stays; its weight is a parameter
        2
        >>> out.sum().backward(); handle.remove(); store.close()
    """
    return _KeepModule(module, _checked_tier(tier, "tierstore.keep_module"))


class _Kept:
    """A saved tensor left on the device, with its version for the check at unpack.

    ``planned``: bytes a plan kept, counted in its peak until the first use
    (NOTE [ Saves that stay ] in tiers/manager.py); 0 otherwise.
    """

    __slots__ = ("__weakref__", "planned", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, planned: int = 0) -> None:
        self.tensor = tensor
        self.version = version
        self.planned = planned


def _kept(t: torch.Tensor, planned: int = 0) -> _Kept | tuple[torch.Tensor, int]:
    """``t`` kept as it is; told to the thread's recorder if one runs (its detach not recorded).

    With no recorder and nothing for a plan's peak, a bare (alias, version)
    pair: a tuple is built in C, a _Kept in Python (NOTE [ Saves that stay ]
    in tiers/manager.py).
    """
    if _local.region_recorder is None and not _local.recompute:  # no recorder: the usual way
        if not planned:
            return (t.detach(), t._version)
        return _Kept(t.detach(), t._version, planned)
    kept = _Kept(_unrecorded(t.detach), t._version, planned)
    recorder = _local.recorder if _local.recompute else _local.region_recorder
    if recorder is not None:
        recorder.note_packed(t, kept, None)
    return kept


def _held(packed: object) -> tuple[torch.Tensor, int] | None:
    """The tensor and version a packed object keeps on the device as it is, else ``None``.

    Only the pack hook's own forms: another hook's tuple (``save_on_cpu``'s
    device and tensor, under a block nested in ours) is not one.
    """
    if type(packed) is tuple:
        if len(packed) == 2 and type(packed[1]) is int and isinstance(packed[0], torch.Tensor):
            return packed
        return None
    if type(packed) is _Kept:
        return packed.tensor, packed.version
    return None


_R = TypeVar("_R")


def _moving(runner: Any, out: bool, fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)``: a profiled step moving a save out (``out``) or back, its host time told.

    NOTE [ Pricing a moved save first ] in planning/runner.py: the store's waits for
    the link are taken out.
    """
    began, waited = time.perf_counter(), runner.waits()
    try:
        return fn(*args)
    finally:
        runner.moved(time.perf_counter() - began - (runner.waits() - waited), out)


def _unrecorded(fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)``, tierstore's own ops in a hook: the recorder neither records nor times them.

    A profile timed the copies off the device as the step's compute. A
    function, not a context manager: kept parameters pay it on every save.
    """
    mode = _local.recorder
    if mode is None:
        return fn(*args)
    mode.paused += 1
    try:
        return fn(*args)
    finally:
        mode.paused -= 1


@functools.cache
def _placeholders() -> tuple[type, ...]:
    """Tracing placeholders (FakeTensor, FunctionalTensor): looked up once."""
    return (
        torch._subclasses.fake_tensor.FakeTensor,
        torch._subclasses.functional_tensor.FunctionalTensor,
    )


def _offload_nbytes(t: torch.Tensor, min_bytes: int) -> int | Placement:
    """Bytes ``t`` rests in once offloaded, or why it stays on the device.

    See NOTE [ What stays on the device ].
    """
    nbytes = _sized(t, min_bytes)
    if type(nbytes) is not int:
        return nbytes
    return _unusual(t) or nbytes


# Looked up once: every save asks (NOTE [ Saves that stay ] in tiers/manager.py).
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided


def _sized(t: torch.Tensor, min_bytes: int) -> int | Placement:
    """The checks every save pays: a parameter, a layout with no plain bytes, or its size.

    A save that stays by device_budget needs no more (NOTE [ Saves that stay ]
    in tiers/manager.py): whatever :func:`_unusual` would say, it stays.
    """
    if type(t) is not _TENSOR:
        return "parameter" if isinstance(t, _PARAMETER) else "layout"
    base = t._base  # early: nn.Linear saves weight.t() at every call
    # type() first: isinstance() with Parameter's metaclass costs 0.3 us, and
    # most views saved are of plain activations.
    if base is not None and type(base) is not _TENSOR and isinstance(base, _PARAMETER):
        return "parameter"
    if t.layout is not _STRIDED or t.is_nested:
        return "layout"
    nbytes: int = t.nbytes if t.is_contiguous() else resting_nbytes(t)
    if nbytes < min_bytes:
        return "min_offload_bytes"
    return nbytes


def _unusual(t: torch.Tensor) -> Placement | None:
    """Why a plain-sized ``t`` still stays: no storage, no data, lazy bits, or a buffer."""
    if t._is_zerotensor() or t.is_meta or t.is_conj() or t.is_neg() or t.is_quantized:
        return "layout"
    if _buffers.storages and t.is_leaf and t.untyped_storage() in _buffers.storages:
        return "parameter"
    return None


def _checked(config: object, where: str) -> TierConfig | None:
    if config is None or isinstance(config, TierConfig):
        return config
    raise ConfigError(
        f"tierstore: {where} takes a TierConfig; got {type(config).__name__}. "
        "Build one with tierstore.TierConfig(**settings), or pass settings as keywords "
        "to tierstore.offload(...)"
    )


class _Block:
    """One entered offload block: its hooks, its first tally (or ``None``), its recompute state."""

    __slots__ = (
        "allocated",
        "alone",
        "before",
        "first",
        "hooks",
        "names",
        "outer_keeps",
        "outer_recompute",
        "outer_regions",
        "pushed",
        "quiet",
        "where",
    )

    hooks: saved_tensors_hooks  # set once made: a quiet block's first pack hook holds the block

    def __init__(self, before: PackTally | None) -> None:
        self.before = before
        # NOTE [ Quiet blocks ]: what its first save was (None: none yet, or a
        # block that may not go quiet); the block it repeats, if its hooks are off.
        self.first: tuple[Any, ...] | None = None
        self.quiet: _Repeat | None = None
        self.outer_keeps = False
        self.alone = 0  # the store's blocks opened so far, if no other was open; else 0
        self.where: tuple[str, int] = ("", 0)  # the code that opened it
        # Its first save's device, and the bytes allocated there as it was made (CUDA).
        self.allocated: tuple[torch.device, int] | None = None
        self.pushed: Recorder | None = None
        self.outer_recompute = False
        # NOTE [ Recording where a plan rebuilds ]: what the block's regions replaced.
        self.outer_regions: tuple[_Regions | None, Recorder | None] | None = None
        self.names: _ModuleNames | None = None


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
# the whole block, as before; one that rebuilds nothing records nothing. A
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
# hook: Python, some microseconds each, which on a GPU is a step's time (the
# issue's H200 step ran 8% slower at a budget of 1.0, where every save
# stays). Where a plan keeps every save of a module (kept_whole() in
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

# NOTE [ Quiet blocks ]
# A save that stays costs a decision and a count (NOTE [ Saves that stay ] in
# tiers/manager.py): Python, microseconds per save, most of a small step's time
# (bench overhead's kept row: 6.1 us a save over no hooks, in callgrind 10k
# instructions a save more than no hooks, well spread over sizing, the
# budget's count and the hooks themselves). A step that repeats one whose
# saves all stayed needs neither, so it runs without the store's hooks after
# its first save, as a module a plan keeps whole does (NOTE [ Modules kept
# whole ]). How:
#   * a block that may go quiet begins with a pack hook of its own
#     (_pack_first): the outermost offload() block of its thread, with no
#     plan and no recorder (recompute off), no keep() region open, nothing
#     beneath it on autograd's stack of hooks (an outer checkpoint's or a
#     user's hooks would take the saves the store's had hidden from them),
#     no tracing, and a torch that reads the stack (2.8 and later);
#   * its first save decides. The block goes quiet where the step before was
#     one block (a forward in two blocks is never repeated), which ran alone
#     (no other block of the store open in any thread beside it), moved
#     nothing, ran no keep() region and was not itself seen to grow (below);
#     this block was opened at the same line (_opened_at: two models fed one
#     batch are two blocks) and its first save looks as that block's did
#     (shape, dtype, device, and its size or why it stays; a nested or sparse
#     one never matches); and that block's bytes fit QUIET_ROOM times in the
#     room device_budget leaves this step. Then its saves are counted as that
#     block's were (TierManager.stayed_as_before), the first is kept as it
#     is, and the hooks come off the stack. Otherwise the store's own hooks
#     take the first one's place for the rest of the block, which is
#     measured: what its saves came to is what the next step may repeat. One
#     step in MEASURED_EVERY is measured all the same, and one block a step
#     goes quiet;
#   * a keep() region or keep_module inside a quiet block puts the hooks back
#     on top for its length (its tier is the hooks' to carry out), where
#     nothing was pushed over the block since: an inner offload() or a
#     checkpoint takes those saves, as over the store's hooks. The block is
#     not repeated. The block's close puts the hooks back for its own pop,
#     unless a keep() region left open past it (a misuse) did: then the pop
#     is of those, and the region's end pops nothing;
#   * on CUDA the allocator's count of bytes allocated, read at the first
#     save and at the close, says what forward left behind it: a quiet block
#     that left more than GREW times what the measured one did (and a MiB) is
#     not repeated;
#   * the first save's unpack counts a backward (NOTE [ Step log ]), which
#     ends the step at the next block.
# What a quiet block skips is what NOTE [ Saves that stay ] skips, and the
# decision and count per save: autograd holds the saves as it does without
# tierstore, so an in-place change raises autograd's own error, and
# retain_graph, double backward and threads are autograd's own. What it
# takes on trust: that a block opened at the same line, whose first save is
# as the measured block's, saves what that block saved. A batch size or
# sequence length that changes changes the first save, and the block is
# measured. A block whose saves differ behind the same first save (a
# decoder's length growing behind an encoder's fixed one, tokens routed to
# experts) keeps them all on the device, as autograd would, and counts them
# as measured, for at most MEASURED_EVERY - 1 steps, and on CUDA for one
# step once forward leaves GREW times the memory: above device_budget only
# once they pass QUIET_ROOM times what was measured. A backward that never
# reaches the first save (a teacher run with grad and its output detached,
# autograd.grad for an inner input) ends no step: the next block is the
# step's second, and is measured; two steps share one room (saves past it
# are moved that would have fitted) and one log line.

#: NOTE [ Quiet blocks ]: of the steps that could repeat the one before, one
#: in this many is measured all the same.
MEASURED_EVERY = 16
#: NOTE [ Quiet blocks ]: a quiet block whose device memory grew past the
#: measured block's by this factor (and a MiB) is not repeated.
GREW = 1.25


class _Repeat(NamedTuple):
    """A measured block, as a quiet one repeats it (NOTE [ Quiet blocks ])."""

    first: tuple[Any, ...]  # where it was opened and its first save
    tally: PackTally  # what its saves came to
    grew: int | None  # the device memory its forward left allocated; None off CUDA


def _device_bytes(device: torch.device) -> int | None:
    """Bytes the caching allocator holds allocated on ``device``; ``None`` off CUDA."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


#: tierstore's own files, and contextlib's: no frame of them opened a block
#: (NOTE [ Quiet blocks ]).
_OWN_FILES = (os.path.dirname(os.path.abspath(__file__)), contextlib.__file__)


def _opened_at() -> tuple[str, int]:
    """The file and line of the code that opened an offload() block (NOTE [ Quiet blocks ]).

    The first frame outside tierstore and contextlib: offload_module's and
    the trainer callbacks' blocks are opened where their module is called.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame = frame.f_back
    return ("", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

#: Autograd's engine: a final callback queued during a backward runs as it ends.
_ENGINE = torch.autograd.Variable._execution_engine
#: The autograd graph task running on this thread, -1 outside backward (NOTE [ Like with like ]).
_graph_task: Callable[[], int] = torch._C._current_graph_task_id
_HOOKS_ENABLED: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)


class _Regions:
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
        if not self.records and _TOP_HOOKS is not None:  # NOTE [ Modules kept whole ]
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
        if kwargs is None or _local.regions is not self or _local.replaying or _tracing():
            return  # or not this store's planned block, or the replay itself in backward
        plan, begin = self.plan, self._begin
        if plan is None or begin is None:
            return
        checkpointing = _checkpointing(module, args, kwargs, self._replaying)
        # Checkpoint saves the module's inputs (and, on some torch, a dummy)
        # through the hooks outside it: kept as they are, counted by the plan,
        # which kept the module's first save, its input.
        outer, _local.tier = _local.tier, "as is"
        try:
            next(checkpointing)
        finally:
            _local.tier = outer
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
            _local.regions is not self
            or _local.tier is not None
            or _local.replaying
            or _local.recorder is not None
            or _tracing()
        ):
            return  # or not this store's planned block, or keep() or a recorder wants the hooks
        plan, begin = self.plan, self._begin_kept
        if plan is not planned or begin is None:
            # A hook of the last plan, taken off as offload_module's pre-hook
            # of this same call followed a new one: torch still calls it.
            return
        autograd = torch._C._autograd
        top = _TOP_HOOKS(False)  # type: ignore[misc]
        if top is None or top[0] != self._pack:
            return  # another's hooks on top: theirs to run
        if not _HOOKS_ENABLED():
            return  # no hook may be pushed back
        autograd._pop_saved_tensors_default_hooks()
        # Hooks beneath the store's (a checkpoint or a user's around the
        # block) would take the module's saves: the store's stay on top.
        if _TOP_HOOKS(False) is not None or not begin(plan, first, end, stays):  # type: ignore[misc]
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
        outer = _local.replaying
        _local.replaying = True
        try:
            yield
        finally:
            _local.replaying = outer

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
        recorder = _local.region_recorder
        if _local.regions is not self or recorder is None or _tracing():
            return  # this store's planned block is not open in this thread
        pushed = None
        if _local.recorder is None:  # not inside another region (nested modules)
            recorder.__enter__()  # type: ignore[no-untyped-call]
            _local.recorder = pushed = recorder
        self._stack().append((module, pushed, _local.recompute))
        _local.recompute = True

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Not "is this store's block open": a block may close first, as
        # offload_module's own forward hook on the same module does.
        stack = self._stack()
        if not stack or stack[-1][0] is not module:
            return  # _enter pushed nothing for this call
        _, pushed, _local.recompute = stack.pop()
        if pushed is not None:
            _local.recorder = None
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
    """Whether this torch checkpoints through hooks (NOTE [ Replayed modules ] in planning/planner.py)."""
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


# NOTE [ Planned saves ]
# With activation_budget set, the pack hook asks the tier manager's plan
# runner what to do with each save it would offload (NOTE [ Planned steps ]
# in planning/runner.py): keep it in the device tier, offload it (the host tier, the
# disk below it), or hand autograd a recipe that rebuilds it. The recorder
# then records every op it may (recompute.everything): the plan, not a list
# of cheap ops, picks what is rebuilt, and chains may run MAX_PLANNED_DEPTH
# ops deep (a block rebuilt from its input is checkpointing). In a profiled
# step the recorder also times each op, and the stack names the module of
# each save (the outermost numbered one: a transformer block; NOTE [ Naming
# modules ]); the pack hook writes down each save, the unpack hook each first
# use. The naming and the timing run in that step only.

#: How many ops a planned rebuild may replay in one chain.
MAX_PLANNED_DEPTH = 64
#: Where a planned choice sends a save (None: the safe placement).
_PLACED: dict[Choice | None, Tier | None] = {"keep": "device", "offload": "host", None: None}


# NOTE [ Naming modules ]
# A profile names the module of each save and of each op a rebuild replays,
# so a plan's table reads per block and a planned step can record inside the
# modules it rebuilds in (NOTE [ Recording where a plan rebuilds ]). The
# names come from the Python stack, read at those moments in the profiled
# step only: the frames of nn.Module's call path hold the modules whose
# forward is running, outermost first, and each is named by its path from
# the outermost one (GPT.blocks.3.attn: the class name of the root, then
# named_modules' path). Not module hooks: a global forward pre-hook (torch's
# ModuleTracker) makes torch.compile(module) warn at every call, and Dynamo
# traced into it and failed on a whole-model compile; per-module hooks would
# need the model, which offload() is not given. Where the stack shows no
# module (ops outside every module, or a whole compiled graph's saves handed
# over as it ends) the name is the outermost module's, or "".

#: The code objects of nn.Module's call path: a frame running one holds the module.
_CALL_CODES = frozenset(
    f.__code__
    for f in (torch.nn.Module._call_impl, getattr(torch.nn.Module, "_wrapped_call_impl", None))
    if f is not None
)


#: Where a compiled region's runtime lives: on the stack, its saves are handed over at its end.
_COMPILED_RUNTIME = f"{os.sep}_aot_autograd{os.sep}"


class _ModuleNames:
    """The running modules' names, read off the stack (NOTE [ Naming modules ]).

    Example:
        >>> names = _ModuleNames()
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.ModuleList([torch.nn.Identity()])
        ...     def forward(self, x):
        ...         return names.running()
        >>> Net()(torch.ones(1))
        'Net'
    """

    def __init__(self) -> None:
        self._trees: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}
        #: Every module named so far, by name.
        self.known: dict[str, weakref.ref[torch.nn.Module]] = {}

    def _chain(self) -> tuple[list[torch.nn.Module], bool]:
        """The modules whose forward runs now, outermost first; and whether under compiled code.

        A compiled region's runtime on the stack hands its saves over as it ends.
        """
        chain: list[torch.nn.Module] = []
        compiled = False
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code in _CALL_CODES:
                module = frame.f_locals.get("self")
                if isinstance(module, torch.nn.Module):
                    # torch.compile's wrapper stands for the module it wraps.
                    inner = getattr(module, "_orig_mod", module)
                    if not chain or chain[-1] is not inner:
                        chain.append(inner)
            elif not compiled and _COMPILED_RUNTIME in code.co_filename:
                compiled = True
            frame = frame.f_back
        chain.reverse()
        return chain, compiled

    def _tree(self, root: torch.nn.Module) -> dict[int, str]:
        """Names of ``root``'s modules by id, made once per root."""
        held = self._trees.get(id(root))
        if held is not None and held[0]() is root:
            return held[1]
        top = type(root).__name__
        names: dict[int, str] = {}
        for path, m in root.named_modules():
            names[id(m)] = name = f"{top}.{path}" if path else top
            self.known.setdefault(name, weakref.ref(m))
        self._trees[id(root)] = (weakref.ref(root), names)
        return names

    def running(self) -> str:
        """The running module: the outermost numbered one (``GPT.blocks.3``), else a top one."""
        return self._name(self._chain()[0])

    def saving(self) -> tuple[str, str, bool]:
        """:meth:`running`, the outermost module's name, and whether compiled code hands it."""
        chain, compiled = self._chain()
        root = self._tree(chain[0]).get(id(chain[0]), "") if chain else ""
        return self._name(chain), root, compiled

    def _name(self, chain: list[torch.nn.Module]) -> str:
        if not chain:
            return ""
        tree = self._tree(chain[0])
        names = [tree.get(id(m), type(m).__name__) for m in chain]
        numbered = [n for n in names if n.rsplit(".", 1)[-1].isdigit()]
        if numbered:
            return min(numbered, key=len)
        top = [n for n in names if n.count(".") == 1]
        return min(top) if top else min(names, key=len)


def _module_name() -> tuple[str, str, bool]:
    """The save's module in a profiled block (NOTE [ Naming modules ]), else "".

    And its outermost module (NOTE [ Modules kept whole ]), and whether a
    compiled region hands it over (NOTE [ A peak above the budget ] in planning/runner.py).
    """
    names = _local.names
    return ("", "", False) if names is None else names.saving()


# NOTE [ Recompute in blocks ]
# One Recorder per thread (a dispatch mode is thread-local), pushed by the
# outermost block that asks for recompute and popped when that block ends;
# an inner block that asks for it uses the one already recording. Whether a
# save may become a recipe is the innermost block's choice (_local.recompute),
# as its hooks are the ones that run. Not in a block entered while make_fx or
# a FakeTensorMode traces, nor while compiled autograd is on: its graph
# unpacks saved tensors itself and must get today's handles.


_PROXY, _FAKE = torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FAKE


def _tracing() -> bool:
    """Whether make_fx or a FakeTensorMode is tracing (NOTE [ Recompute in blocks ])."""
    mode = torch._C._get_dispatch_mode
    return mode(_PROXY) is not None or mode(_FAKE) is not None


def _recorder() -> Recorder | None:
    """The thread's recorder, when the innermost offload() block asks for recompute.

    In a planned block that records in regions, their recorder also outside
    them: a save is often packed by the module after the one that made it
    (NOTE [ Recording where a plan rebuilds ]).
    """
    recorder = _local.recorder if _local.recompute else _local.region_recorder
    if recorder is None:
        return None
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region):
        return None
    return recorder


class TierStore:
    """A tiered store for the tensors autograd saves for backward.

    Use :meth:`offload` around the forward pass; run backward as usual. The
    store keeps its state between steps, so create it once and reuse it.
    Resources (the spill directory, files) are created on first use and
    released by :meth:`close`, which is idempotent; ``with TierStore(...)``
    closes on exit.

    Args:
        config: budgets and placement; ``None`` resolves one from the
            environment and TOML file (see :func:`tierstore.load_config`).

    Example:
        >>> import tempfile, torch, tierstore
        >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="64MiB",
        ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU())
        >>> with tierstore.TierStore(cfg) as store:
        ...     with store.offload():
        ...         loss = model(torch.randn(64, 128)).sum()
        ...     on_disk = store.stats().tiers["disk"].entries
        ...     loss.backward()
        ...     after = store.stats().tiers["disk"].entries
        >>> on_disk > 0, after
        (True, 0)
    """

    def __init__(self, config: TierConfig | None = None) -> None:
        self.config = _checked(config, "TierStore(config=...)") or load_config()
        self._manager = TierManager(self.config)
        self._runner = self._manager.plans  # NOTE [ Planned saves ]
        self._min_bytes = int(self.config.min_offload_bytes)
        self._recompute = policy_of(self.config.recompute)
        self._warned = False  # NOTE [ Is it working? ] in tierstore/stats.py
        # NOTE [ Step log ]: unpack calls so far, and at the last step's end.
        self._unpacks = 0
        self._step_unpacks = 0
        self._steps = 0
        self._logged: Stats | None = None
        # NOTE [ Recording where a plan rebuilds ]: the profiled step's modules by name.
        self._modules: dict[str, weakref.ref[torch.nn.Module]] = {}
        self._regions = _Regions(everything, self._stays, self._pack)
        # NOTE [ Quiet blocks ]: the block a quiet one repeats (its first save
        # and what its saves came to), for this step and for the next.
        self._quiet: _Repeat | None = None
        self._next_quiet: _Repeat | None = None
        self._step_blocks = 0
        self._quiet_steps = 0  # quiet steps since one was measured
        self._opened = 0  # blocks opened so far, in every thread
        self._open = 0  # and open now

    @contextlib.contextmanager
    def offload(self, recompute: RecomputeSetting | None = None) -> Iterator[TierStore]:
        """Offload the tensors autograd saves inside this block.

        Hooks are thread-local and removed on exit, also on an exception.
        An inner ``offload()`` (of this or another store) wins over an outer
        one; ``torch.no_grad()`` saves nothing, so nothing is packed.

        ``recompute`` overrides the store's ``recompute`` setting for this
        block: ``"off"``, ``"cheap"``, or a policy function
        ``(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``
        as selective activation checkpointing takes (NOTE [ Recompute ] in
        ``tierstore/autograd/recompute.py``).

        The first block whose saves all stayed on the device, while nothing
        has left it since the store opened, issues a
        :class:`~tierstore.TierstoreWarning` that says why in numbers and
        which setting to change (once per store). With the ``tierstore``
        logger at INFO, each step (a forward and its backward) logs a line.

        Example:
            >>> import torch, tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0,
            ...                                                  disk_budget=0))
            >>> x = torch.randn(10, requires_grad=True)
            >>> with store.offload():
            ...     y = (x * 2).sin()
            >>> y.sum().backward(); store.close()
        """
        block = self._open_block(recompute)
        ok = False
        try:
            yield self
            ok = True
        finally:
            self._close_block(block, ok, "this offload() block")

    def _open_block(self, recompute: RecomputeSetting | None = None) -> _Block:
        """Push the hooks; :meth:`_close_block` pops them (LIFO, as any hooks)."""
        self._manager.check_open()
        policy = self._recompute if recompute is None else policy_of(recompute)
        if self._unpacks != self._step_unpacks:  # a backward ran: a step ended
            self._step_ended()
        self._step_blocks += 1
        may_quiet = self._may_go_quiet(policy)
        # Only while the warning could still be due, or for a block that may
        # go quiet (NOTE [ Quiet blocks ]): it costs a lock.
        watch = may_quiet or (not self._warned and not self._manager.moved)
        block = _Block(self._manager.pack_tally() if watch else None)
        if may_quiet:
            block.where = _opened_at()
        pack = functools.partial(self._pack_first, block) if may_quiet else self._pack
        block.hooks = saved_tensors_hooks(pack, self._unpack)
        _buffers.use(+1)
        _local.active += 1
        try:
            block.hooks.__enter__()
        except BaseException:
            _local.active -= 1
            _buffers.use(-1)
            raise
        # NOTE [ Quiet blocks ]: a block is repeated only if it ran alone.
        self._opened += 1
        block.alone = self._opened if not self._open else 0
        self._open += 1
        block.outer_keeps, _local.keeps = _local.keeps, False
        # NOTE [ Recompute in blocks ]
        block.outer_recompute = _local.recompute
        runner, timed, depth = self._runner, False, None
        if runner is not None:  # NOTE [ Planned saves ]
            timed = runner.will_time
            policy = everything if timed or runner.rebuilds else None
            depth = MAX_PLANNED_DEPTH
            plan = runner.plan
            if not timed and plan is not None:
                # NOTE [ Recording where a plan rebuilds ], NOTE [ Modules kept whole ]
                regions = self._regions
                regions.follow(
                    plan, self._modules, self._begin_replay, self._begin_kept, self._kept_used
                )
                if not regions.whole and (policy is not None or regions.keeps):
                    policy = None
                    block.outer_regions = (_local.regions, _local.region_recorder)
                    _local.regions = regions
                    _local.region_recorder = regions.recorder() if regions.records else None
        if policy is not None and _tracing():
            policy = None  # make_fx, FakeTensorMode: tracing keeps today's path
        if timed and policy is not None and _local.names is None:
            block.names = _local.names = _ModuleNames()
        if policy is not None and _local.recorder is None:
            where = block.names.running if block.names is not None else None
            timer = runner.profile_timer() if timed and runner is not None else None
            recorder = Recorder(policy, self._stays, timer=timer, max_depth=depth or 8, where=where)
            try:
                recorder.__enter__()  # type: ignore[no-untyped-call]
            except BaseException:
                self._close_block(block, False, "")
                raise
            block.pushed = _local.recorder = recorder
        _local.recompute = policy is not None
        return block

    def _begin_replay(self, plan: Plan, first: int, end: int, tensor: torch.Tensor | None) -> bool:
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

    def _begin_kept(
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

    def _backward_began(self, ended: Callable[[], None]) -> None:
        """A backward of a timed step used its first save: the peak, and ``ended()`` as it ends.

        NOTE [ Like with like ] in planning/runner.py: autograd's engine calls ``ended``
        as this backward ends. An unpack outside a backward (a saved tensor
        read off its node by hand) has no end to time.
        """
        # NOTE [ Reads from backward's start ] in tiers/manager.py: only in a backward
        # (not a saved tensor read by hand), its copies tierstore's own ops,
        # and a profiled step's host time for them a moved save's (NOTE
        # [ Pricing a moved save first ] in planning/runner.py).
        reads = _graph_task() != -1
        runner = self._runner
        if runner is not None and runner.profiling:
            _moving(runner, False, _unrecorded, self._manager.backward_began, reads)
        else:
            _unrecorded(self._manager.backward_began, reads)
        with contextlib.suppress(RuntimeError):  # "only during backward pass"
            _ENGINE.queue_callback(ended)

    def _kept_used(self, nbytes: int) -> None:
        """Backward reached a module kept whole (NOTE [ Modules kept whole ])."""
        self._unpacks += 1  # NOTE [ Step log ]: a backward ran
        runner = self._runner
        if runner is not None and (ended := runner.used(-1, nbytes, _graph_task())):
            self._backward_began(ended)

    def _stays(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays on the device if saved: a recipe may hold it as it is."""
        return isinstance(_offload_nbytes(t, self._min_bytes), str)

    def _close_block(self, block: _Block, ok: bool, where: str) -> None:
        """Pop the hooks; warn if nothing left the device (NOTE [ Is it working? ])."""
        try:
            quiet = _local.quiet
            if block.quiet is not None and quiet is not None:  # NOTE [ Quiet blocks ]
                # The hooks back on top for the pop below, unless a keep()
                # region still open put them there: then the pop is of those.
                if not quiet.woken:
                    torch._C._autograd._push_saved_tensors_default_hooks(*quiet.hooks)
                quiet.open = quiet.woken = False
                _local.quiet = None
            if block.outer_regions is not None:
                self._regions.restore()  # NOTE [ Modules kept whole ]
                _local.regions, _local.region_recorder = block.outer_regions
            if block.names is not None:
                _local.names = None
                # The modules the profile named (NOTE [ Recording where a plan rebuilds ]).
                self._modules = dict(block.names.known)
            if block.pushed is not None:
                _local.recorder = None
                block.pushed.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            _local.recompute = block.outer_recompute
            try:
                block.hooks.__exit__(None, None, None)
            finally:
                _local.active -= 1
                _buffers.use(-1)
        self._open -= 1
        keeps, _local.keeps = _local.keeps, block.outer_keeps or _local.keeps
        alone = block.alone == self._opened  # none opened since, none open before
        self._next_quiet = self._repeatable(block, ok and alone and not keeps)
        before = block.before
        if not ok or before is None or self._warned or self._manager.closed:
            return
        if self._manager.moved:
            return
        message = (
            self._manager.pack_tally()
            .since(before)
            .nothing_moved(where, int(self.config.device_budget), self._min_bytes)
        )
        if message is not None:
            self._warned = True
            warnings.warn(TierstoreWarning(message), stacklevel=_user_stacklevel())

    def _may_go_quiet(self, policy: Policy | None) -> bool:
        """Whether a block opening now may go quiet after its first save (NOTE [ Quiet blocks ])."""
        return (
            self._runner is None
            and policy is None
            and _TOP_HOOKS is not None
            and not _local.active
            and _local.tier is None
            and _local.recorder is None
            and _local.region_recorder is None
            and _TOP_HOOKS(False) is None
            and _HOOKS_ENABLED()
            and not _tracing()
        )

    def _repeatable(self, block: _Block, ok: bool) -> _Repeat | None:
        """What a quiet block may repeat of ``block``, which closed (NOTE [ Quiet blocks ])."""
        if not ok or block.first is None or self._manager.closed:
            return None
        grew = None
        if block.allocated is not None:
            device, then = block.allocated
            now = _device_bytes(device)
            grew = None if now is None else now - then
        repeated = block.quiet
        if repeated is not None:
            # Its saves cannot be seen; on CUDA the memory forward left can.
            if grew is not None and repeated.grew is not None:
                return None if grew > repeated.grew * GREW + (1 << 20) else repeated
            return repeated
        if block.before is None:
            return None
        tally = self._manager.pack_tally().since(block.before)
        return None if tally.moved else _Repeat(block.first, tally, grew)

    @never_traced
    def _pack_first(
        self, block: _Block, t: torch.Tensor
    ) -> Handle | _Kept | tuple[torch.Tensor, int] | Recipe:
        """The pack hook until a block's first save: the block goes quiet, or on as ever.

        NOTE [ Quiet blocks ].
        """
        if block.first is not None:  # decided; a compiled graph hands its saves over at once
            return (t.detach(), t._version) if block.quiet is not None else self._pack(t)
        nbytes = _sized(t, self._min_bytes)
        if nbytes == "layout":  # nested or sparse: no plain shape, and never repeated
            block.first = (object(),)
        else:
            block.first = (block.where, t.shape, t.dtype, t.device, nbytes)
            allocated = _device_bytes(t.device)
            if allocated is not None:
                block.allocated = t.device, allocated
        top = _TOP_HOOKS(False) if _TOP_HOOKS is not None else None
        if top is None or top[0] is not block.hooks.pack_hook:
            return self._pack(t)  # called other than from the top of the stack
        autograd = torch._C._autograd
        autograd._pop_saved_tensors_default_hooks()
        quiet = self._quiet
        if (
            quiet is not None
            and quiet.first == block.first
            and _local.tier is None
            and self._manager.stayed_as_before(quiet.tally)
        ):
            _local.quiet = _Quiet((self._pack, self._unpack))
            block.quiet, self._quiet = quiet, None  # one quiet block a step
            self._quiet_steps += 1
            return (t.detach(), t._version)
        autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self._quiet_steps = 0
        return self._pack(t)

    def _step_ended(self) -> None:
        """NOTE [ Step log ]; with activation_budget, the plan's turn (NOTE [ Planned saves ])."""
        # NOTE [ Quiet blocks ]: only a step of one block is repeated, and
        # one in every MEASURED_EVERY is measured all the same.
        repeat = self._step_blocks == 1 and self._quiet_steps < MEASURED_EVERY - 1
        self._quiet = self._next_quiet if repeat else None
        self._next_quiet, self._step_blocks = None, 0
        self._step_unpacks = self._unpacks
        self._steps += 1
        self._manager.step_ended()
        if self._runner is not None and not self._manager.closed:
            line, said = self._manager.plan_step_ended()
            if line is not None:
                log.info("%s", line)
            for message in said:
                warnings.warn(TierstoreWarning(message), stacklevel=_user_stacklevel())
        if not log.isEnabledFor(logging.INFO) or self._manager.closed:
            return
        now = self._manager.stats()
        log.info("%s", step_summary(self._steps, now, self._logged))
        self._logged = now

    def plan(self) -> Plan | None:
        """The plan ``activation_budget`` runs on; ``None`` before a step was profiled.

        The store's first step warms up, the second is profiled, and the plan
        is made when the third begins (NOTE [ Planned steps ] in planning/runner.py).
        A plan is kept per shape of step: this is the one the latest step
        followed or was profiled for. ``str()`` of it is a table: per module,
        the bytes kept, offloaded and rebuilt and the predicted exposed time,
        then the step's predicted time and peak beside the measured ones
        (NOTE [ Planned steps ] in planning/runner.py).
        ``None`` too without ``activation_budget``.

        Example:
            >>> import torch, tierstore
            >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
            ...                             torch.nn.Linear(256, 256))
            >>> store = tierstore.TierStore(tierstore.TierConfig(
            ...     activation_budget=0.5, min_offload_bytes=0))
            >>> for step in range(3):
            ...     with store.offload():
            ...         loss = model(torch.randn(512, 256)).square().mean()
            ...     loss.backward()
            ...     print(store.plan() is None)
            True
            True
            False
            >>> str(store.plan()).splitlines()[0].split()
            ['module', 'kept', 'offloaded', 'rebuilt', 'exposed']
            >>> store.close()
        """
        runner = self._runner
        return runner.plan if runner is not None else None

    def stats(self) -> Stats:
        """Bytes per tier now and at peak, entries, and what moved.

        After :meth:`close` it returns the final figures (totals and peaks
        as they were, nothing held now) rather than raising, so a summary
        can be printed once the loop is over.

        Example:
            >>> import torch, tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(
            ...     device_budget=0, host_budget="1MiB", disk_budget=0, min_offload_bytes=0))
            >>> x = torch.ones(256, requires_grad=True)
            >>> with store.offload():
            ...     y = x.exp()
            >>> store.stats().tiers["host"].bytes
            1024
            >>> y.sum().backward(); store.close()
            >>> host = store.stats().tiers["host"]
            >>> host.bytes, host.peak_bytes
            (0, 1024)
        """
        return self._manager.stats()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called.

        Example:
            >>> import tierstore
            >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
            ...     store.closed
            False
            >>> store.closed
            True
        """
        return self._manager.closed

    @property
    def disk_directory(self) -> str | None:
        """The private spill directory, once something has been written to disk.

        Example:
            >>> import tempfile, torch, tierstore
            >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="1MiB",
            ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
            >>> with tierstore.TierStore(cfg) as store:
            ...     print(store.disk_directory)
            ...     x = torch.ones(8, requires_grad=True)
            ...     with store.offload():
            ...         y = x.exp()
            ...     print(store.disk_directory.startswith(str(cfg.disk_path)))
            None
            True
        """
        return self._manager.disk_directory

    def flush(self) -> None:
        """Wait until every saved tensor queued for disk has been written.

        Forward never waits for the disk (writes run behind it, up to
        ``write_queue_bytes``); call this before measuring disk usage, say.
        Raises the error of a write that failed.

        Example:
            >>> import tempfile, torch, tierstore
            >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="1MiB",
            ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
            >>> with tierstore.TierStore(cfg) as store:
            ...     x = torch.ones(1000, requires_grad=True)
            ...     with store.offload():
            ...         y = x.exp()
            ...     store.flush()
            ...     store.stats().tiers["disk"].bytes
            8192
        """
        self._manager.flush()

    def close(self) -> None:
        """Free every entry and remove the spill directory. Idempotent.

        Saved tensors of graphs not yet backpropagated are gone afterwards:
        their backward raises :class:`~tierstore.StoreClosedError`.

        Example:
            >>> import tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(disk_budget=0))
            >>> store.close(); store.close(); store.closed
            True
        """
        try:
            if self._unpacks != self._step_unpacks and not self._manager.closed:
                self._step_ended()  # the last step's line (NOTE [ Step log ])
        finally:
            self._regions.remove()
            self._manager.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<TierStore {state} {self.config!r}>"

    # -- hooks ---------------------------------------------------------------

    # NOTE [ Hooks and Dynamo ] in autograd/recompute.py; a save that stays takes the first return
    # (NOTE [ Saves that stay ] in tiers/manager.py).
    @never_traced
    def _pack(self, t: torch.Tensor) -> Handle | _Kept | tuple[torch.Tensor, int] | Recipe:
        tier = _local.tier
        if tier is None:
            nbytes = _sized(t, self._min_bytes)
            if type(nbytes) is int:
                runner = self._runner
                if runner is None:
                    if self._manager.stays(nbytes):
                        return _kept(t)
                    nbytes = _unusual(t) or nbytes
                    if type(nbytes) is int:
                        return self._pack_stored(t, nbytes, None)
                else:
                    nbytes = _unusual(t) or nbytes
                    if type(nbytes) is int:
                        choice = runner.choose(nbytes)
                        if choice == "keep":  # counted by the runner, not here
                            return _kept(t, nbytes)
                        return self._pack_planned(t, nbytes, choice)
        else:
            if tier == "as is":  # a replayed module's inputs: NOTE [ Replayed modules ]
                return _kept(t, t.numel() * t.element_size())
            nbytes = "keep" if tier == "device" else _offload_nbytes(t, self._min_bytes)
            if type(nbytes) is int:
                runner = self._runner
                if runner is not None and runner.profiling:  # NOTE [ Modules kept whole ]
                    runner.beside(_module_name()[:2], "stored", nbytes)
                return self._pack_stored(t, nbytes, tier)
        if nbytes == "layout" and isinstance(t, _placeholders()):
            # make_fx, FakeTensorMode: no data, and a size that may be
            # symbolic: nothing to count. Not detached: torch 2.11 refuses
            # a FunctionalTensor op here.
            return _Kept(t, t._version)
        size = t.numel() * t.element_size()
        self._manager.count_kept(size, nbytes)  # type: ignore[arg-type]
        runner = self._runner
        if runner is not None:
            if nbytes in ("keep", "min_offload_bytes"):
                runner.kept_fixed(size)  # activations it keeps
            if runner.profiling:  # NOTE [ Modules kept whole ]
                runner.beside(_module_name()[:2], nbytes, size)  # type: ignore[arg-type]
        return _kept(t)

    def _pack_stored(self, t: torch.Tensor, nbytes: int, tier: Tier | None) -> Handle | Recipe:
        """The full path: an entry in the tier manager, or a recipe (NOTE [ Recompute ])."""
        recorder = _recorder()
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
            packed = _unrecorded(self._manager.put, t, nbytes, tier)
            recorder.note_packed(t, packed, self._manager.get)
        else:
            recorder.note_packed(t, packed, None)
        return packed

    def _pack_planned(self, t: torch.Tensor, nbytes: int, choice: Choice | None) -> Handle | Recipe:
        """NOTE [ Planned saves ]: one the plan does not keep (``None``: the safe placement)."""
        runner = self._runner
        assert runner is not None
        recorder = _recorder()
        if choice == "rebuild":
            recipe = recorder.recipe_for(t, nbytes) if recorder is not None else None
            if recipe is None:  # not recorded: NOTE [ Rebuilt from the graph ]
                recipe = graph_recipe(t, nbytes, _held, self._manager.get)
            if recipe is not None:
                if recorder is not None:
                    recorder.note_packed(t, recipe, None)
                self._manager.count_recomputed(nbytes, t.device)
                return recipe
            choice = "offload"  # not rebuildable this time: its bytes still leave
        handle: Handle
        if runner.profiling and t.is_cuda:
            handle = _moving(
                runner, True, _unrecorded, self._manager.put, t, nbytes, _PLACED[choice]
            )
        else:
            handle = _unrecorded(self._manager.put, t, nbytes, _PLACED[choice])
        if recorder is not None:
            recorder.note_packed(t, handle, self._manager.get)
        if runner.profiling:
            op, cost, inputs, made_in = (
                recorder.describe(t) if recorder is not None else ("", None, [], ())
            )
            module, root, compiled = _module_name()
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
                graph=graph_op(t, _held) is not None,
            )
        return handle

    @never_traced
    def _unpack(self, packed: Handle | _Kept | tuple[torch.Tensor, int] | Recipe) -> torch.Tensor:
        self._unpacks += 1  # NOTE [ Step log ]; a lost update under threads only delays a line
        if isinstance(packed, tuple):  # no recorder, no plan's peak: NOTE [ Saves that stay ]
            t, version = packed
            if t._version != version:
                raise modified_in_place(tuple(t.shape), t.dtype, t._version, version)
            return t
        runner = self._runner
        if isinstance(
            packed, _Kept
        ):  # the short way (NOTE [ Saves that stay ] in tiers/manager.py)
            if runner is not None:  # a plan-kept save leaves the peak at its first use
                if ended := runner.used(-1, packed.planned, _graph_task()):
                    self._backward_began(ended)
                packed.planned = 0
            t = packed.tensor
            if t._version != packed.version:
                raise modified_in_place(tuple(t.shape), t.dtype, t._version, packed.version)
            return t
        if runner is not None and (
            ended := runner.used(packed.key if type(packed) is Handle else -1, 0, _graph_task())
        ):
            self._backward_began(ended)
        cuda = type(packed) is Handle and packed.device.type == "cuda"
        if cuda and runner is not None and runner.profiling:  # NOTE [ Pricing a moved save first ]
            return _moving(runner, False, self._fetch, packed)
        return self._fetch(packed)

    def _fetch(self, packed: Handle | Recipe) -> torch.Tensor:
        """The tensor a stored or rebuilt save stands for (a kept one is unpack's short way)."""
        if type(packed) is Recipe:
            return packed.rebuild(self._manager.empty)
        assert isinstance(packed, Handle)
        # Read once for this unpack and the recipes that take it as an input.
        shared = shared_fetch(packed)
        return shared if shared is not None else _unrecorded(self._manager.get, packed)


# -- the process-wide stores behind tierstore.offload() ------------------------

# NOTE [ Stores behind offload() ]
# tierstore.offload(**overrides) keeps a store per configuration, so that a
# loop entering it every step with the same settings reuses one store (its
# threads, host pool, plan and step log). At most MAX_STORES are kept: the
# most recently used. Entering offload() with another configuration retires
# the least recently used one; a later offload() with that configuration
# gets a new store. A retired store may still hold the saved tensors of a
# graph whose forward ran under it and whose backward has not run yet, or
# have an offload() block open in another thread: closing it then would make
# that backward raise StoreClosedError. So a retired store is closed only
# once it is idle (no entry left, no offload() block of this registry open
# on it), checked as each offload() block is entered and left, and at
# interpreter exit. A graph dropped without backward frees its entries as
# autograd drops them, so its store closes at the next check. The store
# yielded by offload() is for use inside the block (stats(), say); create a
# TierStore to keep one for longer.

#: How many stores tierstore.offload() keeps (NOTE [ Stores behind offload() ]).
MAX_STORES = 4

_stores: dict[TierConfig, TierStore] = {}  # least recently used first
_retired: list[TierStore] = []
_blocks: dict[TierStore, int] = {}  # offload() blocks open, per store
_stores_lock = threading.Lock()
_at_exit: list[bool] = []


def _close_all() -> None:
    with _stores_lock:
        stores = [*_stores.values(), *_retired]
        _stores.clear()
        _retired.clear()
    for store in stores:
        store.close()


def _enter_store(config: TierConfig) -> TierStore:
    """The store for ``config``, now the most recently used, with one more block open on it."""
    with _stores_lock:
        store = _stores.pop(config, None)
        if store is None or store.closed:
            if not _at_exit:
                _at_exit.append(True)
                atexit.register(_close_all)
            store = TierStore(config)
        _stores[config] = store  # to the end: the most recently used
        _blocks[store] = _blocks.get(store, 0) + 1
        while len(_stores) > MAX_STORES:
            _retired.append(_stores.pop(next(iter(_stores))))
        idle = _idle_retired()
    for old in idle:
        old.close()
    return store


def _leave_store(store: TierStore) -> None:
    """One block fewer open on ``store``; close retired stores that are idle now."""
    with _stores_lock:
        left = _blocks.pop(store) - 1
        if left:
            _blocks[store] = left
        idle = _idle_retired()
    for old in idle:
        old.close()


def _idle_retired() -> list[TierStore]:
    """Retired stores that may close now (NOTE [ Stores behind offload() ]); under the lock."""
    idle = [
        s for s in _retired if s.closed or (s not in _blocks and not s._manager.holds_entries())
    ]
    for store in idle:
        _retired.remove(store)
    return idle


@contextlib.contextmanager
def offload(config: TierConfig | None = None, **overrides: Any) -> Iterator[TierStore]:
    """Offload saved tensors inside this block to a process-wide store.

    With no arguments the store's configuration comes from the environment,
    the TOML file and the defaults (:func:`tierstore.load_config`); keyword
    arguments override single settings. A store is kept per configuration,
    so a training loop that enters ``offload()`` every step reuses it; the
    four most recently used are kept, and an older one is closed once
    nothing saved in it is left (NOTE [ Stores behind offload() ]). Use the
    yielded store inside the block; create a :class:`TierStore` to keep one.

    Args:
        config: the configuration to use instead of resolving one.
        **overrides: settings that win over ``config`` or the resolved one.

    Yields:
        The store, for :meth:`TierStore.stats`.

    Example:
        >>> import torch, tierstore
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> with tierstore.offload(device_budget=0, disk_budget=0) as store:
        ...     loss = (torch.randn(512, 256) @ w).relu().sum()
        >>> loss.backward()
        >>> store.stats().tiers["host"].bytes
        0
    """
    # A policy function is not a setting (no env var or TOML can hold one): it
    # goes to the block, and the store's own setting stays as resolved.
    policy = overrides.pop("recompute") if callable(overrides.get("recompute")) else None
    config = _resolved(config, overrides, "tierstore.offload(config=...)")
    store = _enter_store(config)
    try:
        with store.offload(policy):
            yield store
    finally:
        _leave_store(store)


# Frames a warning should not point at: tierstore's, torch's (Module.__call__
# running offload_module's hooks) and contextlib's (leaving a with block).
_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.abspath(contextlib.__file__),
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by our caller point at user code."""
    frame = sys._getframe(2)  # the caller of the function that warns
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def _resolved(config: object, overrides: dict[str, Any], where: str) -> TierConfig:
    checked = _checked(config, where)
    if checked is None:
        return load_config(**overrides)
    return with_overrides(checked, overrides)


# -- offload_module --------------------------------------------------------------

# NOTE [ offload_module ]
# A forward pre-hook enters an offload block of the handle's store and a
# forward hook registered with always_call=True leaves it, so a forward that
# raises (or a pre-hook after ours that raises) still pops the saved-tensor
# hooks. Backward runs wherever the caller runs it: outside the block. The
# block stack is per thread (DataParallel runs replicas in threads) and gets a
# placeholder before the block is entered, so a failed entry leaves nothing
# for the forward hook to pop but its own placeholder. The module's tree is
# watched for buffers (NOTE [ Buffer watch ]) in case it was built before
# tierstore was imported.


class _OffloadModule:
    """The hooks :func:`offload_module` put on a module, and the store they use."""

    def __init__(self, module: torch.nn.Module, store: TierStore, owned: bool) -> None:
        self.store = store
        self._owned = owned
        self._name = type(module).__name__
        self._where = f"the forward of {self._name} (offload_module)"
        self._blocks = threading.local()
        _buffers.watch(module)
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _stack(self) -> list[_Block | None]:
        stack: list[_Block | None] | None = getattr(self._blocks, "stack", None)
        if stack is None:
            stack = self._blocks.stack = []
        return stack

    @never_traced
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        stack = self._stack()
        stack.append(None)
        if not _local.replaying:  # NOTE [ Replayed modules ] in planning/planner.py
            stack[-1] = self.store._open_block()

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        block = stack.pop() if stack else None
        if block is not None:
            # Inside the except clause of Module.__call__ when forward raised.
            ok = sys.exc_info()[1] is None
            self.store._close_block(block, ok, self._where)

    def remove(self) -> None:
        """Take the hooks off the module and close the store if ``offload_module`` made it.

        Idempotent. Call it after the last backward that needs the saved
        tensors: their backward raises :class:`~tierstore.StoreClosedError`
        once the store is closed. A store passed as ``store=`` stays open.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._owned:
            self.store.close()

    def __enter__(self) -> _OffloadModule:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if not self._handles else "active"
        return f"<offload_module {state} on {self._name}, {self.store!r}>"


def offload_module(
    module: torch.nn.Module,
    config: TierConfig | None = None,
    *,
    store: TierStore | None = None,
    **overrides: Any,
) -> _OffloadModule:
    """Offload every tensor saved inside ``module``'s forward, every time it runs.

    The one-line form of wrapping each forward in :meth:`TierStore.offload`:
    run forward and backward as usual; the saves made inside the module's
    forward go to the store, backward (run outside the forward) brings them
    back. Saves outside the module (a loss computed on its output, say) are
    not offloaded. A forward under ``torch.no_grad()`` (evaluation) saves
    nothing, so costs nothing.

    The handle owns the store it creates: ``handle.store`` gives its
    :meth:`~TierStore.stats`, and ``handle.remove()`` (idempotent; also on
    leaving ``with offload_module(...)``) takes the hooks off and closes the
    store. Pass ``store=`` to share one store between several modules (each
    transformer block, say); ``remove()`` then leaves it open.

    Args:
        module: the module whose forward's saves go to the store.
        config: the store's configuration; ``None`` resolves one as
            :func:`tierstore.offload` does.
        store: an open store to use instead of creating one.
        **overrides: settings that win over ``config`` or the resolved one.

    Returns:
        A handle with ``.store`` and ``.remove()``.

    Raises:
        ConfigError: ``store=`` given together with ``config`` or settings.

    Example:
        >>> import torch, tierstore
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        >>> handle = tierstore.offload_module(model, device_budget=0, disk_budget=0,
        ...                                   min_offload_bytes=0)
        >>> loss = model(torch.randn(32, 64)).square().sum()  # forward: saves are stored
        >>> handle.store.stats().tiers["host"].entries
        2
        >>> loss.backward()  # outside the forward, as usual
        >>> handle.remove(); handle.store.closed
        True
    """
    if store is not None:
        if config is not None or overrides:
            raise ConfigError(
                "tierstore: offload_module() takes either store= or a configuration "
                f"(config={config!r}, settings {sorted(overrides)}), not both; configure "
                "the store when you create it"
            )
        store._manager.check_open()
        return _OffloadModule(module, store, owned=False)
    resolved = _resolved(config, overrides, "tierstore.offload_module(config=...)")
    return _OffloadModule(module, TierStore(resolved), owned=True)
