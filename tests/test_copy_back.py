"""The manager's copy-back logic for CUDA host entries, driven on CPU.

Entries are marked as if they lived on a GPU and the pipeline's
transfers' ``device_copy`` is replaced by a clone, so the window, hit/miss and
demotion bookkeeping that the CUDA path shares runs here too. (Found by a
review of that path; the GPU tests cover the streams themselves.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore import TierConfig
from tierstore.planning.runner import PlanRunner
from tierstore.tiers import readahead
from tierstore.tiers.manager import TierManager
from tierstore.tiers.transfers import DeviceCopy, HostCopy, Transfers

GPU = torch.device("cuda", 0)


class _Event:
    """A CUDA event as the transfers see it: done when the test says so, or once waited on."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


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
    manager._placing._skips = lambda entry, tier: False  # type: ignore[method-assign]
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


def test_without_a_budget_a_save_past_the_bound_waits_for_the_oldest_copy(
    copies: list[int], closing: list[TierManager]
) -> None:
    # NOTE [ Copies in flight ]: every eligible save leaves the device.
    m = _manager(copies, host_budget="1MiB", disk_budget=0, write_queue_bytes=8192)
    closing.append(m)
    events: list[_Event] = []

    def fake_host_copy(span: torch.Tensor) -> HostCopy:
        events.append(_Event())
        return HostCopy(span.clone(), events[-1], None)  # type: ignore[arg-type]

    m._transfers.host_copy = fake_host_copy  # type: ignore[method-assign]
    saved = [torch.randn(1024) for _ in range(5)]  # 4 KiB each
    handles = [m.put(t) for t in saved]
    # The fourth and fifth found 12 KiB under way, past 8 KiB: each waited
    # for the oldest copy, in order.
    assert [e.waited for e in events] == [True, True, False, False, False]
    tiers = m.stats().tiers
    assert (tiers["device"].entries, tiers["host"].entries, tiers["device"].peak_bytes) == (0, 5, 0)
    for handle, t in zip(handles, saved, strict=True):
        assert torch.equal(m.get(handle), t)


class _SlowEvent(_Event):
    """A copy that takes 10 ms to wait for."""

    def synchronize(self) -> None:
        time.sleep(0.01)
        super().synchronize()


def _budget_manager(
    copies: list[int], events: list[_Event], event: type[_Event] = _Event
) -> TierManager:
    """A manager under activation_budget whose D2H copies end when the test says so."""
    m = _manager(
        copies,
        host_budget="1MiB",
        disk_budget=0,
        write_queue_bytes=8192,
        activation_budget="1MiB",
    )
    m.follow(PlanRunner(m.config, **m.measures()))  # as TierStore wires them

    def fake_host_copy(span: torch.Tensor) -> HostCopy:
        events.append(event())
        return HostCopy(span.clone(), events[-1], None)  # type: ignore[arg-type]

    m._transfers.host_copy = fake_host_copy  # type: ignore[method-assign]
    return m


def test_in_a_planned_step_forward_never_waits_on_a_copy_in_flight(
    copies: list[int], closing: list[TierManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ Copies in flight ]: D2H copies whose events have not completed.
    events: list[_Event] = []
    m = _budget_manager(copies, events)
    closing.append(m)
    assert m.limits is not None
    # A step on its plan, whose window is the store's own limit.
    monkeypatch.setattr(type(m.limits), "planned", property(lambda self: True))
    monkeypatch.setattr(m.limits, "in_flight_bytes", lambda adding=0, held=0: None)
    monkeypatch.setattr(m.limits, "budget_bytes_now", lambda: 1 << 20)
    saved = [torch.randn(1024) for _ in range(4)]  # 4 KiB each
    handles = [m.put(t, tier="host") for t in saved]  # as the plan's offloads are put
    # 12 KiB under way, over write_queue_bytes: the fourth save stays on the device.
    assert not any(event.waited for event in events)
    tiers = m.stats().tiers
    assert (tiers["device"].entries, tiers["device"].bytes, tiers["host"].entries) == (1, 4096, 3)
    assert m._entries[handles[3].key].tier == "device"
    for handle, t in zip(handles, saved, strict=True):
        assert torch.equal(m.get(handle), t)


def test_the_safe_placement_waits_for_the_oldest_copy_past_the_bound(
    copies: list[int], closing: list[TierManager]
) -> None:
    # NOTE [ Copies in flight ]: a step that follows no plan (here the
    # store's first) offloads everything; staying on the device past the
    # bound would take the device tier past the budget.
    events: list[_Event] = []
    m = _budget_manager(copies, events, _SlowEvent)
    closing.append(m)
    assert m.limits is not None and not m.limits.planned
    # A budget whose device share (half of it) holds no save: all of them leave.
    m.limits.budget = 4096  # type: ignore[attr-defined]
    saved = [torch.randn(1024) for _ in range(5)]  # 4 KiB each
    handles = [m.put(t) for t in saved]
    assert [e.waited for e in events] == [True, True, False, False, False]
    stats = m.stats()
    tiers = stats.tiers
    assert (tiers["device"].entries, tiers["host"].entries, tiers["device"].peak_bytes) == (0, 5, 0)
    assert stats.pack_wait_s >= 0.02  # both waits, counted as forward's
    for handle, t in zip(handles, saved, strict=True):
        assert torch.equal(m.get(handle), t)


def test_a_copy_back_still_under_way_is_a_stall_not_a_hit(
    copies: list[int], closing: list[TierManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ Hits ]: the CUDA path judged by its copies' events, as the disk
    # path is by its reads' futures.
    # A window of two entries: the third copy goes out after the first unpack
    # (copies that left as backward began never grow it).
    monkeypatch.setattr(readahead, "_START_BYTES", 8192)
    monkeypatch.setattr(readahead, "_MIN_BYTES", 4096)
    m = _manager(copies, host_budget="1MiB", disk_budget=0, prefetch_bytes="64KiB")
    closing.append(m)
    events: list[_Event] = []

    def fake_copy(span: torch.Tensor, device: torch.device, after: object = None) -> DeviceCopy:
        events.append(_Event())
        return DeviceCopy(span.clone(), events[-1])  # type: ignore[arg-type]

    m._transfers.device_copy = fake_copy  # type: ignore[method-assign]
    monkeypatch.setattr(Transfers, "consume", staticmethod(lambda copy: copy.tensor))
    saved = [torch.randn(1024) for _ in range(3)]
    handles = [m.put(t) for t in saved]
    _as_if_on_gpu(m)
    start = m.stats().prefetch_window_bytes
    assert torch.equal(m.get(handles[2]), saved[2])  # the first unpack: copied on demand
    assert len(events) == 2  # its own copy, then the next one, ahead
    events[1].done = True
    assert torch.equal(m.get(handles[1]), saved[1])  # landed: a hit
    assert torch.equal(m.get(handles[0]), saved[0])  # still under way: a stall
    stats = m.stats()
    assert (stats.prefetch_hits, stats.prefetch_misses, stats.prefetch_stalls) == (1, 2, 1)
    assert stats.prefetch_window_bytes == 2 * start
