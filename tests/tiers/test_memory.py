"""The memory probe (issue 53): cgroup v1 and v2 trees, the kernel's figures, ranks, CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierstore.tiers.memory import (
    UNLIMITED,
    CudaMemory,
    HostMemory,
    MemoryReading,
    filesystem_type,
)

GiB = 1 << 30
MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_PAGES = 25_600  # 100 MiB at 4 KiB pages


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(root: Path, cgroup: str, available: int = 16 * GiB) -> None:
    """/proc/self/cgroup, /proc/meminfo and /proc/self/statm under ``root``."""
    _write(root / "proc/self/cgroup", cgroup)
    _write(root / "proc/meminfo", f"MemTotal: 33554432 kB\nMemAvailable: {available // 1024} kB\n")
    _write(root / "proc/self/statm", f"300000 {RSS_PAGES} 1000 10 0 5000 0\n")


def _v1(root: Path, *, leaf_limit: int, parent_limit: int) -> Path:
    """A v1 memory hierarchy: the process in /kubepods/pod/ctr, a limit on each level."""
    _proc(
        root,
        "12:pids:/kubepods/pod/ctr\n4:memory:/kubepods/pod/ctr\n0::/\n",
    )
    mount = root / "sys/fs/cgroup/memory"
    levels = {
        mount: (UNLIMITED * 2 - 8192, 20 * GiB, 1 * GiB),
        mount / "kubepods": (UNLIMITED * 2 - 8192, 10 * GiB, 1 * GiB),
        mount / "kubepods/pod": (parent_limit, 3 * GiB, 1 * GiB),
        mount / "kubepods/pod/ctr": (leaf_limit, 3 * GiB, 1 * GiB),
    }
    for path, (limit, usage, inactive) in levels.items():
        _write(path / "memory.limit_in_bytes", f"{limit}\n")
        _write(path / "memory.usage_in_bytes", f"{usage}\n")
        _write(
            path / "memory.stat",
            f"cache 5\ninactive_file 7\ntotal_inactive_file {inactive}\n"
            f"total_active_file {inactive}\ntotal_dirty {inactive // 2}\ntotal_writeback 0\n",
        )
    return mount


def _v2(root: Path, *, path: str = "/pod/ctr") -> Path:
    """A v2 tree: the process in /pod/ctr, the limit on /pod, ctr's memory.max "max"."""
    _proc(root, f"0::{path}\n")
    mount = root / "sys/fs/cgroup"
    _write(mount / "cgroup.controllers", "cpu memory pids\n")
    _write(mount / "memory.stat", "anon 1\ninactive_file 0\n")
    for sub, limit, current, inactive in (
        ("pod", "4294967296", 3 * GiB, 512 * MiB),
        ("pod/ctr", "max", 2 * GiB, 256 * MiB),
    ):
        _write(mount / sub / "memory.max", f"{limit}\n")
        _write(mount / sub / "memory.current", f"{current}\n")
        _write(
            mount / sub / "memory.stat",
            f"anon 1\nactive_file {inactive}\ninactive_file {inactive}\nfile_dirty 5\n",
        )
    return mount


def test_v1_reads_the_tightest_limit_up_the_hierarchy(tmp_path: Path) -> None:
    mount = _v1(tmp_path, leaf_limit=UNLIMITED * 2 - 8192, parent_limit=4 * GiB)
    probe = HostMemory(tmp_path, local_world_size=1)
    level = probe.tightest()
    assert level is not None
    assert level.path == mount / "kubepods/pod"
    # Usage less the clean page cache: 1 GiB inactive and 1 GiB active, half of it dirty.
    assert (level.limit, level.usage) == (4 * GiB, 3 * GiB - 3 * GiB // 2)
    reading = probe.read()
    assert reading == MemoryReading(4 * GiB, 3 * GiB // 2, f"cgroup {mount / 'kubepods/pod'}", 1)


def test_v1_a_tighter_leaf_wins(tmp_path: Path) -> None:
    mount = _v1(tmp_path, leaf_limit=3 * GiB + 512 * MiB, parent_limit=8 * GiB)
    reading = HostMemory(tmp_path, local_world_size=1).read()
    assert reading.capacity == 3 * GiB + 512 * MiB
    assert reading.in_use == 3 * GiB // 2
    assert reading.source == f"cgroup {mount / 'kubepods/pod/ctr'}"


def test_v1_unlimited_falls_back_to_memavailable(tmp_path: Path) -> None:
    _v1(tmp_path, leaf_limit=UNLIMITED * 2 - 8192, parent_limit=UNLIMITED * 2 - 8192)
    probe = HostMemory(tmp_path, local_world_size=1)
    assert probe.tightest() is None
    rss = RSS_PAGES * PAGE
    assert probe.usage() == rss
    assert probe.read() == MemoryReading(16 * GiB + rss, rss, "MemAvailable", 1)


def test_a_limit_above_what_is_available_reads_what_is_available(tmp_path: Path) -> None:
    _v1(tmp_path, leaf_limit=64 * GiB, parent_limit=UNLIMITED * 2 - 8192)
    (tmp_path / "proc/meminfo").write_text("MemAvailable: 1048576 kB\n")  # 1 GiB left
    reading = HostMemory(tmp_path, local_world_size=1).read()
    assert reading.source == "MemAvailable"
    assert reading.capacity - reading.in_use == GiB


def test_v2_reads_memory_max_current_and_inactive_file(tmp_path: Path) -> None:
    mount = _v2(tmp_path)
    reading = HostMemory(tmp_path, local_world_size=1).read()
    # Usage less the clean page cache: 512 MiB active, 512 MiB inactive, 5 bytes dirty.
    in_use = 3 * GiB - GiB + 5
    assert reading == MemoryReading(4 * GiB, in_use, f"cgroup {mount / 'pod'}", 1)


def test_v2_in_a_cgroup_namespace_reads_the_mount(tmp_path: Path) -> None:
    # Inside a cgroup namespace the path is "/" (or a host path that is not
    # there): the container's own cgroup is the mount's root.
    mount = _v2(tmp_path, path="/")
    _write(mount / "memory.max", f"{2 * GiB}\n")
    _write(mount / "memory.current", f"{GiB}\n")
    assert HostMemory(tmp_path, local_world_size=1).read().capacity == 2 * GiB
    (tmp_path / "proc/self/cgroup").write_text("0::/host/name/of/it\n")
    assert HostMemory(tmp_path, local_world_size=1).read().capacity == 2 * GiB


def test_v2_unified_under_a_hybrid_mount(tmp_path: Path) -> None:
    _proc(tmp_path, "4:cpu:/\n0::/job\n")
    unified = tmp_path / "sys/fs/cgroup/unified"
    _write(unified / "cgroup.controllers", "memory\n")
    _write(unified / "job/memory.max", f"{GiB}\n")
    _write(unified / "job/memory.current", f"{256 * MiB}\n")
    reading = HostMemory(tmp_path, local_world_size=1).read()
    assert (reading.capacity, reading.in_use) == (GiB, 256 * MiB)


def test_local_world_size_halves_the_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ Ranks in one container ]: the limit's share, less this rank's own.
    mount = _v2(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rss = RSS_PAGES * PAGE
    assert HostMemory(tmp_path).read() == MemoryReading(2 * GiB, rss, f"cgroup {mount / 'pod'}", 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert HostMemory(tmp_path).read().capacity == 4 * GiB
    # Without a limit: half of what is available, beside what the rank holds.
    unlimited = tmp_path / "none"
    _v1(unlimited, leaf_limit=UNLIMITED * 2 - 8192, parent_limit=UNLIMITED * 2 - 8192)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert HostMemory(unlimited).read() == MemoryReading(8 * GiB + rss, rss, "MemAvailable", 2)


def test_no_cgroup_file_reads_the_kernel(tmp_path: Path) -> None:
    _write(tmp_path / "proc/meminfo", "MemAvailable: 2097152 kB\n")
    _write(tmp_path / "proc/self/statm", "1 256 0\n")
    reading = HostMemory(tmp_path, local_world_size=1).read()
    assert reading == MemoryReading(2 * GiB + 256 * PAGE, 256 * PAGE, "MemAvailable", 1)


def test_this_machine_reads_something_sane() -> None:
    reading = HostMemory().read()
    assert 0 < reading.in_use < reading.capacity


def test_filesystem_type_takes_the_deepest_mount(tmp_path: Path) -> None:
    _write(
        tmp_path / "proc/self/mounts",
        "/dev/sda1 / ext4 rw 0 0\ntmpfs /scratch tmpfs rw 0 0\nproc /proc proc rw 0 0\n",
    )
    assert filesystem_type("/scratch/ts", tmp_path) == "tmpfs"
    assert filesystem_type("/scratchy", tmp_path) == "ext4"
    assert filesystem_type("/x", tmp_path / "missing") == ""


@pytest.mark.requires_cuda
def test_cuda_capacity_honours_the_process_fraction() -> None:
    probe = CudaMemory(torch.cuda.current_device())
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    full = probe.read()
    assert full.in_use >= x.numel() and full.capacity > full.in_use
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        assert probe.read().capacity <= total // 2
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del x
