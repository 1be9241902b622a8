"""Saves that stay on the device take the short path (NOTE [ Saves that stay ] in tiers/manager.py).

A save that the filters, keep(), device_budget or a plan leave where it is
gets no entry, handle, finalizer or dedupe key; these tests hold it to
every promise of the full path: bitwise gradients, the in-place check,
retain_graph and double backward, threads, keep() regions, and stats that
add up. A step that repeats one whose saves all stayed skips even that
(NOTE [ Quiet blocks ] in autograd/quiet.py); here none does, and
tests/autograd/test_quiet.py holds those.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_helpers import run_in_threads

import tierstore
import tierstore.autograd.state
from tierstore.autograd.filters import Kept
from tierstore.autograd.state import TOP_HOOKS
from tierstore.tiers.handle import Handle

from ..conftest import assert_empty, grads_of_steps, same_grads


@pytest.fixture(autouse=True)
def _save_by_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step on the short path save by save: none goes quiet (tests/autograd/test_quiet.py)."""
    monkeypatch.setattr(tierstore.TierStore, "_may_go_quiet", lambda self, policy: False)


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    )  # fmt: skip


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step))


def _kept_store(spill_root: Path, device_budget: str = "64MiB") -> tierstore.TierStore:
    return tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=device_budget, disk_budget="64MiB", disk_path=spill_root,
            min_offload_bytes=0,
        )
    )  # fmt: skip


def _packed(store: tierstore.TierStore) -> list[Any]:
    """Spy on what the pack hook returns."""
    seen: list[Any] = []
    original = store._pack

    def spy(t: torch.Tensor) -> Any:
        out = original(t)
        seen.append(out)
        return out

    store._pack = spy  # type: ignore[method-assign]
    return seen


_grads = functools.partial(grads_of_steps, batch=_batch)


def _stayed(packed: object) -> torch.Tensor | None:
    """The alias a save that stayed holds (NOTE [ Saves that stay ]); None for any other."""
    if type(packed) is Kept:
        return packed.tensor
    if type(packed) is tuple:  # outside a recorder, no plan's peak
        return packed[0]
    return None


_same = same_grads


def test_device_budget_keeps_without_entries_from_the_second_step(spill_root: Path) -> None:
    store = _kept_store(spill_root)
    model = _model()
    _same(_grads(model, store, 1), _grads(_model(), None, 1))  # the first step: full path
    seen = _packed(store)
    with store.offload():
        loss = model(_batch(1)).square().mean()
    assert seen and all(_stayed(p) is not None for p in seen)
    assert not store._manager.holds_entries()  # no entry, handle or finalizer
    assert store.stats().tiers["device"].entries == 0
    loss.backward()
    model.zero_grad(set_to_none=True)
    _same(_grads(model, store, 3), _grads(_model(), None, 3))
    assert_empty(store)
    store.close()


def test_a_step_past_the_budget_keeps_the_budget(spill_root: Path) -> None:
    # The first steps fit; a larger batch does not: its early saves stay, the
    # later ones take the full path with the device tier's budget less what
    # stayed, and the device never holds more than device_budget.
    x = torch.randn(64, 256)
    w = torch.nn.Parameter(torch.randn(256, 256) / 16)

    def forward(rows: int) -> torch.Tensor:
        h = x[:rows]
        for _ in range(8):
            h = (h @ w).tanh()  # tanh saves its output, the next mm saves it again
        return h.sum()

    store = _kept_store(spill_root, device_budget="96KiB")
    for _ in range(2):
        with store.offload():
            loss = forward(4)  # 1 KiB a row: counted twice, 68 KiB in all
        loss.backward()
    w.grad = None
    seen = _packed(store)
    with store.offload():
        loss = forward(16)  # 272 KiB: the first 96 KiB stay
    stayed = {t.untyped_storage().data_ptr(): t.nbytes for t in map(_stayed, seen)
              if t is not None and t.dim() == 2 and t.shape[0] == 16}  # fmt: skip
    assert len(stayed) >= 3 and any(type(p) is Handle for p in seen)
    s = store.stats()
    assert sum(stayed.values()) + s.tiers["device"].bytes <= 96 << 10
    assert s.tiers["disk"].entries > 0
    loss.backward()
    ref = w.grad.clone()  # type: ignore[union-attr]
    w.grad = None
    forward(16).backward()
    assert torch.equal(ref, w.grad)  # type: ignore[arg-type]
    seen.clear()  # the spy's handles
    assert_empty(store)
    store.close()


@pytest.mark.parametrize("how", ["device_budget", "plan"])
def test_an_inplace_change_to_a_kept_save_raises_as_eager_does(spill_root: Path, how: str) -> None:
    if how == "plan":
        store = tierstore.TierStore(
            tierstore.TierConfig(activation_budget=1.0, min_offload_bytes=0, disk_path=spill_root)
        )
    else:
        store = _kept_store(spill_root)
    x = torch.randn(64, requires_grad=True)
    for _ in range(4):  # past the warm-up, the profile and the first plan
        with store.offload():
            y = x.exp()
        y.sum().backward()
    seen = _packed(store)
    with store.offload():
        y = x.exp()  # saves its output
    assert _stayed(seen[-1]) is not None
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError) as ours:
        y.sum().backward()
    z = x.exp()
    with torch.no_grad():
        z.mul_(2)
    with pytest.raises(RuntimeError) as eager:
        z.sum().backward()
    assert "modified by an inplace operation" in str(eager.value)
    assert "modified by an inplace operation" in str(ours.value)
    store.close()


def test_retain_graph_and_double_backward_on_kept_saves(spill_root: Path) -> None:
    store = _kept_store(spill_root)
    x = torch.randn(32, requires_grad=True)
    for _ in range(2):
        with store.offload():
            y = x.sin().exp()
        y.sum().backward()
    x.grad = None
    with store.offload():
        y = (x.sin().exp()).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()  # type: ignore[union-attr]
    y.backward()
    assert torch.equal(x.grad, 2 * first)  # type: ignore[arg-type]
    x.grad = None
    with store.offload():
        (g,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
    g.sum().backward()
    (g_eager,) = torch.autograd.grad(x.sin().exp().sum(), x, create_graph=True)
    x_grad = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    g_eager.sum().backward()
    assert torch.equal(g, g_eager) and torch.equal(x_grad, x.grad)  # type: ignore[arg-type]
    store.close()


def test_threads_share_a_store_and_the_counts_add_up(spill_root: Path) -> None:
    store = _kept_store(spill_root)
    models = [_model(seed) for seed in range(4)]
    grads: dict[int, list[Any]] = {}

    def work(i: int) -> None:
        grads[i] = _grads(models[i], store, 6)

    assert run_in_threads(work, 4) == []
    for i in range(4):
        _same(grads[i], _grads(_model(i), None, 6))
    s = store.stats()
    tally = store._manager.pack_tally().counts
    assert s.packed == sum(n for n, _ in tally.values())  # a deduplicated save is tallied too
    # Kept: the parameters, and the budget's saves once a step had fitted;
    # the saves before that went into the device tier as entries (how many
    # depends on how the threads' steps interleave).
    on_device = sum(n for k, (n, _) in tally.items() if k != "offloaded")
    assert tally["parameter"][0] < s.kept < on_device and "offloaded" not in tally
    assert_empty(store)
    store.close()


def test_keep_regions_and_stats_add_up_on_the_short_path(spill_root: Path) -> None:
    store = _kept_store(spill_root)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tierstore.TierstoreWarning)  # nothing moved: intended
        for step in range(3):
            with store.offload():
                h = model[:2](_batch(step))
                with tierstore.keep():
                    out = model[2:](h)
            out.square().mean().backward()
    s = store.stats()
    tally = store._manager.pack_tally().counts
    assert set(tally) == {"device_budget", "keep"}
    # Each step: the first Linear's input and GELU's by the budget (the first
    # step's as entries, later ones' without); inside keep(), the next
    # Linear's input and weight, Tanh's output, the last Linear's two.
    assert tally["keep"][0] == 3 * 5 and tally["device_budget"][0] == 3 * 2
    assert s.kept == 3 * 5 + 2 * 2
    assert s.packed == 3 * 7
    assert s.tiers["device"].peak_bytes > 0  # the first step's entries
    store.close()


def test_a_plan_that_keeps_everything_holds_no_entry_and_measures_its_peak(
    spill_root: Path,
) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(activation_budget=1.0, min_offload_bytes=0, disk_path=spill_root)
    )
    model = _model()
    _same(_grads(model, store, 6), _grads(_model(), None, 6))
    seen = _packed(store)
    with store.offload():
        loss = model(_batch(9)).square().mean()
    assert not store._manager.holds_entries()
    assert all(_stayed(p) is not None for p in seen)
    loss.backward()
    with store.offload():
        pass  # the step ends: its peak is measured
    plan = store.plan()
    assert plan is not None and set(plan.choices) == {"keep"}
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes >= plan.bytes_by_choice()["keep"]
    assert not store._runner.rebuilds  # type: ignore[union-attr]
    store.close()


# -- modules the plan keeps whole (NOTE [ Modules kept whole ] in autograd/regions.py) ------------


class _Block(torch.nn.Module):
    """Seven saves a call: two inputs, two weights, tanh's and exp's outputs, a dropout mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.drop = torch.nn.Dropout(0.1)  # its mask: a random op's save, kept as eager keeps it
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("boom")
        return x + self.drop(self.b(torch.tanh(self.a(x)))).exp()


def _blocks(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), _Block(), _Block(), _Block())


def _block_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


#: _grads on the blocks' batches.
_block_grads = functools.partial(_grads, batch=_block_batch)


def _budget_store(spill_root: Path, budget: float = 1.0) -> tierstore.TierStore:
    return tierstore.TierStore(
        tierstore.TierConfig(activation_budget=budget, min_offload_bytes=0, disk_path=spill_root)
    )


def _top_inside(module: torch.nn.Module) -> list[Any]:
    """The pack hook on top of the stack as ``module``'s forward runs, call by call."""
    seen: list[Any] = []

    def look(m: torch.nn.Module, args: Any) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        seen.append(None if top is None else top[0])

    module.register_forward_pre_hook(look)
    return seen


def _saves_per_step(model: torch.nn.Module) -> int:
    n = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(_block_batch(0)).square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return n[0]


needs_stack = pytest.mark.skipif(TOP_HOOKS is None, reason="this torch cannot read the hook stack")


@needs_stack
def test_a_module_the_plan_keeps_whole_runs_without_hooks_and_counts_alike(
    spill_root: Path,
) -> None:
    store = _budget_store(spill_root)
    model = _blocks()
    inside, outside = _top_inside(model[2].a), _top_inside(model[0])
    _same(_block_grads(model, store, 8), _block_grads(_blocks(), None, 8))
    plan = store.plan()
    assert plan is not None and set(plan.choices) == {"keep"}
    # The plan keeps everything: the model, the outermost module, is kept whole.
    assert [m for m, _, _ in tierstore.planning.planner.kept_whole(plan.profile, plan.choices)] == [
        "Sequential"
    ]
    # No hook inside the model once planned, in its blocks or around its first Linear.
    assert inside[:2] == [store._pack] * 2 and inside[-3:] == [None] * 3
    assert outside[:2] == [store._pack] * 2 and outside[-1] is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None

    # stats() adds up as with the hooks: every save counted kept, once per step.
    with store.offload():
        pass  # ends the last step: its plan-kept saves are counted
    before = store.stats()
    _same(_block_grads(model, store, 3, first=8), _block_grads(_blocks(), None, 11)[8:])
    with store.offload():
        pass
    after = store.stats()
    saves = _saves_per_step(_blocks())
    # The first Linear's input (not its weight: x wants no gradient); each
    # block's seven (two inputs, two weights, tanh's and exp's outputs,
    # dropout's mask); square's input.
    assert saves == 1 + 3 * 7 + 1
    assert after.packed - before.packed == 3 * saves
    assert after.kept - before.kept == 3 * saves
    assert after.tiers["host"].bytes_written == before.tiers["host"].bytes_written
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes >= plan.bytes_by_choice()["keep"]
    assert not store._manager.holds_entries()
    store.close()


@needs_stack
def test_an_inplace_change_inside_a_module_kept_whole_raises_as_eager_does(
    spill_root: Path,
) -> None:
    store = _budget_store(spill_root)
    model = _blocks()
    _block_grads(model, store, 8)
    inside = _top_inside(model[3].a)
    with store.offload():
        y = model(_block_batch(9))  # the last block's exp saved its output, y less the residual
    assert inside[-1] is None  # planned, without hooks
    with torch.no_grad():
        y.mul_(2)  # the residual's add made y: exp's output is another tensor
        model[3].b.weight.add_(1)  # saved by the block's second Linear
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    store.close()


@needs_stack
def test_retain_graph_and_double_backward_through_modules_kept_whole(spill_root: Path) -> None:
    store = _budget_store(spill_root)
    model, eager = _blocks(), _blocks()
    _block_grads(model, store, 8)
    inside = _top_inside(model[1].b)
    x = _block_batch(3).requires_grad_()
    torch.manual_seed(7)
    with store.offload():
        loss = model(x).square().mean()
    assert inside[-1] is None
    loss.backward(retain_graph=True)
    loss.backward()
    torch.manual_seed(7)
    ref = eager(x).square().mean()
    ref.backward(retain_graph=True)
    ref.backward()
    _same([[p.grad for p in model.parameters()]], [[p.grad for p in eager.parameters()]])
    model.zero_grad(set_to_none=True)
    torch.manual_seed(8)
    with store.offload():
        (g,) = torch.autograd.grad(model(x).square().mean(), x, create_graph=True)
    torch.manual_seed(8)
    (g_eager,) = torch.autograd.grad(eager(x).square().mean(), x, create_graph=True)
    assert torch.equal(g, g_eager)
    store.close()


@needs_stack
def test_a_module_where_keep_stored_a_save_keeps_its_hooks(spill_root: Path) -> None:
    store = _budget_store(spill_root)
    model = _blocks()
    handle = tierstore.keep_module(model[2], "host")
    inside_kept, inside_stored = _top_inside(model[1].a), _top_inside(model[2].a)
    _same(_block_grads(model, store, 8), _block_grads(_blocks(), None, 8))
    plan = store.plan()
    # Not the model either, which holds that block: the blocks on each side are kept whole.
    assert plan is not None and plan.profile.stored_in == ("Sequential", "Sequential.2")
    assert [m for m, _, _ in tierstore.planning.planner.kept_whole(plan.profile, plan.choices)] == [
        "Sequential.1", "Sequential.3"
    ]  # fmt: skip

    def moved() -> int:  # the host tier holds nothing under a fraction: its saves go on down
        return sum(t.bytes_written for name, t in store.stats().tiers.items() if name != "device")

    written = moved()
    _block_grads(model, store, 1, first=8)
    assert moved() > written  # keep_module's tier, as asked
    assert inside_kept[-1] is None and inside_stored[-1] == store._pack
    handle.remove()
    store.close()


@needs_stack
def test_a_module_kept_whole_that_raises_puts_the_hooks_back(spill_root: Path) -> None:
    store = _budget_store(spill_root)
    model = _blocks()
    _block_grads(model, store, 8)
    model[2].fail = True
    with pytest.raises(ValueError, match="boom"), store.offload():
        model(_block_batch(8))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model[2].fail = False
    inside = _top_inside(model[1].a)
    _same(_block_grads(model, store, 4, first=9), _block_grads(_blocks(), None, 13)[9:])
    assert inside[-1] is None  # planned again
    store.close()


@needs_stack
def test_a_module_called_twice_a_step_stays_on_its_plan(spill_root: Path) -> None:
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _blocks()[:3]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner[0](x)
            for _ in range(2):
                h = self.inner[1](h)  # one block, twice
            return self.inner[2](h)

    store = _budget_store(spill_root)
    model = Twice()
    # keep() stores the first Linear's saves: the model is not kept whole, its blocks are.
    tierstore.keep_module(model.inner[0], "host")
    inside = _top_inside(model.inner[1].a)
    for _ in range(2):
        _block_grads(model, store, 8)
    plan = store.plan()
    assert plan is not None
    spans = tierstore.planning.planner.kept_whole(plan.profile, plan.choices)
    # Five saves of a call go by the plan (not the weights): the block's span holds both calls.
    assert [(m, end - first) for m, first, end in spans] == [
        ("Twice.inner.1", 10), ("Twice.inner.2", 5)
    ]  # fmt: skip
    assert inside[-2:] == [None, None]  # both calls, without hooks
    runner = store._runner
    assert runner is not None and runner._step is not None
    assert runner._step.deviated_at is None and not runner._step.profiling
    store.close()


def test_without_a_readable_hook_stack_every_save_takes_the_hooks(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tierstore.autograd.state, "TOP_HOOKS", None)
    store = _budget_store(spill_root)
    model = _blocks()
    inside = _top_inside(model[2].a)
    _same(_block_grads(model, store, 8), _block_grads(_blocks(), None, 8))
    assert store.plan() is not None and inside[-1] == store._pack
    store.close()


@needs_stack
def test_hooks_around_the_block_never_see_the_saves_of_a_module_kept_whole(
    spill_root: Path,
) -> None:
    store = _budget_store(spill_root)
    model = _blocks()
    outer = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        outer[0] += 1
        return t

    inside = _top_inside(model[2].a)
    _block_grads(model, store, 8)
    assert inside[-1] is None  # kept whole with nothing around the block
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        ours = _block_grads(model, store, 2, first=8)
    assert outer[0] == 0  # as with the store's hooks on top throughout
    assert inside[-1] == store._pack
    _same(ours, _block_grads(_blocks(), None, 10)[8:])
    store.close()


@needs_stack
def test_offload_module_with_a_plan_that_keeps_everything_keeps_its_model_whole(
    spill_root: Path,
) -> None:
    # offload_module opens the block in the model's own pre-hook: the model's
    # hooks that keep it whole run inside that block, and put the store's back first.
    model, eager = _blocks(), _blocks()
    handle = tierstore.offload_module(
        model, activation_budget=1.0, min_offload_bytes=0, disk_path=spill_root
    )
    inside = _top_inside(model[2].a)
    for step in range(10):
        torch.manual_seed(100 + step)
        model(_block_batch(step)).square().mean().backward()
        torch.manual_seed(100 + step)
        eager(_block_batch(step)).square().mean().backward()
        _same([[p.grad for p in model.parameters()]], [[p.grad for p in eager.parameters()]])
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert inside[:2] == [handle.store._pack] * 2 and inside[-3:] == [None] * 3
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    handle.remove()


@needs_stack
def test_a_kept_whole_hook_of_a_replaced_plan_stands_aside(spill_root: Path) -> None:
    # offload_module follows a new plan in the model's own pre-hook, and torch
    # still calls the hooks of the old one for that call.
    store = _budget_store(spill_root)
    model = _blocks()
    _block_grads(model, store, 8)
    regions = store._regions
    plan = regions.plan
    assert plan is not None
    (_, first, end), *_ = tierstore.planning.planner.kept_whole(plan.profile, plan.choices)
    replaced = dataclasses.replace(plan)
    ours = torch._C._autograd._top_saved_tensors_default_hooks
    with store.offload():
        regions._keep((replaced, first, end, ()), model, ())  # a hook of a plan gone
        assert ours(False) is not None  # stood aside: the store's hooks stay on
        regions._keep((plan, first, end, ()), model, ())  # the plan under way
        assert ours(False) is None
        regions.restore()
    assert ours(False) is None
    store.close()
