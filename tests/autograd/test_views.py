"""Saved views come back with the shape and strides they were saved with, on every tier.

NOTE [ Spans ] in tierstore/codec.py. The Function below reads the saved
view's strides in backward to scatter its gradient, as a custom Function or
a compiled graph may: a view that came back with other strides gives other
gradients, so bitwise equality with eager checks the strides too. Each view
also comes back at its address modulo the allocator's boundary, where
kernels may round otherwise (NOTE [ Addresses ]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore

from ..conftest import all_to_disk

View = Callable[[torch.Tensor], torch.Tensor]

# Views of a contiguous (64, 33) float32 tensor.
VIEWS: dict[str, View] = {
    "unfold": lambda y: y.view(-1).unfold(0, 16, 4),  # windows that share elements
    "rows-overlap": lambda y: y.as_strided((40, 33), (17, 1), 3),  # steps shorter than a row
    "sliding-2d": lambda y: y.unfold(0, 8, 1).unfold(1, 8, 1),  # 8x8 windows at every place
    "unfold-t": lambda y: y.view(-1).unfold(0, 16, 4).t(),
    "expand": lambda y: y[:1].expand(64, 33),  # stride 0
    "gapped": lambda y: y[:, ::2],  # no overlap, gaps
    "gapped-t": lambda y: y[5:40, 1:30].t(),
    "dense-t": lambda y: y.t(),
}


class SumViewByStrides(torch.autograd.Function):
    """``view(x.exp()).sum(-1)``, whose backward scatters by the saved view's own strides."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, view: View, seen: list[tuple[Any, ...]]) -> Any:
        y = x.exp()
        v = view(y)
        ctx.save_for_backward(v)
        ctx.numel, ctx.offset, ctx.seen = y.numel(), v.storage_offset(), seen
        seen.append(("saved", tuple(v.shape), v.stride(), v.data_ptr() % 64))
        return v.sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (v,) = ctx.saved_tensors
        ctx.seen.append(("backward", tuple(v.shape), v.stride(), v.data_ptr() % 64))
        # Which element of x each element of v came from, by v's strides now.
        where = torch.arange(ctx.numel).as_strided(v.shape, v.stride(), ctx.offset)
        flat = torch.zeros(ctx.numel).index_add_(
            0, where.reshape(-1), (grad[..., None] * v).reshape(-1)
        )
        return flat.view(64, 33), None, None


def _run(view: View, store: tierstore.TierStore | None) -> tuple[torch.Tensor, list[Any]]:
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    seen: list[tuple[Any, ...]] = []
    if store is None:
        out = SumViewByStrides.apply(x, view, seen)
    else:
        with store.offload():
            out = SumViewByStrides.apply(x, view, seen)
    (out * torch.linspace(0.5, 2.0, out.numel()).view(out.shape)).sum().backward()
    assert x.grad is not None
    return x.grad, seen


def _config(tier: str, spill_root: Path) -> tierstore.TierConfig:
    if tier == "device":
        return tierstore.TierConfig(
            device_budget="64MiB", host_budget=0, disk_budget=0, min_offload_bytes=0
        )
    if tier == "host":
        return tierstore.TierConfig(
            device_budget=0, host_budget="64MiB", disk_budget=0, min_offload_bytes=0
        )
    backend, compression = tier.split("-")
    return all_to_disk(spill_root, backend, compression, disk_budget="64MiB")


TIERS = ["device", "host", "file-none", "file-zstd", "lmdb-none", "lmdb-zstd"]


@pytest.fixture(params=TIERS)
def tier_store(request: pytest.FixtureRequest, spill_root: Path) -> Iterator[tuple[str, Any]]:
    with tierstore.TierStore(_config(request.param, spill_root)) as store:
        yield request.param, store


@pytest.mark.parametrize("name", list(VIEWS))
def test_saved_view_comes_back_with_its_strides(name: str, tier_store: tuple[str, Any]) -> None:
    tier, store = tier_store
    expected, eager_seen = _run(VIEWS[name], None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "tierstore: nothing left the device")
        warnings.filterwarnings("error", "tierstore: a saved view")
        got, seen = _run(VIEWS[name], store)
    assert seen == eager_seen  # shape, strides and address at save and in backward
    assert seen[0][1:] == seen[1][1:]
    assert torch.equal(got, expected)
    stats = store.stats()
    where = "device" if tier == "device" else "host" if tier == "host" else "disk"
    assert stats.tiers[where].peak_bytes > 0  # it did rest there
    assert stats.restrided_views == 0
    for t in stats.tiers.values():
        assert (t.bytes, t.entries) == (0, 0)


def test_overlapping_views_rest_as_the_storage_they_cover(spill_root: Path) -> None:
    # 1,953 windows of 64 elements over 8,192: they rest as the 32 KiB they cover.
    with tierstore.TierStore(_config("file-none", spill_root)) as store:
        x = torch.randn(8192, requires_grad=True)
        with store.offload():
            y = SumViewByStrides.apply(x.view(64, 128), lambda t: t.view(-1).unfold(0, 64, 4), [])
        store.flush()
        assert store.stats().tiers["disk"].bytes_written == 32768 + 4096  # span + header
        del y


def test_thin_view_comes_back_dense_counted_and_warned_once(spill_root: Path) -> None:
    # y[:, :3] reaches across 8.1 KiB for 768 B: restoring its strides would
    # allocate all of it in backward (NOTE [ Spans ]).
    with tierstore.TierStore(_config("file-none", spill_root)) as store:
        x = torch.randn(64, 33, requires_grad=True)
        with pytest.warns(tierstore.TierstoreWarning) as caught, store.offload():
            a = x.exp()[:, :3].sin()  # sin saves its input, the thin view
            b = x.cos()[:, 1:2].sin()
        assert [str(w.message) for w in caught] == [
            "tierstore: a saved view of shape (64, 3) and strides (33, 1) reaches across "
            "8.1 KiB of storage for 768 B of elements; it comes back from the disk tier dense, "
            "with strides (3, 1), rather than allocate all of that in backward. Its values are "
            "the same; code that relies on its strides (a custom autograd.Function, a compiled "
            "graph) sees others. Later ones are only counted, in stats().restrided_views; to "
            "keep its strides, save it inside tierstore.keep()"
        ]
        (a.sum() + b.sum()).backward()
        assert store.stats().restrided_views == 2
        assert "2 saved views came back with dense strides" in str(store.stats())
    eager = x.detach().clone().requires_grad_()
    (eager.exp()[:, :3].sin().sum() + eager.cos()[:, 1:2].sin().sum()).backward()
    assert torch.equal(x.grad, eager.grad)  # the values are the same


class _SaveView(torch.autograd.Function):
    """Saves ``view(x * 2)``; backward hands the saved tensor to ``out``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, view: View, out: list[torch.Tensor]) -> Any:
        ctx.save_for_backward(view(x * 2))
        ctx.out = out
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.out.append(ctx.saved_tensors[0])
        return grad, None, None


@pytest.mark.requires_cuda
@pytest.mark.parametrize("tier", ["host", "file-none", "lmdb-zstd"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_saved_view_of_a_cuda_tensor_comes_back_with_its_strides(
    name: str, tier: str, spill_root: Path
) -> None:
    x = torch.randn(64, 33, device="cuda", requires_grad=True)
    want = VIEWS[name](x.detach() * 2)
    out: list[torch.Tensor] = []
    with tierstore.TierStore(_config(tier, spill_root)) as store:
        with store.offload():
            y = _SaveView.apply(x, VIEWS[name], out)
        y.sum().backward()
        assert store.stats().restrided_views == 0
    (got,) = out
    assert got.device == want.device and got.stride() == want.stride()
    assert got.data_ptr() % 512 == want.data_ptr() % 512  # NOTE [ Addresses ]
    assert torch.equal(got, want)
