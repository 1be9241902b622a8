"""Recompute: saved tensors that a cheap op can rebuild in backward are never stored.

This module is part of the autograd boundary (with ``tier_store.py``): it knows
ops, not bytes. While an ``offload()`` block runs with ``recompute="cheap"``
(or a policy function), a :class:`Recorder` notes which op made each tensor.
When autograd then saves a tensor that a cheap op made from inputs that are
stored anyway, the pack hook returns a :class:`Recipe` instead of storing
it. In backward the recipe fetches its inputs and runs the op again.

Example:
    >>> import torch, tierstore
    >>> store = tierstore.TierStore(tierstore.TierConfig(
    ...     device_budget=0, disk_budget=0, min_offload_bytes=0, recompute="cheap"))
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> with store.offload():
    ...     y = torch.nn.functional.gelu(x)   # gelu saves x: stored
    ...     z = y @ y                         # y: rebuilt from x in backward
    >>> z.sum().backward()
    >>> store.stats().recomputed
    2
    >>> store.close()
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from tierstore.errors import ConfigError, TierstoreError, modified_in_place
from tierstore.tiers.handle import Handle, Saved

__all__ = [
    "CHEAP_OPS",
    "GRAPH_OPS",
    "GraphOp",
    "Policy",
    "Recipe",
    "Recorder",
    "cheap",
    "everything",
    "graph_op",
    "graph_recipe",
    "never_traced",
]

# NOTE [ Hooks and Dynamo ]
# Dynamo must never trace the hooks (locks, threads, file I/O) nor the
# recorder's dispatch. It would: eager code that runs while its frame
# callback is active (module.compile() on a module it does not capture)
# calls them as new frames, and compiled autograd calls the unpack hook from
# its graph. torch.compiler.disable's wrapper costs microseconds a call (it
# swaps the frame callback out and back), which is most of what a save that
# stays may cost (NOTE [ Saves that stay ] in tiers/manager.py), and torch 2.13 puts
# one around every TorchDispatchMode's __torch_dispatch__: 2.5 us of the
# recorder's 16 us an op on a 2-vCPU VM. So each hook's code object, and
# the recorder's dispatch's, is marked for Dynamo to skip, itself and every
# frame it calls (the frame-evaluation hook reads the mark in C, and only
# while a callback is set), and the function carries the attribute by which
# Dynamo, tracing a graph that calls it, calls it rather than inlining it:
# no wrapper, nothing to pay in eager. A torch without those marks gets the
# disabled wrapper.

_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)

_HookT = TypeVar("_HookT", bound=Callable[..., Any])


def never_traced(fn: _HookT) -> _HookT:
    """``fn``, which Dynamo never traces, at no cost in eager (NOTE [ Hooks and Dynamo ]).

    Example:
        >>> from tierstore.autograd.recompute import never_traced
        >>> @never_traced
        ... def pack(t):
        ...     return t
        >>> pack(1)
        1
    """
    mark = getattr(_eval_frame, "set_code_exec_strategy", None)
    strategy = getattr(_eval_frame, "_FrameExecStrategy", None)
    action = getattr(_eval_frame, "_FrameAction", None)
    if mark is None or strategy is None or action is None:
        return torch._compile._disable_dynamo(fn)  # type: ignore[return-value]
    mark(fn.__code__, strategy(action.SKIP, action.SKIP))
    # What Dynamo reads when it meets the function while tracing a graph
    # (compiled autograd's backward): call it as it is, never inline it.
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    return fn


# NOTE [ Recompute ]
# A large share of what a decoder saves for backward is the output of a cheap
# elementwise op whose inputs are saved anyway: SwiGLU's silu(gate) and its
# product, RMSNorm's scaled output, LayerNorm's output, GELU's output. Storing
# them means moving them out and back; rebuilding them costs one cheap op.
#
# How. While an offload() block runs with recompute on, a TorchDispatchMode
# (Recorder) sees every op below autograd. For an op the policy marks for
# recompute, it resolves each tensor input *at once*, while the input is
# alive, to something backward can get it from:
#   * the packed object autograd already holds for it (a Handle, a kept
#     tensor, or another Recipe). Autograd packs an op's inputs before it
#     runs the op, so an input that this op saves is found here;
#   * a parameter or buffer, or a tensor under min_offload_bytes that is not
#     the output of a differentiable op: held as it is (the module holds the
#     former anyway; the latter are small);
#   * another op's output that was recorded the same way, up to MAX_DEPTH
#     ops deep (RMSNorm's rsqrt(mean(x.pow(2)))).
# An input that resolves to none of these makes the output not rebuildable:
# rebuilding it would need bytes that would otherwise not be stored.
# When autograd saves that output, the pack hook asks for a Recipe: the op,
# its non-tensor arguments, and strong references to its inputs' packed
# objects (so their entries live as long as the recipe). The tier manager
# never sees a recipe: prefetching one is prefetching its inputs' handles,
# which backward fetches when it rebuilds.
#
# Exact. The same op on the same bytes in the same layout on the same device
# gives the same bits; a rebuilt tensor is checked against the shape, dtype
# and strides it had, and its rebuild runs with grad mode and autocast off.
# Never recorded: ops that mutate (in-place, out=), ops with random results
# (dropout, the Tag.nondeterministic_seeded ops), anything whose arguments
# are not plain tensors (FakeTensor, FunctionalTensor: torch.compile and
# make_fx tracing), and anything while Dynamo traces or grad mode is off.
#
# Memory. A Node rebuilt for one consumer is cached while other consumers it
# is known to have (autograd's unpacks of its recipes, parent nodes that
# reference it) have not fetched it yet, then dropped; the next backward of a
# retained graph rebuilds it again. A stored input is shared the same way
# (_Stored): the rebuild and the input's own backward node take one read of
# it, not two. Inputs held as they are (parameters, small tensors) are
# checked for in-place changes since the op ran (their version counters): a
# rebuild from changed inputs would be a wrong gradient, so it raises
# instead; a stored input's own entry does the same check at its read.

# NOTE [ Recompute under threads ]
# A Recorder is per thread, but what it makes is shared: backward can unpack
# one graph's saves on several threads (autograd's device threads; two
# backward calls on a retained graph), and a stored input's _Stored is
# looked up by whichever thread unpacks it. Each _Shared value therefore
# has a lock, held while the value is made: a second consumer waits and
# takes the cached value (one read, one rebuild), and the use counts that
# decide when the cache is dropped are never lost. A node's lock is taken
# before its inputs' (the graph of nodes has no cycles, so neither has the
# lock order), and nothing that runs under one takes a node's lock again.
# _Origin.node_for publishes an op's node under _nodes_lock, so two callers
# get the same node and its inputs count it once.

#: Guards _Origin.node (NOTE [ Recompute under threads ]).
_nodes_lock = threading.Lock()

#: Whether autocast is on for any device; torch.autocast(enabled=False) where
#: it is unknown (a torch without this query).
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)

#: The most ops a chain of never-saved intermediates may span.
MAX_DEPTH = 8

#: Ops ``recompute="cheap"`` rebuilds: deterministic elementwise and
#: normalisation ops, and views. Never random, in-place, matmul, convolution or
#: attention ops. Names are ``torch.ops.aten`` overload packets.
CHEAP_OPS: frozenset[str] = frozenset(
    {
        # elementwise arithmetic and activations
        "abs", "add", "sub", "rsub", "mul", "div", "neg", "pow", "square",
        "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos",
        "relu", "gelu", "silu", "sigmoid", "tanh", "erf", "softplus", "mish",
        "hardtanh", "leaky_relu", "elu", "clamp", "clamp_min", "clamp_max",
        "minimum", "maximum", "where", "masked_fill",
        # copies: casts on the same device, contiguous copies, concatenation
        "_to_copy", "clone", "cat",
        # normalisation
        "native_layer_norm", "_fused_rms_norm", "mean",
        # views
        "view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "detach",
        "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
        "slice", "select", "split", "split_with_sizes", "unbind", "chunk",
    }
)  # fmt: skip

#: A policy function in the form selective activation checkpointing uses.
Policy = Callable[..., CheckpointPolicy]

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def cheap(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``recompute="cheap"`` rule: recompute the ops in :data:`CHEAP_OPS`, save the rest.

    A policy in the form of :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`;
    wrap it to make your own (random and mutating ops are never recomputed,
    whatever a policy says).

    Example:
        >>> import torch
        >>> from tierstore.autograd.recompute import cheap
        >>> cheap(None, torch.ops.aten.gelu.default).name
        'PREFER_RECOMPUTE'
        >>> cheap(None, torch.ops.aten.mm.default).name
        'PREFER_SAVE'
    """
    if "device" in kwargs and op._overloadpacket is torch.ops.aten._to_copy:
        return CheckpointPolicy.PREFER_SAVE  # a copy to another device is not cheap
    return _cheap_policy(op)


def everything(
    ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    """The planner's rule: any op may be rebuilt; the plan picks which saves are.

    Random and mutating ops are still never recorded (NOTE [ Recompute ]).

    Example:
        >>> import torch
        >>> from tierstore.autograd.recompute import everything
        >>> everything(None, torch.ops.aten.mm.default).name
        'PREFER_RECOMPUTE'
    """
    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _cheap_policy(op: Any) -> CheckpointPolicy:
    listed = op._overloadpacket.__name__ in CHEAP_OPS
    return CheckpointPolicy.PREFER_RECOMPUTE if listed else CheckpointPolicy.PREFER_SAVE


@functools.cache
def _never(op: Any) -> bool:
    """Ops no policy may recompute: mutating or random ones (looked up once per op)."""
    return bool(op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags)


# An op's arguments as a flat list of leaves and the shape to rebuild them
# from: aten ops take tensors as arguments or in a list (cat, where's
# lists of indices), never deeper, so one level of flattening is enough and
# far cheaper than a general pytree (which was half the recorder's cost).
_Spec = tuple[tuple[Any, ...], tuple[str, ...]]


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], _Spec]:
    leaves: list[Any] = []
    shape: list[Any] = []
    for value in (*args, *kwargs.values()):
        if type(value) in (list, tuple):
            shape.append((type(value), len(value)))
            leaves.extend(value)
        else:
            shape.append(None)
            leaves.append(value)
    return leaves, (tuple(shape), tuple(kwargs))


def _unflatten(leaves: list[Any], spec: _Spec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    shape, names = spec
    values: list[Any] = []
    i = 0
    for kind in shape:
        if kind is None:
            values.append(leaves[i])
            i += 1
        else:
            container, n = kind
            values.append(container(leaves[i : i + n]))
            i += n
    split = len(values) - len(names)
    return tuple(values[:split]), dict(zip(names, values[split:], strict=True))


# What a tensor argument of a recorded op resolves to (NOTE [ Recompute ]),
# with the number of ops a rebuild of it runs:
# ("packed", weakref to the packed object, fetch, depth), ("tensor", tensor,
# version, 0), ("origin", _Origin, output index, depth).
_Ref = tuple[str, Any, Any, int]


#: Ops that allocate and launch nothing: a profile does not time them.
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty,
        torch.ops.aten.empty_like,
        torch.ops.aten.empty_strided,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    }
)


class _Origin:
    """One recorded op: what made a tensor, with its tensor arguments resolved."""

    __slots__ = ("__weakref__", "cost", "depth", "func", "leaves", "module", "node", "outs", "spec")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], depth: int, outs: _Layouts) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves  # constants, or _Ref for tensors
        self.depth = depth
        self.outs = outs  # the layouts of several outputs, for out= (else empty)
        self.node: weakref.ref[_Node] | None = None
        # The op's own time when the recorder times ops: seconds, or a function
        # that reads its span's events (NOTE [ Timing a profile ] in planning/timers.py).
        self.cost: float | Callable[[], float] = 0.0
        self.module = ""  # where it ran, when the recorder is told (a profiled step)

    def seconds(self) -> float:
        """The op's own time (waits for its events on CUDA)."""
        cost = self.cost
        return cost if isinstance(cost, float) else cost()

    def rebuild_cost(self) -> tuple[list[_Origin], list[Any]]:
        """The ops a rebuild replays, and the packed objects it reads.

        The ops are this one and the never-saved ones under it (NOTE
        [ Planned steps ] in planning/runner.py); their times are read later.
        """
        ops = [self]
        packed: list[Any] = []
        for leaf in self.leaves:
            if type(leaf) is not tuple:
                continue
            kind, ref, _, _ = leaf
            if kind == "origin":
                below, inputs = ref.rebuild_cost()
                ops += below
                packed += inputs
            elif kind == "packed" and (obj := ref()) is not None:
                packed.append(obj)
        return ops, packed

    def node_for(self) -> _Node | None:
        """The shared rebuild node of this op, or ``None`` if an input is gone."""
        node = self.node() if self.node is not None else None
        if node is not None:
            return node
        leaves: list[Any] = []
        for leaf in self.leaves:
            if type(leaf) is not tuple:
                leaves.append(leaf)
                continue
            kind, ref, extra, _ = leaf
            if kind == "tensor":
                leaves.append(_Input(ref, extra))
            elif kind == "origin":
                child = ref.node_for()
                if child is None:
                    return None
                leaves.append(_Input(child, extra))
            else:
                packed = ref()
                if packed is None:
                    return None
                if type(packed) is Recipe and type(packed._node) is _GraphNode:
                    leaves.append(_Input(_FromGraph(packed), None))  # made where no recorder ran
                elif type(packed) is Recipe:  # its node serves both
                    leaves.append(_Input(packed._node, packed._index))
                elif extra is None:  # kept as it is: its detached alias shares the version
                    leaves.append(_Input(packed.tensor, packed.version))
                else:
                    leaves.append(_Input(_Stored.of(packed, extra), None, packed))
        with _nodes_lock:  # NOTE [ Recompute under threads ]
            node = self.node() if self.node is not None else None
            if node is not None:  # another thread made it meanwhile: theirs serves both
                return node
            for leaf in leaves:  # every input resolved: count this node as their user
                if type(leaf) is _Input and isinstance(leaf.source, _Shared):
                    leaf.source.add_use()
            node = _Node(self.func, self.spec, leaves, self.outs)
            self.node = weakref.ref(node)
        return node


class _Input:
    """A resolved tensor argument of a node: a shared value, or a tensor held as it is."""

    __slots__ = ("hold", "index", "source")

    def __init__(self, source: Any, index: Any, hold: Any = None) -> None:
        self.source = source
        self.index = index  # for a shared value: the output index; for a tensor: its version
        self.hold = hold  # a stored input's packed object: its entry lives as long as this


class _Shared:
    """A value backward fetches or rebuilds once and hands to each known consumer.

    ``uses`` counts the consumers known at forward (autograd's unpacks, nodes
    that take it as an input); the value is cached until that many have
    fetched it, then dropped (NOTE [ Recompute ]: Memory).
    """

    __slots__ = ("__weakref__", "_cache", "_lock", "_pending", "uses")

    def __init__(self, uses: int) -> None:
        self.uses = uses
        self._pending = 0
        self._cache: Any = None
        self._lock = threading.Lock()

    def add_use(self) -> None:
        """One more consumer will fetch the value."""
        with self._lock:
            self.uses += 1

    def _make(self, alloc: _Alloc | None) -> Any:
        raise NotImplementedError

    def value(self, alloc: _Alloc | None = None) -> Any:
        """The value, made now (into ``alloc``'s memory if it can) or taken from the cache.

        A consumer that comes while another makes it waits for that one
        (NOTE [ Recompute under threads ]).
        """
        with self._lock:
            out = self._cache
            if out is None:
                out = self._make(alloc)
                self._pending = self.uses
            self._pending -= 1
            self._cache = out if self._pending > 0 else None
            return out


class _Node(_Shared):
    """An op to run again in backward."""

    __slots__ = ("func", "leaves", "outs", "spec")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], outs: _Layouts) -> None:
        super().__init__(0)
        self.func = func
        self.spec = spec
        self.leaves = leaves
        self.outs = outs

    def _make(self, alloc: _Alloc | None) -> Any:
        args, kwargs = _unflatten([_value(leaf) for leaf in self.leaves], self.spec)
        return _run(self.func, args, kwargs, alloc, self.outs)


def _run(func: Any, args: Any, kwargs: dict[str, Any], alloc: _Alloc | None, outs: _Layouts) -> Any:
    """``func(*args, **kwargs)``, into ``alloc``'s memory where it gives some.

    NOTE [ Rebuilt tensors in the store's memory ]: through the op's out=
    overload, the output ``alloc`` names in that memory and any others in
    fresh tensors of the layouts ``outs`` gives.
    """
    found = _out_overload(func) if alloc is not None else None
    if found is not None and len(found[1]) in (1, len(outs)):
        assert alloc is not None
        out_op, names = found
        buf = alloc[0]()
        if buf is not None:
            if len(names) == 1:
                return out_op(*args, **kwargs, out=buf)
            others = {
                name: buf
                if i == alloc[1]
                else torch.empty_strided(shape, stride, dtype=dtype, device=buf.device)
                for i, (name, (shape, stride, dtype)) in enumerate(zip(names, outs, strict=True))
            }
            return out_op(*args, **kwargs, **others)
    return func(*args, **kwargs)


# NOTE [ Rebuilt tensors in the store's memory ]
# A tensor backward receives from the disk lands in tierstore's own pool
# (NOTE [ Leased buffers ]), which gives its pages back between steps; a
# rebuilt one made by the functional op would come from the process heap,
# which glibc keeps, so that `top` showed recompute's rebuilt tensors as
# more resident memory than the reads they replace (peak RSS 1.05-1.11x of
# recompute off on bench train's GPT, while live memory was lower). So the
# tensor a recipe hands to autograd is written by the op's out= overload into
# a buffer from the store (same kernel, same layout: the same bits; tested
# for every op of CHEAP_OPS that has one; an op with several outputs, such as
# native_layer_norm, gets the others in fresh tensors of the layouts forward
# gave them). Views, ops without a matching out= overload, intermediates,
# CUDA tensors and tensors under POOLED_MIN_BYTES (tierstore/tiers/manager.py: a
# lease costs more Python than the op that fills one, and glibc's heap
# reuses so small a chunk within the step) keep the functional op.
@functools.cache
def _out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """``func``'s out= overload, taking its arguments plus one out= per output, and their names."""
    schema = func._schema
    if any(r.alias_info is not None for r in schema.returns):
        return None
    names = [a.name for a in schema.arguments]
    packet = func._overloadpacket
    for name in (f"{func._overloadname}_out", "out"):
        if name not in packet.overloads():
            continue
        candidate = getattr(packet, name)
        args = [a.name for a in candidate._schema.arguments]
        outs = tuple(args[len(names) :])
        if args[: len(names)] == names and len(outs) == len(schema.returns):
            return candidate, outs
    return None


#: Memory for a rebuilt tensor (a tensor of the saved layout, or None), and which
#: output of the op it is for (None: the only one).
_Alloc = tuple[Callable[[], "torch.Tensor | None"], "int | None"]
#: (shape, stride, dtype) of each output of an op with several, else ().
_Layouts = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]


# A stored packed object (a Handle) that recipes read -> its _Stored:
# autograd's own unpack of it then shares the read (shared_fetch). The value
# is strong and refers to the handle weakly, so the entry (and a read it
# caches) lives exactly as long as the handle: as long as autograd or a node
# holds it, and no longer.
_stored: weakref.WeakKeyDictionary[Any, _Stored] = weakref.WeakKeyDictionary()
_stored_lock = threading.Lock()


class _Stored(_Shared):
    """A stored saved tensor that recipes take as an input: read once for all its users."""

    __slots__ = ("fetch", "packed")

    def __init__(self, packed: Any, fetch: Callable[[Any], torch.Tensor]) -> None:
        super().__init__(1)  # autograd's own unpack of it
        self.packed = weakref.ref(packed)
        self.fetch = fetch

    @staticmethod
    def of(packed: Any, fetch: Callable[[Any], torch.Tensor]) -> _Stored:
        with _stored_lock:
            stored = _stored.get(packed)
            if stored is None:
                stored = _stored[packed] = _Stored(packed, fetch)
            return stored

    def _make(self, alloc: _Alloc | None) -> Any:
        packed = self.packed()
        assert packed is not None  # whoever asks holds it
        return self.fetch(packed)


class _FromGraph(_Shared):
    """A save rebuilt from the graph that a recorded node takes as an input.

    NOTE [ Rebuilt from the graph ]: the recipe's own node shares nothing
    (autograd's unpack of the save rebuilds it apart), so this rebuilds it
    once more for the recorded node, as the saved tensor, view and all.
    """

    __slots__ = ("recipe",)

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(0)  # the node that takes it counts itself
        self.recipe = recipe

    def _make(self, alloc: _Alloc | None) -> Any:
        return self.recipe.rebuild(_no_memory)


def _no_memory(*args: Any) -> None:
    """Memory for a rebuilt input: none of the store's, the op's own."""


def shared_fetch(packed: Any) -> torch.Tensor | None:
    """The tensor for a stored save that recipes also read, read once for all; else ``None``.

    Example:
        >>> from tierstore.autograd.recompute import shared_fetch
        >>> shared_fetch(object()) is None
        True
    """
    if not _stored:
        return None
    with _stored_lock:
        stored = _stored.get(packed)
    return stored.value() if stored is not None else None


def _value(leaf: Any) -> Any:
    if type(leaf) is not _Input:
        return leaf
    source = leaf.source
    if isinstance(source, _Shared):
        out = source.value()
        return out if leaf.index is None else out[leaf.index]
    if source._version != leaf.index:
        raise TierstoreError(
            "tierstore: an input of a recomputed saved tensor (shape "
            f"{list(source.shape)}, dtype {source.dtype}) was modified in place after "
            f"forward used it: it is at version {source._version}, expected version "
            f"{leaf.index}. Rebuilding from it would give a wrong gradient; modify it "
            "after backward, or set recompute='off' (TIERSTORE_RECOMPUTE)"
        )
    return source


class Recipe(Saved):
    """What autograd holds in place of a saved tensor that backward rebuilds.

    Attributes:
        shape, dtype, stride, device, version: as :class:`~tierstore.tiers.handle.Saved`.
        nbytes: the bytes it would have rested in had it been stored.
        depth: how many ops its rebuild runs, at most ``MAX_DEPTH``.

    Example:
        >>> import torch, tierstore
        >>> store = tierstore.TierStore(tierstore.TierConfig(
        ...     device_budget=0, disk_budget=0, min_offload_bytes=0, recompute="cheap"))
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> with store.offload():
        ...     y = x.sin().exp()               # sin saves x; exp saves its output
        >>> store.stats().recomputed            # exp(sin(x)) is rebuilt from x
        1
        >>> y.sum().backward(); store.close()
    """

    __slots__ = ("_index", "_node", "_view", "depth", "nbytes")

    def __init__(
        self,
        node: _Node | _GraphNode,
        index: int | None,
        t: torch.Tensor,
        nbytes: int,
        depth: int,
        *,
        view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None,
    ) -> None:
        super().__init__(t)
        if type(node) is _Node:  # a graph node has this recipe alone for its user
            node.add_use()
        self._node = node
        self._index = index
        self.nbytes = nbytes
        self.depth = depth
        # The op made the saved tensor's base, of this shape and stride; the
        # saved tensor is a view of it at this offset (NOTE [ Rebuilt from the graph ]).
        self._view = view

    def rebuild(
        self, empty: Callable[[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], Any]
    ) -> torch.Tensor:
        """Run the op again on its inputs and return the saved tensor, bitwise.

        ``empty(shape, stride, dtype, device)`` gives memory for the result (the
        store's pool on a CPU) or ``None`` (NOTE [ Rebuilt tensors in the store's memory ]).

        Raises:
            TierstoreError: the saved tensor or an input was modified in place
                after forward used it (the error eager autograd raises).
        """
        for alias in self.sources():
            if alias is not None and alias._version != self.version:
                raise modified_in_place(self.shape, self.dtype, alias._version, self.version)

        view = self._view
        shape, stride = (self.shape, self.stride) if view is None else view[:2]

        def alloc() -> torch.Tensor | None:
            buf: torch.Tensor | None = empty(shape, stride, self.dtype, self.device)
            return buf

        if torch.is_grad_enabled() or _any_autocast():  # create_graph=True, or under autocast
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                out = self._node.value((alloc, self._index))
        else:  # as backward runs: neither context needed, and each costs microseconds
            out = self._node.value((alloc, self._index))
        t: torch.Tensor = out if self._index is None else out[self._index]
        if view is not None:
            if (tuple(t.shape), tuple(t.stride())) != view[:2]:
                raise TierstoreError(
                    f"tierstore: recomputing {self._node.func} gave shape {list(t.shape)} "
                    f"and strides {list(t.stride())}, but forward's output had "
                    f"{list(view[0])} and {list(view[1])}; please report this, and set "
                    "activation_budget=None (TIERSTORE_ACTIVATION_BUDGET) meanwhile"
                )
            t = t.as_strided(self.shape, self.stride, t.storage_offset() + view[2])
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise TierstoreError(
                f"tierstore: recomputing {self._node.func} gave shape {list(t.shape)} "
                f"and dtype {t.dtype}, but forward saved {list(self.shape)} and "
                f"{self.dtype}; please report this, and set recompute='off' "
                "(TIERSTORE_RECOMPUTE) meanwhile"
            )
        if tuple(t.stride()) != self.stride:  # same bits, another layout: restore it
            t = torch.empty_strided(
                self.shape, self.stride, dtype=self.dtype, device=self.device
            ).copy_(t)
        return t

    def __repr__(self) -> str:
        return f"Recipe({self._node.func}, shape={self.shape}, dtype={self.dtype})"


class _GraphNode:
    """The op a recipe read off the autograd graph runs again: NOTE [ Rebuilt from the graph ].

    Its recipe is its only user, so unlike a recorded :class:`_Node` it
    shares nothing: no cache, no lock, no argument tree to rebuild.
    """

    __slots__ = ("check", "func", "inputs", "kwargs", "names")

    def __init__(
        self,
        func: Any,
        inputs: list[_Input],
        kwargs: dict[str, Any],
        names: tuple[str, ...] | None = None,
        check: tuple[int, _Input] | None = None,
    ) -> None:
        self.func = func
        self.inputs = inputs
        self.kwargs = kwargs
        self.names = names  # the inputs' argument names, where passed by name (GraphOp.by_name)
        # An output the node holds, which the rebuild's must equal bit for bit
        # (a norm's rstd: NOTE [ A norm's eps ]).
        self.check = check

    def value(self, alloc: _Alloc | None = None) -> Any:
        """The op's output, made now (into ``alloc``'s memory if it gives some)."""
        values = [_value(leaf) for leaf in self.inputs]
        if self.names is None:
            out = _run(self.func, values, self.kwargs, alloc, ())
        else:
            named = dict(zip(self.names, values, strict=True))
            out = _run(self.func, (), self.kwargs | named, alloc, ())
        if self.check is not None:
            index, held = self.check
            _same_bits(out[index], _value(held), self.func)
        return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(rebuilt: torch.Tensor, held: torch.Tensor, func: Any) -> None:
    """Raise unless ``rebuilt`` is ``held`` bit for bit (NaNs too); asynchronously on a device.

    NOTE [ A norm's eps ]: on CUDA a mismatch is a device-side assert, which
    stops the process at its next synchronisation rather than let a wrong
    gradient through; the check costs no synchronisation.
    """
    ok: torch.Tensor | bool = False
    if rebuilt.shape == held.shape and rebuilt.dtype == held.dtype:
        bits = _BITS[rebuilt.element_size()]
        ok = torch.eq(rebuilt.view(bits), held.view(bits)).all()
        if rebuilt.device.type != "cpu":
            torch._assert_async(ok)
            return
    if not ok:
        raise TierstoreError(
            f"tierstore: recomputing {func} gave statistics other than forward's: the eps "
            "noted for this norm is not the one forward used (was the module's eps changed "
            "after its profile?). Rebuilding from it would give a wrong gradient; set "
            "recompute='off' (TIERSTORE_RECOMPUTE), or leave eps as it was"
        )


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


# NOTE [ Rebuilt from the graph ]
# The recorder sees every op so that any save can be rebuilt, and on a GPU
# its Python per op is what the step waits on (NOTE [ Replayed modules ] in
# planning/planner.py). Yet most saves a plan rebuilds cheaply are one elementwise
# op's output whose inputs the step keeps anyway (GELU's output from the
# matmul before it, SiLU's, SwiGLU's product), and autograd has already
# written down all a rebuild needs: the saved tensor's base was made by the
# op of its grad_fn, and that node holds the op's inputs, as the packed
# objects our own pack hook gave it, and its other arguments. So a planned
# step rebuilds such a save with no recorder running. At pack,
# graph_recipe() reads the node (its type names the op; its raw saved
# variables' .data gives the packed inputs without unpacking them) and
# returns a Recipe that runs the op again in backward and takes the saved
# view of its output: one lookup per rebuilt save, no Python per op. Its
# node (_GraphNode) has that recipe alone for its user, so it holds no
# cache and no lock, and backward calls the op straight.
# It makes one only where that is exact:
#   * the op is in GRAPH_OPS: deterministic, out of place, every argument
#     held by its node; LayerNorm's node lacks eps, which the op's recorder
#     notes as forward runs it (NOTE [ A norm's eps ]);
#   * the saved tensor is at version 0: nothing changed it in place since
#     the op made its base, so the base is the op's output as it was;
#   * each input is kept on the device as it is (``kept`` resolves its
#     packed object; its version is checked at rebuild, as for every
#     recipe's inputs held as they are), or stored (a Handle): the rebuild
#     reads it through the store once, shared with autograd's own unpack of
#     it just after (_Stored, as a recorded recipe's stored input is), and
#     the store's get checks its version. An input rebuilt itself is not
#     taken (a chain of rebuilds is the recorder's; a node the recorder
#     made may take such a recipe's save as its input, rebuilt once more
#     for it: _FromGraph);
#   * the rebuilt output has the layout the base had (the same op on the
#     same inputs lays it out the same way; checked, and a mismatch raises).
# Elsewhere it returns None and the pack hook stores the save instead. A
# profiled step marks the saves graph_op() finds (Save.graph); the planner
# charges no recorder for those a plan rebuilds with no input rebuilt
# (planner.from_graph), and the hooks record in no module for them: a plan
# whose every rebuild is such runs no recorder at all, and its modules that
# keep everything run without hooks (NOTE [ Modules kept whole ]).


class GraphOp(NamedTuple):
    """How a rebuild runs an op again from its backward node (NOTE [ Rebuilt from the graph ]).

    Attributes:
        func: the op.
        tensors: its tensor arguments, by the names the node saves them
            under (``_raw_saved_self``); passed first, in this order, unless
            ``by_name``.
        others: its other arguments the node holds (``_saved_approximate``),
            passed by name.
        by_name: the tensors are passed by name too (they are not the op's
            first arguments).
        optional: of ``tensors``, those the op may have been given as
            ``None``, which its node then holds as nothing (a LayerNorm's
            bias); passed by name, as ``None``.
        output: which of the op's outputs the saved tensor's base is
            (``None``: its only one).
        eps: the op takes an ``eps`` its node does not hold: the one the
            recorder saw forward pass with the same weight (NOTE [ A
            norm's eps ]); without one, no rebuild from the graph.

    Example:
        >>> from tierstore.autograd.recompute import GRAPH_OPS
        >>> GRAPH_OPS["GeluBackward0"].others
        ('approximate',)
    """

    func: Any
    tensors: tuple[str, ...]
    others: tuple[str, ...] = ()
    by_name: bool = False
    optional: tuple[str, ...] = ()
    output: int | None = None
    eps: bool = False


#: Backward nodes whose op a rebuild runs again from what the node holds, by
#: the node's type name.
GRAPH_OPS: dict[str, GraphOp] = {
    "GeluBackward0": GraphOp(torch.ops.aten.gelu.default, ("self",), ("approximate",)),
    "SiluBackward0": GraphOp(torch.ops.aten.silu.default, ("self",)),
    "MulBackward0": GraphOp(torch.ops.aten.mul.Tensor, ("self", "other")),
    "NativeLayerNormBackward0": GraphOp(
        torch.ops.aten.native_layer_norm.default,
        ("input", "weight", "bias"),
        ("normalized_shape",),
        by_name=True,
        optional=("bias",),
        output=0,
        eps=True,
    ),
}

# NOTE [ A norm's eps ]
# LayerNorm's backward node holds the op's input, weight, bias and shape,
# and the mean and rstd it made, but not eps, which backward does not need;
# and LayerNorm's outputs are what the Linears after it save, 64 MiB of the
# 0.5 GiB each block of a GPT on an H200 saves, rebuilt in 34 us (its plans
# at 0.68x and 0.52x of no offload's memory could rebuild them only with
# the recorder, 1.7 ms a rebuild, or by checkpointing whole blocks). eps is
# a constant of the module, so the recorder notes it, as it sees the op in
# a profiled step, under the weight: its storage (weakly: a storage freed
# and its memory reused is never found) and its place there (one flat
# buffer may hold every norm's weight); a weight seen with two eps values
# is noted as having none. A rebuild from the graph takes that eps: the same
# kernel on the same input, weight, bias and eps makes the same bits. A
# norm the recorder never saw, or one with no weight, is not rebuilt from
# the graph (the save is stored, or the recorder rebuilds it). eps is taken
# on trust from the profile, so each rebuild checks it: forward's rstd,
# which the node holds, is 1/sqrt(var + eps) row by row, and the op makes
# its output from mean and rstd; the rebuild's rstd, bit for bit forward's,
# means the output is too. A mismatch (the module's eps changed since its
# profile) raises, on CUDA as a device-side assert (no synchronisation in
# backward); a norm whose rstd is neither kept as it is nor stored (another
# hook's) is not rebuilt from the graph.
_NORM_EPS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], float]] = (
    weakref.WeakKeyDictionary()
)
_NORM_EPS_LOCK = threading.Lock()
_LAYER_NORM = torch.ops.aten.native_layer_norm.default


def _where(weight: torch.Tensor) -> tuple[Any, ...]:
    """The weight's place in its storage: one flat buffer may hold every norm's."""
    return (weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)


def _note_eps(args: Any, kwargs: dict[str, Any]) -> None:
    """Note the eps a native_layer_norm call passes, under its weight (NOTE [ A norm's eps ])."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = dict(zip(names, args, strict=False)) | kwargs  # the schema's order
    weight = bound.get("weight")
    if not isinstance(weight, torch.Tensor) or "eps" not in bound:
        return
    eps, where = float(bound["eps"]), _where(weight)
    with _NORM_EPS_LOCK:
        noted = _NORM_EPS.setdefault(weight.untyped_storage(), {})
        seen = noted.get(where)
        noted[where] = eps if seen is None or seen == eps else math.nan


def _eps_of(weight: object) -> float | None:
    """The eps noted for a norm with ``weight`` (NOTE [ A norm's eps ]); ``None``: none known."""
    if not isinstance(weight, torch.Tensor):
        return None
    with _NORM_EPS_LOCK:
        noted = _NORM_EPS.get(weight.untyped_storage())
        eps = noted.get(_where(weight)) if noted is not None else None
    return None if eps is None or math.isnan(eps) else eps


def graph_op(
    t: torch.Tensor, kept: Callable[[Any], tuple[torch.Tensor, int] | None] = lambda p: None
) -> Any:
    """The autograd node whose op made ``t``'s base, if :data:`GRAPH_OPS` can run it again.

    NOTE [ Rebuilt from the graph ]. ``None`` where not: another op, an
    input the node did not save, ``t`` modified in place since, or a norm
    whose eps is not known (NOTE [ A norm's eps ]; ``kept`` resolves the
    packed weight, as for :func:`graph_recipe`).

    Example:
        >>> import torch
        >>> from tierstore.autograd.recompute import graph_op
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> graph_op(torch.nn.functional.gelu(x).t()).name()
        'GeluBackward0'
        >>> graph_op(x.exp()) is None
        True
    """
    found = _graph_node(t)
    if found is None:
        return None
    node, op = found
    if any(_packed_input(node, n) is None for n in op.tensors if n not in op.optional):
        return None  # an input its node did not save (mul by a mask that needs no grad)
    if op.eps and _eps_of(_weight(node, kept)) is None:
        return None  # NOTE [ A norm's eps ]
    return node


def _graph_node(t: torch.Tensor) -> tuple[Any, GraphOp] | None:
    """The node that made ``t``'s base and its :data:`GRAPH_OPS` entry, if it has one."""
    if t._version:
        return None
    base = t._base if t._base is not None else t
    node = base.grad_fn
    found = GRAPH_OPS.get(type(node).__name__) if node is not None else None
    if found is None or base.output_nr != (found.output or 0):
        return None  # or another output of the op (LayerNorm's mean, say)
    return node, found


def _leaf(
    packed: Any,
    kept: Callable[[Any], tuple[torch.Tensor, int] | None],
    fetch: Callable[[Any], torch.Tensor] | None,
) -> _Input | None:
    """A rebuild's input from what the pack hook gave a node: kept as it is, or stored.

    A stored one is read through the store once, shared with autograd's own
    unpack of it; ``None``: neither (not saved, or rebuilt itself).
    """
    held = kept(packed) if packed is not None else None
    if held is not None:
        return _Input(held[0], held[1])
    if fetch is not None and type(packed) is Handle:
        return _Input(_Stored.of(packed, fetch), None, packed)
    return None


def _weight(node: Any, kept: Callable[[Any], tuple[torch.Tensor, int] | None]) -> Any:
    """The weight a norm's node holds, where it is kept as it is; else ``None``."""
    packed = _packed_input(node, "weight")
    if isinstance(packed, torch.Tensor):  # saved with no hooks: the tensor itself
        return packed
    held = kept(packed) if packed is not None else None
    return held[0] if held is not None else None


def _packed_input(node: Any, name: str) -> Any:
    """What the pack hook gave ``node`` for its input ``name``, not unpacked; or ``None``."""
    return getattr(getattr(node, "_raw_saved_" + name), "data", None)


def graph_recipe(
    t: torch.Tensor,
    nbytes: int,
    kept: Callable[[Any], tuple[torch.Tensor, int] | None],
    fetch: Callable[[Any], torch.Tensor] | None = None,
) -> Recipe | None:
    """A recipe for ``t`` read off the autograd graph, or ``None``.

    NOTE [ Rebuilt from the graph ].

    ``kept(packed)``: the tensor and version a packed object keeps on the
    device as it is, else ``None`` (the pack hook's own kept forms).
    ``fetch(packed)``: reads a stored input back (the store's ``get``), once
    for the rebuild and autograd's own unpack of it; ``None``: every input
    must be kept.

    Example:
        >>> import torch
        >>> from torch.autograd.graph import saved_tensors_hooks
        >>> from tierstore.autograd.recompute import graph_recipe
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> with saved_tensors_hooks(lambda t: (t, t._version), lambda p: p[0]):
        ...     y = torch.nn.functional.gelu(x * 2)
        >>> recipe = graph_recipe(y, 64, lambda p: p if type(p) is tuple else None)
        >>> torch.equal(recipe.rebuild(lambda *a: None), y)
        True
    """
    found = _graph_node(t)  # its inputs checked below, each looked up once
    if found is None:
        return None
    node, op = found
    kwargs = {name: getattr(node, "_saved_" + name) for name in op.others}
    leaves: list[Any] = []
    names: list[str] = []
    for name in op.tensors:
        packed = _packed_input(node, name)
        if packed is None and name in op.optional:
            kwargs[name] = None  # the op had none (LayerNorm(bias=False))
            continue
        leaf = _leaf(packed, kept, fetch)
        if leaf is None:
            return None  # not saved, or rebuilt itself
        leaves.append(leaf)
        names.append(name)
    check = None
    users = leaves
    if op.eps:  # NOTE [ A norm's eps ]
        eps = _eps_of(_weight(node, kept))
        rstd = _leaf(_packed_input(node, "result2"), kept, fetch)
        if eps is None or rstd is None:
            return None
        kwargs["eps"] = eps
        check = (2, rstd)  # forward's rstd: the eps is checked by it
        users = [*leaves, rstd]
    for leaf in users:  # this node is one more user of each stored read
        if isinstance(leaf.source, _Shared):
            leaf.source.add_use()
    names_of = tuple(names) if op.by_name else None
    node_of = _GraphNode(op.func, leaves, kwargs, names_of, check)
    base = t._base
    if base is None:
        return Recipe(node_of, op.output, t, nbytes, 1)
    offset = int(t.storage_offset() - base.storage_offset())
    return Recipe(
        node_of, op.output, t, nbytes, 1, view=(tuple(base.shape), tuple(base.stride()), offset)
    )


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
        >>> from tierstore.autograd.recompute import Recorder, cheap
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
        # entry dies with its memory and a reused address never matches.
        self._packed: weakref.WeakKeyDictionary[Any, dict[Any, tuple[int, Any, Any, int]]] = (
            weakref.WeakKeyDictionary()
        )
        self._origins: weakref.WeakKeyDictionary[Any, dict[Any, tuple[int, _Origin, Any]]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile'd code run compiled under this mode (it records only eager ops)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func is _LAYER_NORM:
            _note_eps(args, kwargs)  # NOTE [ A norm's eps ]
        if self._timer is not None:
            return self._timed_call(func, args, kwargs)
        out = func(*args, **kwargs)
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not _never(func)
            and self._policy(self._ctx, func, *args, **kwargs) in _RECOMPUTE
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
        if func.is_view or func._overloadpacket in _ALLOCATIONS:
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
            and not _never(func)
            and self._policy(self._ctx, func, *args, **kwargs) in _RECOMPUTE
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
        made = self._origins.get(t.untyped_storage(), {}).get(_view_key(t))
        if made is None or made[0] != t._version:
            return "", None, [], ()
        origin = made[1]
        ops, packed = origin.rebuild_cost()
        name = f"aten.{origin.func._overloadpacket.__name__}"
        where = tuple(sorted({op.module for op in ops}))
        if all(isinstance(op.cost, float) for op in ops):
            return name, sum(op.seconds() for op in ops), packed, where
        return name, lambda: sum(op.seconds() for op in ops), packed, where

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> _Origin | None:
        flat, spec = _flatten(args, kwargs)
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
        outs: _Layouts = ()
        if isinstance(out, (tuple, list)) and all(type(o) is torch.Tensor for o in out):
            outs = tuple((tuple(o.shape), tuple(o.stride()), o.dtype) for o in out)
        origin = _Origin(func, spec, leaves, depth, outs)
        if isinstance(out, torch.Tensor):
            self._note_origin(out, origin, None)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self._note_origin(o, origin, i)
        return origin

    def _note_origin(self, t: torch.Tensor, origin: _Origin, index: int | None) -> None:
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return
        self._origins.setdefault(t.untyped_storage(), {})[_view_key(t)] = (
            t._version,
            origin,
            index,
        )

    def _resolve(self, t: torch.Tensor) -> _Ref | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None  # a tracing subclass, DTensor, ...
        if t.layout is not torch.strided or t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        key = _view_key(t)
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
        self._packed.setdefault(t.untyped_storage(), {})[_view_key(t)] = (
            t._version,
            weakref.ref(packed),
            fetch,
            depth,
        )

    def recipe_for(self, t: torch.Tensor, nbytes: int) -> Recipe | None:
        """A recipe that rebuilds ``t``, or ``None`` when it must be stored."""
        made = self._origins.get(t.untyped_storage(), {}).get(_view_key(t))
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


RecomputeSetting = Literal["off", "cheap"] | Policy
#: What :meth:`Recorder.describe` tells of a tensor: op, cost, packed inputs, modules.
Described = tuple[str, "float | Callable[[], float] | None", list[Any], tuple[str, ...]]


def policy_of(setting: object) -> Policy | None:
    """The policy a ``recompute`` setting names, ``None`` for ``"off"``.

    Example:
        >>> from tierstore.autograd.recompute import policy_of, cheap
        >>> policy_of("cheap") is cheap, policy_of("off")
        (True, None)
    """
    if setting == "off" or setting is None:
        return None
    if setting == "cheap":
        return cheap
    if callable(setting):
        return setting
    raise ConfigError(
        f"tierstore: recompute={setting!r} is not 'off', 'cheap' or a policy function "
        "(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy; set "
        "recompute (TIERSTORE_RECOMPUTE) to one of them"
    )
