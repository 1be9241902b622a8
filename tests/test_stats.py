"""What ``str(store.stats())`` says: each counter named for what it means on its tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import codec
from tierstore.stats import Stats, TierStats

from .conftest import all_to_disk

_MIB = 1 << 20


def _lines(stats: Stats) -> dict[str, str]:
    return {line.split(":")[0].strip(): line for line in str(stats).splitlines()}


def _stats() -> Stats:
    return Stats(
        tiers={
            "device": TierStats(0, 361 * _MIB, 0, bytes_written=361 * _MIB, bytes_read=0),
            "host": TierStats(0, 8 * _MIB, 0, bytes_written=8 * _MIB, bytes_read=8 * _MIB),
            "disk": TierStats(0, 4 * _MIB, 0, bytes_written=4 * _MIB, bytes_read=4 * _MIB),
        },
        packed=10,
        deduplicated=0,
        kept=2,
        kept_bytes=64,
        prefetch_hits=9,
        prefetch_misses=1,
        unpack_wait_s=0.25,
        pack_wait_s=0.5,
    )


def test_device_tier_bytes_read_as_placed_not_copied() -> None:
    device = _lines(_stats())["device"]
    assert "written" not in device and "read" not in device
    assert "361.0 MiB placed (left where autograd made them, not copied)" in device


def test_host_and_disk_say_what_moved() -> None:
    lines = _lines(_stats())
    assert "8.0 MiB copied in, 8.0 MiB copied back" in lines["host"]
    assert "4.0 MiB written, 4.0 MiB read back" in lines["disk"]


def test_totals_and_waits_say_since_when() -> None:
    text = str(_stats())
    for tier in ("device", "host", "disk"):
        assert "since the store opened: " in _lines(_stats())[tier]
    assert (
        "since the store opened: packed 10, deduplicated 0, "
        "kept 2 (64 B; 0 of them parameters, 0 B)" in text
    )
    assert (
        "since the store opened: prefetch 9 hits, 1 misses (90%); backward waited 0.250 s "
        "for reads, forward 0.500 s for the write queue"
    ) in text


def test_a_save_within_device_budget_is_placed_not_copied() -> None:
    config = tierstore.TierConfig(
        device_budget="1MiB", host_budget=0, disk_budget=0, min_offload_bytes=0
    )
    x = torch.randn(64, 64, requires_grad=True)
    with tierstore.TierStore(config) as store:
        warned = pytest.warns(tierstore.TierstoreWarning, match="nothing left the device")
        with warned, store.offload():
            y = x.exp()
        device = _lines(store.stats())["device"]
        y.sum().backward()
    assert "16.0 KiB placed (left where autograd made them, not copied)" in device


def _steps(store: tierstore.TierStore, steps: int = 3) -> list[Stats]:
    """Train a small MLP for ``steps`` steps; the stats after each forward, flush, backward."""
    torch.manual_seed(0)
    # 64 x 256 float32 activations: 64 KiB spans, the size whose records get a
    # header of a whole HEADROOM (NOTE [ Records in one buffer ] in codec.py).
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    seen = []
    for _ in range(steps):
        with store.offload():
            loss = model(torch.randn(64, 256)).tanh().sum()
        seen.append(store.stats())
        store.flush()
        seen.append(store.stats())
        loss.backward()
        del loss
        store.flush()
        seen.append(store.stats())
    return seen


def test_bytes_now_never_above_peak(any_store: tierstore.TierStore) -> None:
    seen = _steps(any_store)
    assert max(s.tiers["disk"].peak_bytes + s.tiers["host"].peak_bytes for s in seen) > 0
    for i, stats in enumerate(seen):
        for name, tier in stats.tiers.items():
            assert tier.bytes <= tier.peak_bytes, (i, name, tier)
    for name, tier in seen[-1].tiers.items():  # after backward, nothing left
        assert (name, tier.bytes, tier.entries) == (name, 0, 0)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_disk_reservation_bounds_the_record(
    spill_root: Path, backend: str, compression: str
) -> None:
    """What a write reserves is at least the footprint of the record it writes."""
    config = tierstore.TierConfig(
        disk_path=spill_root, disk_backend=backend, compression=compression, disk_budget="64MiB"
    )
    with tierstore.TierStore(config) as store:
        pipeline = store._manager._pipeline
        pipeline.footprint_bound(0)  # opens the backend
        disk = pipeline.backend_if_open
        assert disk is not None
        for nbytes in (4, 4000, 65532, 65536, 65540, 1 << 20):
            staged = torch.empty(codec.HEADROOM + nbytes, dtype=torch.uint8)
            span = staged[codec.HEADROOM :]
            span.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # incompressible
            for headroom in (False, True):
                frame = codec.encode(span, compression, headroom=headroom)
                bound = pipeline.footprint_bound(nbytes)
                assert disk.footprint(frame.nbytes) <= bound, (nbytes, headroom)


def test_stats_after_close_are_the_final_figures(spill_root: Path) -> None:
    store = tierstore.TierStore(all_to_disk(spill_root, disk_budget="64MiB"))
    seen = _steps(store, steps=1)
    with store.offload():  # a graph never backpropagated: its bytes are held at close
        y = torch.randn(64, 256, requires_grad=True).exp()
    store.flush()
    before = store.stats()
    assert before.tiers["disk"].bytes > 0
    store.close()
    after = store.stats()
    assert after == store.stats()  # the final figures, not a moving snapshot
    disk = after.tiers["disk"]
    assert (disk.bytes, disk.entries) == (0, 0)
    assert disk.peak_bytes == before.tiers["disk"].peak_bytes >= seen[0].tiers["disk"].bytes > 0
    assert disk.bytes_written == before.tiers["disk"].bytes_written
    assert (after.packed, after.prefetch_hits, after.disk_io) == (
        before.packed,
        before.prefetch_hits,
        before.disk_io,
    )
    assert after.host_pool_bytes == after.buffer_bytes_in_use == 0
    assert "disk" in str(after)
    del y


# -- where kept saves count (issue 53, item 5) ------------------------------------


def _mlp_step(store: tierstore.TierStore, model: torch.nn.Module) -> None:
    with store.offload():
        loss = model(torch.randn(512, 256)).square().mean()
    loss.backward()


@pytest.mark.parametrize(
    "settings",
    [{"device_budget": "1GiB"}, {"activation_budget": 1.0}, {"device_budget": 0}],
    ids=["device_budget", "a plan that keeps all", "everything moves"],
)
def test_saves_kept_in_ram_count_in_the_device_peak_and_parameters_do_not(
    spill_root: Path, settings: dict[str, object]
) -> None:
    # NOTE [ Where kept saves count ] in tierstore/tiers/counts.py.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    )
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, min_offload_bytes=0, **settings)  # type: ignore[arg-type]
    )
    peaks = []
    for _ in range(4):
        before = store.stats()
        _mlp_step(store, model)
        now = store.stats()  # after backward, before the next step begins
        activations = (now.kept_bytes - now.parameter_bytes) - (
            before.kept_bytes - before.parameter_bytes
        )
        peaks.append(now.tiers["device"].peak_bytes)
        # The step's activations kept in RAM are in the device's peak: never
        # a peak of 0 B beside kept bytes.
        assert now.tiers["device"].peak_bytes >= activations
    stats = store.stats()
    # Each step saves the two Linears' inputs, GELU's and square's (512 x 256
    # floats, 512 KiB each) and the second Linear's weight.t(): a parameter's view.
    assert (stats.parameters, stats.parameter_bytes) == (4, 4 * 256 * 256 * 4)
    if "activation_budget" in settings or settings.get("device_budget") == "1GiB":
        assert stats.kept_bytes - stats.parameter_bytes > 0
        # All of a step's activations, and not the weight it saved.
        assert max(peaks) == 4 * 512 * 256 * 4
    else:
        assert stats.kept == stats.parameters  # only the weight stayed
        assert max(peaks) == 0  # and the device held nothing else
    assert stats.tiers["device"].bytes == 0
    store.close()
