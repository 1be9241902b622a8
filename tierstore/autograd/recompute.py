"""Recompute: saved tensors that a cheap op can rebuild in backward are never stored.

This module holds the rules (which ops a policy may rebuild, NOTE
[ Recompute ], NOTE [ Hooks and Dynamo ]); the rest of it is three rooms of
the autograd boundary, all of which know ops, not bytes. While an
``offload()`` block runs with ``recompute="cheap"`` (or a policy function),
the :class:`~tierstore.autograd.recorder.Recorder` notes which op made each
tensor. When autograd then saves a tensor that a cheap op made from inputs
that are stored anyway, the pack hook returns a
:class:`~tierstore.autograd.recipes.Recipe` instead of storing it; a save no
recorder saw may still be rebuilt from its backward node
(:mod:`tierstore.autograd.graph`). In backward the recipe fetches its
inputs and runs the op again.

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
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from tierstore.errors import ConfigError

__all__ = [
    "CHEAP_OPS",
    "Policy",
    "RecomputeSetting",
    "cheap",
    "everything",
    "never_traced",
    "policy_of",
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
# (Stored): the rebuild and the input's own backward node take one read of
# it, not two. Inputs held as they are (parameters, small tensors) are
# checked for in-place changes since the op ran (their version counters): a
# rebuild from changed inputs would be a wrong gradient, so it raises
# instead; a stored input's own entry does the same check at its read.

# NOTE [ Recompute under threads ]
# A Recorder is per thread, but what it makes is shared: backward can unpack
# one graph's saves on several threads (autograd's device threads; two
# backward calls on a retained graph), and a stored input's Stored is
# looked up by whichever thread unpacks it. Each Shared value therefore
# has a lock, held while the value is made: a second consumer waits and
# takes the cached value (one read, one rebuild), and the use counts that
# decide when the cache is dropped are never lost. A node's lock is taken
# before its inputs' (the graph of nodes has no cycles, so neither has the
# lock order), and nothing that runs under one takes a node's lock again.
# Origin.node_for publishes an op's node under _nodes_lock, so two callers
# get the same node and its inputs count it once.


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

RECOMPUTE_POLICIES = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


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
def never_recorded(op: Any) -> bool:
    """Ops no policy may recompute: mutating or random ones (looked up once per op)."""
    return bool(op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags)


RecomputeSetting = Literal["off", "cheap"] | Policy


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
