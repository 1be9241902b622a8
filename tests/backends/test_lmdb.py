"""The LMDB backend: round trips, budget and map limits, corrupt records, lifecycle."""

from __future__ import annotations

import array
import inspect
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest
from backend_helpers import FULL_HINT, KiB, MiB, churn, read, run_in_threads, split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore.backends.lmdb as lmdb_module
from tierstore.backends import Backend, LmdbBackend
from tierstore.errors import (
    ConfigError,
    CorruptDataError,
    StoreClosedError,
    TierFullError,
)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LmdbBackend]:
    b = LmdbBackend(tmp_path, 16 * MiB)
    yield b
    b.close()


def test_is_a_backend() -> None:
    assert issubclass(LmdbBackend, Backend)
    assert LmdbBackend.name == "lmdb"


def test_no_pickle() -> None:
    assert "pickle" not in inspect.getsource(lmdb_module)


def test_environment_settings(backend: LmdbBackend) -> None:
    env = backend._env
    assert backend.map_size == 2 * 16 * MiB + 1 * MiB == env.info()["map_size"]
    flags = env.flags()
    # No fsync (the data dies with the process); readahead on (records are
    # sequential runs of pages, see LmdbBackend._open_storage).
    assert (flags["sync"], flags["metasync"], flags["readahead"], flags["lock"]) == (
        False,
        False,
        True,
        True,
    )
    assert Path(env.path()) == backend.directory / "entries.lmdb"


def test_footprint_counts_overflow_pages(backend: LmdbBackend) -> None:
    page = backend._env.stat()["psize"]
    assert backend.footprint(0) == page  # a leaf-page value is charged one page
    assert backend.footprint(page - 16) == page
    assert backend.footprint(page - 15) == 2 * page
    assert backend.footprint(10 * page) == 11 * page


# -- round trips -----------------------------------------------------------------


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.binary(max_size=20_000),
    write_cuts=st.lists(st.integers(0, 20_000), max_size=6),
    read_cuts=st.lists(st.integers(0, 20_000), max_size=6),
)
def test_round_trip_any_chunking(
    backend: LmdbBackend, data: bytes, write_cuts: list[int], read_cuts: list[int]
) -> None:
    try:
        footprint = backend.write(1, split(data, write_cuts))
        assert footprint == backend.footprint(len(data)) == backend.used_bytes
        assert read(backend, 1, [len(c) for c in split(data, read_cuts)]) == data
    finally:
        backend.delete(1)
    assert (backend.used_bytes, len(backend)) == (0, 0)


def test_round_trip_of_typed_and_shaped_buffers(backend: LmdbBackend) -> None:
    floats = array.array("f", [1.5, -2.0, 3.25])
    grid = memoryview(bytearray(range(12))).cast("B", shape=[3, 4])
    backend.write(7, [b"head", memoryview(floats), grid, bytearray(b"!")])
    backend.write(8, [memoryview(floats)])  # a lone typed chunk is passed through
    head, out, rest = bytearray(4), array.array("f", [0.0] * 3), bytearray(13)
    backend.read_into(7, [memoryview(head), memoryview(out), memoryview(rest)])
    assert (bytes(head), out, bytes(rest)) == (b"head", floats, bytes(range(12)) + b"!")
    again = array.array("f", [0.0] * 3)
    backend.read_into(8, [memoryview(again)])
    assert again == floats


def test_zero_length_records(backend: LmdbBackend) -> None:
    page = backend._env.stat()["psize"]
    assert backend.write(1, []) == page
    assert backend.write(2, [b"", b""]) == page
    assert len(backend) == 2
    backend.read_into(1, [])
    backend.read_into(2, [memoryview(bytearray())])
    backend.delete(1)
    backend.delete(2)
    assert (len(backend), backend.used_bytes) == (0, 0)


def test_many_records_in_any_order(backend: LmdbBackend) -> None:
    rng = random.Random(0)
    records = {k: rng.randbytes(rng.choice([0, 1, 2000, 4080, 4081, 20_000])) for k in range(300)}
    for k, data in records.items():
        backend.write(k, [data])
    assert len(backend) == 300
    assert backend.used_bytes == sum(backend.footprint(len(d)) for d in records.values())
    # Big-endian keys: LMDB's byte order is the numeric order.
    with backend._env.begin() as txn:
        assert [int.from_bytes(k, "big") for k, _ in txn.cursor()] == sorted(records)
    keys = list(records)
    rng.shuffle(keys)
    for k in keys:
        assert read(backend, k, [len(records[k])]) == records[k]
    for k in keys:
        backend.delete(k)
    assert (len(backend), backend.used_bytes) == (0, 0)


def test_concurrent_writers_and_readers(backend: LmdbBackend) -> None:
    assert run_in_threads(lambda tid: churn(backend, tid, 20_000)) == []
    assert (len(backend), backend.used_bytes) == (0, 0)


def test_bad_keys(backend: LmdbBackend) -> None:
    backend.write(1, [b"first"])
    with pytest.raises(ValueError, match=re.escape("tierstore: key 1 is already stored")):
        backend.write(1, [b"second"])
    assert read(backend, 1, [5]) == b"first"
    with pytest.raises(ValueError) as info:
        backend.write(-1, [b"x"])
    assert str(info.value) == (
        "tierstore: key -1 is not an integer in [0, 2**64) and cannot be stored"
    )
    with pytest.raises(KeyError):
        backend.read_into(2, [])
    with pytest.raises(KeyError):
        backend.delete(2)
    assert len(backend) == 1


# -- budget and map limits -----------------------------------------------------------


def test_budget_is_enforced_with_an_exact_message(tmp_path: Path) -> None:
    b = LmdbBackend(tmp_path, 64 * KiB)
    for k in range(16):
        b.write(k, [bytes([k])])
    with pytest.raises(TierFullError) as info:
        b.write(99, [b"x"])
    assert str(info.value) == (
        "tierstore: disk tier is full: 64.0 KiB in use of disk_budget=64.0 KiB; "
        "a record of 4.0 KiB does not fit (0 B free)" + FULL_HINT
    )
    with pytest.raises(TierFullError) as info:
        b.write(100, [bytes(1 * MiB)])
    assert "a record of 1.0 MiB does not fit (0 B free)" in str(info.value)
    assert (len(b), b.used_bytes) == (16, 64 * KiB)
    b.delete(3)
    b.write(99, [b"fits"])
    assert read(b, 99, [4]) == b"fits"
    b.close()


def test_churning_a_record_as_large_as_the_budget(tmp_path: Path) -> None:
    # LMDB reuses freed pages two write transactions late; the backend ages
    # them instead of failing (NOTE [ LMDB map size ]).
    b = LmdbBackend(tmp_path, 4 * MiB)
    record = bytes(4 * MiB - 16)
    assert b.footprint(len(record)) == 4 * MiB
    for k in range(10):
        b.write(k, [record])
        b.delete(k)
    assert b._env.info()["last_pgno"] * 4096 <= b.map_size
    b.close()


def test_map_full_message_and_recovery(tmp_path: Path) -> None:
    b = LmdbBackend(tmp_path, 1 * MiB)
    b.write(1, [bytes(100_000)])
    # Shrink the map to what is in use plus a few pages: the map fills up
    # long before the budget does.
    env = b._env
    env.set_mapsize((env.info()["last_pgno"] + 1 + 16) * env.stat()["psize"])
    map_size = env.info()["map_size"]
    with pytest.raises(TierFullError) as info:
        b.write(2, [bytes(100_000)])
    assert str(info.value) == (
        f"tierstore: LMDB map is full (map_size={map_size / KiB:.1f} KiB) "
        "writing a record of 97.7 KiB" + FULL_HINT
    )
    assert isinstance(info.value.__cause__, lmdb.MapFullError)
    # Nothing is left for key 2; the backend goes on working.
    assert (len(b), b.used_bytes) == (1, b.footprint(100_000))
    with pytest.raises(KeyError):
        b.read_into(2, [])
    b.write(3, [b"small" * 100])
    assert read(b, 3, [500]) == b"small" * 100
    b.delete(1)
    b.write(2, [bytes(100_000)])
    assert read(b, 2, [100_000]) == bytes(100_000)
    b.close()


def test_negative_budget(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        LmdbBackend(tmp_path, -1)
    assert str(info.value) == (
        "tierstore: disk_budget=-1 is negative; "
        "set disk_budget (TIERSTORE_DISK_BUDGET) to a size such as '64GiB'"
    )
    assert os.listdir(tmp_path) == []


# -- corrupt records -----------------------------------------------------------------


def test_length_mismatch_is_corrupt(backend: LmdbBackend) -> None:
    backend.write(5, [b"eighteen bytes!!!!"])
    for sizes in ([17], [10, 10], []):
        with pytest.raises(CorruptDataError) as info:
            read(backend, 5, sizes)
        assert str(info.value) == (
            f"tierstore: entry 5 in the disk tier ({backend.directory / 'entries.lmdb'}) "
            f"holds 18 bytes, not the {sum(sizes)} bytes asked for"
        )
    assert read(backend, 5, [18]) == b"eighteen bytes!!!!"


def test_record_lost_by_lmdb_is_corrupt(backend: LmdbBackend) -> None:
    backend.write(5, [b"gone"])
    with backend._env.begin(write=True) as txn:
        txn.delete((5).to_bytes(8, "big"))
    with pytest.raises(CorruptDataError) as info:
        read(backend, 5, [4])
    assert str(info.value) == (
        f"tierstore: entry 5 is missing from the disk tier ({backend.directory / 'entries.lmdb'})"
    )


# -- lifecycle -----------------------------------------------------------------------


def test_closed_backend_refuses_every_call(tmp_path: Path) -> None:
    b = LmdbBackend(tmp_path, 1 * MiB)
    b.write(1, [b"x"])
    directory = b.directory
    b.close()
    assert not directory.exists()
    assert os.listdir(tmp_path) == []
    message = f"tierstore: the lmdb backend at {directory} is closed"
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


def test_trim_hands_back_the_join_buffer_between_writes(backend: LmdbBackend) -> None:
    # NOTE [ Idle I/O buffers ] in _aligned.py: the buffer a record of several
    # chunks is joined in keeps no pages between steps; the next write refills it.
    assert backend.trim() == 0  # nothing joined yet
    data = os.urandom(3 * 4096 + 100)
    backend.write(1, split(data, [4096, 8192]))
    assert backend.trim() == 4 * 4096  # the record, to whole pages
    assert backend.trim() == 0
    backend.write(2, split(data, [100]))
    assert read(backend, 1, [len(data)]) == data
    assert read(backend, 2, [len(data)]) == data
    backend.close()
    assert backend.trim() == 0
