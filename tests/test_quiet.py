"""A step that repeats one whose saves all stayed runs without hooks (NOTE [ Quiet blocks ]).

After its first save, such a block takes the store's hooks off autograd's
stack and counts its saves as the block it repeats counted them. These tests
hold it to the promises of the short path (tests/test_fast_path.py): bitwise
gradients, the in-place check, retain_graph and double backward, threads,
keep() regions, stats that add up; and to what decides it: the first save,
the room device_budget leaves, one block a step, nothing beneath the hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_helpers import run_in_threads

import tierstore
from tierstore.hooks import _TOP_HOOKS

from .conftest import assert_empty

pytestmark = [
    pytest.mark.skipif(_TOP_HOOKS is None, reason="this torch cannot read autograd's hook stack"),
    pytest.mark.filterwarnings("ignore::tierstore.TierstoreWarning"),  # nothing moved: intended
]


def _model(seed: int = 0, p: float = 0.1) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(p), torch.nn.Linear(64, 8)
    )


def _batch(step: int, rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(step))


def _store(spill_root: Path, device_budget: str | int = "64MiB") -> tierstore.TierStore:
    return tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=device_budget, disk_budget="64MiB", disk_path=spill_root,
            min_offload_bytes=0,
        )
    )  # fmt: skip


class _Watch:
    """Counts the store's pack calls, and what tops autograd's hook stack inside forward."""

    def __init__(self, store: tierstore.TierStore, model: torch.nn.Module) -> None:
        self.packs = 0
        self.tops: list[Any] = []
        original = store._pack

        def pack(t: torch.Tensor) -> Any:
            self.packs += 1
            return original(t)

        store._pack = pack  # type: ignore[method-assign]
        model[-1].register_forward_pre_hook(lambda m, a: self.tops.append(_TOP_HOOKS(False)))  # type: ignore[misc]


def _steps(
    model: torch.nn.Module,
    store: tierstore.TierStore | None,
    steps: int,
    first: int = 0,
    batch: Callable[[int], torch.Tensor] = _batch,
) -> list[list[torch.Tensor]]:
    out = []
    for step in range(first, first + steps):
        torch.manual_seed(100 + step)  # dropout masks, alike with and without the store
        if store is None:
            loss = model(batch(step)).square().mean()
        else:
            with store.offload():
                loss = model(batch(step)).square().mean()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    return out


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def test_a_repeated_step_runs_without_hooks_after_its_first_save(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    _same(_steps(model, store, 5), _steps(_model(), None, 5))
    # Six saves a step (the first Linear's input, GELU's, dropout's mask, the
    # last Linear's input and weight, square's input): the first step's all
    # took the hooks, the later ones' only the first, which _pack_first kept.
    assert watch.packs == 6
    assert watch.tops[0] is not None and watch.tops[1:] == [None] * 4
    assert store.stats().packed == 5 * 6
    assert _TOP_HOOKS(False) is None  # type: ignore[misc]
    assert_empty(store)
    store.close()


def test_quiet_steps_count_as_the_steps_measured(spill_root: Path) -> None:
    quiet, loud = _store(spill_root), _store(spill_root)
    loud._may_go_quiet = lambda policy: False  # type: ignore[method-assign]
    _same(_steps(_model(), quiet, 6), _steps(_model(), loud, 6))
    assert quiet._next_quiet is not None and loud._next_quiet is None
    assert quiet._manager.pack_tally().counts == loud._manager.pack_tally().counts
    q, l_ = quiet.stats(), loud.stats()
    assert (q.packed, q.kept, q.kept_bytes) == (l_.packed, l_.kept, l_.kept_bytes)
    quiet.close()
    loud.close()


def test_an_inplace_change_in_a_quiet_block_raises_as_eager_does(spill_root: Path) -> None:
    store = _store(spill_root)
    x = torch.randn(64, requires_grad=True)
    for _ in range(3):
        with store.offload():
            y = x.sin().exp()
        y.sum().backward()
    with store.offload():
        y = x.sin().exp()  # exp saves its output, autograd's own once the block is quiet
        assert _TOP_HOOKS(False) is None  # type: ignore[misc]
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    store.close()


def test_retain_graph_and_double_backward_in_quiet_blocks(spill_root: Path) -> None:
    store = _store(spill_root)
    x = torch.randn(32, requires_grad=True)
    for _ in range(3):
        with store.offload():
            y = x.sin().exp().sum()
        y.backward()
    x.grad = None
    with store.offload():
        y = x.sin().exp().sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    y.backward()
    assert torch.equal(x.grad, 2 * first)  # type: ignore[arg-type]
    x.grad = None
    for _ in range(3):
        with store.offload():
            (g,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
        g.sum().backward()
    x_grad = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    (g_eager,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
    g_eager.sum().backward()
    assert torch.equal(g, g_eager) and torch.equal(x_grad, 3 * x.grad)  # type: ignore[operator]
    store.close()


def test_a_step_the_room_holds_once_but_not_twice_is_measured(spill_root: Path) -> None:
    # 16 rows save 11.5 KiB past the parameters: within 20 KiB, not twice over.
    store = _store(spill_root, device_budget=20 << 10)
    model = _model()
    watch = _Watch(store, model)
    _same(_steps(model, store, 4), _steps(_model(), None, 4))
    assert watch.packs == 4 * 6 and store._quiet is not None
    assert "offloaded" not in store._manager.pack_tally().counts  # every save fitted
    store.close()


def test_another_batch_size_is_measured_and_keeps_the_budget(spill_root: Path) -> None:
    store = _store(spill_root, device_budget=64 << 10)
    model = _model()
    watch = _Watch(store, model)
    big = lambda step: _batch(step, rows=256)  # noqa: E731  184 KiB: past the budget
    _steps(model, store, 3)
    assert watch.packs == 6
    _same(_steps(model, store, 2, first=3, batch=big), _steps(_model(), None, 5, batch=big)[3:])
    assert watch.packs == 3 * 6  # the first save differs: measured, and the budget holds
    tally = store._manager.pack_tally().counts
    assert tally["offloaded"][0] > 0
    # Back to 16 rows: measured after a step that did not fit, then quiet.
    _same(_steps(model, store, 3, first=5), _steps(_model(), None, 8)[5:])
    assert watch.packs == 4 * 6
    store.close()


def test_a_step_of_two_blocks_is_never_quiet(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    for step in range(4):
        with store.offload():
            h = model[:2](_batch(step))
        with store.offload():
            loss = model[2:](h).square().mean()
        loss.backward()
    assert watch.packs == 4 * 6
    assert store._quiet is None
    store.close()


def test_hooks_beneath_the_block_keep_every_save_on_the_stores_hooks(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    outer = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        outer[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        ours = _steps(model, store, 4)
    _same(ours, _steps(_model(), None, 4))
    assert watch.packs == 4 * 6 and outer[0] == 0
    store.close()


def test_keep_inside_a_quiet_block_puts_the_hooks_back_for_its_saves(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    _steps(model, store, 3)
    with store.offload():
        h = model[:2](_batch(3))
        with tierstore.keep(tier="disk"):
            inside = _TOP_HOOKS(False)  # type: ignore[misc]
            out = model[2:](h)
        after = _TOP_HOOKS(False)  # type: ignore[misc]
        on_disk = store.stats().tiers["disk"].entries
    assert inside is not None and after is None
    assert on_disk == 2  # dropout's mask and the last Linear's input; its weight stays
    out.square().mean().backward()
    assert _TOP_HOOKS(False) is None  # type: ignore[misc]
    assert store._next_quiet is None  # a block that ran keep() is not repeated
    assert_empty(store)
    store.close()


def test_a_quiet_block_that_raises_leaves_the_hook_stack_as_it_was(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    _steps(model, store, 3)
    with pytest.raises(ValueError, match="inside"), store.offload():
        model(_batch(3))
        raise ValueError("inside")
    assert _TOP_HOOKS(False) is None  # type: ignore[misc]
    _same(_steps(model, store, 2, first=4), _steps(_model(), None, 6)[4:])
    store.close()


def test_threads_in_quiet_steps_count_alike(spill_root: Path) -> None:
    store = _store(spill_root)
    models = [_model(seed, p=0.0) for seed in range(4)]  # no mask: one generator, four threads
    grads: dict[int, list[Any]] = {}

    def work(i: int) -> None:
        grads[i] = _steps(models[i], store, 6)

    assert run_in_threads(work, 4) == []
    for i in range(4):
        _same(grads[i], _steps(_model(i, p=0.0), None, 6))
    s = store.stats()
    tally = store._manager.pack_tally().counts
    assert s.packed == sum(n for n, _ in tally.values()) == 4 * 6 * 5  # no mask at p=0
    assert "offloaded" not in tally
    assert_empty(store)
    store.close()


def test_the_step_log_sees_every_quiet_step(
    spill_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(spill_root)
    model = _model()
    with caplog.at_level(logging.INFO, logger="tierstore"):
        _steps(model, store, 5)
        with store.offload():  # the sixth step ends the fifth
            model(_batch(5)).sum().backward()
    assert len([r for r in caplog.records if r.name == "tierstore"]) == 5
    store.close()


def test_one_block_a_step_goes_quiet(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    _steps(model, store, 3)
    assert watch.packs == 6
    torch.manual_seed(0)
    with store.offload():
        a = model(_batch(3)).square().mean()
    with store.offload():  # the same first save, in the same step: measured
        b = model(_batch(3)).square().mean()
    assert watch.packs == 2 * 6
    (a + b).backward()
    assert store.stats().packed == 5 * 6
    model.zero_grad(set_to_none=True)
    _steps(model, store, 2, first=4)  # a step of two blocks is not repeated: measured first
    assert watch.packs == 3 * 6
    store.close()
