"""Shared fixtures: isolated configuration, stores on every disk backend, eager comparison."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierstore
from tierstore import offloading
from tierstore.planning.runner import PlanRunner
from tierstore.tiers.movers import Pipeline


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``@pytest.mark.requires_cuda``, the one marker for GPU tests, skips them without a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


DISK_VARIANTS = [
    pytest.param(("file", "none"), id="file"),
    pytest.param(("file", "zstd"), id="file-zstd"),
    pytest.param(("lmdb", "none"), id="lmdb"),
    pytest.param(("lmdb", "zstd"), id="lmdb-zstd"),
]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No TIERSTORE_* variable or ./tierstore.toml leaks in; default stores are closed after.

    tempfile's directory (the default disk_path, and what examples pass to
    mkdtemp) is the test's own, so nothing is left in the system's /tmp.
    """
    for name in list(os.environ):
        if name.upper().startswith("TIERSTORE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # Tests count steps to the first plan: it is made where the profile ends,
    # not off the thread (NOTE [ Planning off the training thread ]), except
    # where a test asks for the default.
    monkeypatch.setattr(PlanRunner, "first_plan_at_once", True)
    yield
    offloading._close_all()


@pytest.fixture
def spill_root(tmp_path: Path) -> Path:
    root = tmp_path / "spill"
    root.mkdir()
    return root


def all_to_disk(
    spill_root: Path,
    backend: str = "file",
    compression: str = "none",
    disk_budget: str = "256MiB",
) -> tierstore.TierConfig:
    """Every saved tensor of any size to disk under ``spill_root``."""
    return tierstore.TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget=disk_budget,
        disk_path=spill_root,
        disk_backend=backend,
        compression=compression,
        min_offload_bytes=0,
    )


@pytest.fixture(params=DISK_VARIANTS)
def disk_config(request: pytest.FixtureRequest, spill_root: Path) -> tierstore.TierConfig:
    """Every offloadable saved tensor goes to disk, on each backend, compressed and not."""
    return all_to_disk(spill_root, *request.param)


@pytest.fixture
def disk_store(disk_config: tierstore.TierConfig) -> Iterator[tierstore.TierStore]:
    store = tierstore.TierStore(disk_config)
    yield store
    store.close()


@pytest.fixture(params=["host", *DISK_VARIANTS])
def any_store(request: pytest.FixtureRequest, spill_root: Path) -> Iterator[tierstore.TierStore]:
    """Every offloadable saved tensor goes to the host tier, or to disk on each backend."""
    if request.param == "host":
        config = tierstore.TierConfig(
            device_budget=0, host_budget="256MiB", disk_budget=0, min_offload_bytes=0
        )
    else:
        config = all_to_disk(spill_root, *request.param)
    store = tierstore.TierStore(config)
    yield store
    store.close()


def _grads(model: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()] + [x.grad for x in inputs if x.requires_grad]


@pytest.fixture
def compare_with_eager() -> Callable[..., Any]:
    """Run ``build(seed) -> (model, inputs, loss_fn)`` eagerly and under ``store.offload()``.

    Returns the store's stats taken right after the forward. Asserts every
    parameter and input gradient is bitwise equal (``torch.equal``).
    """

    def run(build: Callable[[], Any], store: tierstore.TierStore) -> tierstore.Stats:
        torch.manual_seed(0)
        model, inputs, loss_fn = build()
        torch.manual_seed(1)
        loss_fn(model, *inputs).backward()
        expected = _grads(model, inputs)

        torch.manual_seed(0)
        model, inputs, loss_fn = build()
        torch.manual_seed(1)
        with store.offload():
            loss = loss_fn(model, *inputs)
        stats = store.stats()
        loss.backward()
        del loss
        got = _grads(model, inputs)
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert (a is None) == (b is None), i
            if a is not None and b is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), f"gradient {i} differs"
        return stats

    return run


def in_block(store: tierstore.TierStore, fn: Callable[[], Any]) -> Any:
    """``fn()`` in ``store.offload()``: every call's block opened at this one line.

    A repeated step must be opened where the step it repeats was (NOTE [
    Quiet blocks ] in tierstore/autograd/quiet.py).
    """
    with store.offload():
        return fn()


def grads_of_steps(
    model: torch.nn.Module,
    store: tierstore.TierStore | None,
    steps: int,
    first: int = 0,
    *,
    batch: Callable[[int], torch.Tensor],
) -> list[list[torch.Tensor]]:
    """Each step's gradients of ``model`` on ``batch(step)``, in ``store``'s block (None: eager)."""
    out = []
    for step in range(first, first + steps):
        torch.manual_seed(100 + step)  # dropout masks, alike with and without the store
        rows = batch(step)
        if store is None:
            loss = model(rows).square().mean()
        else:
            loss = in_block(store, lambda: model(rows).square().mean())  # noqa: B023
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
    return out


def same_grads(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    """Every step's gradients bitwise equal."""
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x, y, strict=True))


def assert_empty(store: tierstore.TierStore) -> None:
    """Every tier back to zero bytes, and no record left in the disk backend."""
    stats = store.stats()
    for name, tier in stats.tiers.items():
        assert (name, tier.bytes, tier.entries) == (name, 0, 0)
    backend = store._manager._pipeline.backend_if_open
    if backend is not None:
        assert len(backend) == 0
        assert backend.used_bytes == 0


def remake_done(runner: PlanRunner) -> None:
    """Wait for a plan being remade off the training thread, if one is.

    Ready for the next step boundary, or taken up already where it finished
    before the step that asked for it returned.
    """
    remaking = runner._checker._remaking
    if remaking is not None:
        remaking.join(60)
        assert not remaking.is_alive()


@pytest.fixture
def empty_check() -> Callable[[tierstore.TierStore], None]:
    return assert_empty


def buffers_in_use(store: tierstore.TierStore, expected: int = 0) -> int:
    """Bytes of buffers out of the pool, once they settle at ``expected`` (or after 2 s).

    An I/O thread may drop its last reference to a write's staging a moment
    after the write's future completes (the executor keeps a finished job
    until its next one): what counts is that the buffer comes back.
    """
    deadline = time.monotonic() + 2
    while True:
        gc.collect()
        in_use = store.stats().buffer_bytes_in_use
        if in_use == expected or time.monotonic() > deadline:
            return in_use
        time.sleep(0.01)


class FailingBackward(torch.autograd.Function):
    """Identity in forward; its backward raises ``RuntimeError("boom")`` (a backward that fails)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def reads_done_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read ends before submit_read returns: backward never waits for one.

    A read ahead has then landed when backward asks, so the hit and miss
    counts say what was read ahead, whatever the machine's load
    (NOTE [ Hits ] in tierstore/tiers/readahead.py).
    """
    original = Pipeline.submit_read

    def at_once(self: Pipeline, *args: Any) -> concurrent.futures.Future[torch.Tensor]:
        future = original(self, *args)
        concurrent.futures.wait([future])
        return future

    monkeypatch.setattr(Pipeline, "submit_read", at_once)


@pytest.fixture
def reads_land_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`reads_done_at_once` for the whole test."""
    reads_done_at_once(monkeypatch)


def cpu_storages(exclude: Collection[tuple[int, int]] = ()) -> dict[tuple[int, int], int]:
    """Every CPU tensor storage Python can reach, once each: {(address, size): size}.

    Counted independently of tierstore (the issues' "measured independently"):
    walks the objects the garbage collector tracks. Tensors with no storage
    of their own (fake, functional, meta: what an earlier compile test may
    leave for the collector) are not memory, and are skipped.
    """
    gc.collect()
    seen: dict[tuple[int, int], int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated names, asked their type
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.device.type != "cpu" or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # no data of its own
            continue
        if key[0] and key not in exclude:
            seen[key] = key[1]
    return seen
