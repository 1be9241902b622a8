"""The tier manager: placement, demotion, budgets, dedupe, lifetimes, closing."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from backend_helpers import run_in_threads

import tierstore
from tierstore.tiers.handle import Handle
from tierstore.tiers.manager import TierManager

KIB4 = 1024  # float32 elements in 4 KiB: one file-backend page per entry


def _manager(spill_root: Path, **settings: object) -> TierManager:
    base: dict[str, object] = {"disk_path": spill_root, "min_offload_bytes": 0}
    return TierManager(tierstore.TierConfig(**{**base, **settings}))


def _keys(mgr: TierManager, tier: str) -> list[int]:
    return sorted(mgr._tiers[tier].entries)  # type: ignore[index]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_newest_stay_fastest_oldest_demoted(spill_root: Path, device: str) -> None:
    mgr = _manager(spill_root, device_budget=3 * 4096, host_budget=2 * 4096, disk_budget="1MiB")
    tensors = [torch.full((KIB4,), float(i), device=device) for i in range(8)]
    handles = [mgr.put(t) for t in tensors]
    mgr.flush()
    # CPU tensors skip the host tier while there is a disk tier: it is their own RAM.
    host = [3, 4] if device == "cuda" else []
    assert _keys(mgr, "device") == [5, 6, 7]
    assert _keys(mgr, "host") == host
    assert _keys(mgr, "disk") == [k for k in range(5) if k not in host]
    stats = mgr.stats()
    assert stats.tiers["device"].bytes == 3 * 4096
    assert stats.tiers["host"].bytes == len(host) * 4096
    # Header page rounding: 2 pages each.
    assert stats.tiers["disk"].bytes == (5 - len(host)) * (4096 + 4096)
    for t, h in zip(tensors, handles, strict=True):
        assert torch.equal(mgr.get(h), t)
    del handles, h
    assert all(s.bytes == 0 and s.entries == 0 for s in mgr.stats().tiers.values())
    mgr.close()


@pytest.mark.requires_cuda
def test_a_pool_full_of_blocks_on_their_way_to_disk_waits_for_the_writes(
    spill_root: Path,
) -> None:
    # NOTE [ Placement ]: a 12 KiB save pushes three 4 KiB entries down to the
    # disk; their pinned blocks stay taken until their writes land, so the
    # pool (16 KiB + 8 KiB) has no 12 KiB for the new copy until then.
    mgr = _manager(
        spill_root,
        device_budget=0,
        host_budget=4 * 4096,
        write_queue_bytes=2 * 4096,
        host_pool_step=4096,
        disk_budget="1MiB",
    )
    mgr._pipeline.open_backend()
    disk = mgr._pipeline.backend_if_open
    assert disk is not None
    real_store = disk._store

    def slow_store(*args: object) -> None:
        time.sleep(0.2)  # the writes are still under way when the pool is asked
        real_store(*args)

    disk._store = slow_store  # type: ignore[method-assign]
    tensors = [torch.full((KIB4,), float(i), device="cuda") for i in range(4)]
    tensors.append(torch.full((3 * KIB4,), 4.0, device="cuda"))
    handles = [mgr.put(t) for t in tensors]
    mgr.flush()
    assert _keys(mgr, "host") == [3, 4] and _keys(mgr, "disk") == [0, 1, 2]
    for t, h in zip(tensors, handles, strict=True):
        assert torch.equal(mgr.get(h), t)
    mgr.close()


def test_entry_larger_than_a_tier_skips_it(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=4096, host_budget=64 * 1024, disk_budget=0)
    small, big = mgr.put(torch.zeros(KIB4)), mgr.put(torch.zeros(4 * KIB4))
    assert _keys(mgr, "device") == [0] and _keys(mgr, "host") == [1]
    assert small.key == 0 and big.key == 1
    mgr.close()


def test_tensor_that_fits_no_tier(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=0, host_budget="4KiB", disk_budget=0)
    with pytest.raises(tierstore.TierFullError) as info:
        mgr.put(torch.zeros(2 * KIB4))
    assert str(info.value) == (
        "tierstore: a saved tensor of 8.0 KiB fits in no tier (device_budget=0 B, "
        "host_budget=4.0 KiB, disk_budget=0 B); raise host_budget (TIERSTORE_HOST_BUDGET) "
        "or give disk_budget a size"
    )
    mgr.close()


def test_full_disk_raises_and_loses_nothing(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=4096, disk_budget=16 * 1024)
    tensors = [torch.full((KIB4,), float(i)) for i in range(3)]
    handles = [mgr.put(t) for t in tensors]  # device: [2], disk: [0, 1] at 8 KiB each
    mgr.flush()  # written bytes count when a write ends: settle them before comparing
    before = mgr.stats()
    with pytest.raises(tierstore.TierFullError) as info:
        mgr.put(torch.zeros(KIB4))  # must demote entry 2 to a full disk
    assert str(info.value) == (
        "tierstore: the disk tier is full: 16.0 KiB of disk_budget=16.0 KiB in use, and a "
        "saved tensor of 4.0 KiB needs 8.0 KiB more; raise disk_budget (TIERSTORE_DISK_BUDGET)"
    )
    after = mgr.stats()
    assert after.tiers == before.tiers  # the entry that could not move stayed where it was
    for t, h in zip(tensors, handles, strict=True):
        assert torch.equal(mgr.get(h), t)
    del handles[1]
    later = mgr.put(torch.ones(KIB4))  # room again: the store is still usable
    assert torch.equal(mgr.get(later), torch.ones(KIB4))
    mgr.close()


def test_lmdb_map_full_names_disk_budget(spill_root: Path) -> None:
    mgr = _manager(
        spill_root, device_budget=0, host_budget=0, disk_budget="1MiB", disk_backend="lmdb"
    )
    handles = []
    with pytest.raises(
        tierstore.TierFullError, match=r"raise disk_budget \(TIERSTORE_DISK_BUDGET\)"
    ):
        for _ in range(64):
            handles.append(mgr.put(torch.randn(64 * KIB4)))  # 256 KiB each
    assert len(handles) >= 2
    assert all(mgr.get(h).shape == (64 * KIB4,) for h in handles)
    mgr.close()


@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")
def test_dedupe_never_aliases_another_storage_at_the_same_address(spill_root: Path) -> None:
    # Two storages over one buffer: the same data_ptr, offset, shape, stride,
    # dtype and version, as when a freed block is handed out again. Only the
    # weak reference to the storage tells them apart.
    mgr = _manager(spill_root, device_budget=0, host_budget=0, disk_budget="1MiB")
    buffer = bytearray(256 * 4)
    first = torch.frombuffer(buffer, dtype=torch.float32)
    second = torch.frombuffer(buffer, dtype=torch.float32)
    assert first.data_ptr() == second.data_ptr()
    assert first.untyped_storage() is not second.untyped_storage()
    a, b = mgr.put(first), mgr.put(second)
    assert a.key != b.key and mgr.stats().deduplicated == 0
    mgr.close()


@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")
def test_release_keeps_another_entrys_dedupe(spill_root: Path) -> None:
    """Two entries under one dedupe key: releasing the older leaves the newer shareable.

    NOTE [ Deduplication under threads ]: the second storage over the same
    buffer takes the key over; the first one's release must not drop it.
    """
    mgr = _manager(spill_root, device_budget=0, host_budget="1MiB", disk_budget=0)
    buffer = bytearray(256 * 4)
    first = torch.frombuffer(buffer, dtype=torch.float32)
    second = torch.frombuffer(buffer, dtype=torch.float32)
    a, b = mgr.put(first), mgr.put(second)
    assert a.key != b.key
    del a  # releases the first entry
    again = mgr.put(second)
    stats = mgr.stats()
    assert again.key == b.key
    assert (stats.deduplicated, stats.tiers["host"].entries) == (1, 1)
    mgr.close()


def test_dedupe_same_view_and_not_other_versions(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=0, host_budget="1MiB", disk_budget=0)
    t = torch.randn(64, 64)
    a, b = mgr.put(t), mgr.put(t.view(64, 64))  # another view object, same geometry
    c = mgr.put(t.t())  # other strides: another entry
    t.add_(1)
    d = mgr.put(t)  # another version: another entry
    assert a.key == b.key and len({a.key, c.key, d.key}) == 3
    assert mgr.stats().deduplicated == 1
    mgr.close()


def test_release_while_locked_is_deferred(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=0, host_budget="1MiB", disk_budget=0)
    h = mgr.put(torch.randn(256))
    with mgr._releases.lock:
        del h  # the finalizer runs now, cannot take the lock, and queues the key
        gc.collect()
        assert len(mgr._releases.pending) == 1
        assert mgr._tiers["host"].bytes == 1024
    assert mgr.stats().tiers["host"].entries == 0  # drained by the next call
    mgr.close()


def test_handles_from_threads(spill_root: Path) -> None:
    mgr = _manager(spill_root, device_budget=8192, host_budget=8192, disk_budget="8MiB")

    def work(seed: int) -> None:
        for i in range(50):
            t = torch.full((KIB4,), float(seed * 1000 + i))
            h = mgr.put(t)
            assert torch.equal(mgr.get(h), t)

    assert run_in_threads(work, 4) == []
    assert sum(s.entries for s in mgr.stats().tiers.values()) == 0
    mgr.close()


# -- closing ----------------------------------------------------------------------

CLOSED = (
    "tierstore: this TierStore is closed; create a new one, or call close() only after the "
    "last backward that needs its saved tensors"
)


def test_use_after_close(disk_config: tierstore.TierConfig) -> None:
    store = tierstore.TierStore(disk_config)
    x = torch.randn(16, requires_grad=True)
    with store.offload():
        y = x.exp()
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.offload().__enter__(), lambda: y.sum().backward()):
        with pytest.raises(tierstore.StoreClosedError) as info:
            call()
        assert str(info.value) == CLOSED


def test_spill_directory_private_and_removed(disk_config: tierstore.TierConfig) -> None:
    store = tierstore.TierStore(disk_config)
    assert store.disk_directory is None  # nothing on disk until something spills
    assert os.listdir(disk_config.disk_path) == []
    x = torch.randn(64, requires_grad=True)
    with store.offload():
        y = x.exp()
    spill = Path(store.disk_directory or "")
    assert spill.parent == disk_config.disk_path
    assert stat.S_IMODE(spill.stat().st_mode) == 0o700
    for path in spill.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    y.sum().backward()
    store.close()
    assert os.listdir(disk_config.disk_path) == []


def test_spill_directory_removed_at_interpreter_exit(spill_root: Path) -> None:
    code = f"""
import torch, tierstore
store = tierstore.TierStore(tierstore.TierConfig(device_budget=0, host_budget=0,
    disk_budget="1MiB", disk_path={str(spill_root)!r}, min_offload_bytes=0))
x = torch.randn(64, requires_grad=True)
with store.offload():
    y = x.exp()
print(store.disk_directory)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().startswith(str(spill_root))
    assert os.listdir(spill_root) == []


def test_unusable_disk_path(tmp_path: Path) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="1MiB",
            disk_path="/proc/tierstore",
            min_offload_bytes=0,
        )
    )
    x = torch.randn(64, requires_grad=True)
    with (
        pytest.raises(
            tierstore.ConfigError,
            match=r"^tierstore: cannot create a spill directory "
            r"under disk_path='/proc/tierstore': .*; set disk_path "
            r"\(TIERSTORE_DISK_PATH\) to a writable local directory$",
        ),
        store.offload(),
    ):
        x.exp()
    store.close()


def test_handle_metadata() -> None:
    t = torch.randn(3, 5).t()
    h = Handle(7, t)
    assert (h.key, h.shape, h.stride, h.dtype, h.version) == (7, (5, 3), (1, 5), torch.float32, 0)
    assert h.source() is t


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_stats_say_how_the_disk_tier_moves_bytes(backend: str, spill_root: Path) -> None:
    config = tierstore.TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget="8MiB",
        disk_path=spill_root,
        disk_backend=backend,
    )
    with tierstore.TierStore(config) as store:
        assert store.stats().disk_io is None  # nothing spilled: no backend opened
        handle = store._manager.put(torch.ones(1024))
        io = store.stats().disk_io
        direct = store._manager._pipeline.backend_if_open.direct if backend == "file" else None
        expected = {"lmdb": "lmdb", "file": "file: O_DIRECT" if direct else "file: buffered"}
        assert io == expected[backend]
        assert f"disk I/O: {io}" in str(store.stats())
        del handle
