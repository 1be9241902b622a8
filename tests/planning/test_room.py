"""activation_budget="auto" (issue 53): the budget read off the memory each step, and followed.

The memory is a fake probe (tierstore.tiers.memory.MemoryProbe) whose
capacity a test sets between steps: the interface the runner reads a GPU
and a cgroup through. Every step's gradients are checked against eager
autograd, bitwise, on the same weights, tokens and dropout masks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore.models import GPT, GPTConfig
from tierstore.planning.room import ROOM_STEPS, Room
from tierstore.planning.runner import PlanRunner
from tierstore.tiers.memory import CudaMemory, MemoryReading

from ..conftest import remake_done

CONFIG = GPTConfig(vocab=64, d_model=64, heads=4, layers=3, seq=32, dropout=0.1)
GiB = 1 << 30
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


class FakeMemory:
    """A memory of ``capacity`` bytes, ``in_use`` of them in use, whatever the step does."""

    def __init__(self, capacity: int, in_use: int = 0) -> None:
        self.capacity = capacity
        self.in_use = in_use
        self.reads = 0
        self.closed = 0

    def read(self) -> MemoryReading:
        self.reads += 1
        return MemoryReading(self.capacity, self.in_use, "fake")

    def usage(self) -> int:
        return self.in_use

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def auto_store(spill_root: Path) -> Iterator[Any]:
    stores: list[tierstore.TierStore] = []

    def make(memory: FakeMemory, **settings: Any) -> tierstore.TierStore:
        config = tierstore.TierConfig(
            activation_budget="auto", disk_path=spill_root, min_offload_bytes=0, **settings
        )
        store = tierstore.TierStore(config)
        assert store._runner is not None and store._runner.room is not None
        store._runner.room.probe = memory
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _model(device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).to(device)


def _step(model: GPT, step: int, device: str) -> list[torch.Tensor]:
    torch.manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab, (4, CONFIG.seq), device=device)
    model.zero_grad(set_to_none=True)
    model.loss(tokens).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _eager(steps: int, device: str) -> list[list[torch.Tensor]]:
    model = _model(device)
    return [_step(model, step, device) for step in range(steps)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    assert all(torch.equal(g, h) for g, h in zip(a, b, strict=True))


def _saved_bytes(auto_store: Any, device: str) -> int:
    """What one step of the model saves, as a profile counts it."""
    store = auto_store(FakeMemory(64 * GiB))
    model = _model(device)
    for step in range(3):
        with store.offload():
            _step(model, step, device)
    plan = store.plan()
    assert plan is not None
    return plan.profile.saved_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_with_room_to_spare_moves_nothing_once_planned(auto_store: Any, device: str) -> None:
    memory = FakeMemory(8 * GiB, in_use=GiB)
    store = auto_store(memory)
    model = _model(device)
    eager = _eager(6, device)
    for step in range(6):
        with store.offload():
            _same(_step(model, step, device), eager[step])
            if step >= 2:  # the store's first step warms up, the second is profiled
                assert store._runner.planned
    plan = store.plan()
    assert plan is not None and plan.keeps_everything
    # 8 GiB - 1 GiB in use - the 10% margin, nothing measured beside the saves.
    assert plan.budget_bytes == 8 * GiB - GiB - int(0.1 * 8 * GiB)
    stats = store.stats()
    assert stats.tiers["disk"].bytes_written == 0
    assert stats.tiers["host"].bytes_written == 0
    assert memory.reads == 6  # once per step, at its start
    assert "this step's budget: auto 6.2 GiB = capacity 8.0 GiB (fake)" in str(plan)


@pytest.mark.parametrize("device", DEVICES)
def test_the_budget_follows_a_capacity_that_shrinks_between_steps(
    auto_store: Any, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved = _saved_bytes(auto_store, device)
    memory = FakeMemory(64 * GiB)
    store = auto_store(memory, memory_margin=0)
    runner = store._runner
    model = _model(device)
    eager = _eager(8, device)
    caplog.set_level(logging.INFO, logger="tierstore")
    for step in range(3):
        with store.offload():
            _same(_step(model, step, device), eager[step])
    kept_all = store.plan()
    assert kept_all is not None and kept_all.keeps_everything
    assert kept_all.budget_bytes == 64 * GiB
    memory.capacity = saved // 2  # another process takes the memory
    with store.offload():
        _same(_step(model, 3, device), eager[3])
        # At once: this step runs the safe placement within the new budget.
        assert runner.budget == saved // 2
        assert not runner.planned and runner._step is not None and runner._step.waiting
        assert runner.kept() == (0, 0)  # none of the plan's: the safe placement's
    remake_done(runner)
    for step in range(4, 8):
        with store.offload():
            _same(_step(model, step, device), eager[step])
            assert runner.planned
    plan = store.plan()
    assert plan is not None and plan is not kept_all
    assert plan.budget_bytes == saved // 2
    assert plan.predicted_peak_bytes <= saved // 2
    assert store.stats().tiers["disk"].bytes_written > 0
    assert "plan remade for activation_budget='auto' (" in caplog.text


class FakeCuda:
    """The figures ``torch.cuda`` reports, for CudaMemory: a device with no GPU behind it.

    ``free`` is the driver's free memory; the process holds ``reserved``
    (``allocated`` of it in use) and may use ``fraction`` of ``total``
    (``set_per_process_memory_fraction``).
    """

    def __init__(self, total: int, free: int, fraction: float = 1.0) -> None:
        self.total, self.free, self.fraction = total, free, fraction
        self.reserved = self.allocated = 0

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.free, self.total

    def memory_reserved(self, device: int) -> int:
        return self.reserved

    def memory_allocated(self, device: int) -> int:
        return self.allocated

    def get_per_process_memory_fraction(self, device: int) -> float:
        return self.fraction


def test_auto_on_cuda_follows_a_device_capacity_that_shrinks_between_steps(
    auto_store: Any,
) -> None:
    """The CUDA probe's figures, faked: the budget follows the driver's free memory, capped.

    The saves are CPU tensors (no GPU here); the room is read as a GPU's:
    free + reserved, within the process's fraction of the total, less what
    is allocated and the margin.
    """
    saved = _saved_bytes(auto_store, "cpu")
    cuda = FakeCuda(total=80 * GiB, free=60 * GiB, fraction=0.5)
    cuda.reserved, cuda.allocated = 2 * GiB, GiB
    store = auto_store(FakeMemory(0), memory_margin=0)
    runner = store._runner
    runner.room.probe = CudaMemory(0, runtime=cuda)
    model = _model("cpu")
    eager = _eager(8, "cpu")
    for step in range(3):
        with store.offload():
            _same(_step(model, step, "cpu"), eager[step])
    first = store.plan()
    assert first is not None and first.keeps_everything
    # The fraction caps it: min(60 + 2, 0.5 * 80) GiB, less 1 GiB allocated.
    assert runner.budget == 40 * GiB - GiB
    assert "(fraction 0.5)" in str(first)
    # Another process takes the GPU: free + reserved is now below what the step saves.
    cuda.free = saved // 2 + GiB - cuda.reserved
    with store.offload():
        _same(_step(model, 3, "cpu"), eager[3])
        assert runner.budget == saved // 2
        assert not runner.planned and runner._step is not None and runner._step.waiting
    remake_done(runner)
    for step in range(4, 8):
        with store.offload():
            _same(_step(model, step, "cpu"), eager[step])
            assert runner.planned
    plan = store.plan()
    assert plan is not None and plan.budget_bytes == saved // 2
    assert plan.predicted_peak_bytes <= saved // 2
    assert not torch.cuda.is_initialized()


def test_a_capacity_jittering_by_5_percent_remakes_no_plan(auto_store: Any) -> None:
    saved = _saved_bytes(auto_store, "cpu")
    capacity = int(saved * 0.8)  # the room is below the step's saves: the plan offloads
    memory = FakeMemory(capacity)
    store = auto_store(memory)  # memory_margin: the default, 10%
    runner = store._runner
    model = _model("cpu")
    eager = _eager(8, "cpu")
    budgets = set()
    for step in range(8):
        # High as the profiled step (the second) begins: a plan made for it alone
        # would be over the room of the next step.
        memory.capacity = int(capacity * (1.05 if step % 2 == 1 else 0.95))
        with store.offload():
            _same(_step(model, step, "cpu"), eager[step])
            if step >= 2:
                assert runner.planned, step
        plan = store.plan()
        if plan is not None:
            budgets.add(plan.budget_bytes)
    plan = store.plan()
    assert plan is not None and not plan.keeps_everything
    low = int(capacity * 0.95)
    assert budgets == {low - int(0.1 * low)}  # planned once, at the room's low point


def test_the_first_step_holds_back_half_the_room(auto_store: Any) -> None:
    memory = FakeMemory(4 * GiB, in_use=GiB)
    store = auto_store(memory, memory_margin="1GiB")
    model = _model("cpu")
    with store.offload():
        _step(model, 0, "cpu")
        room = store._runner.room.last
        assert room is not None and not room.measured
        assert store._runner.budget == GiB  # (4 - 1 - 1) GiB, half of it the reserve
    with store.offload():
        _step(model, 1, "cpu")
        assert store._runner.room.last.measured
        assert store._runner.budget == 2 * GiB  # the fake's usage does not move: none


def test_the_room_measures_the_steps_working_memory() -> None:
    class Growing(FakeMemory):
        def __init__(self) -> None:
            super().__init__(16 * GiB, in_use=GiB)
            self.now = GiB

        def usage(self) -> int:
            return self.now

    memory = Growing()
    room = Room(tierstore.TierConfig(activation_budget="auto", memory_margin=0), memory)
    room.step_began()
    memory.now = 4 * GiB  # backward begins: 2 GiB of saves, 1 GiB else
    room.backward_began()
    memory.now = 5 * GiB  # backward ended: gradients of 2 GiB beside the saves' pages
    room.backward_ended()
    room.step_ended(saves_peak=2 * GiB)
    memory.now = GiB
    budget = room.step_began()
    assert budget.measured and budget.working == 2 * GiB
    assert budget.budget_bytes == 16 * GiB - GiB - 2 * GiB
    for _ in range(ROOM_STEPS):  # steps with no backward measure nothing
        room.step_began()
        room.step_ended(saves_peak=0)
    assert room.step_began().working == 2 * GiB
    room.close()
    room.close()
    assert memory.closed == 1


def test_the_runner_closes_its_probe(auto_store: Any) -> None:
    memory = FakeMemory(GiB)
    store = auto_store(memory)
    store.close()
    store.close()
    assert memory.closed == 1


def test_the_plan_line_names_auto_and_its_bytes(
    auto_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierstore")
    store = auto_store(FakeMemory(2 * GiB))
    model = _model("cpu")
    for step in range(3):
        with store.offload():
            _step(model, step, "cpu")
    assert "plan made for activation_budget='auto' (1.8 GiB of " in caplog.text


def test_device_budget_beside_activation_budget_warns(spill_root: Path) -> None:
    config = tierstore.TierConfig(
        activation_budget="auto", device_budget="1GiB", disk_path=spill_root
    )
    with pytest.warns(tierstore.TierstoreWarning) as caught:
        tierstore.TierStore(config).close()
    assert str(caught[0].message) == (
        "tierstore: device_budget=1073741824 is not used: activation_budget='auto' decides what "
        "stays on the device (the plan, or the safe placement before one). Unset device_budget "
        "(TIERSTORE_DEVICE_BUDGET), or activation_budget (TIERSTORE_ACTIVATION_BUDGET) to place "
        "by the tiers' budgets"
    )


def test_a_disk_path_on_tmpfs_warns_under_auto(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstore.planning import room as room_module

    monkeypatch.setattr(room_module, "filesystem_type", lambda path: "tmpfs")
    store = tierstore.TierStore(
        tierstore.TierConfig(activation_budget="auto", disk_path=spill_root)
    )
    model = _model("cpu")
    with pytest.warns(tierstore.TierstoreWarning, match="is on tmpfs, which is RAM"):
        for step in range(2):
            with store.offload():
                _step(model, step, "cpu")
    store.close()


def test_nothing_touches_cuda_for_cpu_saves(auto_store: Any) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process already")
    store = tierstore.TierStore(tierstore.TierConfig(activation_budget="auto"))
    model = _model("cpu")
    for step in range(2):
        with store.offload():
            _step(model, step, "cpu")
    assert not torch.cuda.is_initialized()
    assert type(store._runner.room.probe).__name__ == "HostMemory"
    store.close()


def test_first_plan_at_once_is_what_these_tests_count_on() -> None:
    assert PlanRunner.first_plan_at_once
