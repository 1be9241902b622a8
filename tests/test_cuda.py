"""The CUDA path: pinned pool, copy streams, device keep-window (skipped without a GPU).

The placement, schedule and release logic these paths share with the CPU
path is covered by the CPU tests; these check what only a GPU can show:
stream ordering, buffer lifetimes and device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierstore
from tierstore.tiers import host_pool as host

EmptyCheck = Callable[[tierstore.TierStore], None]

pytestmark = pytest.mark.requires_cuda

CUDA = torch.device("cuda")
MIB = 1 << 20


def _host(**changes: Any) -> tierstore.TierConfig:
    fields: dict[str, Any] = {
        "device_budget": 0,
        "host_budget": "512MiB",
        "disk_budget": 0,
        "min_offload_bytes": 0,
        "host_pool_step": "64MiB",
    }
    return tierstore.TierConfig(**{**fields, **changes})


CONFIGS: dict[str, Callable[[Path], tierstore.TierConfig]] = {
    "host": lambda _: _host(),
    "device-window": lambda _: _host(device_budget="2MiB"),
    "pageable": lambda _: _host(pin_memory=False),
    "host+disk": lambda root: _host(host_budget="1MiB", disk_budget="512MiB", disk_path=root),
    "disk": lambda root: _host(host_budget=0, disk_budget="512MiB", disk_path=root),
}


@pytest.fixture(params=list(CONFIGS))
def cuda_store(request: pytest.FixtureRequest, spill_root: Path) -> Iterator[tierstore.TierStore]:
    store = tierstore.TierStore(CONFIGS[request.param](spill_root))
    yield store
    store.close()


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.fc = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc(x)


def _transformer() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = nn.Sequential(*(_Block(64) for _ in range(3))).to(CUDA)
    x = torch.randn(4, 128, 64, device=CUDA, requires_grad=True)
    return model, [x], lambda m, x: m(x).square().mean()


def _cnn() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 8, 3)
    ).to(CUDA)
    x = torch.randn(8, 3, 64, 64, device=CUDA)
    return model, [x], lambda m, x: m(x).sum()


def _autocast() -> tuple[nn.Module, list[torch.Tensor], Callable[..., torch.Tensor]]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(CUDA)
    x = torch.randn(512, 256, device=CUDA)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x).float().pow(2).mean()

    return model, [x], loss


@pytest.mark.parametrize("build", [_transformer, _cnn, _autocast])
def test_gradients_bitwise_equal_on_cuda(
    build: Callable[[], Any],
    cuda_store: tierstore.TierStore,
    compare_with_eager: Callable[..., tierstore.Stats],
    empty_check: EmptyCheck,
) -> None:
    for step in range(2):  # the second step replays the recorded schedule
        stats = compare_with_eager(build, cuda_store)
        held = sum(t.bytes for t in stats.tiers.values())
        # A step after one that fitted device_budget keeps its saves without
        # entries (NOTE [ Saves that stay ] in tiers/manager.py).
        stayed = cuda_store._manager.pack_tally().counts.get("device_budget", (0, 0))[0]
        assert held > 0 or (step == 1 and stayed > 0)
    empty_check(cuda_store)


def test_a_step_whose_pinning_fails_warns_and_runs_on_pageable_memory(
    monkeypatch: pytest.MonkeyPatch,
    compare_with_eager: Callable[..., tierstore.Stats],
    empty_check: EmptyCheck,
) -> None:
    def refuse(nbytes: int) -> torch.Tensor:  # cudaHostAlloc past the locked-memory limit
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(host, "_pinned", refuse)
    with tierstore.TierStore(_host()) as store:
        with pytest.warns(tierstore.TierstoreWarning) as caught:
            stats = compare_with_eager(_cnn, store)
        assert [str(w.message) for w in caught] == [
            "tierstore: pinning 64.0 MiB of host memory for the host pool failed (CUDA error: "
            "out of memory); the pool goes on in pageable memory, where copies to and from "
            "the GPU are slower. The locked-memory limit (ulimit -l) or the free memory is "
            "below the 768.0 MiB the pool may pin: lower host_budget (TIERSTORE_HOST_BUDGET), "
            "or set pin_memory=False (TIERSTORE_PIN_MEMORY) to pin nothing"
        ]
        assert stats.tiers["host"].bytes > 0 and stats.host_pool_misses == 0
        pool = store._manager._transfers.pinned_pool_if_open
        assert pool is not None and not pool.pinned
        empty_check(store)


class _Delayed(torch.autograd.Function):
    """y = x * w; saves both, and delays the GPU around every use of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.cuda._sleep(20_000_000)  # the consumer's stream runs late
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_copies_wait_for_delayed_streams(
    cuda_store: tierstore.TierStore, empty_check: EmptyCheck
) -> None:
    """A buffer freed, reused or read too early would change the gradients."""

    def run(offload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(1 << 20, device=CUDA, requires_grad=True)
        w = torch.randn(1 << 20, device=CUDA, requires_grad=True)
        ctx = (
            cuda_store.offload()
            if offload
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:
            h = x
            for _ in range(6):
                torch.cuda._sleep(20_000_000)  # the producer's stream runs late
                h = _Delayed.apply(h * 1.5, w)
                # Memory freed here goes straight to the next tensor, filled
                # while the copies may still be running.
                junk = torch.full((1 << 20,), float("nan"), device=CUDA)
                del junk
        h.sum().backward()
        assert x.grad is not None and w.grad is not None
        return [x.grad, w.grad]

    expected = run(offload=False)
    got = run(offload=True)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    empty_check(cuda_store)


class _ViewBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (y,) = ctx.saved_tensors
        return g, y.t().t()  # a view of the unpacked tensor is the gradient


def test_backward_returns_a_view_of_an_unpacked_tensor(
    cuda_store: tierstore.TierStore, empty_check: EmptyCheck
) -> None:
    x = torch.randn(512, 512, device=CUDA, requires_grad=True)
    y = torch.randn(512, 512, device=CUDA, requires_grad=True)
    source = (y * 2).detach()
    with cuda_store.offload():
        out = _ViewBack.apply(x, y * 2)
    out.sum().backward()
    assert y.grad is not None and torch.equal(y.grad, source * 2)
    empty_check(cuda_store)


def test_memory_after_forward_matches_no_grad_within_one_entry(empty_check: EmptyCheck) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)))
    model = model.to(CUDA)
    x = torch.randn(2048, 1024, device=CUDA)
    entry = x.numel() * x.element_size()
    # A first backward allocates cuBLAS workspaces for the autograd thread,
    # which stay: take them before measuring.
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = model(x)
    no_grad = torch.cuda.memory_allocated() - before
    del out

    with tierstore.TierStore(_host()) as store:
        with store.offload():
            out = model(x)
        torch.cuda.synchronize()
        stats = store.stats()  # lets go of the sources whose copies have ended
        offloaded = torch.cuda.memory_allocated() - before
        assert stats.tiers["host"].entries == 16  # each Linear's input, each GELU's
        assert stats.host_pool_bytes >= stats.tiers["host"].bytes > 0
        assert offloaded - no_grad <= entry, (offloaded, no_grad)
        out.sum().backward()
        del out
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        assert torch.cuda.memory_allocated() == before  # nothing left on the device
        empty_check(store)
        assert store._manager._transfers.pinned_pool_if_open is not None
        assert store._manager._transfers.pinned_pool_if_open.used_bytes == 0


def test_dedupe_keeps_one_pinned_copy(empty_check: EmptyCheck) -> None:
    with tierstore.TierStore(_host()) as store:
        x = torch.randn(1 << 20, device=CUDA, requires_grad=True)
        with store.offload():
            h = x * 2
            y = h * h  # saves h twice
        stats = store.stats()
        assert (stats.deduplicated, stats.tiers["host"].entries) == (1, 1)
        pool = store._manager._transfers.pinned_pool_if_open
        assert pool is not None and pool.pinned
        assert pool.used_bytes == 4 * MIB
        y.sum().backward()
        assert x.grad is not None and torch.equal(x.grad, 8 * x.detach())  # d/dx (2x)^2
        empty_check(store)


def test_device_window_keeps_the_newest_entries(empty_check: EmptyCheck) -> None:
    with tierstore.TierStore(_host(device_budget="3MiB")) as store:
        x = torch.randn(1 << 18, device=CUDA, requires_grad=True)  # 1 MiB
        with store.offload():
            h = x
            saved = []
            for _ in range(8):
                h = h.sin()  # saves its 1 MiB input
                saved.append(h)
        stats = store.stats()
        assert (stats.tiers["device"].entries, stats.tiers["host"].entries) == (3, 5)
        resident = store._manager._tiers["device"].entries.values()
        newest = sorted(store._manager._entries)[-3:]
        assert sorted(e.key for e in resident) == newest
        h.sum().backward()
        expected = x.detach()
        grad = torch.ones_like(expected)
        for _ in range(8):
            grad = grad * expected.cos()
            expected = expected.sin()
        assert x.grad is not None and torch.allclose(x.grad, grad)
        empty_check(store)


@pytest.mark.parametrize(("act", "entries"), [(nn.Tanh, 7), (nn.GELU, 12)])
def test_second_step_prefetches_host_entries(
    empty_check: EmptyCheck, act: type[nn.Module], entries: int
) -> None:
    # Tanh saves its output, which the next Linear saves again as its input:
    # one entry for both (deduplication), so 6 blocks make 7 entries of 12
    # saves. GELU saves its input, a tensor of its own: 12 entries.
    with tierstore.TierStore(_host(prefetch_bytes="64MiB")) as store:
        model = nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), act()) for _ in range(6)))
        model = model.to(CUDA)
        x = torch.randn(1024, 512, device=CUDA)
        for _ in range(2):
            with store.offload():
                loss = model(x).sum()
            assert store.stats().tiers["host"].entries == entries
            loss.backward()
        stats = store.stats()
        # Every unpack is a hit or a miss. The first of each backward is
        # copied on demand (nothing says forward ended); every other entry
        # was already on its way. Whether its copy had landed (a hit) or not
        # (a miss) is the GPU's timing (NOTE [ Hits ] in tierstore/tiers/readahead.py).
        assert stats.prefetch_hits + stats.prefetch_misses == 2 * 12
        assert stats.bytes_prefetched == 2 * (entries - 1) * 1024 * 512 * 4
        assert stats.host_pool_misses == 0
        empty_check(store)


_SLEEP_CYCLES = 2_000_000_000  # about a second of one GPU stream's time


def _sines(x: torch.Tensor) -> torch.Tensor:
    for _ in range(6):
        x = x.sin()  # saves its 1 MiB input
    return x.sum()


@pytest.mark.parametrize("budget", [None, 0.5], ids=["no budget", "budget, no plan yet"])
def test_a_save_past_the_bound_waits_for_the_oldest_copy(
    monkeypatch: pytest.MonkeyPatch, budget: float | None
) -> None:
    """NOTE [ Copies in flight ]: the README's defaults, and a budget's safe placement.

    Every eligible save moves; none stays on the device.
    """
    waited: list[torch.cuda.Event] = []
    synchronize = torch.cuda.Event.synchronize

    def counted(self: torch.cuda.Event) -> None:
        waited.append(self)
        synchronize(self)

    config = _host(write_queue_bytes="2MiB", activation_budget=budget)
    with tierstore.TierStore(config) as store:
        x = torch.randn(1 << 18, device=CUDA, requires_grad=True)
        torch.cuda._sleep(_SLEEP_CYCLES // 4)  # the producer runs late: copies pile up
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda.Event, "synchronize", counted)
            with store.offload():  # with a budget, the store's first step: no plan
                loss = _sines(x)
        tiers = store.stats().tiers
        assert (tiers["device"].entries, tiers["host"].entries) == (0, 6)
        # A save past 2 MiB under way waited for the oldest copy, counted as forward's.
        assert waited and store.stats().pack_wait_s > 0
        loss.backward()
        expected = x.detach().clone().requires_grad_()
        _sines(expected).backward()
        assert x.grad is not None and torch.equal(x.grad, expected.grad)


def test_in_a_planned_step_forward_never_blocks_on_a_copy_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ Copies in flight ]: a planned step's saves over the bound stay on the device."""

    def forbidden(self: torch.cuda.Event) -> None:
        raise AssertionError("forward waited on a CUDA event")

    with tierstore.TierStore(_host(write_queue_bytes="2MiB", activation_budget="1GiB")) as store:
        manager = store._manager
        assert manager.limits is not None
        # A step on its plan, whose window is the store's own limit; the
        # plan's offloads are put to the host tier, as the hooks put them.
        monkeypatch.setattr(type(manager.limits), "planned", property(lambda self: True))
        monkeypatch.setattr(manager.limits, "in_flight_bytes", lambda adding=0, held=0: None)
        saved = [torch.randn(1 << 18, device=CUDA) for _ in range(6)]  # 1 MiB each
        torch.cuda._sleep(_SLEEP_CYCLES)  # the producer runs late: no copy lands here
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda.Event, "synchronize", forbidden)
            handles = [manager.put(t, tier="host") for t in saved]
        tiers = manager.stats().tiers
        # Two copies (2 MiB) under way; every later save stayed on the device.
        assert tiers["device"].entries >= 1
        assert tiers["device"].entries + tiers["host"].entries == 6
        for handle, t in zip(handles, saved, strict=True):
            assert torch.equal(manager.get(handle), t)


def test_a_copy_back_is_allocated_on_the_consumers_stream_and_waits_for_the_allocation() -> None:
    """NOTE [ Copies on CUDA ]: the reload's memory is the compute stream's, no side pool."""
    with tierstore.TierStore(_host()) as store:
        transfers = store._manager._transfers
        span = torch.randn(1 << 20).pin_memory()
        torch.cuda._sleep(_SLEEP_CYCLES)  # the consumer's stream is busy
        busy = torch.cuda.Event()
        busy.record(torch.cuda.current_stream())
        copy = transfers.device_copy(span, CUDA)
        assert copy.ready is not None and copy.stream == torch.cuda.current_stream()
        copy.ready.synchronize()  # the copy has landed only after ...
        assert busy.query()  # ... what the consumer queued before the allocation
        ptr = copy.tensor.data_ptr()
        (segment,) = (
            s
            for s in torch.cuda.memory_snapshot()
            if s["address"] <= ptr < s["address"] + s["total_size"]
        )
        assert segment["stream"] == torch.cuda.current_stream().cuda_stream
        out = transfers.consume(copy)
        assert torch.equal(out.cpu(), span)


def test_reloads_leave_no_pool_on_a_copy_stream() -> None:
    """NOTE [ Copies on CUDA ]: after offloaded steps every segment is the compute stream's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(CUDA)
    x = torch.randn(64, 256, device=CUDA)
    with tierstore.TierStore(_host()) as store:
        for _ in range(3):
            with store.offload():
                loss = model(x).square().mean()
            loss.backward()
        assert store.stats().tiers["host"].bytes_written > 0
        streams = store._manager._transfers._streams_of(CUDA)
        sides = {streams.h2d.cuda_stream, streams.d2h.cuda_stream}
        assert not [s for s in torch.cuda.memory_snapshot() if s["stream"] in sides]


def test_a_save_put_on_the_host_tier_starts_its_copy_at_once() -> None:
    """What the planner asks for: put(t, nbytes, "host") copies at the save, budget or not."""
    with tierstore.TierStore(_host(device_budget="1GiB")) as store:
        manager = store._manager
        t = torch.randn(1 << 18, device=CUDA)
        torch.cuda._sleep(_SLEEP_CYCLES // 10)  # the copy cannot have landed when put returns
        handle = manager.put(t, tier="host")
        entry = manager._entries[handle.key]
        assert entry.tier == "host" and entry.ready is not None  # issued on the d2h stream
        assert entry.tensor is not None and entry.tensor.is_pinned()
        assert manager.stats().tiers["device"].entries == 0
        assert torch.equal(manager.get(handle), t)


def test_a_block_the_plan_keeps_whole_runs_without_hooks_on_cuda(tmp_path: Path) -> None:
    # NOTE [ Modules kept whole ] in tierstore/autograd/regions.py: on a GPU, the hooks' Python per
    # save is what a step waits on.
    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            *(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(3))
        ).to(CUDA)

    store = tierstore.TierStore(
        tierstore.TierConfig(activation_budget=1.0, min_offload_bytes=0, disk_path=tmp_path)
    )
    model, eager = blocks(), blocks()
    tops: list[Any] = []
    model[1][0].register_forward_pre_hook(
        lambda m, a: tops.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
    )
    for step in range(10):
        x = torch.randn(8, 64, device=CUDA, generator=torch.Generator(CUDA).manual_seed(step))
        with store.offload():
            loss = model(x).square().mean()
        loss.backward()
        eager(x).square().mean().backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    assert store.plan() is not None and tops[-1] is None
    store.close()


def test_quiet_steps_on_cuda_see_forward_memory_grow(spill_root: Path) -> None:
    # NOTE [ Quiet blocks ]: a repeated step runs without hooks after its
    # first save; on CUDA the allocator's count shows a quiet forward that
    # left more behind than the step measured, and the next is measured.
    # 4 GiB: the step with 256 MiB more saved still fits QUIET_ROOM (8) times.
    store = tierstore.TierStore(_host(device_budget="4GiB"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).to(CUDA)
    packs = [0]
    original = store._pack

    def pack(t: torch.Tensor) -> Any:
        packs[0] += 1
        return original(t)

    store._pack = pack  # type: ignore[method-assign]
    extra = [0]  # columns of a wider tensor forward saves behind the same first save

    def step() -> list[torch.Tensor]:
        x = torch.randn(64, 256, device=CUDA, generator=torch.Generator(CUDA).manual_seed(1))
        with store.offload():
            h = model(x)
            if extra[0]:  # exp saves its output: one save more, far more bytes
                w = torch.randn(64, extra[0], device=CUDA, requires_grad=True)
                h = h + w.exp().sum()
            loss = h.square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
        return grads

    first = step()
    per_step = packs[0]
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(step(), first, strict=True))
    assert packs[0] == per_step  # quiet: only the first save of each took _pack_first
    extra[0] = 1 << 20  # 256 MiB more saved, behind the same first save
    step()
    assert packs[0] == per_step  # quiet still: its saves could not be seen
    step()
    assert packs[0] == 2 * per_step + 1  # but its forward's memory was: this step measured
    step()
    assert packs[0] == 2 * per_step + 1  # and the next repeats the step just measured
    store.close()
