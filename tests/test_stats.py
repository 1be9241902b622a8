"""What ``str(store.stats())`` says: each counter named for what it means on its tier."""

from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore.stats import Stats, TierStats

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
    assert "since the store opened: packed 10, deduplicated 0, kept 2 (64 B)" in text
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
