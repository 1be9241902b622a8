"""Saves that stay on the device take the short path (NOTE [ Saves that stay ] in store.py).

A save that the filters, keep(), device_budget or a plan leave where it is
gets no entry, handle, finalizer or dedupe key; these tests hold it to
every promise of the full path: bitwise gradients, the in-place check,
retain_graph and double backward, threads, keep() regions, and stats that
add up.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_helpers import run_in_threads

import tierstore
from tierstore.handle import Handle
from tierstore.hooks import _Kept

from .conftest import assert_empty


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


def _grads(model: torch.nn.Module, store: tierstore.TierStore | None, steps: int) -> list[Any]:
    out = []
    for step in range(steps):
        if store is None:
            loss = model(_batch(step)).square().mean()
        else:
            with store.offload():
                loss = model(_batch(step)).square().mean()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    return out


def _same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def test_device_budget_keeps_without_entries_from_the_second_step(spill_root: Path) -> None:
    store = _kept_store(spill_root)
    model = _model()
    _same(_grads(model, store, 1), _grads(_model(), None, 1))  # the first step: full path
    seen = _packed(store)
    with store.offload():
        loss = model(_batch(1)).square().mean()
    assert seen and all(type(p) is _Kept for p in seen)
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
    stayed = {p.tensor.untyped_storage().data_ptr(): p.tensor.nbytes for p in seen
              if type(p) is _Kept and p.tensor.dim() == 2 and p.tensor.shape[0] == 16}  # fmt: skip
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
    assert type(seen[-1]) is _Kept
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
    assert all(type(p) is _Kept for p in seen)
    loss.backward()
    with store.offload():
        pass  # the step ends: its peak is measured
    plan = store.plan()
    assert plan is not None and set(plan.choices) == {"keep"}
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes >= plan.bytes_by_choice()["keep"]
    assert not store._runner.rebuilds  # type: ignore[union-attr]
    store.close()
