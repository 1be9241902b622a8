"""Bytes in flight sized by need, and tierstore's own buffers given back (issue 11).

NOTE [ In-flight sizing ] (tierstore/tiers/sizing.py) and NOTE [ Leased buffers ]
(tierstore/tiers/host_pool.py). Everything is judged on counts and bytes from stats(),
never on timings: stalls are forced by gating the disk, not by a slow one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import codec
from tierstore.backends.file import FileBackend
from tierstore.tiers import readahead, writebehind
from tierstore.tiers.manager import POOLED_MIN_BYTES, TierManager
from tierstore.tiers.movers import LinkClock, Pipeline
from tierstore.tiers.transfers import Transfers

from ..conftest import FailingBackward, buffers_in_use, reads_done_at_once

MIB = 1 << 20


def _config(spill_root: Path, **overrides: Any) -> tierstore.TierConfig:
    settings: dict[str, Any] = {
        "device_budget": 0,
        "host_budget": 0,
        "disk_budget": "64MiB",
        "disk_path": spill_root,
        "min_offload_bytes": 0,
    }
    settings.update(overrides)
    return tierstore.TierConfig(**settings)


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Limits that start and end small, so that a few 64 KiB saves move them."""
    monkeypatch.setattr(readahead, "_START_BYTES", 128 << 10)
    monkeypatch.setattr(readahead, "_MIN_BYTES", 64 << 10)
    monkeypatch.setattr(writebehind, "_START_BYTES", 128 << 10)
    monkeypatch.setattr(writebehind, "_MIN_BYTES", 64 << 10)


def slow_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read takes 50 ms, far longer than the backward of a sin(): unpacks stall."""
    original = FileBackend._load

    def slow(self: FileBackend, *args: Any) -> None:
        time.sleep(0.05)
        original(self, *args)

    monkeypatch.setattr(FileBackend, "_load", slow)


def _gated_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Disk writes wait for the returned event (or 5 s)."""
    gate = threading.Event()
    original = FileBackend._store

    def gated(self: FileBackend, *args: Any) -> None:
        gate.wait(5)
        original(self, *args)

    monkeypatch.setattr(FileBackend, "_store", gated)
    return gate


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()  # each saves its 64 KiB input
    return x.sum()


def _step(store: tierstore.TierStore, x: torch.Tensor, n: int = 8) -> None:
    with store.offload():
        loss = _chain(x, n)
    store.flush()  # every save on disk: backward must read each one
    loss.backward()


def test_the_window_grows_after_stalls_and_shrinks_while_every_unpack_hits(
    spill_root: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(16 * 1024, requires_grad=True)  # 64 KiB
    cfg = _config(spill_root, prefetch_bytes="8MiB", io_workers=1)
    with tierstore.TierStore(cfg) as store:
        start = store.stats().prefetch_window_bytes
        assert start == 128 << 10
        with monkeypatch.context() as patch:
            slow_reads(patch)
            _step(store, x, n=6)
        grown = store.stats()
        # Every unpack stalls but the first (a miss that nothing could have read
        # ahead) and the one whose read its top-up sent out (128 KiB less the
        # 64 KiB being read), which left as backward began (NOTE [ Prefetch ]).
        assert grown.prefetch_stalls == 4
        assert grown.prefetch_window_bytes == start * 2**4
        # Reads that are done before anyone asks: no stall, a smaller window each step.
        sizes = []
        for _ in range(3):
            with store.offload():
                loss = _chain(x, 6)
            sizes.append(store.stats().prefetch_window_bytes)
            store.flush()
            with monkeypatch.context() as patch:
                reads_done_at_once(patch)
                loss.backward()
        after = store.stats()
        assert after.prefetch_stalls == grown.prefetch_stalls  # none since
        assert sizes[0] == grown.prefetch_window_bytes  # the grown step stalled: kept
        assert sizes[1] == sizes[0] * 3 // 4 and sizes[2] == sizes[1] * 3 // 4


def test_the_window_never_passes_prefetch_bytes(
    spill_root: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(16 * 1024, requires_grad=True)
    cfg = _config(spill_root, prefetch_bytes="256KiB", io_workers=1)
    with tierstore.TierStore(cfg) as store:
        slow_reads(monkeypatch)
        _step(store, x, n=6)
        stats = store.stats()
        assert stats.prefetch_stalls == 4  # 128 KiB doubled four times: 2 MiB
        assert stats.prefetch_window_bytes == 256 << 10


def test_the_write_queue_grows_after_pack_waits_and_shrinks_without_them(
    spill_root: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _gated_writes(monkeypatch)
    x = torch.randn(16 * 1024, requires_grad=True)
    with tierstore.TierStore(_config(spill_root, write_queue_bytes="4MiB")) as store:
        assert store.stats().write_queue_limit_bytes == 128 << 10
        timer = threading.Timer(0.2, gate.set)  # writes hang: the queue fills, forward waits
        timer.start()
        _step(store, x, n=8)  # 8 saves of 64 KiB: over 128 KiB
        timer.join()
        grown = store.stats()
        assert grown.pack_waits >= 1 and grown.pack_wait_s > 0
        assert grown.write_queue_limit_bytes == (128 << 10) * 2**grown.pack_waits
        _step(store, x, n=1)  # the step that waited ends: no shrink
        assert store.stats().write_queue_limit_bytes == grown.write_queue_limit_bytes
        _step(store, x, n=1)  # this one did not wait: a quarter less
        after = store.stats()
        assert after.pack_waits == grown.pack_waits
        assert after.write_queue_limit_bytes == grown.write_queue_limit_bytes * 3 // 4


def test_written_bytes_never_go_down(spill_root: Path) -> None:
    # The reservation is a bound (zstd, 4 KiB pages); written counts what landed.
    x = torch.zeros(64 * 1024, requires_grad=True)  # compresses to almost nothing
    with tierstore.TierStore(_config(spill_root, compression="zstd")) as store:
        seen = []
        for _ in range(3):
            with store.offload():
                loss = _chain(x, 4)
            seen.append(store.stats().tiers["disk"].bytes_written)
            store.flush()
            seen.append(store.stats().tiers["disk"].bytes_written)
            loss.backward()
        assert seen == sorted(seen) and seen[-1] > 0
        assert seen[-1] < 12 * 256 * 1024  # compressed sizes, not the reservations


# -- buffers (NOTE [ Leased buffers ]) -------------------------------------------------


@pytest.mark.parametrize("in_flight", ["default", "none"])
def test_a_read_back_tensor_lives_in_the_pool_until_autograd_drops_it(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch, in_flight: str
) -> None:
    # "none": nothing may be in flight (writes synchronous, reads on demand),
    # yet the pool still has room for the read in use (NOTE [ Leased buffers ]).
    reads_done_at_once(monkeypatch)
    x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB
    settings = {"prefetch_bytes": 0, "write_queue_bytes": 0} if in_flight == "none" else {}
    with tierstore.TierStore(_config(spill_root, **settings)) as store:
        with store.offload():
            y = x.exp()
        store.flush()
        assert buffers_in_use(store) == 0  # forward's bytes are on disk, the pool is idle
        saved = y.grad_fn._saved_result  # unpacks: a read into the pool
        assert torch.equal(saved, x.detach().exp())
        # The record as read: its padded header's page, then the payload; a
        # write from the caller's memory (none staged) kept a short header,
        # read apart (NOTE [ Records in one buffer ]).
        record = 256 * 1024 + (codec.HEADROOM if in_flight == "default" else 0)
        assert buffers_in_use(store, record) == record
        del saved
        assert buffers_in_use(store) == 0  # back in the pool, not on the heap
        y.sum().backward()
        assert torch.equal(x.grad, x.detach().exp())
        assert buffers_in_use(store) == 0
        assert store.stats().buffer_misses == 0


def test_buffers_come_back_when_backward_fails_midway(spill_root: Path) -> None:
    x = torch.randn(64 * 1024, requires_grad=True)
    with tierstore.TierStore(_config(spill_root)) as store:
        with store.offload():
            loss = FailingBackward.apply(_chain(x, 4).expand(8)).sum()
        store.flush()
        with pytest.raises(RuntimeError, match="boom"):
            loss.backward()
        del loss
        assert buffers_in_use(store) == 0
        assert store.stats().tiers["disk"].entries == 0


def test_buffers_come_back_when_a_graph_is_dropped_without_backward(spill_root: Path) -> None:
    # A gapped view (every other column) is staged densely in the pool before its write.
    x = torch.randn(256, 512, requires_grad=True)
    with tierstore.TierStore(_config(spill_root)) as store:
        for _ in range(2):
            with store.offload():
                loss = (x * 2)[:, ::2].sin().sum()
            del loss
            store.flush()
            assert buffers_in_use(store) == 0
            stats = store.stats()
            assert stats.tiers["disk"].entries == 0 and stats.tiers["disk"].bytes == 0


def test_a_read_back_tensor_outlives_close(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads_done_at_once(monkeypatch)
    x = torch.randn(64 * 1024, requires_grad=True)
    store = tierstore.TierStore(_config(spill_root))
    with store.offload():
        y = x.exp()
    store.flush()
    saved = y.grad_fn._saved_result
    store.close()
    assert torch.equal(saved, x.detach().exp())  # the pool is gone, its memory is not
    del saved, y
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name.startswith("tierstore")]


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_gradients_are_exact_with_pooled_buffers(
    spill_root: Path,
    backend: str,
    compression: str,
    compare_with_eager: Callable[..., Any],
) -> None:
    def build() -> Any:
        model = torch.nn.Sequential(
            torch.nn.Linear(128, 256),
            torch.nn.GELU(),
            torch.nn.Linear(256, 128),
            torch.nn.LayerNorm(128),
        )

        def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            h = model(x)  # gapped views below: staged and restored through the pool
            return (h[:, ::2].sin() + h.t()[::2].t().cos()).square().mean()

        return model, [torch.randn(64, 128, requires_grad=True)], loss_fn

    cfg = _config(spill_root, disk_backend=backend, compression=compression)
    with tierstore.TierStore(cfg) as store:
        for _ in range(2):
            compare_with_eager(build, store)
        assert buffers_in_use(store) == 0


# -- write staging (NOTE [ Write staging ]) ---------------------------------------------


def test_a_queued_write_lets_go_of_the_callers_memory_at_once(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _gated_writes(monkeypatch)
    x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB
    with tierstore.TierStore(_config(spill_root)) as store:
        with store.offload():
            h = x * 2
            y = h.sin()  # saves h, which forward then drops
        expected = h.detach().cos()
        h_storage = h.untyped_storage()._weak_ref()
        del h
        gc.collect()
        # The write still waits, yet h's memory is gone: the queue holds a copy.
        assert torch.UntypedStorage._expired(h_storage)
        # The queued bytes, and room for their record's header in front.
        assert store.stats().buffer_bytes_in_use == 256 * 1024 + codec.HEADROOM
        gate.set()
        store.flush()
        assert buffers_in_use(store) == 0  # written: the copy went back to the pool
        y.sum().backward()
        assert torch.equal(x.grad, 2 * expected)
        assert store.stats().buffer_misses == 0


def test_a_full_pool_writes_from_the_callers_memory(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _gated_writes(monkeypatch)
    x = torch.randn(64 * 1024, requires_grad=True)
    # The pool holds twice prefetch_bytes + write_queue_bytes, and at least a
    # chunk: 128 KiB, less than one save.
    config = _config(
        spill_root, prefetch_bytes="32KiB", write_queue_bytes="32KiB", host_pool_step="64KiB"
    )
    with tierstore.TierStore(config) as store:
        with store.offload():
            y = x.exp()
        gate.set()
        store.flush()
        assert store.stats().buffer_misses == 1  # no copy: written from y itself
        y.sum().backward()
        assert torch.equal(x.grad, x.detach().exp())


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_write_queue_bytes_zero_writes_each_save_before_pack_returns(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    # NOTE [ Write staging ]: no queue, so nothing is staged; the save waits
    # for its own write, from the caller's memory, as config.py promises.
    x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB
    config = _config(spill_root, disk_backend=backend, write_queue_bytes=0)
    with tierstore.TierStore(config) as store:
        with store.offload():
            h = x * 2
            y = h.sin()  # saves h
            stats = store.stats()
            assert stats.tiers["disk"].bytes_written >= 256 * 1024  # on disk already
            assert stats.buffer_bytes_in_use == 0  # and never copied into a buffer
            z = y.exp()  # saves y: written before exp returns, too
            assert store.stats().tiers["disk"].entries == 2
        expected = (z.detach() * h.detach().cos() * 2).clone()
        del h
        z.sum().backward()
        assert torch.equal(x.grad, expected)


def test_staged_writes_keep_the_eager_version_check(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _gated_writes(monkeypatch)
    x = torch.randn(64 * 1024, requires_grad=True)
    with tierstore.TierStore(_config(spill_root)) as store:
        with store.offload():
            y = x.exp()
        with torch.no_grad():
            y.add_(1)  # after the copy was taken: eager raises at backward, so must we
        gate.set()
        with pytest.raises(tierstore.TierstoreError, match="modified by an inplace operation"):
            y.sum().backward()


def test_queued_buffers_reuse_the_lowest_free_space() -> None:
    # Leases freed in the order they were taken (the write queue, the read
    # window) reuse the start of the chunk instead of walking across it:
    # NOTE [ Extent allocation ].
    from tierstore.tiers.host_pool import HostPool

    pool = HostPool(capacity=64 * MIB, step=64 * MIB, pin=False)
    queue = [pool.take(MIB) for _ in range(3)]
    ends = []
    for _ in range(100):
        pool.give(queue.pop(0))
        block = pool.take(MIB)
        assert block is not None
        queue.append(block)
        ends.append(block.offset + block.length)
    assert max(ends) <= 4 * MIB  # never more than one block past the three in flight
    pool.close()


# -- records in one buffer (NOTE [ Records in one buffer ]) ------------------------------


def test_a_record_with_room_in_front_is_one_buffer() -> None:
    buf = torch.zeros(codec.HEADROOM + 4000, dtype=torch.uint8)
    span = buf[codec.HEADROOM :].view(torch.float32)
    span.copy_(torch.arange(1000.0))
    frame = codec.encode(span, headroom=True)
    (record,) = frame.views()
    assert bytes(record) == frame.header + bytes(frame.payload)
    assert torch.equal(span, torch.arange(1000.0))  # the header went in front, not over it
    meta = codec.parse_header(bytes(record)[: len(frame.header)])
    back = codec.decode(meta, bytearray(bytes(record)[len(frame.header) :]))
    assert torch.equal(back, span)


def test_the_callers_memory_is_never_written_in_front_of() -> None:
    whole = torch.full((codec.HEADROOM + 4000,), 7, dtype=torch.uint8)
    span = whole[codec.HEADROOM :]  # room in front, but the caller's: no headroom=True
    frame = codec.encode(span)
    assert [len(v) for v in frame.views()] == [len(frame.header), 4000]
    assert bool((whole == 7).all())
    short = torch.zeros(100, dtype=torch.uint8)[10:]  # too little room: two views
    assert len(codec.encode(short, headroom=True).views()) == 2


def test_zstd_records_are_one_buffer() -> None:
    frame = codec.encode(torch.zeros(10_000), "zstd")
    (record,) = frame.views()
    assert bytes(record) == frame.header + bytes(frame.payload)


def test_lmdb_writes_staged_records_without_joining_them(spill_root: Path) -> None:
    x = torch.randn(64 * 1024, requires_grad=True)
    with tierstore.TierStore(_config(spill_root, disk_backend="lmdb")) as store:
        _step(store, x, n=8)
        backend = store._manager._pipeline._backend
        assert backend is not None and backend._joined is None  # no copy into a join buffer
        assert store.stats().tiers["disk"].bytes_written >= 8 * 256 * 1024
        grad = x.grad.clone()
        x.grad = None
        loss = _chain(x, 8)
        loss.backward()
        assert torch.equal(x.grad, grad)


@contextlib.contextmanager
def _manager(spill_root: Path, **overrides: Any) -> Iterator[TierManager]:
    m = TierManager(_config(spill_root, **overrides))
    try:
        yield m
    finally:
        m.close()


def _outstanding(m: TierManager) -> int:
    """What the window's limit bounds now, once dropped tensors are collected."""
    gc.collect()
    with m._releases.lock:
        return m._reads.outstanding_bytes()


def test_tensors_backward_still_holds_count_against_the_window(spill_root: Path) -> None:
    # NOTE [ Prefetch ]: the window bounds reads ahead plus what backward holds.
    # A 256 KiB window over 64 KiB entries: while backward keeps k tensors,
    # 256 - 64 k KiB may be read ahead, and never less than one read.
    with _manager(spill_root, prefetch_bytes="256KiB", io_workers=1) as m:
        handles = [m.put(torch.full((16 * 1024,), float(i))) for i in range(8)]
        m.flush()
        m._reads.limit.bytes = 256 << 10  # as if grown: start at the bound
        kept = []
        for n, h in enumerate(reversed(handles), 1):
            kept.append(m.get(h))
            with m._releases.lock:
                assert m._reads.held_bytes == n * 64 << 10
                assert m._reads.window_bytes == (0 if n == 8 else max(256 - 64 * n, 64) << 10)
        assert [float(t[0]) for t in kept] == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
        del kept
        assert _outstanding(m) == 0


def test_a_rebuilt_tensor_counts_against_the_window_while_it_lives(spill_root: Path) -> None:
    with _manager(spill_root) as m:
        out = m.empty((16, 1024), (1024, 1), torch.float32, torch.device("cpu"))
        assert out is not None
        assert _outstanding(m) == 64 << 10 == POOLED_MIN_BYTES
        del out
        assert _outstanding(m) == 0


def test_a_rebuilt_tensor_under_pooled_min_bytes_comes_from_the_heap(spill_root: Path) -> None:
    # A lease costs more than the op that fills a tensor this small (POOLED_MIN_BYTES).
    with _manager(spill_root) as m:
        assert m.empty((16, 1023), (1023, 1), torch.float32, torch.device("cpu")) is None
        assert _outstanding(m) == 0


def test_prefetch_bytes_zero_reads_nothing_ahead(spill_root: Path) -> None:
    # Held tensors keep one read in flight when they fill the window; with
    # prefetch_bytes=0 there is no window, and every unpack reads on demand.
    x = torch.randn(16 * 1024, requires_grad=True)
    with tierstore.TierStore(_config(spill_root, prefetch_bytes=0)) as store:
        _step(store, x, n=6)
        stats = store.stats()
    assert (stats.prefetch_hits, stats.prefetch_misses, stats.bytes_prefetched) == (0, 6, 0)


@pytest.mark.parametrize("backend", ["file", "lmdb"])
@pytest.mark.parametrize("recompute", ["off", "cheap"])
def test_every_charge_comes_off_the_window_after_backward(
    spill_root: Path, backend: str, recompute: str
) -> None:
    # Reads, inputs a rebuild kept for their own unpacks, rebuilt tensors: once
    # backward has dropped them, nothing is left charged, step after step.
    from tierstore.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16, dropout=0.1))
    tokens = torch.randint(0, 64, (2, 17))
    cfg = _config(spill_root, disk_backend=backend, recompute=recompute)
    with tierstore.TierStore(cfg) as store:
        for _ in range(3):
            with store.offload():
                loss = model.loss(tokens)
            loss.backward()
            del loss
            assert _outstanding(store._manager) == 0
        stats = store.stats()
        assert stats.prefetch_hits > 0
        assert (stats.recomputed > 0) == (recompute == "cheap")


def test_a_failed_read_takes_its_charge_back(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(16 * 1024, requires_grad=True)

    def broken(self: FileBackend, *args: Any) -> None:
        raise OSError(5, "Input/output error")

    # prefetch_bytes=0: the unpack reads on demand, charged before it waits.
    with tierstore.TierStore(_config(spill_root, prefetch_bytes=0)) as store:
        with store.offload():
            loss = _chain(x, 2)
        store.flush()
        monkeypatch.setattr(FileBackend, "_load", broken)
        with pytest.raises(tierstore.TierstoreError, match="Input/output error"):
            loss.backward()
        del loss
        assert _outstanding(store._manager) == 0


def test_backward_of_device_entries_reads_the_next_disk_entries_ahead(
    spill_root: Path, reads_land_first: None
) -> None:
    # NOTE [ Prefetch ]: the newest two saves stay on the device tier; the
    # unpacks of those top up the window, so the first disk entry is a hit.
    x = torch.randn(16 * 1024, requires_grad=True)  # 64 KiB
    with tierstore.TierStore(_config(spill_root, device_budget="128KiB")) as store:
        with store.offload():
            loss = _chain(x, 6)
        store.flush()
        placed = store.stats()
        assert (placed.tiers["device"].entries, placed.tiers["disk"].entries) == (2, 4)
        loss.backward()
        stats = store.stats()
        assert (stats.prefetch_hits, stats.prefetch_misses) == (4, 0)
    expected = x.detach().clone().requires_grad_()
    _chain(expected, 6).backward()
    assert x.grad is not None and torch.equal(x.grad, expected.grad)


def test_a_read_ahead_still_under_way_is_a_stall_not_a_hit(
    spill_root: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ Hits ]: one read is held back until backward waits for it; the
    # others land before backward asks.
    m = TierManager(_config(spill_root, prefetch_bytes="8MiB", io_workers=4))
    try:
        saved = [torch.full((16 * 1024,), float(i)) for i in range(4)]  # 64 KiB each
        handles = [m.put(t) for t in saved]
        m.flush()
        held = handles[1].key
        gate = threading.Event()
        held_reads: list[concurrent.futures.Future[torch.Tensor]] = []
        load, submit_read, wait = FileBackend._load, Pipeline.submit_read, Pipeline.wait

        def gated_load(self: FileBackend, key: int, *args: Any) -> None:
            if key == held:
                gate.wait(5)
            load(self, key, *args)

        def read(self: Pipeline, key: int, *args: Any) -> concurrent.futures.Future[torch.Tensor]:
            future = submit_read(self, key, *args)
            if key == held:
                held_reads.append(future)
            else:
                concurrent.futures.wait([future])
            return future

        def wait_for(self: Pipeline, futures: Any) -> None:
            futures = list(futures)
            if any(f in futures for f in held_reads):
                gate.set()  # the unpack has judged the read already: let it land
            wait(self, futures)

        monkeypatch.setattr(FileBackend, "_load", gated_load)
        monkeypatch.setattr(Pipeline, "submit_read", read)
        monkeypatch.setattr(Pipeline, "wait", wait_for)
        start = m.stats().prefetch_window_bytes
        for handle, t in zip(reversed(handles), reversed(saved), strict=True):
            assert torch.equal(m.get(handle), t)
        assert len(held_reads) == 1  # read ahead, at the unpack before its own
        stats = m.stats()
        # The first unpack is a miss that waits for nothing the window could
        # have read; the held read is a miss and a stall, which grew the window.
        assert (stats.prefetch_hits, stats.prefetch_misses, stats.prefetch_stalls) == (2, 2, 1)
        assert stats.prefetch_window_bytes == 2 * start
    finally:
        m.close()


def test_a_save_put_on_the_disk_tier_starts_its_write_at_once(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the planner asks for (put(t, nbytes, tier)): a CPU tensor sent to
    # the disk tier is queued at the save, with room on the device to spare.
    started, gate = threading.Event(), threading.Event()
    store = FileBackend._store

    def gated(self: FileBackend, *args: Any) -> None:
        started.set()
        gate.wait(5)
        store(self, *args)

    monkeypatch.setattr(FileBackend, "_store", gated)
    m = TierManager(_config(spill_root, device_budget="1MiB"))
    try:
        t = torch.randn(16 * 1024)
        h = m.put(t, tier="disk")
        assert started.wait(5)  # no flush, no later save: the write is under way
        placed = m.stats()
        assert (placed.tiers["device"].entries, placed.tiers["disk"].entries) == (0, 1)
        gate.set()
        m.flush()
        assert m.stats().tiers["disk"].bytes_written >= t.numel() * t.element_size()
        assert torch.equal(m.get(h), t)
    finally:
        gate.set()
        m.close()


def test_copies_count_in_the_link_clock_as_they_complete_in_order() -> None:
    # NOTE [ Copies on CUDA ]: each copy's two timing events, read once it
    # has completed; a copy still under way holds back the ones behind it.
    class Event:
        def __init__(self, ms: float, done: bool = True) -> None:
            self.ms, self.done = ms, done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: Event) -> float:
            return end.ms - self.ms

    d2h, h2d = LinkClock(), LinkClock()
    transfers = Transfers(tierstore.TierConfig(disk_budget=0), (d2h, h2d))
    late = Event(30.0, done=False)
    transfers._timed.extend(
        [
            (d2h, Event(0.0), Event(10.0), 500_000_000),
            (h2d, Event(10.0), late, 100),
            (d2h, Event(30.0), Event(40.0), 500_000_000),
        ]
    )
    transfers.settle()
    assert d2h.snapshot() == (500_000_000, pytest.approx(0.010))
    assert h2d.snapshot() == (0, 0.0)
    late.done = True
    transfers.settle()
    assert d2h.snapshot() == (1_000_000_000, pytest.approx(0.020))
    assert h2d.snapshot() == (100, pytest.approx(0.020))
    assert d2h.rate_since((0, 0.0)) == pytest.approx(50e9)
    transfers.close()
