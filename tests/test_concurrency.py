"""Concurrency: one store shared by threads, backward on another thread, many small entries.

Every test runs its threads with a join timeout and fails, instead of hanging,
if one does not finish: a deadlock is a failure, not a stuck run.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierstore
from tierstore.tiers.manager import TierManager, resting_nbytes

JOIN_TIMEOUT_S = 60.0

VARIANTS = {
    "host": None,
    "file": ("file", "none"),
    "lmdb": ("lmdb", "none"),
    "file-zstd": ("file", "zstd"),
    "lmdb-zstd": ("lmdb", "zstd"),
}


def _config(name: str, disk_path: Path) -> tierstore.TierConfig:
    variant = VARIANTS[name]
    if variant is None:
        return tierstore.TierConfig(
            device_budget=0, host_budget="256MiB", disk_budget=0, min_offload_bytes=0
        )
    backend, compression = variant
    return tierstore.TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget="256MiB",
        disk_path=disk_path,
        disk_backend=backend,
        compression=compression,
        min_offload_bytes=0,
    )


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[[str], tierstore.TierStore]]:
    """``make_store(variant)``: a store that is closed, leaving no file, after the test."""
    made: list[tierstore.TierStore] = []

    def make(name: str) -> tierstore.TierStore:
        store = tierstore.TierStore(_config(name, tmp_path / f"spill-{len(made)}"))
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def _run_threads(*targets: Callable[[], None], timeout: float = JOIN_TIMEOUT_S) -> None:
    """Run each target on its own thread; re-raise the first error; fail on a hang."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        pytest.fail(f"threads {stuck} still running after {timeout} s: deadlock?")
    if errors:
        raise errors[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Elements as bytes in logical order (NaN payloads and -0.0 compare too)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8)


def _assert_empty(store: tierstore.TierStore) -> None:
    for name, tier in store.stats().tiers.items():
        assert (name, tier.bytes, tier.entries) == (name, 0, 0)
    backend = store._manager._pipeline.backend_if_open
    if backend is not None:
        assert (len(backend), backend.used_bytes) == (0, 0)


# -- models and their eager gradients -----------------------------------------------------


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # on the test's thread: nn.init uses the global generator
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.LayerNorm(32),
        nn.Linear(32, 8),
        nn.Softmax(dim=-1),
    )


def _inputs(seed: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(12, 16, generator=gen) for _ in range(steps)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * torch.arange(8.0)).sum()


def _step_grads(model: nn.Module, x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert x.grad is not None
    grads.append(x.grad.clone())
    model.zero_grad(set_to_none=True)
    return grads


def _eager(model: nn.Module, inputs: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], int]:
    """Per step, the gradients eager autograd computes; and how many tensors a step saves."""
    saves = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal saves
        saves += 1
        return t

    grads = []
    for x0 in inputs:
        x = x0.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            loss = _loss(model, x)
        grads.append(_step_grads(model, x, loss))
    assert saves % len(inputs) == 0
    return grads, saves // len(inputs)


def _assert_same_grads(want: list[torch.Tensor], got: list[torch.Tensor], where: str) -> None:
    assert len(got) == len(want), where
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(_bits(a), _bits(b)), f"{where}: gradient {i} differs from eager"


# -- (a) two threads, one store ------------------------------------------------------------


@pytest.mark.parametrize("name", ["host", "file", "lmdb-zstd"])
def test_two_threads_share_one_store(name: str, make_store: Callable[..., Any]) -> None:
    store = make_store(name)
    steps = 25
    # Same architecture in both threads: their saved tensors have the same shapes
    # and dtypes, so a store that mixed them up would not notice by metadata.
    models = [_model(10), _model(20)]
    inputs = [_inputs(1, steps), _inputs(2, steps)]
    expected = [_eager(m, xs) for m, xs in zip(models, inputs, strict=True)]
    start = threading.Barrier(2, timeout=JOIN_TIMEOUT_S)

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            model, want = models[k], expected[k][0]
            start.wait()
            for i, x0 in enumerate(inputs[k]):
                x = x0.clone().requires_grad_()
                with store.offload():
                    loss = _loss(model, x)
                _assert_same_grads(want[i], _step_grads(model, x, loss), f"thread {k} step {i}")

        return run

    _run_threads(worker(0), worker(1))
    stats = store.stats()
    assert stats.packed == steps * sum(saves for _, saves in expected)
    offloaded = stats.packed - stats.kept
    assert offloaded > 0
    assert stats.tiers["disk" if VARIANTS[name] else "host"].peak_bytes > 0
    _assert_empty(store)


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
def test_threads_interleave_graphs_on_one_store(name: str, make_store: Callable[..., Any]) -> None:
    """Each thread keeps two graphs alive and runs their backwards newest first."""
    store = make_store(name)
    steps = 10
    models = [_model(30), _model(40)]
    inputs = [_inputs(3, 2 * steps), _inputs(4, 2 * steps)]
    expected = [_eager(m, xs)[0] for m, xs in zip(models, inputs, strict=True)]

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            model = models[k]
            for i in range(0, 2 * steps, 2):
                xs = [inputs[k][i].clone().requires_grad_(), inputs[k][i + 1].clone()]
                xs[1].requires_grad_()
                with store.offload():
                    losses = [_loss(model, x) for x in xs]
                for j in (1, 0):
                    got = _step_grads(model, xs[j], losses[j])
                    _assert_same_grads(expected[k][i + j], got, f"thread {k} step {i + j}")

        return run

    _run_threads(worker(0), worker(1))
    _assert_empty(store)


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
def test_threads_share_a_saved_tensor(name: str, make_store: Callable[..., Any]) -> None:
    """Both threads save the same input in lockstep: one entry, two graphs, two threads.

    Each thread's first layer saves the shared input, so the second save
    deduplicates onto the first thread's entry; whichever backward ends first
    must leave it intact for the other.
    """
    store = make_store(name)
    steps = 12
    models = [_model(70), _model(80)]
    shared = _inputs(9, steps)  # the same tensor objects in both threads, no grad

    def grads(model: nn.Module, x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
        loss.backward()
        out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return out

    expected = [[grads(m, x, _loss(m, x)) for x in shared] for m in models]
    # Saves a step of one model deduplicates on its own (tanh's result is layer_norm's input).
    alone = []
    for m in models:
        before = store.stats().deduplicated
        with store.offload():
            loss = _loss(m, shared[0])
        alone.append(store.stats().deduplicated - before)
        grads(m, shared[0], loss)
    before = store.stats().deduplicated
    forwarded = threading.Barrier(2, timeout=JOIN_TIMEOUT_S)

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            for i, x in enumerate(shared):
                with store.offload():
                    loss = _loss(models[k], x)
                forwarded.wait()  # both graphs hold the shared entry now
                got = grads(models[k], x, loss)
                _assert_same_grads(expected[k][i], got, f"thread {k} step {i}")
                forwarded.wait()  # the next step saves a new input only after both ended

        return run

    _run_threads(worker(0), worker(1))
    assert store.stats().deduplicated - before == steps * (sum(alone) + 1)
    _assert_empty(store)


# -- (b) backward on another thread ----------------------------------------------------------


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
@pytest.mark.parametrize("forward_on", ["main", "worker"])
def test_backward_on_another_thread(
    name: str, forward_on: str, make_store: Callable[..., Any]
) -> None:
    store = make_store(name)
    model = _model(50)
    xs = _inputs(5, 3)
    want, _ = _eager(model, xs)
    for i, x0 in enumerate(xs):
        x = x0.clone().requires_grad_()
        box: list[Any] = []

        def forward(x: torch.Tensor = x, box: list[Any] = box) -> None:
            with store.offload():
                box.append(_loss(model, x))

        def backward(x: torch.Tensor = x, box: list[Any] = box) -> None:
            box.append(_step_grads(model, x, box.pop()))

        if forward_on == "main":
            forward()
            _run_threads(backward)
        else:
            _run_threads(forward)
            backward()
        _assert_same_grads(want[i], box.pop(), f"step {i}")
    _assert_empty(store)


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
def test_forward_and_backward_threads_pipelined(name: str, make_store: Callable[..., Any]) -> None:
    """One thread runs forwards while another runs the backwards of earlier steps."""
    store = make_store(name)
    steps = 20
    model = _model(60)
    xs = _inputs(6, steps)
    want, _ = _eager(copy.deepcopy(model), xs)
    graphs: queue.Queue[tuple[int, torch.Tensor, torch.Tensor] | None] = queue.Queue(maxsize=3)

    def producer() -> None:
        try:
            for i, x0 in enumerate(xs):
                x = x0.clone().requires_grad_()
                with store.offload():
                    loss = _loss(model, x)
                graphs.put((i, x, loss), timeout=JOIN_TIMEOUT_S)
        finally:
            graphs.put(None, timeout=JOIN_TIMEOUT_S)

    def consumer() -> None:
        done = 0
        while (item := graphs.get(timeout=JOIN_TIMEOUT_S)) is not None:
            i, x, loss = item
            del item
            # Forward of later steps runs meanwhile and reads the same parameters;
            # gradients accumulate here only, in step order, as in eager.
            loss.backward()
            assert x.grad is not None
            _assert_same_grads(want[i][-1:], [x.grad], f"input gradient of step {i}")
            done += 1
        assert done == steps

    _run_threads(producer, consumer)
    # Parameter gradients accumulated over all steps, as the same eager loop does.
    eager = copy.deepcopy(model)
    eager.zero_grad(set_to_none=True)
    for x in xs:
        _loss(eager, x).backward()
    for (n, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert b.grad is not None and torch.equal(_bits(a.grad), _bits(b.grad)), n
    _assert_empty(store)


# -- (c) many small tensors ----------------------------------------------------------------

SMALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


def _small_tensors(seed: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 9, (n,), generator=gen).tolist()
    out = []
    for i, size in enumerate(sizes):
        dtype = SMALL_DTYPES[i % len(SMALL_DTYPES)]
        raw = torch.randint(
            0,
            2 if dtype == torch.bool else 256,
            (size * dtype.itemsize,),
            generator=gen,
            dtype=torch.uint8,
        )
        out.append(raw.view(dtype))
    return out


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
def test_ten_thousand_small_entries(name: str, tmp_path: Path) -> None:
    """10 000 entries, put by two threads at once: each comes back exact; stats add up.

    On the disk variants the device tier keeps about 60% of the bytes (CPU
    tensors skip the host tier while there is a disk tier) and the oldest
    entries are demoted to disk (a few thousand records: all 10 000 on disk
    would take most of a minute on a small machine).
    """
    per_thread = 5000
    total = 2 * per_thread
    tensors = [_small_tensors(7, per_thread), _small_tensors(8, per_thread)]
    want = [[_bits(t) for t in ts] for ts in tensors]
    raw_bytes = sum(resting_nbytes(t) for ts in tensors for t in ts)
    config = _config(name, tmp_path / "spill")
    first, unused = ("host", "device") if VARIANTS[name] is None else ("device", "host")
    if VARIANTS[name] is not None:
        config = config.model_copy(update={"device_budget": raw_bytes * 3 // 5})
    store = tierstore.TierStore(config)
    mgr: TierManager = store._manager
    handles: list[list[Any]] = [[], []]

    def putter(k: int, mine: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            handles[k].extend(mgr.put(t) for t in mine)

        return run

    _run_threads(putter(0, tensors[0]), putter(1, tensors[1]))
    del tensors  # from here on only the store has the bytes
    mgr.flush()
    full = store.stats()
    top, disk = full.tiers[first], full.tiers["disk"]
    assert (full.packed, full.deduplicated, full.kept) == (total, 0, 0)
    assert full.tiers[unused].entries == full.tiers[unused].peak_bytes == 0
    assert top.entries + disk.entries == total  # each entry rests in exactly one tier
    # Every entry landed in the first tier; demotion kept it within budget.
    assert top.bytes_written == raw_bytes
    assert top.bytes <= top.peak_bytes <= getattr(config, f"{first}_budget")
    backend = mgr._pipeline.backend_if_open
    if VARIANTS[name] is None:
        assert top.bytes == top.peak_bytes == raw_bytes and disk.bytes_written == 0
        assert backend is None
    else:
        assert disk.entries > total // 10 and top.entries > total // 10
        assert backend is not None
        assert (len(backend), backend.used_bytes) == (disk.entries, disk.bytes)
        assert disk.bytes <= disk.peak_bytes <= config.disk_budget
        assert disk.bytes_written >= disk.bytes >= raw_bytes - top.bytes

    def getter(k: int) -> Callable[[], None]:
        def run() -> None:
            for i in reversed(range(per_thread)):  # newest first, as backward does
                got = mgr.get(handles[k][i])
                assert torch.equal(_bits(got), want[k][i]), f"thread {k} entry {i}"

        return run

    _run_threads(getter(0), getter(1))
    read = store.stats()
    # Each host entry read once; the device tier hands back the tensor itself.
    assert read.tiers[first].bytes_read == (top.bytes if first == "host" else 0)
    # Each disk entry read once: a hit or a miss, reading its footprint.
    assert read.prefetch_hits + read.prefetch_misses == disk.entries
    assert read.tiers["disk"].bytes_read == disk.bytes
    handles = [[], []]
    after = store.stats()
    _assert_empty(store)
    for t in (first, "disk"):  # a high-water mark stays
        assert after.tiers[t].peak_bytes == full.tiers[t].peak_bytes
    assert after.packed == total
    store.close()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# -- (d) releases: bookkeeping under the lock, the disk on the I/O thread --------------------


def _disk_manager(tmp_path: Path, backend: str, disk_budget: str = "64MiB") -> TierManager:
    return TierManager(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget=disk_budget,
            disk_path=tmp_path,
            disk_backend=backend,
            io_workers=4,
            min_offload_bytes=0,
        )
    )


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_a_finalizer_deletes_no_record_itself(backend: str, tmp_path: Path) -> None:
    """The thread that releases the last handle's entry queues the delete; an I/O thread runs it.

    A release runs under the manager's lock, on whichever thread takes it next
    (NOTE [ Deletes on the I/O thread ]): the backend's delete, held here until
    the test lets it go, must not run on the thread that dropped the handle
    and then took the lock.
    """
    mgr = _disk_manager(tmp_path, backend)
    handles = [mgr.put(torch.randn(4096))]
    mgr.flush()
    disk = mgr._pipeline.backend_if_open
    assert disk is not None
    entered, go = threading.Event(), threading.Event()
    ran_on: list[threading.Thread] = []
    real_delete = disk.delete

    def held_delete(key: int) -> None:
        ran_on.append(threading.current_thread())
        entered.set()
        go.wait(JOIN_TIMEOUT_S)
        real_delete(key)

    disk.delete = held_delete  # type: ignore[method-assign]

    def drop() -> None:
        handles.clear()  # queues the release (NOTE [ Deferred release ])
        mgr.holds_entries()  # takes the lock: the release runs on this thread

    dropper = threading.Thread(target=drop, name="dropper", daemon=True)
    dropper.start()
    assert entered.wait(JOIN_TIMEOUT_S)
    names = [t.name for t in ran_on]
    go.set()
    dropper.join(JOIN_TIMEOUT_S)
    assert not dropper.is_alive()
    assert len(names) == 1 and names[0].startswith("tierstore-io"), names
    stats = mgr.stats()  # waits for the queued delete
    assert (stats.tiers["disk"].entries, stats.tiers["disk"].bytes) == (0, 0)
    assert (len(disk), disk.used_bytes) == (0, 0)
    mgr.close()


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_a_write_waits_for_the_delete_before_it(backend: str, tmp_path: Path) -> None:
    """A record's room is free in the backend before a later write claims it.

    The manager counts a released record's bytes as free at once; the backend
    (whose capacity is the same disk_budget) frees them when the queued delete
    runs. With room for one record, a save right after a release must not find
    the backend full (NOTE [ Deletes on the I/O thread ]).
    """
    nbytes = 384 << 10
    mgr = _disk_manager(tmp_path, backend, disk_budget=str(nbytes + (128 << 10)))
    first = [mgr.put(torch.randn(nbytes // 4))]
    mgr.flush()
    disk = mgr._pipeline.backend_if_open
    assert disk is not None
    order: list[str] = []
    writing = threading.Event()
    real_delete, real_write = disk.delete, disk.write

    def slow_delete(key: int) -> None:
        # Gives a write that does not wait for this delete the time to start first.
        writing.wait(0.5)
        real_delete(key)
        order.append("deleted")

    def noted_write(key: int, chunks: Any) -> int:
        order.append("write")
        writing.set()
        return real_write(key, chunks)

    disk.delete = slow_delete  # type: ignore[method-assign]
    disk.write = noted_write  # type: ignore[method-assign]
    first.clear()  # released: the manager's disk tier is empty at once
    second = torch.randn(nbytes // 4)
    handle = mgr.put(second)
    mgr.flush()
    stats = mgr.stats()
    assert order == ["deleted", "write"]
    assert (stats.failed_writes, stats.tiers["disk"].entries) == (0, 1)
    assert torch.equal(mgr.get(handle), second)
    del handle
    mgr.close()


# -- (e) deduplication under threads ----------------------------------------------------------


def test_a_save_made_while_another_waited_is_shared(tmp_path: Path) -> None:
    """Two threads save one tensor; the first waits (lock released) after its lookup missed.

    The second saves it meanwhile. When the first gets the lock back it must
    share that entry, not store the bytes twice (NOTE [ Deduplication under
    threads ]). The wait is forced: the first thread's backpressure waits,
    with the lock released, until the second thread's save has returned.
    """
    mgr = TierManager(_config("host", tmp_path))
    t = torch.randn(64, 64)
    waiting, saved = threading.Event(), threading.Event()
    real_make_room = mgr._writes.make_room

    def make_room(unlocked: Callable[[Callable[[], object]], None]) -> None:
        if threading.current_thread().name == "first":
            waiting.set()
            unlocked(lambda: saved.wait(JOIN_TIMEOUT_S))
        real_make_room(unlocked)

    mgr._writes.make_room = make_room  # type: ignore[method-assign]
    handles: dict[str, Any] = {}

    def first() -> None:
        handles["first"] = mgr.put(t)

    def second() -> None:
        waiting.wait(JOIN_TIMEOUT_S)
        handles["second"] = mgr.put(t)
        saved.set()

    threads = [threading.Thread(target=f, name=f.__name__, daemon=True) for f in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads)
    stats = mgr.stats()
    assert handles["first"].key == handles["second"].key
    assert (stats.packed, stats.deduplicated, stats.tiers["host"].entries) == (2, 1, 1)
    assert stats.tiers["host"].bytes == t.nbytes
    assert torch.equal(_bits(mgr.get(handles["first"])), _bits(t))
    handles.clear()
    stats = mgr.stats()
    assert (stats.tiers["host"].entries, stats.tiers["host"].bytes) == (0, 0)
    mgr.close()


@pytest.mark.parametrize("name", ["host", "file", "lmdb"])
def test_threads_save_one_tensor_many_times(name: str, make_store: Callable[..., Any]) -> None:
    """Four threads, each saving the same input several times per step, not in lockstep.

    Saves of the shared input deduplicate onto entries other threads' graphs
    hold and release at any moment; every gradient is still bitwise eager's.
    """
    store = make_store(name)
    threads, steps = 4, 8
    torch.manual_seed(5)
    x = torch.randn(32, 64)  # shared by every thread and step, never modified
    weights = [torch.randn(64, 64, requires_grad=True) for _ in range(threads)]

    def loss_of(w: torch.Tensor) -> torch.Tensor:
        # x is saved by each matmul and mul: several saves of one tensor per step.
        return ((x @ w).tanh() * x + (x @ w.t()).sigmoid() * x).square().sum()

    def grad_of(w: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(loss, [w])
        return g

    want = [grad_of(w, loss_of(w)) for w in weights]

    def worker(k: int) -> Callable[[], None]:
        def run() -> None:
            for step in range(steps):
                with store.offload():
                    loss = loss_of(weights[k])
                got = grad_of(weights[k], loss)
                assert torch.equal(_bits(got), _bits(want[k])), f"thread {k} step {step}"

        return run

    _run_threads(*(worker(k) for k in range(threads)))
    stats = store.stats()
    assert stats.deduplicated >= threads * steps  # x saved at least twice per step
    _assert_empty(store)
