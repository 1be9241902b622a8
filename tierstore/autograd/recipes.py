"""Recipes: what autograd holds for a save that backward rebuilds, and the nodes they run.

A :class:`Recipe` names the op that made a saved tensor, its non-tensor
arguments and its inputs' packed objects (NOTE [ Recompute ] in
``autograd/recompute.py``); an :class:`Origin` is a recorded op with its inputs
resolved, a :class:`Node` one rebuilt and cached for its consumers, a
:class:`GraphNode` one read off autograd's graph (NOTE [ Rebuilt from the
graph ] in ``autograd/graph.py``). :func:`shared_fetch` reads a stored input
once for the rebuild and the input's own backward node.

Example:
    >>> from tierstore.autograd.recipes import shared_fetch
    >>> shared_fetch(object()) is None   # nothing a recipe reads
    True
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tierstore.errors import TierstoreError, modified_in_place
from tierstore.tiers.handle import Saved
from tierstore.tiers.weak import WeakKeyMap

__all__ = ["Recipe", "shared_fetch"]

#: Guards Origin.node (NOTE [ Recompute under threads ]).
_nodes_lock = threading.Lock()

#: Whether autocast is on for any device; torch.autocast(enabled=False) where
#: it is unknown (a torch without this query).
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


# An op's arguments as a flat list of leaves and the shape to rebuild them
# from: aten ops take tensors as arguments or in a list (cat, where's
# lists of indices), never deeper, so one level of flattening is enough and
# far cheaper than a general pytree (which was half the recorder's cost).
Spec = tuple[tuple[Any, ...], tuple[str, ...]]


def flatten_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Spec]:
    """An op's arguments as one flat list of leaves, and the spec to rebuild them."""
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


def unflatten_args(leaves: list[Any], spec: Spec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments :func:`flatten_args` flattened, rebuilt from their leaves."""
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
# version, 0), ("origin", Origin, output index, depth).
Ref = tuple[str, Any, Any, int]


#: Ops that allocate and launch nothing: a profile does not time them.
ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty,
        torch.ops.aten.empty_like,
        torch.ops.aten.empty_strided,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    }
)


class Origin:
    """One recorded op: what made a tensor, with its tensor arguments resolved."""

    __slots__ = ("__weakref__", "cost", "depth", "func", "leaves", "module", "node", "outs", "spec")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], depth: int, outs: Layouts) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves  # constants, or Ref for tensors
        self.depth = depth
        self.outs = outs  # the layouts of several outputs, for out= (else empty)
        self.node: weakref.ref[Node] | None = None
        # The op's own time when the recorder times ops: seconds, or a function
        # that reads its span's events (NOTE [ Timing a profile ] in planning/timers.py).
        self.cost: float | Callable[[], float] = 0.0
        self.module = ""  # where it ran, when the recorder is told (a profiled step)

    def seconds(self) -> float:
        """The op's own time (waits for its events on CUDA)."""
        cost = self.cost
        return cost if isinstance(cost, float) else cost()

    def rebuild_cost(self) -> tuple[list[Origin], list[Any]]:
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

    def node_for(self) -> Node | None:
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
                leaves.append(Input(ref, extra))
            elif kind == "origin":
                child = ref.node_for()
                if child is None:
                    return None
                leaves.append(Input(child, extra))
            else:
                packed = ref()
                if packed is None:
                    return None
                if type(packed) is Recipe and type(packed._node) is GraphNode:
                    leaves.append(Input(FromGraph(packed), None))  # made where no recorder ran
                elif type(packed) is Recipe:  # its node serves both
                    leaves.append(Input(packed._node, packed._index))
                elif extra is None:  # kept as it is: its detached alias shares the version
                    leaves.append(Input(packed.tensor, packed.version))
                else:
                    leaves.append(Input(Stored.of(packed, extra), None, packed))
        with _nodes_lock:  # NOTE [ Recompute under threads ]
            node = self.node() if self.node is not None else None
            if node is not None:  # another thread made it meanwhile: theirs serves both
                return node
            for leaf in leaves:  # every input resolved: count this node as their user
                if type(leaf) is Input and isinstance(leaf.source, Shared):
                    leaf.source.add_use()
            node = Node(self.func, self.spec, leaves, self.outs)
            self.node = weakref.ref(node)
        return node


class Input:
    """A resolved tensor argument of a node: a shared value, or a tensor held as it is."""

    __slots__ = ("hold", "index", "source")

    def __init__(self, source: Any, index: Any, hold: Any = None) -> None:
        self.source = source
        self.index = index  # for a shared value: the output index; for a tensor: its version
        self.hold = hold  # a stored input's packed object: its entry lives as long as this


class Shared:
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

    def _make(self, alloc: Alloc | None) -> Any:
        raise NotImplementedError

    def value(self, alloc: Alloc | None = None) -> Any:
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


class Node(Shared):
    """An op to run again in backward."""

    __slots__ = ("func", "leaves", "outs", "spec")

    def __init__(self, func: Any, spec: Any, leaves: list[Any], outs: Layouts) -> None:
        super().__init__(0)
        self.func = func
        self.spec = spec
        self.leaves = leaves
        self.outs = outs

    def _make(self, alloc: Alloc | None) -> Any:
        args, kwargs = unflatten_args([value_of(leaf) for leaf in self.leaves], self.spec)
        return run_op(self.func, args, kwargs, alloc, self.outs)


def run_op(func: Any, args: Any, kwargs: dict[str, Any], alloc: Alloc | None, outs: Layouts) -> Any:
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
Alloc = tuple[Callable[[], "torch.Tensor | None"], "int | None"]
#: (shape, stride, dtype) of each output of an op with several, else ().
Layouts = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]


# A stored packed object (a Handle) that recipes read -> its Stored:
# autograd's own unpack of it then shares the read (shared_fetch). The value
# is strong and refers to the handle weakly, so the entry (and a read it
# caches) lives exactly as long as the handle: as long as autograd or a node
# holds it, and no longer.
# Its keys die with no Python run: NOTE [ Finalizers and interrupts ] in
# tierstore/tiers/release.py.
_stored: WeakKeyMap[Stored] = WeakKeyMap()
_stored_lock = threading.Lock()


class Stored(Shared):
    """A stored saved tensor that recipes take as an input: read once for all its users."""

    __slots__ = ("fetch", "packed")

    def __init__(self, packed: Any, fetch: Callable[[Any], torch.Tensor]) -> None:
        super().__init__(1)  # autograd's own unpack of it
        self.packed = weakref.ref(packed)
        self.fetch = fetch

    @staticmethod
    def of(packed: Any, fetch: Callable[[Any], torch.Tensor]) -> Stored:
        """The one shared read of ``packed`` (NOTE [ Recompute under threads ])."""
        with _stored_lock:
            stored = _stored.get(packed)
            if stored is None:
                stored = _stored[packed] = Stored(packed, fetch)
            return stored

    def _make(self, alloc: Alloc | None) -> Any:
        packed = self.packed()
        assert packed is not None  # whoever asks holds it
        return self.fetch(packed)


class FromGraph(Shared):
    """A save rebuilt from the graph that a recorded node takes as an input.

    NOTE [ Rebuilt from the graph ]: the recipe's own node shares nothing
    (autograd's unpack of the save rebuilds it apart), so this rebuilds it
    once more for the recorded node, as the saved tensor, view and all.
    """

    __slots__ = ("recipe",)

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(0)  # the node that takes it counts itself
        self.recipe = recipe

    def _make(self, alloc: Alloc | None) -> Any:
        return self.recipe.rebuild(_no_memory)


def _no_memory(*args: Any) -> None:
    """Memory for a rebuilt input: none of the store's, the op's own."""


def shared_fetch(packed: Any) -> torch.Tensor | None:
    """The tensor for a stored save that recipes also read, read once for all; else ``None``.

    Example:
        >>> from tierstore.autograd.recipes import shared_fetch
        >>> shared_fetch(object()) is None
        True
    """
    if not _stored:
        return None
    with _stored_lock:
        stored = _stored.get(packed)
    return stored.value() if stored is not None else None


def value_of(leaf: Any) -> Any:
    """A recorded op's argument as the rebuild passes it: an input's value, else as it is."""
    if type(leaf) is not Input:
        return leaf
    source = leaf.source
    if isinstance(source, Shared):
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
        node: Node | GraphNode,
        index: int | None,
        t: torch.Tensor,
        nbytes: int,
        depth: int,
        *,
        view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None,
    ) -> None:
        super().__init__(t)
        if type(node) is Node:  # a graph node has this recipe alone for its user
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


class GraphNode:
    """The op a recipe read off the autograd graph runs again: NOTE [ Rebuilt from the graph ].

    Its recipe is its only user, so unlike a recorded :class:`Node` it
    shares nothing: no cache, no lock, no argument tree to rebuild.
    """

    __slots__ = ("check", "func", "inputs", "kwargs", "names")

    def __init__(
        self,
        func: Any,
        inputs: list[Input],
        kwargs: dict[str, Any],
        names: tuple[str, ...] | None = None,
        check: tuple[int, Input] | None = None,
    ) -> None:
        self.func = func
        self.inputs = inputs
        self.kwargs = kwargs
        self.names = names  # the inputs' argument names, where passed by name (GraphOp.by_name)
        # An output the node holds, which the rebuild's must equal bit for bit
        # (a norm's rstd: NOTE [ A norm's eps ]).
        self.check = check

    def value(self, alloc: Alloc | None = None) -> Any:
        """The op's output, made now (into ``alloc``'s memory if it gives some)."""
        values = [value_of(leaf) for leaf in self.inputs]
        if self.names is None:
            out = run_op(self.func, values, self.kwargs, alloc, ())
        else:
            named = dict(zip(self.names, values, strict=True))
            out = run_op(self.func, (), self.kwargs | named, alloc, ())
        if self.check is not None:
            index, held = self.check
            _same_bits(out[index], value_of(held), self.func)
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
