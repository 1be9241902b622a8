"""A step that repeats one whose saves all stayed runs without hooks (NOTE [ Quiet blocks ]).

After its first save, such a block takes the store's hooks off autograd's
stack and counts its saves as the block it repeats counted them. These tests
hold it to the promises of the short path (tests/autograd/test_fast_path.py): bitwise
gradients, the in-place check, retain_graph and double backward, threads,
keep() regions, stats that add up; and to what decides it: the first save,
the room device_budget leaves, one block a step, nothing beneath the hooks.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_helpers import run_in_threads

import tierstore
from tierstore.autograd.quiet import GREW, MEASURED_EVERY
from tierstore.autograd.state import TOP_HOOKS, local
from tierstore.tiers.manager import QUIET_ROOM

from ..conftest import assert_empty, grads_of_steps, in_block, same_grads

pytestmark = [
    pytest.mark.skipif(TOP_HOOKS is None, reason="this torch cannot read autograd's hook stack"),
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
        model[-1].register_forward_pre_hook(lambda m, a: self.tops.append(TOP_HOOKS(False)))  # type: ignore[misc]


_steps = functools.partial(grads_of_steps, batch=_batch)
_same = same_grads


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
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
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
        in_block(store, lambda: x.sin().exp()).sum().backward()
    # exp saves its output, autograd's own once the block is quiet.
    y, top = in_block(store, lambda: (x.sin().exp(), TOP_HOOKS(False)))  # type: ignore[misc]
    assert top is None
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    store.close()


def test_retain_graph_and_double_backward_in_quiet_blocks(spill_root: Path) -> None:
    store = _store(spill_root)
    x = torch.randn(32, requires_grad=True)
    for _ in range(3):
        in_block(store, lambda: x.sin().exp().sum()).backward()
    x.grad = None
    y = in_block(store, lambda: x.sin().exp().sum())
    y.backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    y.backward()
    assert torch.equal(x.grad, 2 * first)  # type: ignore[arg-type]
    x.grad = None
    for _ in range(3):
        (g,) = in_block(
            store, lambda: torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
        )
        g.sum().backward()
    x_grad = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    (g_eager,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
    g_eager.sum().backward()
    assert torch.equal(g, g_eager) and torch.equal(x_grad, 3 * x.grad)  # type: ignore[operator]
    store.close()


def test_a_step_that_fills_a_share_of_the_room_is_measured(spill_root: Path) -> None:
    # 16 rows save 14.5 KiB past the parameters: within 20 KiB, but not
    # QUIET_ROOM times over.
    store = _store(spill_root, device_budget=20 << 10)
    model = _model()
    watch = _Watch(store, model)
    _same(_steps(model, store, 4), _steps(_model(), None, 4))
    assert watch.packs == 4 * 6 and store._quiet is not None
    assert "offloaded" not in store._manager.pack_tally().counts  # every save fitted
    store.close()


def test_another_batch_size_is_measured_and_keeps_the_budget(spill_root: Path) -> None:
    # 16 rows save 14.5 KiB past the parameters, 256 rows 16 times that.
    assert QUIET_ROOM * 14848 <= 128 << 10 < 16 * 14848
    store = _store(spill_root, device_budget=128 << 10)
    model = _model()
    watch = _Watch(store, model)
    big = lambda step: _batch(step, rows=256)  # noqa: E731  232 KiB: past the budget
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


def test_blocks_opened_at_two_places_are_measured(spill_root: Path) -> None:
    # Two models fed the same batch (an actor and a critic): the same first
    # save, not the same block.
    store = _store(spill_root)
    actor, critic = _model(0), torch.nn.Sequential(*_model(1), torch.nn.Linear(8, 512))
    watch = _Watch(store, actor)
    critic_watch = [0]
    critic[-1].register_forward_pre_hook(lambda m, a: critic_watch.__setitem__(0, 1))
    for step in range(3):
        with store.offload():
            actor(_batch(step)).square().mean().backward()
        with store.offload():
            critic(_batch(step)).square().mean().backward()
    assert watch.tops == [watch.tops[0]] * 3 and watch.tops[0] is not None
    assert store._manager.pack_tally().counts["device_budget"][0] > 0
    store.close()


def test_one_step_in_every_measured_every_is_measured(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    _steps(model, store, 1 + MEASURED_EVERY)
    assert watch.packs == 2 * 6  # the first step, and one after MEASURED_EVERY - 1 quiet ones
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
    seen: dict[str, Any] = {}

    def forward() -> torch.Tensor:
        h = model[:2](_batch(3))
        with tierstore.keep(tier="disk"):
            seen["inside"] = TOP_HOOKS(False)  # type: ignore[misc]
            out = model[2:](h)
        seen["after"] = TOP_HOOKS(False)  # type: ignore[misc]
        seen["on_disk"] = store.stats().tiers["disk"].entries
        return out

    out = in_block(store, forward)
    assert seen["inside"] is not None and seen["after"] is None
    assert seen["on_disk"] == 2  # dropout's mask and the last Linear's input; its weight stays
    out.square().mean().backward()
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
    assert store._next_quiet is None  # a block that ran keep() is not repeated
    assert_empty(store)
    store.close()


def test_keep_under_a_checkpoint_in_a_quiet_block_leaves_it_to_the_checkpoint(
    spill_root: Path,
) -> None:
    # A keep() region inside a checkpointed function: checkpoint's hooks take
    # its saves, as they do over the store's hooks; the store's pushed over
    # them would take saves checkpoint needs to match in its recompute.
    store = _store(spill_root)
    model = _model(p=0.0)

    def inner(h: torch.Tensor) -> torch.Tensor:
        with tierstore.keep():
            return model[2:](h.exp())

    def forward(rows: torch.Tensor) -> torch.Tensor:
        h = model[:2](rows)
        return torch.utils.checkpoint.checkpoint(inner, h, use_reentrant=False).square().mean()

    ours, eager = [], []
    for step in range(4):
        rows = _batch(step)
        in_block(store, lambda: forward(rows)).backward()  # noqa: B023
        ours.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
        forward(rows).backward()
        eager.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    _same(ours, eager)
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
    store.close()


def test_keep_inside_another_stores_block_in_a_quiet_block_is_that_stores(
    spill_root: Path,
) -> None:
    outer, inner = _store(spill_root), _store(spill_root, device_budget=0)
    model = _model()
    _steps(model, outer, 3)

    def forward() -> torch.Tensor:
        h = model[:2](_batch(3))
        with inner.offload(), tierstore.keep(tier="disk"):
            return model[2:](h)

    out = in_block(outer, forward)
    assert inner.stats().tiers["disk"].entries == 2  # the inner block wins, as ever
    assert outer.stats().tiers["disk"].entries == 0
    out.square().mean().backward()
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
    outer.close()
    inner.close()


def test_a_keep_region_that_outlives_a_quiet_block_leaves_the_stack_balanced(
    spill_root: Path,
) -> None:
    store = _store(spill_root)
    model = _model()
    _steps(model, store, 3)
    region = tierstore.keep(tier="disk")

    def forward() -> torch.Tensor:
        out = model(_batch(3))
        region.__enter__()  # left open past the block: a misuse, not a corruption
        assert TOP_HOOKS(False) is not None  # type: ignore[misc]
        return out

    in_block(store, forward).sum().backward()
    assert TOP_HOOKS(False) is None  # type: ignore[misc]  the block's pop took the region's
    region.__exit__(None, None, None)
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
    assert local.quiet is None and local.tier is None
    x = torch.randn(8, requires_grad=True)
    with tierstore.keep(tier="disk"):  # outside every block: changes nothing
        x.exp().sum().backward()
    assert store.stats().tiers["disk"].entries == 0
    store.close()


def test_keep_where_hooks_are_disabled_leaves_no_tier_behind(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    _steps(model, store, 3)

    def forward() -> torch.Tensor:
        out = model(_batch(3))
        with torch.autograd.graph.disable_saved_tensors_hooks("off"), tierstore.keep():
            pass
        return out

    in_block(store, forward).sum().backward()
    assert local.tier is None
    store.close()


def test_a_quiet_block_that_raises_leaves_the_hook_stack_as_it_was(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    _steps(model, store, 3)
    with pytest.raises(ValueError, match="inside"), store.offload():
        model(_batch(3))
        raise ValueError("inside")
    assert TOP_HOOKS(False) is None  # type: ignore[misc]
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
        in_block(store, lambda: model(_batch(5)).sum())  # the sixth step ends the fifth
    assert len([r for r in caplog.records if r.name == "tierstore"]) == 5
    store.close()


def test_one_block_a_step_goes_quiet(spill_root: Path) -> None:
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    _steps(model, store, 3)
    assert watch.packs == 6
    torch.manual_seed(0)
    rows = _batch(3)
    a = in_block(store, lambda: model(rows).square().mean())
    b = in_block(store, lambda: model(rows).square().mean())  # the same step: measured
    assert watch.packs == 2 * 6
    (a + b).backward()
    assert store.stats().packed == 5 * 6
    model.zero_grad(set_to_none=True)
    _steps(model, store, 2, first=4)  # a step of two blocks is not repeated: measured first
    assert watch.packs == 3 * 6
    store.close()


def test_a_quiet_block_that_left_more_device_memory_is_not_repeated(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA the allocator's count of allocated bytes shows what a quiet
    # block's saves no longer can; here a fake count, behind the same function.
    allocated = [0]
    monkeypatch.setattr(tierstore.tier_store, "device_bytes", lambda device: allocated[0])
    store = _store(spill_root)
    model = _model()
    watch = _Watch(store, model)
    left = [4 << 20]  # what each forward leaves allocated after its first save
    model[-1].register_forward_hook(
        lambda m, a, out: allocated.__setitem__(0, allocated[0] + left[0])
    )
    _steps(model, store, 3)
    assert watch.packs == 6  # measured, then quiet at the same 4 MiB
    left[0] = int(4 * GREW * (1 << 20))  # within GREW of the measured step (and a MiB)
    _steps(model, store, 2, first=3)
    assert watch.packs == 6
    left[0] = 16 << 20  # grew 4x: the saves behind the first were not those measured
    _steps(model, store, 2, first=5)
    assert watch.packs == 2 * 6  # the quiet step that grew is not repeated: measured
    store.close()
