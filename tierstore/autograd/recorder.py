"""The recorder: a dispatch mode that notes which op made each tensor, for rebuilds.

Example:
    >>> import torch
    >>> from tierstore.autograd.recompute import cheap
    >>> from tierstore.autograd.recorder import Recorder
    >>> with Recorder(cheap, lambda t: False) as recorder:
    ...     y = torch.ones(4).exp()
    >>> recorder.paused
    0
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SelectiveCheckpointContext

from tierstore.autograd.graph import LAYER_NORM, note_eps, view_key
from tierstore.autograd.recipes import ALLOCATIONS, Layouts, Origin, Recipe, Ref, flatten_args
from tierstore.autograd.recompute import (
    MAX_DEPTH,
    RECOMPUTE_POLICIES,
    Policy,
    never_recorded,
    never_traced,
)
from tierstore.tiers.weak import WeakKeyMap

__all__ = ["Recorder"]


class Recorder(TorchDispatchMode):
    """Notes which op made each tensor, so the pack hook can hand out recipes.

    One per thread, pushed by the outermost ``offload()`` block that asks for
    recompute and popped when it ends (NOTE [ Recompute ]).

    Args:
        policy: decides per op, as selective checkpointing's policies do.
        is_kept: whether a tensor stays on the device anyway (a parameter,
            a buffer, or under ``min_offload_bytes``).

    Example:
        >>> import torch
        >>> from tierstore.autograd.recompute import cheap
        >>> from tierstore.autograd.recorder import Recorder
        >>> rec = Recorder(cheap, lambda t: False)
        >>> with rec:
        ...     y = torch.ones(4).exp()
        >>> rec.recipe_for(y, 16) is None  # its input is stored nowhere
        True
    """

    def __init__(
        self,
        policy: Policy,
        is_kept: Callable[[torch.Tensor], bool],
        *,
        max_depth: int = MAX_DEPTH,
        timer: Any = None,
        where: Callable[[], str] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._where = where  # the module running now, for a profile (NOTE [ Planned steps ])
        self._policy = policy
        self._is_kept = is_kept
        self._max_depth = max_depth
        self._timer = timer  # a profile's Timer (planning/timers.py): each op is a span of it
        # Above 0 while tierstore's own hooks run ops (a copy off the device, a
        # detach): they are neither recorded nor timed as the step's compute.
        self.paused = 0
        self._ctx = SelectiveCheckpointContext(is_recompute=False)
        # storage -> {view key: (version, ...)}; weak on the storage, so an
        # entry dies with its memory and a reused address never matches; with
        # no Python run as it dies (NOTE [ Finalizers and interrupts ] in
        # tierstore/tiers/release.py).
        self._packed: WeakKeyMap[dict[Any, tuple[int, Any, Any, int]]] = WeakKeyMap()
        self._origins: WeakKeyMap[dict[Any, tuple[int, Origin, Any]]] = WeakKeyMap()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile'd code run compiled under this mode (it records only eager ops)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func is LAYER_NORM:
            note_eps(args, kwargs)  # NOTE [ A norm's eps ]
        if self._timer is not None:
            return self._timed_call(func, args, kwargs)
        out = func(*args, **kwargs)
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not never_recorded(func)
            and self._policy(self._ctx, func, *args, **kwargs) in RECOMPUTE_POLICIES
        ):
            self._record(func, args, kwargs, out)
        return out

    def _timed_call(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A profiled step (NOTE [ Planned steps ], planning/runner.py): each op's time, to rebuild.

        The op is a span of the profile's timer: on CUDA two events around
        it on the current stream, read when the profile becomes a plan
        (NOTE [ Timing a profile ] in planning/timers.py): no synchronisation, which
        would make the op look slower than it is.
        """
        timer = self._timer
        cost: float | Callable[[], float] = 0.0
        if func.is_view or func._overloadpacket in ALLOCATIONS:
            # No kernel: on a device its span would time only the host (an
            # allocation that waited on the device took 340 ms of a profile).
            out = func(*args, **kwargs)
        else:
            start = timer.begin()
            out = func(*args, **kwargs)
            end = timer.end()
            cost = (
                end - start
                if type(start) is float
                else functools.partial(timer.elapsed, start, end)
            )
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not never_recorded(func)
            and self._policy(self._ctx, func, *args, **kwargs) in RECOMPUTE_POLICIES
        ):
            origin = self._record(func, args, kwargs, out)
            if origin is not None:
                origin.cost = cost
                if self._where is not None:
                    origin.module = self._where()
        return out

    def describe(self, t: torch.Tensor) -> Described:
        """The op that made ``t``, what rebuilding it costs, what it reads, and where it ran.

        The cost is ``None`` when ``t`` cannot be rebuilt; seconds, or on
        CUDA a function that reads them once the step's events have run
        (NOTE [ Timing a profile ] in planning/timers.py). Where: the modules that ran
        the ops a rebuild replays, when the recorder was told (``where``).
        """
        made = self._origins.get(t.untyped_storage(), {}).get(view_key(t))
        if made is None or made[0] != t._version:
            return "", None, [], ()
        origin = made[1]
        ops, packed = origin.rebuild_cost()
        name = f"aten.{origin.func._overloadpacket.__name__}"
        where = tuple(sorted({op.module for op in ops}))
        if all(isinstance(op.cost, float) for op in ops):
            return name, sum(op.seconds() for op in ops), packed, where
        return name, lambda: sum(op.seconds() for op in ops), packed, where

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> Origin | None:
        flat, spec = flatten_args(args, kwargs)
        leaves: list[Any] = []
        depth = 1
        for leaf in flat:
            if isinstance(leaf, torch.Tensor):
                ref = self._resolve(leaf)
                if ref is None:
                    return None
                depth = max(depth, ref[3] + 1)
                if depth > self._max_depth:  # a longer chain is stored, which cuts it
                    return None
                leaves.append(ref)
            else:
                leaves.append(leaf)
        outs: Layouts = ()
        if isinstance(out, (tuple, list)) and all(type(o) is torch.Tensor for o in out):
            outs = tuple((tuple(o.shape), tuple(o.stride()), o.dtype) for o in out)
        origin = Origin(func, spec, leaves, depth, outs)
        if isinstance(out, torch.Tensor):
            self._note_origin(out, origin, None)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self._note_origin(o, origin, i)
        return origin

    def _note_origin(self, t: torch.Tensor, origin: Origin, index: int | None) -> None:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return
        self._origins.setdefault(t.untyped_storage(), {})[view_key(t)] = (
            t._version,
            origin,
            index,
        )

    def _resolve(self, t: torch.Tensor) -> Ref | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None  # a tracing subclass, DTensor, ...
        if t.layout is not torch.strided or t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        key = view_key(t)
        found = self._packed.get(storage, {}).get(key)
        if found is not None and found[0] == t._version:
            return ("packed", found[1], found[2], found[3])
        if t.is_leaf and self._is_kept(t):  # is_leaf: no grad_fn, and no Python node made
            # The tensor itself: below autograd, detach() would not share its
            # version counter. Only without a grad_fn, so a recipe never holds
            # a graph (which holds the recipe).
            return ("tensor", t, t._version, 0)
        made = self._origins.get(storage, {}).get(key)
        if made is not None and made[0] == t._version:
            return ("origin", made[1], made[2], made[1].depth)
        return None

    def note_packed(
        self, t: torch.Tensor, packed: Any, fetch: Callable[[Any], torch.Tensor] | None
    ) -> None:
        """Remember what autograd holds for ``t``: later ops may rebuild from it.

        ``fetch`` reads a stored ``packed`` back; ``None`` for a tensor kept as
        it is (which has ``.tensor`` and ``.version``) or a :class:`Recipe`.
        """
        depth = packed.depth if type(packed) is Recipe else 0
        self._packed.setdefault(t.untyped_storage(), {})[view_key(t)] = (
            t._version,
            weakref.ref(packed),
            fetch,
            depth,
        )

    def recipe_for(self, t: torch.Tensor, nbytes: int) -> Recipe | None:
        """A recipe that rebuilds ``t``, or ``None`` when it must be stored."""
        made = self._origins.get(t.untyped_storage(), {}).get(view_key(t))
        if made is None or made[0] != t._version:
            return None
        node = made[1].node_for()
        if node is None:
            return None
        return Recipe(node, made[2], t, nbytes, made[1].depth)


# NOTE [ Hooks and Dynamo ]: the dispatch as written, without the wrapper
# TorchDispatchMode's subclass hook puts around it (where the torch has one).
Recorder.__torch_dispatch__ = never_traced(  # type: ignore[method-assign]
    inspect.unwrap(Recorder.__dict__["__torch_dispatch__"])
)


#: What :meth:`Recorder.describe` tells of a tensor: op, cost, packed inputs, modules.
Described = tuple[str, "float | Callable[[], float] | None", list[Any], tuple[str, ...]]
