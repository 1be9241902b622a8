"""Out of the box (issue 12): a spill file grown on demand, a warning for a disk tier in
memory, and CPU tensors that go to disk, not to a host "copy" in the same RAM."""

from __future__ import annotations

import errno
import gc
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import tierstore
from tierstore.backends import file as file_backend
from tierstore.backends._spill import memory_filesystem
from tierstore.backends.file import ALIGN, FileBackend

MiB = 1 << 20
GiB = 1 << 30

IN_MEMORY = "a filesystem in memory"


def _data_file(store: tierstore.TierStore) -> Path:
    """The spill file, through its descriptor: it has no name once open.

    NOTE [ File backend unlinked ] in backends/file.py.
    """
    assert store.disk_directory is not None
    assert os.listdir(store.disk_directory) == [".lock"]
    return _backend(store).path


def _backend(store: tierstore.TierStore) -> FileBackend:
    backend = store._manager._pipeline.backend_if_open
    assert isinstance(backend, FileBackend)
    return backend


def _saved(store: tierstore.TierStore, mib: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf and ``leaf.exp()``, whose ``mib`` MiB output autograd saves in ``store``."""
    x = torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(seed))
    x.requires_grad_()
    with store.offload():
        y = x.exp()
    return x, y


def _check_exp_grad(x: torch.Tensor, y: torch.Tensor) -> None:
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.func.grad(lambda t: t.exp().sum())(x.detach()))


# -- the spill file grows on demand --------------------------------------------------------


def test_a_small_spill_does_not_claim_the_default_budget(spill_root: Path) -> None:
    # The defaults but the place: disk_budget is 32 GiB. The file is one
    # growth step, not the budget (it used to be preallocated to all of it).
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root))
    assert store.config.disk_budget == 32 * GiB
    x, y = _saved(store, 9, seed=0)
    store.flush()
    st = _data_file(store).stat()
    assert st.st_size == file_backend._MIN_GROWTH == 16 * MiB
    assert st.st_blocks * 512 <= 16 * MiB  # reserved: one step, not the budget
    assert store.stats().tiers["disk"].bytes == _backend(store).used_bytes >= 9 * MiB
    _check_exp_grad(x, y)
    store.close()
    assert os.listdir(spill_root) == []


def test_the_spill_file_grows_in_steps_and_never_past_the_budget(spill_root: Path) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, disk_budget="100MiB", write_queue_bytes=0)
    )
    backend_sizes: list[int] = []
    kept = []
    for i in range(10):  # 9 MiB (and a header page) each: 90 MiB and more in all
        kept.append(_saved(store, 9, seed=i))
        store.flush()
        size = _data_file(store).stat().st_size
        assert size == _backend(store).file_bytes
        backend_sizes.append(size)
        disk = store.stats().tiers["disk"]
        # stats() counts the records' footprints, which the file covers.
        assert disk.bytes == _backend(store).used_bytes <= size <= 100 * MiB
        assert disk.entries == i + 1
    # 16 MiB, then the file's own size again each time, capped by the budget.
    assert sorted(set(backend_sizes)) == [16 * MiB, 32 * MiB, 64 * MiB, 100 * MiB]
    assert backend_sizes == sorted(backend_sizes)
    for x, y in reversed(kept):
        _check_exp_grad(x, y)
    assert store.stats().tiers["disk"].bytes == 0
    assert _data_file(store).stat().st_size == 100 * MiB  # kept for the next step
    kept.append(_saved(store, 9, seed=99))  # reused, not grown
    store.flush()
    assert _data_file(store).stat().st_size == 100 * MiB
    _check_exp_grad(*kept[-1])
    store.close()


# -- a growth the disk cannot hold ----------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8)
    )


BATCH = torch.randn(1024, 512, generator=torch.Generator().manual_seed(1))  # 2 MiB


def _grads(store: tierstore.TierStore | None) -> list[torch.Tensor]:
    model = _model()
    if store is None:
        loss = model(BATCH).square().sum()
    else:
        with store.offload():
            loss = model(BATCH).square().sum()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _assert_eager(grads: list[torch.Tensor]) -> None:
    for got, want in zip(grads, _grads(None), strict=True):
        assert torch.equal(got, want)


def _free_space(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """The filesystem says it has ``nbytes`` free (a full disk cannot be made here)."""
    real = os.fstatvfs

    def fstatvfs(fd: int) -> Any:
        st = real(fd)
        return SimpleNamespace(f_bavail=nbytes // st.f_frsize, f_frsize=st.f_frsize)

    monkeypatch.setattr(os, "fstatvfs", fstatvfs)


def _growth_message(root: Path, end: str, free: str) -> str:
    return (
        f"cannot grow the disk tier's file from 0 B to {end} in {root} "
        f"(disk_budget=32.0 GiB): only {free} free there; set disk_path (TIERSTORE_DISK_PATH) "
        "to a disk with more room, or lower disk_budget (TIERSTORE_DISK_BUDGET) to what this "
        "one holds"
    )


def test_a_growth_the_disk_cannot_hold_loses_nothing(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1 MiB free, every record 2 MiB: each write fails at its growth, and its
    # entry stays in host memory (NOTE [ Failed writes ]).
    _free_space(monkeypatch, MiB)
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _grads(store)
        store.flush()
    _assert_eager(grads)
    messages = [str(w.message) for w in caught if w.category is tierstore.TierstoreWarning]
    assert len(messages) == 1, messages  # once, however many growths failed
    assert messages[0].startswith(
        "tierstore: a write to the disk tier failed ("
        + _growth_message(spill_root, "2.0 MiB", "1.0 MiB")
        + "); the saved tensor of 2.0 MiB stays in host memory"
    ), messages[0]
    stats = store.stats()
    assert stats.failed_writes >= 4
    assert stats.tiers["host"].peak_bytes > 0  # where they waited for backward
    assert stats.tiers["disk"].bytes == stats.tiers["disk"].bytes_written == 0
    assert (_backend(store).file_bytes, _data_file(store).stat().st_size) == (0, 0)
    store.close()
    assert os.listdir(spill_root) == []


def test_a_nearly_full_disk_takes_what_fits_and_the_rest_waits_in_memory(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 5 MiB free: not a 16 MiB step, but two records of 2 MiB (and a header
    # page) fit, each growing the file to its own end; the rest fail.
    free = 5 * MiB
    real = os.fstatvfs

    def fstatvfs(fd: int) -> Any:
        st = real(fd)
        left = free - os.fstat(fd).st_size
        return SimpleNamespace(f_bavail=left // st.f_frsize, f_frsize=st.f_frsize)

    monkeypatch.setattr(os, "fstatvfs", fstatvfs)
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root, write_queue_bytes=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = _grads(store)
    _assert_eager(grads)
    messages = [str(w.message) for w in caught if w.category is tierstore.TierstoreWarning]
    assert len(messages) == 1 and "only 1016.0 KiB free there" in messages[0], messages
    stats = store.stats()
    assert stats.tiers["disk"].bytes_written == 2 * (2 * MiB + ALIGN)
    assert stats.tiers["host"].peak_bytes > 0
    assert stats.failed_writes >= 1
    assert _backend(store).file_bytes == 2 * (2 * MiB + ALIGN) <= free
    store.close()


def test_a_growth_with_no_host_room_raises_and_keeps_the_tensors(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No host memory allowed for failed writes: the failure is raised at the
    # next call (NOTE [ Failed writes ]), with the TierFullError as its cause.
    _free_space(monkeypatch, 0)
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, host_budget=0, write_queue_bytes=0)
    )
    model = _model()
    with pytest.raises(tierstore.TierstoreError) as info, store.offload():
        model(BATCH).square().sum()
    assert "a background write to the disk tier failed" in str(info.value)
    cause = info.value.__cause__
    assert isinstance(cause, tierstore.TierFullError)
    assert str(cause) == "tierstore: " + _growth_message(spill_root, "2.0 MiB", "0 B")
    # The failed forward's graph lives on in the traceback; another of its
    # writes may fail after the first was raised, and would be raised at the
    # next call while the graph holds its entry (NOTE [ Failed writes ]).
    # Dropped, as a training loop drops a failed step, its entries are released
    # and such a failure is only counted.
    del info, cause
    gc.collect()
    monkeypatch.undo()  # room again: the store is still usable
    _assert_eager(_grads(store))
    store.close()
    assert os.listdir(spill_root) == []


# -- a disk tier in memory -------------------------------------------------------------------


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A directory on /dev/shm, which is tmpfs on Linux."""
    if memory_filesystem("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    root = Path("/dev/shm") / f"tierstore-test-{uuid.uuid4().hex}"
    root.mkdir(mode=0o700)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _memory_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if w.category is tierstore.TierstoreWarning and IN_MEMORY in str(w.message)
    ]


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_a_disk_path_in_memory_warns_once_per_store(shm_root: Path, backend: str) -> None:
    config = tierstore.TierConfig(disk_path=shm_root, disk_backend=backend, disk_budget="1GiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count them all: Python's registry would hide repeats
        with tierstore.TierStore(config) as store:
            for _ in range(3):
                _assert_eager(_grads(store))
        assert _memory_warnings(caught) == [
            f"tierstore: disk_path='{shm_root}' is on tmpfs, a filesystem in memory: the disk "
            "tier there takes RAM for every byte it holds and frees none; set disk_path "
            "(TIERSTORE_DISK_PATH) to a directory on a local disk"
        ]
        with tierstore.TierStore(config) as other:  # another store: its own warning
            _grads(other)
        assert len(_memory_warnings(caught)) == 2
    assert os.listdir(shm_root) == []


def test_a_symlink_to_memory_names_both_paths(shm_root: Path, tmp_path: Path) -> None:
    link = tmp_path / "scratch"
    link.symlink_to(shm_root)
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=link))
    with pytest.warns(tierstore.TierstoreWarning) as caught:
        _grads(store)
    (message,) = _memory_warnings(list(caught))
    assert message.startswith(f"tierstore: disk_path='{link}' (-> '{shm_root}') is on tmpfs, ")
    store.close()


def test_as_an_error_the_warning_leaves_nothing_behind(shm_root: Path) -> None:
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=shm_root))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tierstore.TierstoreWarning)  # python -W error
        with pytest.raises(tierstore.TierstoreWarning, match=re.escape(IN_MEMORY)):
            _grads(store)
    assert os.listdir(shm_root) == []
    store.close()


def test_a_disk_path_on_a_disk_does_not_warn(spill_root: Path) -> None:
    if memory_filesystem(spill_root) is not None:
        pytest.skip(f"the test's temporary directory is on {memory_filesystem(spill_root)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root)) as store:
            _grads(store)
    assert _memory_warnings(caught) == []


def test_memory_filesystem_names_tmpfs_and_nothing_else(tmp_path: Path) -> None:
    assert memory_filesystem("/proc") is None
    assert memory_filesystem(tmp_path / "missing") is None  # statfs fails: nothing said
    if Path("/dev/shm").is_dir():
        assert memory_filesystem("/dev/shm") in ("tmpfs", None)


# -- CPU tensors go to disk, not to the host tier -----------------------------------------------


def test_offload_with_no_settings_puts_cpu_tensors_on_disk() -> None:
    # conftest points the system temp dir, the default disk_path, at the test's own.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f".*{IN_MEMORY}", category=UserWarning)
        model = _model()
        with tierstore.offload() as store:
            loss = model(BATCH).square().sum()
        store.flush()
        during = store.stats()
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    _assert_eager(grads)
    after = store.stats()
    assert store.config.host_budget == 8 * GiB and store.config.device_budget == 0
    assert during.tiers["disk"].entries >= 4 and during.tiers["disk"].bytes > 8 * MiB
    assert after.tiers["disk"].peak_bytes > 0 and after.tiers["disk"].bytes == 0
    assert after.tiers["host"].peak_bytes == 0 and after.tiers["host"].bytes_written == 0
    # Nothing placed on the device (device_budget=0): its peak is the saves
    # under min_offload_bytes, kept in RAM, and not the parameters saved.
    assert after.tiers["device"].bytes_written == 0
    small = after.kept_bytes - after.parameter_bytes
    assert 0 < small < 5 * store.config.min_offload_bytes
    assert after.tiers["device"].peak_bytes == small


def test_an_explicit_host_budget_does_not_pull_cpu_tensors_into_ram(spill_root: Path) -> None:
    # NOTE [ CPU tensors skip the host tier ]: device_budget is the RAM knob.
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root, host_budget="1GiB"))
    _assert_eager(_grads(store))
    stats = store.stats()
    assert stats.tiers["host"].peak_bytes == 0 and stats.tiers["disk"].peak_bytes > 0
    store.close()


def test_device_budget_keeps_the_newest_cpu_tensors_in_ram(spill_root: Path) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(disk_path=spill_root, device_budget="4MiB", min_offload_bytes=0)
    )
    _assert_eager(_grads(store))
    stats = store.stats()
    assert 0 < stats.tiers["device"].peak_bytes <= 4 * MiB
    assert stats.tiers["disk"].peak_bytes > 0
    assert stats.tiers["host"].peak_bytes == 0
    store.close()


def test_without_a_disk_tier_cpu_tensors_use_the_host_tier() -> None:
    with tierstore.offload(device_budget=0, disk_budget=0) as store:
        loss = _model()(BATCH).square().sum()
    loss.backward()
    stats = store.stats()
    assert stats.tiers["host"].peak_bytes > 0
    assert stats.tiers["disk"].peak_bytes == 0 and store.disk_directory is None


@pytest.mark.requires_cuda
def test_accelerator_tensors_still_use_the_host_tier(spill_root: Path) -> None:
    store = tierstore.TierStore(tierstore.TierConfig(disk_path=spill_root))
    model = _model().cuda()
    with store.offload():
        loss = model(BATCH.cuda()).square().sum()
    loss.backward()
    torch.cuda.synchronize()
    stats = store.stats()
    assert stats.tiers["host"].peak_bytes > 0
    assert stats.tiers["disk"].peak_bytes == 0  # 8 GiB of host_budget: nothing demoted
    eager = _model().cuda()
    eager(BATCH.cuda()).square().sum().backward()
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)  # type: ignore[arg-type]
    store.close()


def test_fallocate_errors_other_than_a_full_disk_fail_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # EIO at a growth is a failing disk, not a full one: the write fails with
    # the store's usual message, and the next growth tries again.
    def eio(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    backend = FileBackend(tmp_path, 64 * MiB)
    with monkeypatch.context() as m:
        m.setattr(file_backend, "_fallocate", eio)
        with pytest.raises(tierstore.TierstoreError, match="Input/output error") as info:
            backend.write(1, [b"x"])
        assert not isinstance(info.value, tierstore.TierFullError)
    assert (len(backend), backend.file_bytes) == (0, 0)
    backend.write(1, [b"x"])
    assert backend.file_bytes == 16 * MiB
    backend.close()
