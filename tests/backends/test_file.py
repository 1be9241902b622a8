"""The file backend: extent allocation, round trips, full and corrupt records, lifecycle."""

from __future__ import annotations

import array
import errno
import fcntl
import gc
import itertools
import mmap
import os
import random
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from backend_helpers import FULL_HINT, KiB, MiB, churn, read, run_in_threads, split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import tierstore.backends
from tierstore.backends import Backend, FileBackend, LmdbBackend, backend_class
from tierstore.backends import file as file_backend
from tierstore.backends._extents import ExtentAllocator
from tierstore.backends.file import ALIGN
from tierstore.errors import (
    ConfigError,
    CorruptDataError,
    StoreClosedError,
    TierFullError,
    TierstoreError,
)


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make opening with O_DIRECT fail as on a filesystem without it (EINVAL)."""
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def direct_backend(path: Path, capacity: int) -> FileBackend:
    """A backend on the O_DIRECT path, or a skip naming the filesystem that refuses it."""
    b = FileBackend(path, capacity)
    if not b.direct:
        b.close()
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT (tmpfs on older kernels does)")
    return b


#: The paths every I/O test runs on: buffered (O_DIRECT refused), O_DIRECT,
#: and O_DIRECT with bounce buffers of two blocks, so that small records
#: already span several chunks.
IO_PATHS = ["buffered", "direct", "direct-2-block-chunks"]


@pytest.fixture(params=IO_PATHS)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FileBackend]:
    if request.param == "buffered":
        with monkeypatch.context() as m:
            refuse_o_direct(m)
            b = FileBackend(tmp_path, 4 * MiB)
        assert not b.direct
    else:
        if request.param == "direct-2-block-chunks":
            monkeypatch.setattr(file_backend, "_CHUNK", 2 * ALIGN)
        b = direct_backend(tmp_path, 4 * MiB)
    yield b
    b.close()


@pytest.fixture
def buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FileBackend]:
    with monkeypatch.context() as m:
        refuse_o_direct(m)
        b = FileBackend(tmp_path, 4 * MiB)
    yield b
    b.close()


# -- the package surface ---------------------------------------------------------


def test_exported_names() -> None:
    assert tierstore.backends.__all__ == ["Backend", "FileBackend", "LmdbBackend", "backend_class"]
    assert issubclass(FileBackend, Backend)
    assert FileBackend.name == "file"


def test_backend_class() -> None:
    assert backend_class("file") is FileBackend
    assert backend_class("lmdb") is LmdbBackend
    with pytest.raises(ConfigError) as info:
        backend_class("tape")
    assert str(info.value) == (
        "tierstore: disk_backend='tape' is not a backend; expected one of 'file', 'lmdb'"
    )


# -- the allocator -------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of the live extents."""

    capacity = 64

    @initialize()
    def setup(self) -> None:
        self.alloc = ExtentAllocator(self.capacity)
        self.live: dict[int, int] = {}  # offset -> length

    @rule(n=st.integers(1, 24))
    def allocate(self, n: int) -> None:
        offset = self.alloc.allocate(n)
        if offset is None:
            assert self.alloc.largest_free() < n
            return
        assert offset >= 0
        assert offset + n <= self.capacity
        for o, m in self.live.items():
            assert offset + n <= o or o + m <= offset, "overlap"
        self.live[offset] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data(), newest=st.booleans())
    def free(self, data: st.DataObject, newest: bool) -> None:
        offset = max(self.live) if newest else data.draw(st.sampled_from(sorted(self.live)))
        n = self.live.pop(offset)
        top, free_before = self.alloc.top, len(self.alloc.free_extents)
        self.alloc.free(offset, n)
        if offset + n == top:
            # The stack case: top comes down, the free list never grows.
            assert self.alloc.top <= offset
            assert len(self.alloc.free_extents) <= free_before

    @invariant()
    def live_and_free_tile_the_stack(self) -> None:
        free = self.alloc.free_extents
        for (o1, n1), (o2, _) in itertools.pairwise(free):
            assert o1 + n1 < o2, "free extents not coalesced"
        if free:
            assert free[-1][0] + free[-1][1] < self.alloc.top, "free extent touching top"
        pos = 0
        for o, n in sorted([*self.live.items(), *free]):
            assert o == pos
            pos += n
        assert pos == self.alloc.top <= self.capacity
        assert self.alloc.free_bytes() == self.capacity - sum(self.live.values())

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for offset in list(self.live):
            self.alloc.free(offset, self.live.pop(offset))
        assert self.alloc.top == 0
        assert self.alloc.free_extents == []


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_allocator_lifo_frees_are_pure_stack_moves() -> None:
    alloc = ExtentAllocator(1000 * ALIGN)
    offsets = [alloc.allocate(ALIGN * (1 + i % 3)) for i in range(300)]
    assert offsets[:3] == [0, ALIGN, 3 * ALIGN]
    sizes = [ALIGN * (1 + i % 3) for i in range(300)]
    for offset, size in zip(reversed(offsets), reversed(sizes), strict=True):
        assert offset is not None
        alloc.free(offset, size)
        assert alloc.top == offset
        assert alloc.free_extents == []
    assert alloc.top == 0


def test_allocator_folds_free_extents_back_into_the_stack() -> None:
    alloc = ExtentAllocator(16)
    a, b, c = alloc.allocate(4), alloc.allocate(4), alloc.allocate(4)
    assert (a, b, c) == (0, 4, 8)
    alloc.free(4, 4)
    assert alloc.free_extents == [(4, 4)]
    alloc.free(8, 4)  # ends at top: top drops to 8, then past the free extent to 4
    assert (alloc.top, alloc.free_extents) == (4, [])
    alloc.free(0, 4)
    assert (alloc.top, alloc.free_extents) == (0, [])


def test_allocator_first_fit_below_top_when_the_stack_is_full() -> None:
    alloc = ExtentAllocator(16)
    for _ in range(4):
        alloc.allocate(4)
    alloc.free(0, 4)
    alloc.free(8, 4)
    assert alloc.allocate(8) is None  # 8 bytes free, but in two pieces
    assert alloc.largest_free() == 4
    assert alloc.allocate(2) == 0
    assert alloc.free_extents == [(2, 2), (8, 4)]
    assert alloc.allocate(4) == 8
    assert alloc.free_extents == [(2, 2)]


def test_allocator_rejects_double_and_foreign_frees() -> None:
    alloc = ExtentAllocator(16)
    for _ in range(3):
        alloc.allocate(4)
    alloc.free(0, 4)
    with pytest.raises(ValueError, match="overlaps a free extent"):
        alloc.free(0, 4)
    with pytest.raises(ValueError, match="overlaps a free extent"):
        alloc.free(2, 10)  # ends at top, but starts inside the free extent
    with pytest.raises(ValueError, match="not below top"):
        alloc.free(12, 4)
    assert (alloc.top, alloc.free_extents) == (12, [(0, 4)])


# -- round trips -----------------------------------------------------------------


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.binary(max_size=3 * ALIGN),
    write_cuts=st.lists(st.integers(0, 3 * ALIGN), max_size=6),
    read_cuts=st.lists(st.integers(0, 3 * ALIGN), max_size=6),
)
def test_round_trip_any_chunking(
    backend: FileBackend, data: bytes, write_cuts: list[int], read_cuts: list[int]
) -> None:
    try:
        footprint = backend.write(1, split(data, write_cuts))
        assert footprint == -(-len(data) // ALIGN) * ALIGN == backend.used_bytes
        assert read(backend, 1, [len(c) for c in split(data, read_cuts)]) == data
    finally:
        backend.delete(1)
    assert backend.used_bytes == 0
    assert backend._alloc.top == 0


def test_round_trip_of_typed_and_shaped_buffers(backend: FileBackend) -> None:
    floats = array.array("f", [1.5, -2.0, 3.25])
    grid = memoryview(bytearray(range(12))).cast("B", shape=[3, 4])
    assert backend.write(7, [b"head", memoryview(floats), grid, bytearray(b"!")]) == ALIGN
    head, out, rest = bytearray(4), array.array("f", [0.0] * 3), bytearray(13)
    backend.read_into(7, [memoryview(head), memoryview(out), memoryview(rest)])
    assert (bytes(head), out, bytes(rest)) == (b"head", floats, bytes(range(12)) + b"!")


def test_zero_length_records(backend: FileBackend) -> None:
    assert backend.write(1, []) == 0
    assert backend.write(2, [b"", bytearray()]) == 0
    assert (len(backend), backend.used_bytes) == (2, 0)
    backend.read_into(1, [])
    backend.read_into(2, [memoryview(bytearray())])
    with pytest.raises(CorruptDataError):
        backend.read_into(1, [memoryview(bytearray(1))])
    backend.delete(1)
    backend.delete(2)
    assert len(backend) == 0


def test_many_records_in_any_order(backend: FileBackend) -> None:
    rng = random.Random(0)
    records = {
        k: rng.randbytes(rng.choice([0, 1, 100, ALIGN, ALIGN + 1, 20_000])) for k in range(300)
    }
    for k, data in records.items():
        backend.write(k, [data])
    assert len(backend) == 300
    assert backend.used_bytes == sum(backend.footprint(len(d)) for d in records.values())
    keys = list(records)
    rng.shuffle(keys)
    for k in keys:
        assert read(backend, k, [len(records[k])]) == records[k]
    for i, k in enumerate(keys):
        backend.delete(k)
        if i % 7 == 0:  # reuse freed space in between
            backend.write(1000 + i, [records[k]])
            assert read(backend, 1000 + i, [len(records[k])]) == records[k]
            backend.delete(1000 + i)
    assert (len(backend), backend.used_bytes) == (0, 0)
    assert (backend._alloc.top, backend._alloc.free_extents) == (0, [])


def test_lifo_deletes_keep_the_free_list_empty(backend: FileBackend) -> None:
    for k in range(50):
        backend.write(k, [bytes(1 + k * 300)])
    for k in reversed(range(50)):
        backend.delete(k)
        assert backend._alloc.free_extents == []
        assert backend._alloc.top == backend.used_bytes
    assert backend._alloc.top == 0


def test_more_chunks_than_iov_max(backend: FileBackend) -> None:
    chunks = [bytes([i % 251]) * 3 for i in range(3000)]
    backend.write(1, chunks)
    assert read(backend, 1, [2] * 4500) == b"".join(chunks)


def test_short_writes_and_reads_are_resumed(
    buffered: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = buffered
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def clip(buffers: list[Any], limit: int) -> list[memoryview]:
        out = []
        for b in buffers:
            view = memoryview(b)[:limit]
            out.append(view)
            limit -= view.nbytes
            if limit == 0:
                break
        return out

    def short_pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        return real_pwritev(fd, clip(buffers, 1000), offset)

    def short_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        return real_preadv(fd, clip(buffers, 777), offset)

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    monkeypatch.setattr(os, "preadv", short_preadv)
    data = random.Random(1).randbytes(50_000)
    backend.write(1, split(data, [3, 5000, 5001, 22_222]))
    assert read(backend, 1, [1, 9999, 40_000]) == data


def test_concurrent_writers_and_readers(backend: FileBackend) -> None:
    assert run_in_threads(lambda tid: churn(backend, tid, 3 * ALIGN)) == []
    assert (len(backend), backend.used_bytes, backend._alloc.top) == (0, 0, 0)


def test_duplicate_key_is_refused_and_the_record_kept(backend: FileBackend) -> None:
    backend.write(1, [b"first"])
    with pytest.raises(ValueError, match=re.escape("tierstore: key 1 is already stored")):
        backend.write(1, [b"second"])
    assert read(backend, 1, [5]) == b"first"
    assert backend.used_bytes == ALIGN


# -- sizes, full disk ----------------------------------------------------------------


def test_file_starts_empty_and_grows_within_the_aligned_budget(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 10_000)
    assert b.capacity_bytes == 2 * ALIGN
    path = b.path
    assert path.stat().st_size == b.file_bytes == 0  # nothing claimed before a record
    b.write(1, [b"x"])
    st_ = path.stat()
    # One growth step is 64 MiB at least, capped by the budget.
    assert st_.st_size == b.file_bytes == 2 * ALIGN
    assert st_.st_blocks * 512 >= 2 * ALIGN  # really reserved, not sparse
    assert (b.footprint(0), b.footprint(1), b.footprint(ALIGN), b.footprint(ALIGN + 1)) == (
        0,
        ALIGN,
        ALIGN,
        2 * ALIGN,
    )
    b.close()


def test_full_message_and_recovery(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 16 * KiB)
    for k in range(4):
        b.write(k, [bytes([k]) * 100])
    with pytest.raises(TierFullError) as info:
        b.write(9, [b"x"])
    assert str(info.value) == (
        "tierstore: disk tier is full: 16.0 KiB in use of disk_budget=16.0 KiB; "
        "a record of 4.0 KiB does not fit (0 B free)" + FULL_HINT
    )
    assert (len(b), b.used_bytes) == (4, 16 * KiB)
    with pytest.raises(KeyError):
        b.read_into(9, [memoryview(bytearray(1))])

    b.delete(0)
    b.delete(2)  # 8 KiB free, in two extents of 4 KiB
    with pytest.raises(TierFullError) as info:
        b.write(9, [bytes(5000)])
    assert str(info.value) == (
        "tierstore: disk tier is full: 8.0 KiB in use of disk_budget=16.0 KiB; "
        "a record of 8.0 KiB does not fit (fragmented free space: 8.0 KiB free, "
        "largest extent 4.0 KiB)" + FULL_HINT
    )
    assert b.write(9, [b"fits"]) == 4 * KiB
    assert read(b, 9, [4]) == b"fits"
    assert read(b, 1, [100]) == b"\x01" * 100
    assert read(b, 3, [100]) == b"\x03" * 100
    b.close()


def test_record_larger_than_the_budget(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 10_000)
    with pytest.raises(TierFullError) as info:
        b.write(1, [bytes(20_000)])
    assert str(info.value) == (
        "tierstore: disk tier is full: 0 B in use of disk_budget=9.8 KiB; "
        "a record of 20.0 KiB does not fit (8.0 KiB free)" + FULL_HINT
    )
    assert b.used_bytes == 0
    b.close()


def _growth_full(tmp_path: Path, size: str, end: str, why: str, budget: str = "64.0 MiB") -> str:
    return (
        f"tierstore: cannot grow the disk tier's file from {size} to {end} in {tmp_path} "
        f"(disk_budget={budget}): {why}; set disk_path (TIERSTORE_DISK_PATH) to a disk with "
        "more room, or lower disk_budget (TIERSTORE_DISK_BUDGET) to what this one holds"
    )


def test_growth_without_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def no_space(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_backend, "_fallocate", no_space)
    b = FileBackend(tmp_path, 64 * MiB)
    with pytest.raises(TierFullError) as info:
        b.write(1, [bytes(5000)])
    assert str(info.value) == _growth_full(tmp_path, "0 B", "8.0 KiB", "No space left on device")
    assert isinstance(info.value.__cause__, OSError)
    # The full step, then just the record: the disk's last bytes are tried too.
    assert calls == [(0, file_backend._MIN_GROWTH), (0, 2 * ALIGN)]
    assert (len(b), b.used_bytes, b.file_bytes) == (0, 0, 0)  # nothing stored
    assert b.path.stat().st_size == 0  # a partial fallocate given back
    b.close()
    assert os.listdir(tmp_path) == []


def test_growth_larger_than_the_free_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[tuple[int, int]] = []
    b = FileBackend(tmp_path, 64 * MiB)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: SimpleNamespace(f_bavail=256, f_frsize=4 * KiB))
    monkeypatch.setattr(file_backend, "_fallocate", lambda fd, o, n: called.append((o, n)))
    with pytest.raises(TierFullError) as info:
        b.write(1, [bytes(2 * MiB)])
    assert str(info.value) == _growth_full(tmp_path, "0 B", "2.0 MiB", "only 1.0 MiB free there")
    assert called == []  # refused before a single block was claimed
    # The free space cannot take a full step, but it can take this record.
    b.write(2, [b"fits"])
    assert called == [(0, ALIGN)]
    assert b.file_bytes == ALIGN
    assert read(b, 2, [4]) == b"fits"
    b.close()


def test_a_budget_larger_than_the_disk_claims_only_what_is_used(tmp_path: Path) -> None:
    # Once preallocated, this budget was refused at the first spill; grown on
    # demand, it is fine until a growth needs more than is free.
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    b = FileBackend(tmp_path, free + 1024 * MiB)
    b.write(1, [b"small"])
    assert 0 < b.file_bytes <= 64 * MiB
    assert read(b, 1, [5]) == b"small"
    b.close()


def test_growth_is_geometric_and_capped_by_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "_MIN_GROWTH", 4 * ALIGN)
    calls: list[tuple[int, int]] = []
    real = file_backend._fallocate

    def counted(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(file_backend, "_fallocate", counted)
    b = FileBackend(tmp_path, 25 * ALIGN)
    sizes = []
    for key in range(25):
        b.write(key, [bytes([key]) * 100])
        sizes.append(b.file_bytes // ALIGN)
    # 4 blocks at least, then the file's own size again, then the budget.
    assert sorted(set(sizes)) == [4, 8, 16, 25]
    assert calls == [
        (0, 4 * ALIGN),
        (4 * ALIGN, 4 * ALIGN),
        (8 * ALIGN, 8 * ALIGN),
        (16 * ALIGN, 9 * ALIGN),
    ]
    with pytest.raises(TierFullError):
        b.write(99, [b"x"])
    assert b.path.stat().st_size == 25 * ALIGN  # never past the budget
    for key in range(25):
        b.delete(key)
    assert len(calls) == 4  # freed space is reused: the file never shrinks nor regrows
    assert b.write(100, [bytes(20 * ALIGN)]) == 20 * ALIGN
    assert len(calls) == 4
    b.close()


def test_growth_jumps_to_a_large_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_backend, "_MIN_GROWTH", 4 * ALIGN)
    b = FileBackend(tmp_path, 64 * ALIGN)
    b.write(1, [bytes(10 * ALIGN)])
    assert b.file_bytes == 10 * ALIGN  # to the record's end: more than one step
    b.write(2, [b"x"])
    assert b.file_bytes == 20 * ALIGN  # then the file's own size again
    b.close()


def test_fallocate_reserves_real_blocks(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 4 * MiB)
    b.write(1, [b"x"])
    st = b.path.stat()
    assert st.st_size == 4 * MiB and st.st_blocks * 512 >= 4 * MiB
    b.close()


def test_growth_falls_back_to_ftruncate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def unsupported(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(file_backend, "_MIN_GROWTH", 4 * ALIGN)
    monkeypatch.setattr(file_backend, "_fallocate", unsupported)
    b = FileBackend(tmp_path, 64 * KiB)
    b.write(1, [b"sparse is fine"])
    assert b.path.stat().st_size == 16 * KiB
    b.write(2, [bytes(20 * KiB)])
    assert b.path.stat().st_size == 32 * KiB
    assert calls == [16 * KiB]  # asked once: the filesystem has no fallocate
    assert read(b, 1, [14]) == b"sparse is fine"
    b.close()


def test_negative_budget(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        FileBackend(tmp_path, -1)
    assert str(info.value) == (
        "tierstore: disk_budget=-1 is negative; "
        "set disk_budget (TIERSTORE_DISK_BUDGET) to a size such as '64GiB'"
    )
    assert os.listdir(tmp_path) == []


def test_zero_budget_holds_only_empty_records(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 0)
    assert b.write(1, [b""]) == 0
    with pytest.raises(TierFullError):
        b.write(2, [b"x"])
    b.close()


def test_failed_write_frees_its_extent(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.write(1, [b"kept"])
    cause = OSError(errno.EIO, os.strerror(errno.EIO))

    def broken(fd: int, buffers: list[Any], offset: int) -> int:
        raise cause

    monkeypatch.setattr(os, "pwritev", broken)
    with pytest.raises(TierstoreError) as info:
        backend.write(2, [bytes(5000)])
    assert str(info.value) == (
        f"tierstore: writing entry 2 (4.9 KiB) to {backend.directory / 'entries.bin'} failed: "
        "[Errno 5] Input/output error; check the disk under disk_path (TIERSTORE_DISK_PATH)"
    )
    assert info.value.__cause__ is cause
    assert (len(backend), backend.used_bytes, backend._alloc.top) == (1, ALIGN, ALIGN)
    monkeypatch.undo()
    backend.write(2, [b"later"])
    assert read(backend, 2, [5]) == b"later"


# -- corrupt records -----------------------------------------------------------------


def test_length_mismatch_is_corrupt(backend: FileBackend) -> None:
    backend.write(5, [b"eighteen bytes!!!!"])
    for sizes in ([17], [10, 10], []):
        with pytest.raises(CorruptDataError) as info:
            read(backend, 5, sizes)
        assert str(info.value) == (
            f"tierstore: entry 5 in the disk tier ({backend.directory / 'entries.bin'}) "
            f"holds 18 bytes, not the {sum(sizes)} bytes asked for"
        )
    assert read(backend, 5, [18]) == b"eighteen bytes!!!!"


def test_truncated_file_is_corrupt(backend: FileBackend) -> None:
    backend.write(1, [bytes(ALIGN)])
    backend.write(2, [bytes(3 * ALIGN)])
    path = backend.path
    os.truncate(path, 2 * ALIGN)
    assert read(backend, 1, [ALIGN]) == bytes(ALIGN)
    with pytest.raises(CorruptDataError) as info:
        read(backend, 2, [3 * ALIGN])
    assert str(info.value) == (
        f"tierstore: entry 2 in the disk tier ({backend.directory / 'entries.bin'}) ends early: "
        "the file ends after "
        f"{ALIGN} of its {3 * ALIGN} bytes at offset {ALIGN}; "
        "the file was truncated outside tierstore"
    )


# -- lifecycle -----------------------------------------------------------------------


def test_closed_backend_refuses_every_call(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, 1 * MiB)
    b.write(1, [b"x"])
    directory = b.directory
    b.close()
    assert not directory.exists()
    message = f"tierstore: the file backend at {directory} is closed"
    calls: list[Callable[[], object]] = [
        lambda: b.write(2, [b"y"]),
        lambda: b.read_into(1, [memoryview(bytearray(1))]),
        lambda: b.delete(1),
        lambda: len(b),
        lambda: b.used_bytes,
    ]
    for call in calls:
        with pytest.raises(StoreClosedError) as info:
            call()
        assert str(info.value) == message
    b.close()  # idempotent
    assert "closed" in repr(b)


def test_close_waits_for_io_in_flight(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwritev = os.pwritev
    started, release = threading.Event(), threading.Event()

    def slow(fd: int, buffers: list[Any], offset: int) -> int:
        started.set()
        release.wait(10)
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", slow)
    writer = threading.Thread(target=backend.write, args=(1, [b"in flight"]))
    writer.start()
    assert started.wait(10)
    closer = threading.Thread(target=backend.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # still waiting for the write
    assert backend.directory.exists()
    with pytest.raises(StoreClosedError):
        backend.write(2, [b"too late"])
    release.set()
    writer.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert not backend.directory.exists()


# -- O_DIRECT and its fallback ---------------------------------------------------------


def _open_fds() -> set[str]:
    gc.collect()  # descriptors of backends other tests dropped close now, not mid-test
    return set(os.listdir("/proc/self/fd"))


def _o_direct_accepted(directory: Path) -> bool:
    # An independent probe: an aligned write and read through O_DIRECT in ``directory``.
    path = directory / "probe.bin"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buf], 0)
        return os.preadv(fd, [buf], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()
        buf.close()


def test_direct_where_the_filesystem_accepts_it(tmp_path: Path) -> None:
    accepted = _o_direct_accepted(tmp_path)
    b = FileBackend(tmp_path, 1 * MiB)
    assert b.direct is accepted
    if accepted:
        assert fcntl.fcntl(b._direct_fd, fcntl.F_GETFL) & os.O_DIRECT
    assert not fcntl.fcntl(b._fd, fcntl.F_GETFL) & os.O_DIRECT
    b.close()


def test_fallback_when_the_open_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _open_fds()
    refuse_o_direct(monkeypatch)
    b = FileBackend(tmp_path, 1 * MiB)
    assert not b.direct
    data = random.Random(2).randbytes(3 * ALIGN + 5)
    b.write(1, [data])
    assert read(b, 1, [len(data)]) == data
    assert b._pool.created == 0  # the buffered path needs no bounce buffer
    b.close()
    assert _open_fds() == before


def test_fallback_when_the_first_direct_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some filesystems (FUSE, network ones) accept the open and fail the I/O.
    real_pwritev = os.pwritev
    refused: list[int] = []

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwritev(fd, buffers, offset)

    before = _open_fds()
    monkeypatch.setattr(os, "pwritev", pwritev)
    b = FileBackend(tmp_path, 1 * MiB)
    if not refused:
        b.close()
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT at the open already")
    assert not b.direct
    # The lock file and the buffered fd: the O_DIRECT one was closed again.
    assert len(_open_fds() - before) == 2
    b.write(1, [b"buffered after all"])
    assert read(b, 1, [18]) == b"buffered after all"
    b.close()
    assert _open_fds() == before


def test_fallback_when_the_probe_reads_back_other_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: ALIGN)  # reads nothing
    b = FileBackend(tmp_path, 1 * MiB)
    assert not b.direct
    b.close()


def test_no_probe_without_room_for_a_block(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, ALIGN - 1)
    assert (b.capacity_bytes, b.direct) == (0, False)
    b.close()


SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 5 * ALIGN + 7]


@pytest.mark.parametrize("path", ["buffered", "direct"])
@pytest.mark.parametrize("chunk", [2 * ALIGN, file_backend._CHUNK])
def test_round_trips_of_odd_sizes_and_alignments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, chunk: int
) -> None:
    monkeypatch.setattr(file_backend, "_CHUNK", chunk)
    # Around the chunk size too: a record that ends just before, at and after
    # a chunk boundary, and one that spans more than two chunks.
    sizes = [*SIZES, chunk - 1, chunk, chunk + 1, 2 * chunk + ALIGN + 3]
    capacity = sum(file_backend.ALIGN + s for s in sizes) * 2
    if path == "buffered":
        with monkeypatch.context() as m:
            refuse_o_direct(m)
            b = FileBackend(tmp_path, capacity)
    else:
        b = direct_backend(tmp_path, capacity)
    rng = random.Random(chunk)
    written = {}
    for key, size in enumerate(sizes):
        data = rng.randbytes(size)
        # Sources at odd addresses: a read-only header, then writable slices
        # of a bytearray that start 1..7 bytes past an aligned address.
        skew = key % 7 + 1
        backing = bytearray(skew) + bytearray(data)
        body = memoryview(backing)[skew:]
        cut = min(size, 13)
        third = cut + (size - cut) // 3
        assert b.write(key, [data[:cut], body[cut:third], body[third:]]) == b.footprint(size)
        written[key] = data
    for key, data in written.items():
        # Targets at odd addresses too, cut at other places than the writes.
        skew = key % 5 + 3
        backing = bytearray(skew + len(data))
        out = memoryview(backing)[skew:]
        cuts = sorted({0, len(data), min(len(data), 1), len(data) // 2})
        b.read_into(key, [out[a:c] for a, c in itertools.pairwise(cuts)])
        assert bytes(out) == data, f"record {key} of {len(data)} bytes"
        assert bytes(backing[:skew]) == bytes(skew)  # nothing written before the target
    assert b.direct is (path == "direct")
    if b.direct and chunk < max(sizes):
        assert b._pool.created >= 1
    b.close()


def test_direct_padding_is_zeros_and_spares_the_neighbours(tmp_path: Path) -> None:
    b = direct_backend(tmp_path, 4 * ALIGN)  # full after 1 and 2: 3 and 4 reuse 1's blocks
    b.write(1, [b"\xff" * (2 * ALIGN)])
    b.write(2, [b"\xee" * (2 * ALIGN)])
    b.delete(1)
    b.write(3, [b"abc"])  # reuses the first block of 1, leaves its second alone
    b.write(4, [b"\xdd" * 10])  # takes 1's second block
    with open(b.path, "rb") as f:
        head = f.read(4 * ALIGN)
    assert head[:ALIGN] == b"abc" + bytes(ALIGN - 3)
    assert head[ALIGN : 2 * ALIGN] == b"\xdd" * 10 + bytes(ALIGN - 10)
    assert head[2 * ALIGN :] == b"\xee" * (2 * ALIGN)
    assert read(b, 2, [2 * ALIGN]) == b"\xee" * (2 * ALIGN)
    b.close()


def test_short_direct_writes_and_reads_are_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "_CHUNK", 8 * ALIGN)
    b = direct_backend(tmp_path, 1 * MiB)
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = {"w": 0, "r": 0}

    def short_pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        calls["w"] += 1
        return real_pwritev(fd, [memoryview(buffers[0])[: 3 * ALIGN]], offset)

    def short_preadv(fd: int, buffers: list[Any], offset: int) -> int:
        calls["r"] += 1
        return real_preadv(fd, [memoryview(buffers[0])[:ALIGN]], offset)

    monkeypatch.setattr(os, "pwritev", short_pwritev)
    monkeypatch.setattr(os, "preadv", short_preadv)
    data = random.Random(3).randbytes(20 * ALIGN + 99)
    b.write(1, [data])
    assert read(b, 1, [len(data)]) == data
    assert calls == {"w": 3 + 3 + 2, "r": 21}  # chunks of 8, 8 and 5 blocks
    b.close()


def _count_bounced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes copied through the bounce buffer, one item per copy."""
    copied: list[int] = []
    real_copy = file_backend.copy

    def counting_copy(dst: memoryview, src: memoryview) -> None:
        copied.append(src.nbytes)
        real_copy(dst, src)

    monkeypatch.setattr(file_backend, "copy", counting_copy)
    return copied


def test_aligned_views_go_straight_to_the_device_and_only_the_rest_bounces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = direct_backend(tmp_path, 1 * MiB)
    copied = _count_bounced(monkeypatch)
    data = random.Random(5).randbytes(20 * ALIGN + 99)
    source = mmap.mmap(-1, 21 * ALIGN)  # page-aligned, as tierstore's buffers are
    source[: len(data)] = data
    b.write(1, [memoryview(source)[: len(data)]])
    assert copied == [99]  # only the part block at the end
    copied.clear()
    target = mmap.mmap(-1, 21 * ALIGN)
    b.read_into(1, [memoryview(target)[: len(data)]])
    assert target[: len(data)] == data
    assert copied == [99]
    copied.clear()
    # An aligned view behind a short, read-only header: the header starts the
    # record, so nothing after it is aligned in the file and all of it bounces.
    b.write(2, [b"head", memoryview(source)[: 2 * ALIGN]])
    assert sum(copied) == 4 + 2 * ALIGN
    assert read(b, 2, [4, 2 * ALIGN]) == b"head" + data[: 2 * ALIGN]
    b.close()


def test_direct_reads_stop_at_a_truncated_file(tmp_path: Path) -> None:
    b = direct_backend(tmp_path, 1 * MiB)
    b.write(1, [memoryview(mmap.mmap(-1, 8 * ALIGN))])
    path = b.path
    os.truncate(path, 3 * ALIGN)
    target = mmap.mmap(-1, 8 * ALIGN)
    with pytest.raises(CorruptDataError) as info:
        b.read_into(1, [memoryview(target)])
    assert str(info.value) == (
        f"tierstore: entry 1 in the disk tier ({b.directory / 'entries.bin'}) ends early: "
        "the file ends after "
        f"{3 * ALIGN} of its {8 * ALIGN} bytes at offset 0; "
        "the file was truncated outside tierstore"
    )
    b.close()


def test_truncated_inside_a_block_is_corrupt(backend: FileBackend) -> None:
    backend.write(1, [bytes(ALIGN)])
    backend.write(2, [bytes(3 * ALIGN)])
    path = backend.path
    os.truncate(path, ALIGN + 100)
    with pytest.raises(CorruptDataError) as info:
        read(backend, 2, [3 * ALIGN])
    assert str(info.value) == (
        f"tierstore: entry 2 in the disk tier ({backend.directory / 'entries.bin'}) ends early: "
        "the file ends after "
        f"100 of its {3 * ALIGN} bytes at offset {ALIGN}; "
        "the file was truncated outside tierstore"
    )


def test_failed_direct_read_names_the_file_and_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = direct_backend(tmp_path, 1 * MiB)
    b.write(1, [b"x" * 100])
    cause = OSError(errno.EIO, os.strerror(errno.EIO))

    def broken(fd: int, buffers: list[Any], offset: int) -> int:
        raise cause

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(TierstoreError) as info:
        read(b, 1, [100])
    assert str(info.value) == (
        f"tierstore: reading entry 1 from {b.directory / 'entries.bin'} failed: "
        "[Errno 5] Input/output error; check the disk under disk_path (TIERSTORE_DISK_PATH)"
    )
    assert info.value.__cause__ is cause
    monkeypatch.undo()
    assert read(b, 1, [100]) == b"x" * 100
    b.close()


def test_concurrent_direct_io_shares_a_bounded_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "_CHUNK", 4 * ALIGN)
    monkeypatch.setattr(file_backend, "_MAX_BUFFERS", 3)
    b = direct_backend(tmp_path, 16 * MiB)
    barrier = threading.Barrier(8)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        barrier.wait(10)
        for i in range(40):
            key = tid * 1000 + i
            data = rng.randbytes(rng.randrange(0, 30 * ALIGN))
            skew = rng.randrange(1, 64)
            src = memoryview(bytearray(skew) + bytearray(data))[skew:]
            b.write(key, [data[:5], src[5:]])
            assert read(b, key, [len(data) // 3, len(data) - len(data) // 3]) == data
            if i % 2:
                b.delete(key)

    assert run_in_threads(worker) == []
    assert 1 <= b._pool.created <= 3
    b.close()


def test_close_unmaps_the_bounce_buffers_and_the_direct_descriptor(tmp_path: Path) -> None:
    before = _open_fds()
    b = direct_backend(tmp_path, 1 * MiB)
    assert len(_open_fds() - before) == 3  # the lock file, the buffered and the O_DIRECT fd
    b.write(1, [bytes(5 * ALIGN)])
    read(b, 1, [5 * ALIGN])
    buffers = b._pool.buffers
    assert len(buffers) == 1 and not buffers[0].closed
    b.close()
    assert all(buf.closed for buf in buffers)
    assert _open_fds() == before
    b.close()  # idempotent
    assert _open_fds() == before


def test_dropped_backend_releases_everything(tmp_path: Path) -> None:
    before = _open_fds()
    b = direct_backend(tmp_path, 1 * MiB)
    b.write(1, [b"left open"])
    buffers, directory = b._pool.buffers, b.directory
    assert buffers
    del b
    gc.collect()
    assert all(buf.closed for buf in buffers)
    assert _open_fds() == before
    assert not directory.exists()


def test_direct_backend_does_all_its_io_with_o_direct(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwritev, real_preadv = os.pwritev, os.preadv
    flags: list[tuple[str, bool]] = []

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        flags.append(("w", bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real_pwritev(fd, buffers, offset)

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        flags.append(("r", bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    data = random.Random(4).randbytes(3 * ALIGN + 1)
    backend.write(1, [data[:7], data[7:]])
    assert read(backend, 1, [len(data)]) == data
    assert {kind for kind, _ in flags} == {"w", "r"}
    assert {direct for _, direct in flags} == {backend.direct}


def test_direct_read_that_stops_inside_a_block_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where the file ends inside a block, O_DIRECT returns the part block; a
    # filesystem may then refuse the next, unaligned read (EINVAL) instead of
    # returning 0, and that must still read as a truncated file.
    b = direct_backend(tmp_path, 1 * MiB)
    b.write(1, [bytes(3 * ALIGN)])
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        if offset % ALIGN:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return min(real_preadv(fd, buffers, offset), 100)  # as if the file ended there

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(CorruptDataError) as info:
        read(b, 1, [3 * ALIGN])
    assert str(info.value) == (
        f"tierstore: entry 1 in the disk tier ({b.directory / 'entries.bin'}) ends early: "
        f"the file ends after 100 of its {3 * ALIGN} bytes at offset 0; "
        "the file was truncated outside tierstore"
    )
    b.close()
