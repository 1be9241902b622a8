"""Security of what rests on disk (issue 6, item 8).

* Nothing tierstore reads back is ever unpickled: no module imports an
  unpickler (the static half), and a record replaced by a pickle that would
  run code when unpickled comes back as an error, the code never run.
* The spill directory is 0700 and its files 0600, whatever the umask.
* A corrupt record cannot make the store allocate more than the record it
  wrote: what a read allocates is sized from the store's own record of the
  write (``pipeline.Record``), never from bytes read from disk.

Planted symlinks and untrusted ``disk_path`` directories are tested with the
spill directory, in ``tests/backends/test_spill.py``.
"""

from __future__ import annotations

import ast
import contextlib
import os
import pickle
import stat
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore.backends.base import Backend

ROOT = Path(__file__).resolve().parent.parent
UNPICKLERS = {"pickle", "cPickle", "dill", "marshal", "shelve", "_pickle", "cloudpickle"}


def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            out.append((ast.unparse(node.func), node))
    return out


def test_no_module_unpickles() -> None:
    files = [*ROOT.joinpath("tierstore").rglob("*.py"), *ROOT.joinpath("backends").rglob("*.py")]
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & UNPICKLERS, f"{path.relative_to(ROOT)} imports {names}"
        for name, call in _calls(tree):
            if name != "torch.load":
                continue
            # Only the benchmark's disk-naive baseline loads with torch.load, and
            # only with weights_only=True (no arbitrary objects).
            assert path.relative_to(ROOT).parts[:2] == ("tierstore", "bench"), path
            flags = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert flags.get("weights_only") == "True", f"{path}: {ast.unparse(call)}"


# -- the dynamic half: a crafted record --------------------------------------------

BACKENDS = ["file", "lmdb"]


class _RunsCode:
    """Unpickling this makes the directory ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_RunsCode(marker), protocol=pickle.HIGHEST_PROTOCOL)


def test_the_crafted_pickle_runs_code_when_unpickled(tmp_path: Path) -> None:
    # The payload below is live: unpickling it really runs os.mkdir.
    marker = tmp_path / "unpickled"
    data = _evil_pickle(marker) + b"\0" * 100  # unpickling ignores what follows STOP
    pickle.loads(data)  # the point of this test: the payload is live
    assert marker.is_dir()


def _store(tmp_path: Path, backend: str) -> tierstore.TierStore:
    return tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="4MiB",
            disk_path=tmp_path / "spill",
            disk_backend=backend,
            min_offload_bytes=0,
        )
    )


def _one_record_on_disk(
    store: tierstore.TierStore,
) -> tuple[torch.Tensor, torch.Tensor, Backend[Any], int]:
    """A leaf ``x`` and ``y = x.exp()``, whose saved result is the one record on disk."""
    x = torch.randn(4096, requires_grad=True)
    with store.offload():
        y = x.exp()
    store.flush()
    backend = store._manager._pipeline.backend_if_open
    assert backend is not None
    (key,) = backend._records
    return x, y, backend, key


def _record_bytes(backend: Backend[Any], key: int) -> bytes:
    place, length, _ = backend._records[key]
    if backend.name == "file":
        fd = os.open(backend.path, os.O_RDONLY)
        try:
            return os.pread(fd, length, place)
        finally:
            os.close(fd)
    with backend._env.begin() as txn:  # type: ignore[attr-defined]
        return bytes(txn.get(place))


def _overwrite(backend: Backend[Any], key: int, data: bytes) -> None:
    """Replace the record's bytes, where the backend keeps them, behind the store's back."""
    place, length, _ = backend._records[key]
    if backend.name == "file":
        assert len(data) <= length  # never into a neighbour's extent
        fd = os.open(backend.path, os.O_WRONLY)
        try:
            assert os.pwrite(fd, data, place) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        with backend._env.begin(write=True) as txn:  # type: ignore[attr-defined]
            assert txn.put(place, data)  # overwrites


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pickle_in_place_of_a_record_is_never_unpickled(tmp_path: Path, backend: str) -> None:
    marker = tmp_path / "unpickled"
    with contextlib.closing(_store(tmp_path, backend)) as store:
        _, y, disk, key = _one_record_on_disk(store)
        length = disk._records[key][1]
        _overwrite(disk, key, _evil_pickle(marker).ljust(length, b"\0"))
        assert _record_bytes(disk, key).startswith(_evil_pickle(marker))
        with pytest.raises(tierstore.CorruptDataError):
            y.sum().backward()
    assert not marker.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pickle_in_place_of_a_payload_is_never_unpickled(tmp_path: Path, backend: str) -> None:
    # The header is left as written, so only the payload's checksum can tell.
    marker = tmp_path / "unpickled"
    with contextlib.closing(_store(tmp_path, backend)) as store:
        _, y, disk, key = _one_record_on_disk(store)
        record = _record_bytes(disk, key)
        (n,) = struct.unpack("<Q", record[:8])
        header = record[: 8 + n]
        _overwrite(disk, key, header + _evil_pickle(marker).ljust(len(record) - len(header), b"\0"))
        with pytest.raises(tierstore.CorruptDataError):
            y.sum().backward()
    assert not marker.exists()


# -- allocations are sized by the store, never by the disk ---------------------------


@contextlib.contextmanager
def _allocations() -> Iterator[dict[str, int]]:
    """The largest ``torch.empty`` and the peak of Python allocations inside the block."""
    seen = {"torch.empty": 0, "python peak": 0}
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        seen["torch.empty"] = max(seen["torch.empty"], out.nbytes)
        return out

    tracemalloc.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "empty", empty)
            yield seen
        seen["python peak"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_header_claiming_a_huge_record_allocates_nothing_more(
    tmp_path: Path, backend: str
) -> None:
    huge = str(1 << 60).encode()
    with contextlib.closing(_store(tmp_path, backend)) as store:
        _, y, disk, key = _one_record_on_disk(store)
        record = _record_bytes(disk, key)
        # Every length in the header says 2**60: the JSON length, numel and offsets.
        (n,) = struct.unpack("<Q", record[:8])
        body = record[8 : 8 + n]
        for field in (b'"numel":"4096"', b'"shape":[4096]', b'"data_offsets":[0,16384]'):
            assert body.count(field) == 1, (field, body)
            body = body.replace(field, field.replace(b"16384", b"4096").replace(b"4096", huge))
        forged = struct.pack("<Q", 1 << 60) + body
        _overwrite(disk, key, forged + record[len(forged) :])  # the record's length, kept
        with _allocations() as seen, pytest.raises(tierstore.CorruptDataError):
            y.sum().backward()
    # The payload buffer of the record as written (4096 float32), nothing larger.
    assert seen["torch.empty"] <= 4096 * 4
    assert seen["python peak"] < 1 << 20


def test_an_oversized_lmdb_value_is_refused_before_it_is_copied(tmp_path: Path) -> None:
    with contextlib.closing(_store(tmp_path, "lmdb")) as store:
        _, y, disk, key = _one_record_on_disk(store)
        length = disk._records[key][1]
        _overwrite(disk, key, _record_bytes(disk, key) * 100)
        with _allocations() as seen, pytest.raises(tierstore.CorruptDataError) as info:
            y.sum().backward()
    assert str(info.value) == (
        f"tierstore: entry {key} in the disk tier ({disk.path}) holds {100 * length} bytes, "
        f"not the {length} bytes asked for"
    )
    # Read in place from LMDB's map: no copy of the 100x value, on either side.
    assert seen["torch.empty"] <= 4096 * 4
    assert seen["python peak"] < 50 * length


# -- permissions, through the store ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_spill_directory_0700_and_files_0600_whatever_the_umask(
    tmp_path: Path, backend: str
) -> None:
    old = os.umask(0)
    try:
        store = _store(tmp_path, backend)
        _, y, disk, _ = _one_record_on_disk(store)
        root = tmp_path / "spill"  # made by the store: it did not exist
        modes = {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}
        name = disk.directory.name
        assert stat.S_IMODE(root.lstat().st_mode) == 0o700
        assert (
            modes
            == {
                # entries.bin has no name once open (NOTE [ File backend unlinked ]).
                "file": {name: 0o700, f"{name}/.lock": 0o600},
                "lmdb": {
                    name: 0o700,
                    f"{name}/.lock": 0o600,
                    f"{name}/entries.lmdb": 0o700,
                    f"{name}/entries.lmdb/data.mdb": 0o600,
                    f"{name}/entries.lmdb/lock.mdb": 0o600,
                },
            }[backend]
        )
        if backend == "file":  # reached through its descriptor, it is 0600 all the same
            data = os.stat(disk.path)
            assert (stat.S_IMODE(data.st_mode), data.st_nlink) == (0o600, 0)
        y.sum().backward()
        store.close()
    finally:
        os.umask(old)
    # The store made disk_path, so it goes with the store, empty (NOTE [ Spill
    # directory lifecycle ]).
    assert os.listdir(tmp_path) == []
