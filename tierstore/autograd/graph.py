"""Rebuilt from the graph: a save rebuilt from what its backward node holds, no recorder.

Example:
    >>> from tierstore.autograd.graph import GRAPH_OPS
    >>> "NativeLayerNormBackward0" in GRAPH_OPS
    True
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tierstore.autograd.recipes import GraphNode, Input, Recipe, Shared, Stored
from tierstore.tiers.handle import Handle
from tierstore.tiers.weak import WeakKeyMap

__all__ = ["GRAPH_OPS", "GraphOp", "graph_op", "graph_recipe"]


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What tells two views of one storage apart: offset, shape, stride, dtype."""
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
# node (GraphNode) has that recipe alone for its user, so it holds no
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
#     it just after (Stored, as a recorded recipe's stored input is), and
#     the store's get checks its version. An input rebuilt itself is not
#     taken (a chain of rebuilds is the recorder's; a node the recorder
#     made may take such a recipe's save as its input, rebuilt once more
#     for it: FromGraph);
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
        >>> from tierstore.autograd.graph import GRAPH_OPS
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
# and LayerNorm's outputs are what the Linears after it save, about an
# eighth of what a GPT block saves, which the graph rebuilds in tens of
# microseconds where the recorder takes milliseconds a rebuild (without the
# graph, a plan rebuilds them only with the recorder or by checkpointing
# whole blocks). eps is
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
# Weak on the storage, with no Python run as it dies (NOTE [ Finalizers and
# interrupts ] in tierstore/tiers/release.py).
_NORM_EPS: WeakKeyMap[dict[tuple[Any, ...], float]] = WeakKeyMap()
_NORM_EPS_LOCK = threading.Lock()
LAYER_NORM = torch.ops.aten.native_layer_norm.default


def _where(weight: torch.Tensor) -> tuple[Any, ...]:
    """The weight's place in its storage: one flat buffer may hold every norm's."""
    return (weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()), weight.dtype)


def note_eps(args: Any, kwargs: dict[str, Any]) -> None:
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
        >>> from tierstore.autograd.graph import graph_op
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
) -> Input | None:
    """A rebuild's input from what the pack hook gave a node: kept as it is, or stored.

    A stored one is read through the store once, shared with autograd's own
    unpack of it; ``None``: neither (not saved, or rebuilt itself).
    """
    held = kept(packed) if packed is not None else None
    if held is not None:
        return Input(held[0], held[1])
    if fetch is not None and type(packed) is Handle:
        return Input(Stored.of(packed, fetch), None, packed)
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
        >>> from tierstore.autograd.graph import graph_recipe
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
        if isinstance(leaf.source, Shared):
            leaf.source.add_use()
    names_of = tuple(names) if op.by_name else None
    node_of = GraphNode(op.func, leaves, kwargs, names_of, check)
    base = t._base
    if base is None:
        return Recipe(node_of, op.output, t, nbytes, 1)
    offset = int(t.storage_offset() - base.storage_offset())
    return Recipe(
        node_of, op.output, t, nbytes, 1, view=(tuple(base.shape), tuple(base.stride()), offset)
    )
