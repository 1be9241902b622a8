"""Autograd semantics under offload: gradients bitwise equal to eager, on every disk backend."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tierstore
from tierstore import offloading

Compare = Callable[..., tierstore.Stats]


# -- models ---------------------------------------------------------------------


def _mlp() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )
    x = torch.randn(16, 32, requires_grad=True)
    return model, [x], lambda m, x: m(x).square().mean()


def _cnn() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),  # saves int64 indices
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )
    x = torch.randn(4, 3, 16, 16)
    target = torch.randint(0, 10, (4,))
    return model, [x], lambda m, x: F.cross_entropy(m(x), target)


class _Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def _transformer() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = _Block()
    x = torch.randn(2, 12, 32, requires_grad=True)
    return model, [x], lambda m, x: m(x).square().mean()


def _autocast_mlp() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model, inputs, _ = _mlp()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().square().mean()

    return model, inputs, loss


@pytest.mark.parametrize("build", [_mlp, _cnn, _transformer, _autocast_mlp])
def test_models_match_eager(
    build: Callable[[], Any],
    any_store: tierstore.TierStore,
    compare_with_eager: Compare,
    empty_check: Callable[..., None],
) -> None:
    stats = compare_with_eager(build, any_store)
    offloaded = "disk" if any_store.config.disk_budget else "host"
    assert stats.tiers[offloaded].entries > 0
    assert stats.tiers["device"].entries == 0
    empty_check(any_store)


def test_maxpool_indices_go_to_disk(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    with disk_store.offload():
        y = F.max_pool2d(x, 2)  # saves self and the int64 indices
    saved = y.grad_fn._saved_result1
    assert saved.dtype == torch.int64
    assert disk_store.stats().tiers["disk"].entries == 2
    y.sum().backward()
    assert torch.equal(x.grad, torch.func.grad(lambda t: F.max_pool2d(t, 2).sum())(x.detach()))


# -- graph reuse ------------------------------------------------------------------


def test_retain_graph_two_backwards(
    disk_store: tierstore.TierStore, empty_check: Callable[..., None]
) -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    eager = (x @ w).tanh().sin().sum()
    eager.backward(retain_graph=True)
    eager.backward()
    expected = w.grad.clone()
    w.grad = None

    with disk_store.offload():
        loss = (x @ w).tanh().sin().sum()
    loss.backward(retain_graph=True)
    held = disk_store.stats().tiers["disk"].entries
    assert held > 0  # nothing is freed at unpack: the graph is retained
    loss.backward(retain_graph=True)
    assert torch.equal(w.grad, expected)
    assert disk_store.stats().tiers["disk"].entries == held  # until the graph is dropped
    del loss
    empty_check(disk_store)


def test_double_backward(disk_store: tierstore.TierStore) -> None:
    def second(x: torch.Tensor) -> torch.Tensor:
        y = (x.sin() * x.exp()).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return g.square().sum()

    x = torch.randn(64, requires_grad=True)
    second(x).backward()
    expected, x.grad = x.grad.clone(), None
    with disk_store.offload():
        y = (x.sin() * x.exp()).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    g.square().sum().backward()
    assert torch.equal(x.grad, expected)


class _TwiceRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        x2, w2 = ctx.saved_tensors  # a second read must give the same tensors
        assert torch.equal(x, x2) and torch.equal(w, w2)
        return grad @ w.t(), x2.t() @ grad


def test_custom_function_reads_saved_tensors_twice(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    (x @ w).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with disk_store.offload():
        out = _TwiceRead.apply(x, w)
    assert disk_store.stats().tiers["disk"].entries == 2
    out.sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])


def test_saved_self_readable_before_backward(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(5, 7, requires_grad=True)
    h = (x * 3).t()
    with disk_store.offload():
        y = h.sin()  # saves self
    saved = y.grad_fn._saved_self
    assert torch.equal(saved, h) and saved.stride() == h.stride()
    y.sum().backward()
    assert torch.equal(x.grad, torch.func.grad(lambda t: (t * 3).t().sin().sum())(x.detach()))


# -- views, strides, dtypes -----------------------------------------------------------

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "non-contiguous": lambda t: t[:, ::2],
    "transposed": lambda t: t.t(),
    "rows-transposed": lambda t: t[1:5].t(),
    "block-transposed": lambda t: t[1:5, 2:9].t(),
    "expanded": lambda t: t[:1].expand(64, -1),
    "zero-size": lambda t: t[:0],
    "0-dim": lambda t: t[2, 3],
}


@pytest.mark.parametrize("view", list(VIEWS), ids=list(VIEWS))
def test_views_and_strides(
    view: str, any_store: tierstore.TierStore, empty_check: Callable[..., None]
) -> None:
    store = any_store
    base = torch.randn(64, 32, requires_grad=True)
    other = torch.randn(64, 32)

    def loss() -> tuple[torch.Tensor, torch.Tensor]:
        v = VIEWS[view](base * 1)  # non-leaf, so mul saves it
        o = VIEWS[view](other)
        return v, (v * o).sum()

    _, eager = loss()
    eager.backward()
    expected, base.grad = base.grad.clone(), None

    with store.offload():
        v, out = loss()
    saved = out.grad_fn.next_functions[0][0]._saved_other
    if view not in ("non-contiguous", "block-transposed"):  # gapped: rest dense (NOTE [ Spans ])
        assert saved.stride() == VIEWS[view](other).stride()
    assert saved.shape == v.shape and torch.equal(saved, VIEWS[view](other))
    if view == "expanded":
        # mul saved one tensor, o: 64 rows of stride 0 rest as one row of 32
        # floats (128 bytes), not 64 * 32; on disk that is one 4 KiB page.
        if store.config.disk_budget:
            assert store.stats().tiers["disk"].bytes == 4096
        else:
            assert store.stats().tiers["host"].bytes == 32 * 4
    out.backward()
    assert torch.equal(base.grad, expected)
    del out, v, saved
    empty_check(store)


DTYPES = [
    torch.bool,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_dtypes_round_trip(dtype: torch.dtype, disk_store: tierstore.TierStore) -> None:
    torch.manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(17, 9, dtype=dtype, requires_grad=True)
        with disk_store.offload():
            y = (x * 1).exp()  # exp saves its result
        saved = y.grad_fn._saved_result
        assert saved.dtype == dtype and torch.equal(saved, y.detach())
        y.abs().sum().backward() if dtype.is_complex else y.sum().backward()
        expected = torch.func.grad(
            lambda t: (t * 1).exp().abs().sum() if dtype.is_complex else (t * 1).exp().sum()
        )(x.detach())
        assert torch.equal(x.grad, expected)
    else:
        src = torch.randn(17, 9, requires_grad=True)
        index = torch.randint(0, 9, (17, 4)) if dtype == torch.int64 else None
        mask = torch.rand(17, 9) > 0.5 if dtype == torch.bool else None
        with disk_store.offload():
            y = src.gather(1, index) if index is not None else src.masked_fill(mask, 0.0)
        fn = y.grad_fn
        saved = fn._saved_index if index is not None else fn._saved_mask
        assert saved.dtype == dtype
        assert torch.equal(saved, index if index is not None else mask)
        y.sum().backward()
        assert disk_store.stats().tiers["disk"].bytes == 0


def test_sparse_coo_is_kept(disk_store: tierstore.TierStore) -> None:
    i = torch.tensor([[0, 1, 2], [2, 0, 1]])
    sparse = torch.sparse_coo_tensor(i, torch.randn(3), (3, 3), check_invariants=True).coalesce()
    dense = torch.randn(3, 4, requires_grad=True)
    torch.sparse.mm(sparse, dense).sum().backward()
    expected, dense.grad = dense.grad.clone(), None
    with disk_store.offload():
        out = torch.sparse.mm(sparse, dense)
    stats = disk_store.stats()
    assert stats.kept >= 1 and stats.kept == stats.packed - stats.tiers["disk"].entries
    out.sum().backward()
    assert torch.equal(dense.grad, expected)


def test_same_tensor_saved_several_times_is_stored_once(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(128, 128, requires_grad=True)
    h = x * 2  # saves nothing (scalar other)
    with disk_store.offload():
        y = h.sin() + h.cos() + h * h  # h saved four times
    disk_store._manager.flush()
    stats = disk_store.stats()
    assert stats.packed == 4 and stats.deduplicated == 3
    assert stats.tiers["disk"].entries == 1
    backend = disk_store._manager._pipeline.backend_if_open
    assert backend is not None and len(backend) == 1
    assert stats.tiers["disk"].bytes == backend.used_bytes  # one record's footprint
    if disk_store.config.compression == "none":
        assert 128 * 128 * 4 < backend.used_bytes <= 128 * 128 * 4 + 2 * 4096
    y.sum().backward()
    expected = torch.func.grad(lambda t: ((h := t * 2).sin() + h.cos() + h * h).sum())(x.detach())
    assert torch.equal(x.grad, expected)


def test_parameters_and_buffer_views_stay(disk_store: tierstore.TierStore) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.register_buffer("scale", torch.rand(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale[:32]  # a view of a buffer, saved by mul

    model = Scaled()
    x = torch.randn(32, 64, requires_grad=True)
    with disk_store.offload():
        out = model(x)
    fn = out.grad_fn
    stats = disk_store.stats()
    # Saved: x and weight.t() by addmm, the buffer view by mul.
    assert stats.packed == 3
    assert stats.kept == 2  # weight.t() and scale[:32]
    assert stats.kept_bytes == 64 * 64 * 4 + 32 * 64 * 4
    assert stats.tiers["disk"].entries == 1
    assert fn._saved_other.data_ptr() == model.scale.data_ptr()
    out.sum().backward()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("scale", torch.rand(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # saved by mul


def test_buffer_replaced_by_module_to_stays(disk_store: tierstore.TierStore) -> None:
    # NOTE [ Buffer watch ]: Module.to() swaps the buffer without registering it.
    model = _Scaled().to(torch.float64)
    with disk_store.offload():
        out = model(torch.randn(32, 64, dtype=torch.float64, requires_grad=True))
    stats = disk_store.stats()
    assert (stats.packed, stats.kept) == (3, 2)  # x offloaded; weight.t() and scale kept
    assert stats.kept_bytes == (64 * 64 + 64) * 8
    out.sum().backward()


def test_an_unhashable_module_still_registers_its_buffers() -> None:
    class Unhashable(nn.Module):  # noqa: PLW1641 (what the test is about)
        def __eq__(self, other: object) -> bool:  # and so no __hash__
            return self is other

    module = Unhashable()
    module.register_buffer("scale", torch.ones(2))
    assert torch.equal(module.scale, torch.ones(2))


def test_offload_module_watches_buffers_it_never_saw_registered(
    disk_store: tierstore.TierStore,
) -> None:
    class Unseen(_Scaled):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.lin = nn.Linear(64, 64)
            # As if registered before tierstore was imported: its hook never saw it.
            self._buffers["scale"] = torch.rand(64)

    model = Unseen()
    handle = tierstore.offload_module(model, store=disk_store)
    out = model(torch.randn(32, 64, requires_grad=True))
    stats = disk_store.stats()
    assert (stats.packed, stats.kept, stats.kept_bytes) == (3, 2, (64 * 64 + 64) * 4)
    out.sum().backward()
    handle.remove()


# -- in-place modification ---------------------------------------------------------

TIER_CONFIGS = {
    "device": {"device_budget": "1GiB", "host_budget": 0, "disk_budget": 0},
    "host": {"device_budget": 0, "host_budget": "1GiB", "disk_budget": 0},
    "disk": {"device_budget": 0, "host_budget": 0, "disk_budget": "64MiB"},
    "kept": {
        "device_budget": 0,
        "host_budget": "1GiB",
        "disk_budget": 0,
        "min_offload_bytes": "1GiB",
    },
}


@pytest.mark.parametrize("tier", list(TIER_CONFIGS))
@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_inplace_after_save_raises(tier: str, backend: str, spill_root: Any) -> None:
    settings = {"min_offload_bytes": 0, **TIER_CONFIGS[tier]}
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, disk_backend=backend, **settings)
    )
    x = torch.randn(10, requires_grad=True)
    h = x * 1
    eager = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager.sum().backward()

    h = x * 1
    with store.offload():
        y = h.sin()
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    store.close()


# -- lifetimes ------------------------------------------------------------------------


def test_discarded_forward_frees_everything(
    disk_store: tierstore.TierStore, empty_check: Callable[..., None]
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with disk_store.offload():
        loss = model(torch.randn(32, 64)).sum()
    assert disk_store.stats().tiers["disk"].entries > 0
    del loss
    empty_check(disk_store)


def test_backward_frees_everything_and_leaves_no_records(
    disk_store: tierstore.TierStore, empty_check: Callable[..., None]
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    for _ in range(3):
        with disk_store.offload():
            loss = model(torch.randn(32, 64)).sum()
        disk_store.flush()  # on disk for sure, so backward reads records back
        loss.backward()
        del loss
        empty_check(disk_store)
    stats = disk_store.stats().tiers["disk"]
    assert stats.bytes_written > 0 and stats.bytes_read > 0


# -- contexts and threads --------------------------------------------------------------


def test_exception_inside_offload_removes_hooks(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(ValueError, match="boom"), disk_store.offload():
        raise ValueError("boom")
    y = x.exp()  # outside any context: not packed
    assert disk_store.stats().packed == 0
    y.sum().backward()


def test_nested_offload_inner_wins(spill_root: Any) -> None:
    outer = tierstore.TierStore(
        tierstore.TierConfig(device_budget=0, disk_budget=0, min_offload_bytes=0)
    )
    inner = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_path=spill_root,
            disk_budget="8MiB",
            min_offload_bytes=0,
        )
    )
    x = torch.randn(16, requires_grad=True)
    with outer.offload():
        a = x.exp()
        with inner.offload():
            b = a.sin()
        c = b.cos()
    assert outer.stats().packed == 2 and inner.stats().packed == 1
    assert inner.stats().tiers["disk"].entries == 1
    c.sum().backward()
    outer.close()
    inner.close()


def test_no_grad_packs_nothing(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(16, requires_grad=True)
    with torch.no_grad(), disk_store.offload():
        x.exp().sin()
    assert disk_store.stats().packed == 0


def test_hooks_are_thread_local(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(16, requires_grad=True)
    results: list[torch.Tensor] = []
    with disk_store.offload():
        worker = threading.Thread(target=lambda: results.append(x.exp()))
        worker.start()
        worker.join()
    assert disk_store.stats().packed == 0
    results[0].sum().backward()


def test_keep_keeps_on_device(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(64, requires_grad=True)
    with disk_store.offload():
        a = x.exp()
        with tierstore.keep():
            b = a.sin()
        c = b.cos()
    stats = disk_store.stats()
    assert (stats.packed, stats.kept, stats.tiers["disk"].entries) == (3, 1, 2)
    c.sum().backward()


# -- activation checkpointing ----------------------------------------------------------


def _checkpointed(inner_offload: tierstore.TierStore | None) -> Callable[..., Any]:
    def build() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
        model, inputs, _ = _mlp()

        def body(x: torch.Tensor) -> torch.Tensor:
            if inner_offload is None:
                return model[:3](x)
            with inner_offload.offload():
                return model[:3](x)

        def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(body, x, use_reentrant=False)
            return m[3:](h).square().mean()

        return model, inputs, loss

    return build


def test_checkpoint_inside_offload(
    disk_store: tierstore.TierStore, compare_with_eager: Compare
) -> None:
    compare_with_eager(_checkpointed(None), disk_store)


def test_offload_inside_checkpoint(
    disk_store: tierstore.TierStore, compare_with_eager: Compare
) -> None:
    compare_with_eager(_checkpointed(disk_store), disk_store)


# -- tierstore.offload() -----------------------------------------------------------------


def test_offload_reuses_one_store_per_config(spill_root: Any) -> None:
    x = torch.randn(32, 32, requires_grad=True)
    settings = {
        "device_budget": 0,
        "host_budget": 0,
        "disk_budget": "8MiB",
        "disk_path": spill_root,
        "min_offload_bytes": 0,
    }
    with tierstore.offload(**settings) as first:
        y = x.exp()
    y.sum().backward()
    with tierstore.offload(tierstore.TierConfig(**settings)) as second:
        y = x.exp()
    y.sum().backward()
    assert first is second
    assert second.stats().packed == 2
    with tierstore.offload(tierstore.TierConfig(**settings), host_budget="1MiB") as third:
        pass
    assert third is not first


def _registry_step(
    k: int, w: torch.Tensor, x: torch.Tensor, spill_root: Any
) -> tuple[tierstore.TierStore, torch.Tensor]:
    """A forward under the process-wide store of configuration ``k``: (store, loss)."""
    settings = {"device_budget": 0, "disk_budget": "8MiB", "disk_path": spill_root}
    with tierstore.offload(**settings, min_offload_bytes=k) as store:
        loss = (x @ w).tanh().square().sum()
    return store, loss


def test_offload_keeps_at_most_four_stores(spill_root: Any) -> None:
    """Six configurations in turn: at most four stores open, a repeated one reused, exact.

    NOTE [ Stores behind offload() ].
    """

    offloading._close_all()
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    (want,) = torch.autograd.grad((x @ w).tanh().square().sum(), [w])
    seen: list[tierstore.TierStore] = []
    for step in range(3):
        for k in range(6):
            for again in range(2):  # the same configuration twice: the same store
                store, loss = _registry_step(k, w, x, spill_root)
                (got,) = torch.autograd.grad(loss, [w])
                assert torch.equal(got, want), (step, k, again)
                if again:
                    assert store is seen[-1]
                else:
                    seen.append(store)
                open_stores = [s for s in seen if not s.closed]
                assert len(open_stores) <= 4
                assert store in open_stores
    # Six configurations in turn: each came back after four others, as a new store.
    assert len(seen) == 18 and len(set(map(id, seen))) == 18
    # Within the last four, a configuration's store is still the one it had.
    store, loss = _registry_step(3, w, x, spill_root)
    assert store is seen[-3]
    del loss
    offloading._close_all()
    assert all(s.closed for s in seen)


def test_a_retired_store_stays_open_for_the_backward_it_owes(spill_root: Any) -> None:
    """A store whose graph has not run backward is closed only after it has.

    NOTE [ Stores behind offload() ].
    """

    offloading._close_all()
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    (want,) = torch.autograd.grad((x @ w).tanh().square().sum(), [w])
    owed, pending = _registry_step(0, w, x, spill_root)
    others = []
    for k in range(1, 6):  # four other configurations retire the first
        store, loss = _registry_step(k, w, x, spill_root)
        (got,) = torch.autograd.grad(loss, [w])
        assert torch.equal(got, want)
        others.append(store)
    assert owed not in offloading._stores.values() and not owed.closed
    assert others[0].closed  # retired too, with nothing left: closed at once
    (got,) = torch.autograd.grad(pending, [w])
    assert torch.equal(got, want)
    del pending
    assert not owed.closed  # until the next offload() block
    store, loss = _registry_step(5, w, x, spill_root)
    assert store is others[-1] and owed.closed
    del loss
    offloading._close_all()


def test_inplace_on_the_base_of_a_dead_view_raises(any_store: tierstore.TierStore) -> None:
    x = torch.randn(64, requires_grad=True)
    h = x * 1
    with any_store.offload():
        y = h[8:].sin()  # the view object dies at once; its base h lives on
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_inplace_before_demotion_raises_instead_of_copying(spill_root: Any) -> None:
    # The entry sits on the device tier, aliasing h's memory. h itself is gone,
    # but a detach()ed alias modifies that memory; a later save demotes the
    # entry to disk, copying the modified values. Only the entry's own probe
    # can tell (NOTE [ Version check ]).
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=64 * 64 * 4,
            host_budget=0,
            disk_budget="16MiB",
            disk_path=spill_root,
            min_offload_bytes=0,
        )
    )
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1
    alias = h.detach()
    with store.offload():
        y = h.sin()
    del h
    alias.add_(100)
    with store.offload():
        z = (x * 2).exp()  # pushes the first entry down to disk
    store._manager.flush()
    assert store.stats().tiers["disk"].entries == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + z.sum()).backward()
    store.close()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_and_zero_tensors_are_kept(disk_store: tierstore.TierStore) -> None:
    nested = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], requires_grad=True)
    x = torch.randn(4, 4, requires_grad=True)
    zero = torch._efficientzerotensor(4, 4)
    with disk_store.offload():
        y = nested.sin()
        w = x * zero  # saves the zero tensor, which has no storage to copy
    stats = disk_store.stats()
    assert stats.kept == 2 and stats.packed == 2 and stats.tiers["disk"].entries == 0
    y.backward(torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)]))
    w.sum().backward()
    assert torch.equal(x.grad, torch.zeros(4, 4))


def test_keep_module_keeps_only_that_modules_saves(
    any_store: tierstore.TierStore, compare_with_eager: Callable[..., tierstore.Stats]
) -> None:
    def build() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        return model, [torch.randn(32, 64)], lambda m, x: m(x).square().mean()

    handles: list[Any] = []

    def build_kept() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
        model, inputs, loss = build()
        handles.append(tierstore.keep_module(model[2]))
        return model, inputs, loss

    plain = compare_with_eager(build, any_store)
    kept = compare_with_eager(build_kept, any_store)
    # Counters add up over both runs. The head saves its input (32x64 floats)
    # and weight.t() (a parameter view, kept either way): only the input moves
    # from an offload tier to "kept".
    assert (kept.kept - plain.kept) - plain.kept == 1
    assert (kept.kept_bytes - plain.kept_bytes) - plain.kept_bytes == 32 * 64 * 4
    for handle in handles:
        handle.remove()
        handle.remove()  # idempotent


def test_keep_module_leaves_keep_even_when_forward_raises(disk_store: tierstore.TierStore) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    boom = Boom()
    handle = tierstore.keep_module(boom)
    x = torch.randn(128, 128, requires_grad=True)
    with disk_store.offload():
        with pytest.raises(ValueError, match="boom"):
            boom(x)
        y = x.exp()  # after the failed forward: offloaded again
    stats = disk_store.stats()
    assert (stats.kept, stats.tiers["disk"].entries) == (0, 1)
    handle.remove()
    y.sum().backward()


# -- offload_module ------------------------------------------------------------------------


def test_offload_module_gradients_match_eager(disk_config: tierstore.TierConfig) -> None:
    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model, (x,), loss_fn = _mlp()
        x.requires_grad_(True)
        handle = tierstore.offload_module(model, disk_config) if offload else None
        torch.manual_seed(1)
        loss = loss_fn(model, x)
        if handle is not None:
            handle.store.flush()
            assert handle.store.stats().tiers["disk"].entries > 0
        loss.backward()
        if handle is not None:
            assert handle.store.stats().tiers["disk"].entries == 0
            handle.remove()
        return [*(p.grad for p in model.parameters()), x.grad]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_offload_module_stores_only_what_the_forward_saves(
    disk_config: tierstore.TierConfig,
) -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    x = torch.randn(16, 32, requires_grad=True)
    handle = tierstore.offload_module(model, disk_config)
    store = handle.store
    y = model(x)
    packed = store.stats().packed
    assert packed > 0
    z = (y * 1).exp()  # after the forward: not stored
    assert store.stats().packed == packed
    z.sum().backward()  # backward runs outside the forward: nothing new stored
    assert store.stats().packed == packed
    with torch.no_grad():
        model(x)  # evaluation saves nothing
    assert store.stats().packed == packed
    handle.remove()


def test_offload_module_remove_is_idempotent_and_closes_its_store(
    disk_config: tierstore.TierConfig,
) -> None:
    model = nn.Linear(8, 8)
    handle = tierstore.offload_module(model, disk_config)
    handle.remove()
    handle.remove()
    assert handle.store.closed
    model(torch.randn(4, 8)).sum().backward()  # no hooks left to reach the closed store
    shared = tierstore.TierStore(disk_config)
    with tierstore.offload_module(model, store=shared) as second:
        model(torch.randn(4, 8)).sum().backward()
    assert second.store is shared and not shared.closed  # not its store: left open
    assert shared.stats().packed > 0
    shared.close()
    with pytest.raises(tierstore.ConfigError, match="either store= or a configuration"):
        tierstore.offload_module(model, disk_config, store=shared)


def test_offload_module_leaves_the_block_when_forward_raises(
    disk_config: tierstore.TierConfig,
) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.exp()
            raise ValueError("boom")

    boom = Boom()
    handle = tierstore.offload_module(boom, disk_config)
    x = torch.randn(64, requires_grad=True)
    with pytest.raises(ValueError, match="boom"):
        boom(x)
    packed = handle.store.stats().packed
    assert packed == 1
    (x * 1).exp()  # outside: the saved-tensor hooks were popped
    assert handle.store.stats().packed == packed
    handle.remove()


def test_offload_module_inside_offload_wins(spill_root: Any) -> None:
    config = tierstore.TierConfig(
        device_budget=0, host_budget=0, disk_path=spill_root, min_offload_bytes=0
    )
    head = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), head)
    inner = tierstore.offload_module(head, config)
    outer = tierstore.TierStore(config)
    x = torch.randn(8, 32, requires_grad=True)
    with outer.offload():
        y = model(x)
    # model[2:] saved into its own store (the innermost block wins), the rest into outer.
    assert inner.store.stats().packed == outer.stats().packed == 3
    y.sum().backward()
    inner.remove()
    outer.close()


# -- keep(tier=...) ------------------------------------------------------------------------


def _three_saves(x: torch.Tensor, tier: str) -> torch.Tensor:
    a = x.exp()  # saves a
    with tierstore.keep(tier=tier):  # type: ignore[arg-type]
        b = (a * 2).sin()  # saves a * 2
    return (b * 2).cos()  # saves b * 2


@pytest.mark.parametrize(
    ("tier", "where"),
    [("device", "kept"), ("host", "host"), ("disk", "disk")],
)
def test_keep_sends_saves_to_the_named_tier(spill_root: Any, tier: str, where: str) -> None:
    # Outside keep() everything stays within device_budget; only the save
    # inside keep(tier=...) goes where it is told.
    host_only = tier == "host"  # on a CPU the host tier is used only without a disk tier
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget="1GiB",
            host_budget="64MiB",
            disk_budget=0 if host_only else "64MiB",
            disk_path=spill_root,
            min_offload_bytes=0,
        )
    )
    x = torch.randn(64, 64, requires_grad=True)
    _three_saves(x, tier).sum().backward()
    expected = x.grad
    x.grad = None
    with store.offload():
        y = _three_saves(x, tier)
    store.flush()
    stats = store.stats()
    got = {"kept": stats.kept, **{name: t.entries for name, t in stats.tiers.items()}}
    want = {"kept": 0, "device": 2, "host": 0, "disk": 0}
    want[where] = 1
    assert got == want
    y.sum().backward()
    assert torch.equal(x.grad, expected)
    store.close()


def test_keep_tier_with_no_budget_falls_to_the_next_tier(spill_root: Any) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget="1GiB", host_budget=0, disk_path=spill_root, min_offload_bytes=0
        )
    )
    x = torch.randn(64, 64, requires_grad=True)
    with store.offload(), tierstore.keep(tier="host"):
        y = x.exp()
    store.flush()
    assert store.stats().tiers["disk"].entries == 1
    y.sum().backward()
    store.close()


def test_keep_module_sends_its_saves_to_the_named_tier(spill_root: Any) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(device_budget="1GiB", disk_path=spill_root, min_offload_bytes=0)
    )
    head = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), head)
    handle = tierstore.keep_module(head, tier="disk")
    with store.offload():
        y = model(torch.randn(16, 64))
    store.flush()
    stats = store.stats()
    # Outside head: the input and tanh's output stay. Inside: the Linear's input is
    # that same tanh output (one entry, already on the device); tanh's output goes to disk.
    assert (stats.tiers["device"].entries, stats.tiers["disk"].entries) == (2, 1)
    y.sum().backward()
    handle.remove()
    handle.remove()
    store.close()


def test_a_bad_tier_name_is_a_config_error() -> None:
    with pytest.raises(tierstore.ConfigError) as e:
        tierstore.keep(tier="ssd")  # type: ignore[arg-type]
    assert str(e.value) == (
        "tierstore: tierstore.keep(tier='ssd') names no tier; use one of 'device', 'host', 'disk'"
    )
    with pytest.raises(tierstore.ConfigError) as e:
        tierstore.keep_module(nn.Linear(2, 2), tier="gpu")  # type: ignore[arg-type]
    assert str(e.value) == (
        "tierstore: tierstore.keep_module(tier='gpu') names no tier; "
        "use one of 'device', 'host', 'disk'"
    )


# -- is it working? -----------------------------------------------------------------------


def test_warns_once_when_nothing_left_the_device(spill_root: Any) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, min_offload_bytes="1MiB")
    )
    x = torch.randn(12, 256, requires_grad=True)  # 12 KiB
    with pytest.warns(tierstore.TierstoreWarning) as record, store.offload():
        y = x.exp().sin()  # two saves of 12 KiB
    assert [str(w.message) for w in record] == [
        "tierstore: nothing left the device in this offload() block: all 2 saved tensors "
        "(24.0 KiB) were under min_offload_bytes=1.0 MiB; to offload them, lower "
        "min_offload_bytes (TIERSTORE_MIN_OFFLOAD_BYTES)"
    ]
    assert record[0].filename == __file__  # points at the with statement
    y.sum().backward()
    with (
        pytest.warns(tierstore.TierstoreWarning) as record,
        tierstore.offload(disk_path=spill_root, min_offload_bytes="1MiB"),
    ):
        y = x.exp()
    assert record[0].filename == __file__
    y.sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with store.offload():  # once per store
            y = x.exp().sin()
        y.sum().backward()
    store.close()


def test_warning_counts_each_reason(spill_root: Any) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(device_budget="1MiB", disk_path=spill_root, min_offload_bytes="8KiB")
    )

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Saves x (16 KiB), weight.t() (256 KiB) and exp's output (512 B).
            return self.lin(x)[:, :8].exp()

    model = Net()
    x = torch.randn(16, 256, requires_grad=True)
    handle = tierstore.offload_module(model, store=store)
    with pytest.warns(tierstore.TierstoreWarning) as record:
        y = model(x)
    assert [str(w.message) for w in record] == [
        "tierstore: nothing left the device in the forward of Net (offload_module): of "
        "3 saved tensors (272.5 KiB), 1 (256.0 KiB) was a parameter or buffer (or a view of "
        "one), 1 (16.0 KiB) was within device_budget=1.0 MiB and 1 (512 B) was under "
        "min_offload_bytes=8.0 KiB; to offload them, lower device_budget "
        "(TIERSTORE_DEVICE_BUDGET) or lower min_offload_bytes (TIERSTORE_MIN_OFFLOAD_BYTES)"
    ]
    assert record[0].filename == __file__  # points at the call of the module
    y.sum().backward()
    handle.remove()
    store.close()


def test_no_warning_once_something_moved(disk_store: tierstore.TierStore) -> None:
    x = torch.randn(64, 64, requires_grad=True)
    with disk_store.offload():
        y = x.exp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with disk_store.offload(), tierstore.keep():
            z = x.sin()  # nothing moves here, but the store works
    (y.sum() + z.sum()).backward()


def test_step_summary_on_the_tierstore_logger(
    caplog: pytest.LogCaptureFixture, disk_config: tierstore.TierConfig
) -> None:
    import logging
    import re

    store = tierstore.TierStore(disk_config)
    x = torch.randn(1024, requires_grad=True)
    caplog.set_level(logging.INFO, logger="tierstore")
    for _ in range(3):
        with store.offload():
            y = x.exp()
        y.sum().backward()
    with store.offload():  # no backward since the last line: no line
        pass
    store.close()  # the last step's line
    lines = [r.getMessage() for r in caplog.records if r.name == "tierstore"]
    assert len(lines) == 3
    for step, line in enumerate(lines, 1):
        assert re.fullmatch(
            rf"tierstore: step {step}: saved 1 \(0 kept on the device, 0 B; 0 parameters\); "
            r"peak device 0 B, host 0 B, disk \S+ \S+; moved to host 0 B, to disk \S+ \S+, "
            r"back \S+ \S+; prefetch \d+ hits, \d+ misses \(\d+%\); "
            r"waited \d+\.\d{3} s in backward, \d+\.\d{3} s in forward",
            line,
        ), line


def test_step_summary_costs_nothing_when_info_is_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, disk_store: Any
) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="tierstore")

    def no_stats() -> None:
        raise AssertionError("stats() called with INFO off")

    monkeypatch.setattr(disk_store._manager, "stats", no_stats)
    x = torch.randn(1024, requires_grad=True)
    for _ in range(2):
        with disk_store.offload():
            y = x.exp()
        y.sum().backward()
    assert not [r for r in caplog.records if r.name == "tierstore"]
