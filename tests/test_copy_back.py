"""The manager's copy-back logic for CUDA host entries, driven on CPU.

Entries are marked as if they lived on a GPU and the pipeline's
transfers' ``device_copy`` is replaced by a clone, so the window, hit/miss and
demotion bookkeeping that the CUDA path shares runs here too. (Found by a
review of that path; the GPU tests cover the streams themselves.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore import TierConfig
from tierstore.store import TierManager
from tierstore.transfers import DeviceCopy

GPU = torch.device("cuda", 0)


@pytest.fixture
def copies() -> list[int]:
    return []


def _manager(copies: list[int], **config: object) -> TierManager:
    manager = TierManager(TierConfig(device_budget=0, **config))  # type: ignore[arg-type]

    def fake_copy(span: torch.Tensor, device: torch.device, after: object = None) -> DeviceCopy:
        copies.append(span.data_ptr())
        return DeviceCopy(span.clone(), None)

    manager._transfers.device_copy = fake_copy  # type: ignore[method-assign]
    # Placed as GPU entries are: CPU tensors would skip the host tier while
    # there is a disk tier (NOTE [ CPU tensors skip the host tier ]).
    manager._skips = lambda entry, tier: False  # type: ignore[method-assign]
    return manager


def _as_if_on_gpu(manager: TierManager) -> None:
    for entry in manager._entries.values():
        entry.device = GPU


@pytest.fixture
def closing() -> Iterator[list[TierManager]]:
    managers: list[TierManager] = []
    yield managers
    for m in managers:
        m.close()


def test_a_read_back_entry_in_the_plan_is_not_tested_for_truth(
    copies: list[int], closing: list[TierManager]
) -> None:
    # A window of one entry: after get(a) misses and get(b) hits, the top-up
    # reaches a, whose read-back tensor is alive (a 1024-element tensor's truth
    # value is an error).
    m = _manager(copies, host_budget="1MiB", disk_budget=0, prefetch_bytes=4096)
    closing.append(m)
    a, b = torch.randn(1024), torch.randn(1024)
    ha, hb = m.put(a), m.put(b)
    _as_if_on_gpu(m)
    out_a = m.get(ha)
    out_b = m.get(hb)
    assert torch.equal(out_a, a) and torch.equal(out_b, b)


def test_a_miss_does_not_copy_its_own_entry_twice(
    copies: list[int], closing: list[TierManager]
) -> None:
    m = _manager(copies, host_budget="1MiB", disk_budget=0, prefetch_bytes="1MiB")
    closing.append(m)
    handles = [m.put(torch.randn(1024)) for _ in range(3)]
    _as_if_on_gpu(m)
    m.get(handles[2])  # the first unpack of a backward: the newest, a miss
    assert len(copies) == len(set(copies)) == 3  # each entry copied once
    assert handles[2].key not in m._reads
    stats = m.stats()
    assert (stats.prefetch_misses, stats.prefetch_hits) == (1, 0)


def test_an_entry_prefetched_then_demoted_to_disk_reads_back(
    copies: list[int], closing: list[TierManager], tmp_path: Path
) -> None:
    # 1F1B-style: backward of one micro-batch has prefetched a host entry when
    # the forward of the next demotes it to disk.
    m = _manager(
        copies, host_budget=8192, disk_budget="1MiB", disk_path=tmp_path, prefetch_bytes="1MiB"
    )
    closing.append(m)
    a, b = torch.randn(1024), torch.randn(1024)
    ha, hb = m.put(a), m.put(b)
    _as_if_on_gpu(m)
    m.get(hb)
    assert isinstance(m._reads._window[ha.key][0], DeviceCopy)
    m.put(torch.randn(1024))  # makes room: a goes to disk
    m.flush()
    assert m._entries[ha.key].tier == "disk"
    assert ha.key not in m._reads
    assert torch.equal(m.get(ha), a)
