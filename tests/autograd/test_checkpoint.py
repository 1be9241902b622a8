"""Activation checkpointing composed with offload: only block boundaries reach the store.

Non-reentrant ``torch.utils.checkpoint`` saves a block's inputs through
autograd's saved-tensor mechanism (so ``offload()`` sees them) and runs the
block under its own hooks (so nothing inside reaches the store); in backward
the block is recomputed outside ``offload()``. These tests pin that down on
the installed torch, with plain and selective checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import tierstore
from tierstore.models import GPT, GPTConfig

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


CONTEXTS: dict[str, Callable[[], Any] | None] = {
    "checkpoint": None,
    "selective": functools.partial(create_selective_checkpoint_contexts, _save_matmuls),
}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, d_model=64, heads=2, layers=3, seq=32, dropout=0.1))


class _Recorder:
    """Wraps the store's put: which tensors it got, and whether inside a block's forward."""

    def __init__(self, store: tierstore.TierStore, model: GPT) -> None:
        self.puts: list[tuple[int, tuple[int, ...], bool]] = []
        self.block_inputs: list[int] = []
        self._inside = 0
        manager = store._manager
        original = manager.put

        def put(t: torch.Tensor, nbytes: int | None = None) -> Any:
            self.puts.append((t.data_ptr(), tuple(t.shape), self._inside > 0))
            return original(t, nbytes)

        manager.put = put  # type: ignore[method-assign]
        for block in model.blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self._inside += 1
        self.block_inputs.append(args[0].data_ptr())

    def _leave(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._inside -= 1


@contextlib.contextmanager
def _checkpointed(model: GPT, context_fn: Callable[[], Any] | None) -> Iterator[None]:
    """Every block's forward runs under non-reentrant checkpoint (as bench train does)."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for block in model.blocks:
        original = block.forward

        def wrapped(x: torch.Tensor, _f: Callable[..., Any] = original) -> Any:
            return checkpoint(_f, x, use_reentrant=False, **extra)

        block.__dict__["forward"] = wrapped
    try:
        yield
    finally:
        for block in model.blocks:
            block.__dict__.pop("forward", None)


def _grads(model: GPT) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step(model: GPT, tokens: torch.Tensor, offload: tierstore.TierStore | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every run
    with offload.offload() if offload is not None else contextlib.nullcontext():
        loss = model.loss(tokens)
    return loss


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_only_block_inputs_reach_the_store_and_gradients_match_eager(
    context: str, any_store: tierstore.TierStore, empty_check: Callable[..., None]
) -> None:
    model = _model()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    _step(model, tokens, None).backward()
    eager = _grads(model)

    recorder = _Recorder(any_store, model)
    with _checkpointed(model, CONTEXTS[context]):
        for _ in range(2):  # the second step replays the recorded schedule
            loss = _step(model, tokens, any_store)
            packed = len(recorder.puts)
            loss.backward()
            del loss
            # The recomputation in backward runs outside offload(): nothing new is stored.
            assert len(recorder.puts) == packed
            for a, b in zip(eager, _grads(model), strict=True):
                assert torch.equal(a, b)
    # torch 2.11's checkpoint also saves a 0-element tensor of its own per block.
    inside = [(p, shape) for p, shape, in_block in recorder.puts if in_block and 0 not in shape]
    # Per block and step exactly one save reaches the store from inside a
    # block: its input. Attention probabilities, MLP activations and the rest
    # are recomputed, never stored.
    assert len(inside) == 2 * len(model.blocks)
    assert [ptr for ptr, _ in inside] == recorder.block_inputs
    assert all(shape == (4, 32, 64) for _, shape in inside)
    empty_check(any_store)


def test_block_inputs_leave_memory_while_checkpointed(disk_store: tierstore.TierStore) -> None:
    model = _model()
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    inputs: list[weakref.ref[torch.Tensor]] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    with _checkpointed(model, None):
        loss = _step(model, tokens, disk_store)
    gc.collect()
    disk_store.flush()
    # Only the store holds the inputs of blocks 2 and 3 (outputs of 1 and 2):
    # they were written to disk and their memory is gone. Block 1's input is
    # the embedding sum, also saved by nothing else.
    assert [ref() is None for ref in inputs] == [True, True, True]
    assert disk_store.stats().tiers["disk"].entries >= len(model.blocks)
    loss.backward()
