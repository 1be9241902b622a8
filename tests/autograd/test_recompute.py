"""recompute="cheap": saves a cheap op can rebuild are never stored (NOTE [ Recompute ]).

Each rule of the "cheap" list has an op that must be rebuilt and one that must
not; each semantic (retain_graph, double backward, dropped graphs, in-place
changes, nesting, threads, tracing, checkpointing) is checked against eager
autograd, bitwise.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import tierstore
import tierstore.autograd.recipes
from tierstore.autograd import graph, recompute
from tierstore.autograd.recipes import Recipe
from tierstore.autograd.recompute import everything
from tierstore.autograd.recorder import Recorder
from tierstore.models import GPT, GPTConfig
from tierstore.planning.timers import BusyTimer
from tierstore.tiers.handle import Handle

from ..conftest import DISK_VARIANTS, FailingBackward, all_to_disk, assert_empty, buffers_in_use


def _cheap(config: tierstore.TierConfig) -> tierstore.TierConfig:
    return config.model_copy(update={"recompute": "cheap"})


@pytest.fixture
def host_store() -> Iterator[tierstore.TierStore]:
    config = tierstore.TierConfig(
        device_budget=0, host_budget="256MiB", disk_budget=0, min_offload_bytes=0, recompute="cheap"
    )
    with tierstore.TierStore(config) as store:
        yield store


@pytest.fixture(params=["host", "device_budget", *DISK_VARIANTS])
def store(request: pytest.FixtureRequest, spill_root: Path) -> Iterator[tierstore.TierStore]:
    """A recompute="cheap" store on every tier and disk backend."""
    if request.param == "host":
        config = tierstore.TierConfig(
            device_budget=0, host_budget="256MiB", disk_budget=0, min_offload_bytes=0
        )
    elif request.param == "device_budget":
        config = tierstore.TierConfig(device_budget="1GiB", disk_budget=0, min_offload_bytes=0)
    else:
        config = all_to_disk(spill_root, *request.param)
    with tierstore.TierStore(_cheap(config)) as s:
        yield s


class Spy:
    """What the store's pack hook returned for each saved tensor, by its memory and view."""

    def __init__(self, store: tierstore.TierStore) -> None:
        self.packed: list[tuple[int, tuple[int, ...], Any]] = []
        original = store._pack

        def pack(t: torch.Tensor) -> Any:
            out = original(t)
            self.packed.append((t.data_ptr(), tuple(t.shape), out))
            return out

        store._pack = pack  # type: ignore[method-assign]

    def of(self, t: torch.Tensor) -> Any:
        found = [p for ptr, shape, p in self.packed if (ptr, shape) == (t.data_ptr(), t.shape)]
        assert found, "not saved"
        return found[-1]

    def rebuilt(self, t: torch.Tensor) -> bool:
        return type(self.of(t)) is Recipe


# -- a decoder block of the kinds the issue measured ----------------------------


class RMSNorm(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(torch.nn.Module):
    """RMSNorm, rotary-mixed SDPA attention, SwiGLU: Llama's saves, in a few lines."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.gate = torch.nn.Linear(d, 2 * d, bias=False)
        self.up = torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def _rotary(self, x: torch.Tensor) -> torch.Tensor:
        seq, half = x.shape[-2], x.shape[-1] // 2
        angle = torch.arange(seq, dtype=x.dtype)[:, None] * torch.arange(1, half + 1) / half
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _decoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block())


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad.clone()]


def _run(
    model: torch.nn.Module,
    x: torch.Tensor,
    store: tierstore.TierStore | None,
    **offload: Any,
) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(1)
    if store is None:
        loss = model(x).square().mean()
    else:
        with store.offload(**offload):
            loss = model(x).square().mean()
    loss.backward()
    return _grads(model, x)


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(p, q), f"gradient {i} differs"


def _input() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(2, 16, 64, requires_grad=True)


# -- semantics ------------------------------------------------------------------


def test_gradients_are_bitwise_eager_on_every_tier(store: tierstore.TierStore) -> None:
    model, x = _decoder(), _input()
    expected = _run(model, x, None)
    _assert_bitwise(expected, _run(model, x, store))
    stats = store.stats()
    assert stats.recomputed > 0 and stats.recomputed_bytes > 0
    assert_empty(store)


def test_stored_bytes_go_down_and_reads_are_not_repeated(spill_root: Path) -> None:
    model, x = _decoder(), _input()
    moved = {}
    for setting in ("off", "cheap"):
        config = all_to_disk(spill_root, "file", "none").model_copy(update={"recompute": setting})
        with tierstore.TierStore(config) as s:
            for _ in range(2):
                _run(model, x, s)
            stats = s.stats()
            disk = stats.tiers["disk"]
            moved[setting] = (disk.bytes_written, disk.bytes_read, stats.recomputed_bytes)
    (w_off, _, none_off), (w_cheap, r_cheap, rebuilt) = moved["off"], moved["cheap"]
    assert none_off == 0
    assert w_cheap < 0.8 * w_off and rebuilt > 0
    # A stored input that both a recipe and its own backward node need is read once.
    assert r_cheap <= w_cheap


def test_a_policy_function_decides_per_op(host_store: tierstore.TierStore) -> None:
    seen: list[str] = []

    def only_silu(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        seen.append(op._overloadpacket.__name__)
        if op is torch.ops.aten.silu.default:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.PREFER_SAVE

    model, x = _decoder(), _input()
    expected = _run(model, x, None)
    _assert_bitwise(expected, _run(model, x, host_store, recompute=only_silu))
    assert "mm" in seen and "silu" in seen
    assert host_store.stats().recomputed == 2  # one silu output per block, saved by mul


def test_the_process_wide_offload_takes_a_policy(spill_root: Path) -> None:
    def everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(64, 64, requires_grad=True)
    with tierstore.offload(
        recompute=everything, device_budget=0, disk_budget=0, min_offload_bytes=0
    ) as s:
        y = (x @ x).exp()  # exp saves its output: mm made it from x, which mm saved
    y.sum().backward()
    assert s.config.recompute == "off"
    assert s.stats().recomputed == 1


def test_retain_graph_rebuilds_again(host_store: tierstore.TierStore) -> None:
    model, x = _decoder(), _input()
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = _grads(model, x)

    model.zero_grad(set_to_none=True)
    x.grad = None
    with host_store.offload():
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_bitwise(expected, _grads(model, x))
    del loss
    assert_empty(host_store)


def test_double_backward(host_store: tierstore.TierStore) -> None:
    def second_order(store: tierstore.TierStore | None) -> torch.Tensor:
        torch.manual_seed(0)
        w = torch.randn(32, 32, requires_grad=True)
        x = torch.randn(16, 32)
        with store.offload() if store is not None else _nothing():
            y = F.gelu(x @ w).tanh().sum()
        (g,) = torch.autograd.grad(y, w, create_graph=True)
        g.square().sum().backward()
        assert w.grad is not None
        return w.grad

    expected = second_order(None)
    assert torch.equal(expected, second_order(host_store))
    assert host_store.stats().recomputed > 0


def test_a_graph_dropped_without_backward_leaves_nothing(host_store: tierstore.TierStore) -> None:
    gc.collect()  # recipes of earlier tests' graphs left in cycles: not this graph's
    model, x = _decoder(), _input()
    with host_store.offload():
        loss = model(x).square().mean()
    recipes = [
        weakref.ref(obj) for obj in gc.get_objects() if type(obj) is Recipe
    ]  # the recorded graph
    assert recipes and host_store.stats().recomputed == len(recipes)
    del loss
    gc.collect()
    assert all(r() is None for r in recipes)
    assert not tierstore.autograd.recipes._stored
    assert_empty(host_store)


def test_a_failing_backward_leaves_nothing(host_store: tierstore.TierStore) -> None:
    model, x = _decoder(), _input()
    with host_store.offload():
        loss = model(FailingBackward.apply(x)).square().mean()
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    del loss
    gc.collect()
    assert not tierstore.autograd.recipes._stored
    assert_empty(host_store)


def test_a_rebuilt_tensor_modified_in_place_raises_the_eager_error(
    host_store: tierstore.TierStore,
) -> None:
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    a = F.gelu(x)
    out = a @ w
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as eager:
        out.sum().backward()

    spy = Spy(host_store)
    with host_store.offload():
        a = F.gelu(x)
        out = a @ w
    assert spy.rebuilt(a)
    a.add_(1)
    with pytest.raises(tierstore.TierstoreError) as ours:
        out.sum().backward()
    assert "modified by an inplace operation" in str(eager.value)
    assert str(ours.value) == (
        "tierstore: one of the variables needed for gradient computation has been modified "
        "by an inplace operation: a saved tensor of shape [8, 32] and dtype torch.float32 is "
        "at version 1; expected version 0 instead. Hint: clone the tensor before modifying it "
        "in place, or modify it before it is saved"
    )


def test_an_input_held_as_it_is_and_modified_after_raises(spill_root: Path) -> None:
    # A parameter is held, not stored; changing it before backward would change
    # the rebuilt tensor, so the rebuild refuses instead of giving a wrong gradient.
    config = tierstore.TierConfig(
        device_budget=0, host_budget="1GiB", disk_budget=0, min_offload_bytes=0, recompute="cheap"
    )
    bias = torch.nn.Parameter(torch.randn(32))
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    with tierstore.TierStore(config) as s:
        with s.offload():
            y = (x.exp() + bias) @ w  # add saves nothing; mm saves the sum: rebuilt
        assert s.stats().recomputed == 1
        with torch.no_grad():
            bias.add_(1)
        with pytest.raises(tierstore.TierstoreError) as err:
            y.sum().backward()
    assert str(err.value) == (
        "tierstore: an input of a recomputed saved tensor (shape [32], dtype torch.float32) "
        "was modified in place after forward used it: it is at version 1, expected version 0. "
        "Rebuilding from it would give a wrong gradient; modify it after backward, or set "
        "recompute='off' (TIERSTORE_RECOMPUTE)"
    )


def test_nested_blocks_and_keep(host_store: tierstore.TierStore) -> None:
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    spy = Spy(host_store)
    with host_store.offload():
        with host_store.offload(recompute="off"):
            ga = F.gelu(x)
            a = ga @ w  # inner block: stored
        with tierstore.keep():
            gb = F.gelu(x)
            b = gb @ w  # kept as it is
        gc_ = F.gelu(x)
        c = gc_ @ w  # rebuilt
    assert not spy.rebuilt(ga) and not spy.rebuilt(gb) and spy.rebuilt(gc_)
    (a + b + c).sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    (F.gelu(x) @ w + F.gelu(x) @ w + F.gelu(x) @ w).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], w.grad)


def test_threads_record_their_own_ops(host_store: tierstore.TierStore) -> None:
    model = _decoder()
    inputs = [torch.randn(2, 16, 64, requires_grad=True) for _ in range(4)]
    expected = []
    for x in inputs:
        expected.append(torch.autograd.grad(model(x).square().mean(), [x, *model.parameters()]))
    results: dict[int, Any] = {}

    def work(i: int) -> None:
        with host_store.offload():
            loss = model(inputs[i]).square().mean()
        results[i] = torch.autograd.grad(loss, [inputs[i], *model.parameters()])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        _assert_bitwise(list(expected[i]), list(results[i]))
    assert host_store.stats().recomputed > 0


class _ContendedLock:
    """A lock that tells when a second thread had to wait for it."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self._contended = contended

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._contended.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_shared_value_is_made_once_for_consumers_on_two_threads() -> None:
    """Two threads fetch one stored input of a recipe at once: one read, the same tensor.

    NOTE [ Recompute under threads ]. The first read is held until the second
    consumer has either started a read of its own or is waiting for the first.
    """
    t = torch.randn(64)
    packed = Handle(0, t)
    arrived, reading = threading.Event(), threading.Event()
    reads: list[str] = []

    def fetch(_: Any) -> torch.Tensor:
        reads.append(threading.current_thread().name)
        if len(reads) == 1:
            reading.set()
            arrived.wait(60)
        else:
            arrived.set()
        return t.clone()

    stored = tierstore.autograd.recipes.Stored.of(packed, fetch)
    stored.add_use()  # autograd's unpack of it, and one rebuild that reads it
    stored._lock = _ContendedLock(arrived)  # type: ignore[assignment]
    got: dict[str, torch.Tensor] = {}

    def consumer() -> None:
        got[threading.current_thread().name] = stored.value()

    first = threading.Thread(target=consumer, name="first", daemon=True)
    second = threading.Thread(target=consumer, name="second", daemon=True)
    first.start()
    assert reading.wait(60)
    second.start()
    for thread in (first, second):
        thread.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert reads == ["first"]
    assert got["first"] is got["second"] and torch.equal(got["first"], t)
    assert stored._cache is None  # both consumers have it: dropped


def test_two_threads_get_one_node_for_an_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op's rebuild node, asked for on two threads at once: one node, its input counted once.

    NOTE [ Recompute under threads ]. The first thread is held while it
    resolves the op's inputs, until the second has made and published a node.
    """
    x = torch.randn(64)
    packed = Handle(0, x)
    rec = Recorder(recompute.cheap, lambda t: False)
    rec.note_packed(x, packed, lambda p: x)
    with rec:
        y = x.exp()
    origin = rec._origins[y.untyped_storage()][graph.view_key(y)][1]
    resolving, published = threading.Event(), threading.Event()
    real_of = tierstore.autograd.recipes.Stored.of

    def held_of(p: Any, fetch: Any) -> Any:
        if threading.current_thread().name == "first":
            resolving.set()
            assert published.wait(60)
        return real_of(p, fetch)

    monkeypatch.setattr(tierstore.autograd.recipes.Stored, "of", staticmethod(held_of))
    nodes: dict[str, Any] = {}

    def ask() -> None:
        nodes[threading.current_thread().name] = origin.node_for()
        if threading.current_thread().name == "second":
            published.set()

    threads = [threading.Thread(target=ask, name=n, daemon=True) for n in ("first", "second")]
    threads[0].start()
    assert resolving.wait(60)  # the first is past its look at origin.node
    threads[1].start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert nodes["first"] is nodes["second"]
    assert (
        tierstore.autograd.recipes._stored[packed].uses == 2
    )  # autograd's unpack and the one node


def test_threads_run_backward_of_one_graph_at_once(host_store: tierstore.TierStore) -> None:
    """Recipes and their stored inputs of one retained graph, unpacked by four threads at once."""
    model, x = _decoder(), _input()
    params = [x, *model.parameters()]
    expected = torch.autograd.grad(model(x).square().mean(), params)
    with host_store.offload():
        graph = [model(x).square().mean()]
    assert host_store.stats().recomputed > 0
    results: dict[int, Any] = {}
    start = threading.Barrier(4, timeout=60)

    def work(i: int) -> None:
        start.wait()
        results[i] = torch.autograd.grad(graph[0], params, retain_graph=True)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    for i in range(4):
        _assert_bitwise(list(expected), list(results[i]))
    graph.clear()
    gc.collect()
    assert_empty(host_store)


def test_torch_compile_keeps_its_graph(host_store: tierstore.TierStore) -> None:
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    model = _decoder()
    compiled = torch.compile(model, backend=counter)
    x = _input()
    expected = _run(model, x, None)
    _assert_bitwise(expected, _run(compiled, x, host_store))
    assert counter.frame_count >= 1  # compiled, not skipped because a mode was active


def test_make_fx_traces_without_recipes(host_store: tierstore.TierStore) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor) -> torch.Tensor:
        with host_store.offload():
            y = F.gelu(x) @ x
        return torch.autograd.grad(y.sum(), x)[0]

    graph = make_fx(f)(torch.randn(8, 8, requires_grad=True))
    x = torch.randn(8, 8, requires_grad=True)
    assert torch.equal(graph(x), torch.autograd.grad((F.gelu(x) @ x).sum(), x)[0])
    assert host_store.stats().recomputed == 0


def test_a_checkpointed_region_is_not_recomputed_twice(host_store: tierstore.TierStore) -> None:
    calls = 0

    def region(t: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return F.gelu(t).exp()

    x = torch.randn(32, 32, requires_grad=True)
    with host_store.offload():
        y = checkpoint(region, x.sin(), use_reentrant=False) @ x
    assert calls == 1
    y.sum().backward()
    assert calls == 2  # the checkpoint's own recompute, once
    got = x.grad.clone()
    x.grad = None
    (region(x.sin()) @ x).sum().backward()
    assert torch.equal(got, x.grad)


# -- the rule -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "rebuilt"),
    [
        pytest.param(F.gelu, True, id="elementwise-gelu"),
        pytest.param(lambda x: F.silu(x) * x, True, id="elementwise-mul"),
        pytest.param(lambda x: F.layer_norm(x, (32,)), True, id="normalisation"),
        pytest.param(lambda x: F.gelu(x).t(), True, id="view"),
        pytest.param(lambda x: x @ x, False, id="matmul"),
        pytest.param(lambda x: torch.rand_like(x) + 0, False, id="random"),
        # dropout on a CPU: bernoulli_ (random, stored), then a mul that is rebuilt from it
        pytest.param(lambda x: F.dropout(x.exp(), 0.5), True, id="after-random"),
        pytest.param(lambda x: x.sigmoid().exp(), True, id="input-stored"),  # sigmoid saves it
        pytest.param(lambda x: (x @ x).tanh(), False, id="input-not-stored"),
        pytest.param(lambda x: F.gelu(x).add_(1), False, id="in-place"),
        pytest.param(lambda x: F.conv1d(x[None], x[:4, :, None])[0], False, id="convolution"),
    ],
)
def test_what_cheap_rebuilds(
    host_store: tierstore.TierStore, make: Callable[[torch.Tensor], torch.Tensor], rebuilt: bool
) -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    spy = Spy(host_store)
    torch.manual_seed(1)
    with host_store.offload():
        y = make(x)
        out = y @ w  # mm saves y
    assert spy.rebuilt(y) == rebuilt
    got = torch.autograd.grad(out.sum(), (x, w), allow_unused=True, materialize_grads=True)
    torch.manual_seed(1)
    expected = torch.autograd.grad(
        (make(x) @ w).sum(), (x, w), allow_unused=True, materialize_grads=True
    )
    _assert_bitwise(list(expected), list(got))


def test_a_random_ops_output_is_stored(host_store: tierstore.TierStore) -> None:
    x = torch.randn(32, 32, requires_grad=True)
    spy = Spy(host_store)
    with host_store.offload():
        noise = torch.rand_like(x)
        y = x * noise  # mul saves the noise
    assert not spy.rebuilt(noise)
    y.sum().backward()
    assert torch.equal(x.grad, noise)


def test_attention_is_never_rebuilt(host_store: tierstore.TierStore) -> None:
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    spy = Spy(host_store)
    with host_store.offload():
        a = F.scaled_dot_product_attention(q.exp(), q.exp(), q.exp())
        out = a @ torch.randn(8, 4)
    assert not spy.rebuilt(a)
    out.sum().backward()
    assert "scaled_dot_product" not in " ".join(recompute.CHEAP_OPS)


def test_chains_are_cut_at_the_depth_bound(host_store: tierstore.TierStore) -> None:
    x = torch.randn(64, 64, requires_grad=True)
    spy = Spy(host_store)
    with host_store.offload():
        y = x.exp()  # exp saves its output: nothing stored it yet, stored
        for _ in range(20):
            y = y.sin()  # each saves its input, made by the op before
    depths = [p.depth if type(p) is Recipe else 0 for _, _, p in spy.packed]
    # exp's output, saved again by the first sin, then the chain, cut where it is stored
    chain = list(range(1, recompute.MAX_DEPTH + 1))
    assert depths[: recompute.MAX_DEPTH + 4] == [0, 0, *chain, 0, 1]
    y.sum().backward()
    got = x.grad.clone()
    x.grad = None
    z = x.exp()
    for _ in range(20):
        z = z.sin()
    z.sum().backward()
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("op", sorted(recompute.CHEAP_OPS))
def test_every_cheap_op_is_deterministic_here(op: str) -> None:
    # Running an op twice on the same inputs gives the same bits: what a rebuild relies on.
    fn = getattr(torch.ops.aten, op)
    torch.manual_seed(0)
    x = torch.rand(16, 64) + 0.5  # positive: log, sqrt and rsqrt give numbers, not NaN
    y = torch.randn(16, 64)
    cases: dict[str, Callable[[], Any]] = {
        "native_layer_norm": lambda: fn(x, [64], None, None, 1e-5),
        "_fused_rms_norm": lambda: fn(x, [64], None, 1e-6),
        "mean": lambda: fn(x, [-1], True),
        "where": lambda: fn(x > 1, x, y),
        "masked_fill": lambda: fn(x, x > 1, 0.0),
        "_to_copy": lambda: fn(x, dtype=torch.bfloat16),
        "view": lambda: fn(x, [64, 16]),
        "_unsafe_view": lambda: fn(x, [64, 16]),
        "reshape": lambda: fn(x, [64, 16]),
        "_reshape_alias": lambda: fn(x, [64, 16], [16, 1]),
        "transpose": lambda: fn(x, 0, 1),
        "permute": lambda: fn(x, [1, 0]),
        "expand": lambda: fn(x[:1], [16, 64]),
        "unsqueeze": lambda: fn(x, 0),
        "squeeze": lambda: fn(x[None], 0),
        "slice": lambda: fn(x, 1, 0, 32),
        "select": lambda: fn(x, 0, 3),
        "split": lambda: fn(x, 8),
        "split_with_sizes": lambda: fn(x, [4, 12]),
        "unbind": lambda: fn(x),
        "chunk": lambda: fn(x, 2),
        "cat": lambda: fn([x, y], 1),
        "pow": lambda: fn(x, 2),
        "clamp": lambda: fn(x, -1, 1),
        "clamp_min": lambda: fn(x, 0),
        "clamp_max": lambda: fn(x, 0),
        "hardtanh": lambda: fn(x),
        "leaky_relu": lambda: fn(x),
        "elu": lambda: fn(x),
        "softplus": lambda: fn(x),
    }
    binary = {"add", "sub", "rsub", "mul", "div", "minimum", "maximum"}
    call = cases.get(op) or ((lambda: fn(x, y)) if op in binary else (lambda: fn(x)))
    if op == "_fused_rms_norm" and not hasattr(torch.ops.aten, op):
        pytest.skip("no _fused_rms_norm in this torch")
    recorded: list[Any] = []

    class Overloads(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            recorded.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Overloads():
        first = call()
    second = call()
    flat_a = first if isinstance(first, (tuple, list)) else [first]
    flat_b = second if isinstance(second, (tuple, list)) else [second]
    for a, b in zip(flat_a, flat_b, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
    # A recipe's own output is written by the out= overload, into the store's memory
    # (NOTE [ Rebuilt tensors in the store's memory ]): the same bits.
    ours = [r for r in recorded if r[0]._overloadpacket.__name__ == op]
    if not ours:  # decomposed above the dispatch mode (CompositeImplicit): never recorded
        return
    func, args, kwargs = ours[0]
    assert not func._schema.is_mutable
    found = tierstore.autograd.recipes._out_overload(func)
    if found is not None:
        out_op, names = found
        outs = {n: torch.full_like(a, float("nan")) for n, a in zip(names, flat_a, strict=True)}
        out_op(*args, **kwargs, **outs)
        for a, b in zip(flat_a, outs.values(), strict=True):
            assert torch.equal(a, b) and a.stride() == b.stride()
    elif op not in ("_to_copy", "split", "split_with_sizes", "unbind", "chunk"):
        assert func._schema.returns[0].alias_info is not None, f"{func} has no out= overload"


def test_random_and_in_place_ops_are_refused_whatever_the_policy() -> None:
    assert recompute.never_recorded(torch.ops.aten.native_dropout.default)
    assert recompute.never_recorded(torch.ops.aten.add_.Tensor)
    assert recompute.never_recorded(torch.ops.aten.bernoulli.default)
    assert not recompute.never_recorded(torch.ops.aten.add.Tensor)


# -- accounting and configuration -------------------------------------------------


def test_stats_count_rebuilt_saves_and_their_bytes(host_store: tierstore.TierStore) -> None:
    x = torch.randn(128, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with host_store.offload():
        out = F.gelu(x) @ w  # gelu saves x (stored); mm saves gelu(x) (rebuilt) and w
    stats = host_store.stats()
    assert (stats.recomputed, stats.recomputed_bytes) == (1, 128 * 64 * 4)
    assert stats.tiers["host"].bytes == 128 * 64 * 4 + 64 * 64 * 4  # x and w
    assert "recomputed 1 (32.0 KiB)" in str(stats)
    out.sum().backward()


def test_a_rebuilt_tensor_lives_in_the_stores_pool_until_autograd_drops_it(
    spill_root: Path,
) -> None:
    # NOTE [ Rebuilt tensors in the store's memory ]: not the process heap.
    # No read-ahead: only the reads this test makes are in flight.
    config = _cheap(all_to_disk(spill_root, "file", "none")).model_copy(
        update={"prefetch_bytes": 0}
    )
    x = torch.randn(256, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    with tierstore.TierStore(config) as s:
        spy = Spy(s)
        with s.offload():
            y = F.gelu(x)
            out = y @ w
        recipe = spy.of(y)
        assert type(recipe) is Recipe
        s.flush()
        rebuilt = recipe.rebuild(s._manager.empty)
        assert torch.equal(rebuilt, F.gelu(x).detach())
        # The read of x stays out, kept for gelu's own backward.
        during = s.stats().buffer_bytes_in_use
        del rebuilt
        assert buffers_in_use(s, during - 256 * 256 * 4) == during - 256 * 256 * 4
        out.sum().backward()
        del recipe  # what held the recipe beside autograd
        spy.packed.clear()
        assert buffers_in_use(s) == 0
    assert w.grad is not None
    assert torch.equal(w.grad, F.gelu(x).detach().t() @ torch.ones(256, 256))


def test_the_schedule_prefetches_a_recipes_inputs(spill_root: Path, reads_land_first: None) -> None:
    # Reads land before backward asks: a miss is an entry the plan did not read ahead.
    config = _cheap(all_to_disk(spill_root, "file", "none"))
    model, x = _decoder(), _input()
    with tierstore.TierStore(config) as s:
        _run(model, x, s)
        first = s.stats()
        _run(model, x, s)
        second = s.stats()
    # The first read of a backward comes before any plan: with recompute it is an
    # input of the last recipe, long written, so a miss. Every other read is planned.
    assert second.prefetch_misses - first.prefetch_misses <= 1
    assert second.prefetch_hits - first.prefetch_hits >= 8


def test_the_setting_comes_from_env_and_toml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_RECOMPUTE", "cheap")
    assert tierstore.load_config().recompute == "cheap"
    monkeypatch.delenv("TIERSTORE_RECOMPUTE")
    Path("tierstore.toml").write_text('recompute = "cheap"\n')
    assert tierstore.load_config().recompute == "cheap"


def test_a_bad_setting_names_what_to_set() -> None:
    with pytest.raises(tierstore.ConfigError) as err:
        tierstore.TierConfig(recompute="always")
    assert "recompute" in str(err.value)
    store = tierstore.TierStore(tierstore.TierConfig(disk_budget=0))
    with pytest.raises(tierstore.ConfigError) as bad, store.offload(recompute="all"):
        pass
    assert str(bad.value) == (
        "tierstore: recompute='all' is not 'off', 'cheap' or a policy function "
        "(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy; set "
        "recompute (TIERSTORE_RECOMPUTE) to one of them"
    )
    store.close()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_gpt_with_dropout_is_bitwise(host_store: tierstore.TierStore) -> None:
    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab=64, d_model=64, heads=2, layers=2, seq=32, dropout=0.1))

    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
    model = build()
    torch.manual_seed(5)
    model(tokens).logsumexp(-1).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model = build()
    torch.manual_seed(5)
    with host_store.offload():
        loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    _assert_bitwise(expected, [p.grad.clone() for p in model.parameters()])
    assert host_store.stats().recomputed > 0


def test_an_event_timed_op_is_read_when_asked_not_when_recorded() -> None:
    # NOTE [ Timing a profile ] in planning/timers.py: on CUDA an op is a span of the
    # profile's BusyTimer, its two events read (and waited for) only when the
    # plan is made.
    class Event:
        def __init__(self, ms: float) -> None:
            self.ms, self.waited = ms, False

        def synchronize(self) -> None:
            self.waited = True

        def elapsed_time(self, end: Event) -> float:
            assert end.waited
            return end.ms - self.ms

    events: list[Event] = []

    def record() -> Event:
        events.append(Event(len(events) ** 2))  # the device's clock, in ms
        return events[-1]

    timer = BusyTimer(lambda: 0.0, record)
    timer.device = True
    recorder = Recorder(everything, lambda t: t.grad_fn is None, timer=timer)
    x = torch.randn(8, requires_grad=True)
    with recorder:
        y = x.sin()
    op, cost, _, _ = recorder.describe(y)
    assert op == "aten.sin" and callable(cost)
    assert events and not any(e.waited for e in events)
    start, end = events[-2:]  # sin's span
    assert cost() == pytest.approx(1e-3 * (end.ms - start.ms)) and end.waited


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recipes_from_the_graph_rebuild_gelu_silu_and_swiglu_bitwise(
    device: str, dtype: torch.dtype
) -> None:
    # NOTE [ Rebuilt from the graph ]: the saved views the Linears after them
    # save, rebuilt from the inputs their nodes hold, are the tensors forward made.
    torch.manual_seed(0)
    up, gate = (torch.nn.Linear(32, 64, device=device, dtype=dtype) for _ in range(2))
    x = torch.randn(4, 8, 32, device=device, dtype=dtype, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        saved.append(t)
        return t.detach(), t._version

    w = torch.randn(64, 4, device=device, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]):
        g = F.gelu(up(x), approximate="tanh")
        h = F.silu(gate(x)) * up(x)  # SwiGLU
        loss = (g @ w).sum() + (h @ w).sum()
    ops = []
    for t in saved:
        recipe = graph.graph_recipe(t, t.numel() * t.element_size(), lambda p: p)
        if recipe is None:
            continue
        ops.append(graph.graph_op(t).name())
        rebuilt = recipe.rebuild(lambda *a: None)
        assert torch.equal(rebuilt, t) and rebuilt.stride() == t.stride()
    # SiLU's output the product saves; GELU's output and the product, the matmuls.
    assert ops == ["SiluBackward0", "GeluBackward0", "MulBackward0"]
    del loss


def _saved_by_linear_after(
    norm: torch.nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``Linear(norm(x))`` under hooks that keep every save as it is: the norm's output,
    the Linear's, and what the Linear saved."""
    lin = torch.nn.Linear(x.shape[-1], 8, device=x.device, dtype=x.dtype)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        saved.append(t)
        return t.detach(), t._version

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]):
        h = norm(x)
        before = len(saved)
        y = lin(h)
    return h, y, saved[before:]


def _norm_output(saved: list[torch.Tensor]) -> torch.Tensor:
    """Of a Linear's saves, the view of the norm's output it took as its input."""
    (t,) = [t for t in saved if t._base is not None and t.dim() == 2 and t.shape[1] == 32]
    return t


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_layer_norms_output_is_rebuilt_from_the_graph_with_the_eps_the_recorder_saw(
    device: str, dtype: torch.dtype, bias: bool
) -> None:
    # NOTE [ A norm's eps ]: the node holds no eps. Until a recorder has seen
    # the op with this weight, no recipe; after, the rebuild is forward's
    # output, bitwise, with an eps other than the default (a rebuild with
    # the default would differ); with no bias too (GraphOp.optional).
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(32, eps=1e-2, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if bias:
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 8, 32, device=device, dtype=dtype, requires_grad=True) * 3
    _, _, saved = _saved_by_linear_after(norm, x)
    t = _norm_output(saved)
    assert graph.graph_op(t, lambda p: p) is None
    assert graph.graph_recipe(t, t.numel() * t.element_size(), lambda p: p) is None

    with Recorder(everything, lambda t: False):
        norm(x)  # a profiled step's forward: the recorder sees the op
    h, y, saved = _saved_by_linear_after(norm, x)
    t = _norm_output(saved)
    assert graph.graph_op(t, lambda p: p).name() == "NativeLayerNormBackward0"
    recipe = graph.graph_recipe(t, t.numel() * t.element_size(), lambda p: p)
    assert recipe is not None
    rebuilt = recipe.rebuild(lambda *a: None)
    assert torch.equal(rebuilt, t) and rebuilt.stride() == t.stride()
    default = F.layer_norm(x.detach(), (32,), norm.weight, norm.bias).view(-1, 32)
    assert not torch.equal(default, t)  # the eps matters: the recorder's was taken
    del h, y


def test_a_layer_norm_whose_eps_is_in_doubt_is_not_rebuilt_from_the_graph() -> None:
    # NOTE [ A norm's eps ]: one weight seen with two eps values; a norm
    # with no weight (its node saves none). Neither gets a recipe.
    x = torch.randn(4, 8, 32, requires_grad=True)
    norm = torch.nn.LayerNorm(32)
    with Recorder(everything, lambda t: False):
        norm(x)
        F.layer_norm(x, (32,), norm.weight, norm.bias, eps=1e-3)
    _, _, saved = _saved_by_linear_after(norm, x)
    t = _norm_output(saved)
    assert graph.graph_op(t, lambda p: p) is None
    assert graph.graph_recipe(t, t.numel() * 4, lambda p: p) is None

    bare = torch.nn.LayerNorm(32, elementwise_affine=False)
    with Recorder(everything, lambda t: False):
        bare(x)
    _, _, saved = _saved_by_linear_after(bare, x)
    t = _norm_output(saved)
    assert graph.graph_op(t, lambda p: p) is None
    assert graph.graph_recipe(t, t.numel() * 4, lambda p: p) is None


def test_a_norm_whose_eps_changed_since_the_recorder_saw_it_raises_at_rebuild() -> None:
    # NOTE [ A norm's eps ]: the eps is the profile's; a module changed since
    # is caught by forward's rstd, which the rebuild must match bit for bit,
    # before any wrong gradient.
    norm = torch.nn.LayerNorm(32, eps=1e-2)
    x = torch.randn(4, 8, 32, requires_grad=True)
    with Recorder(everything, lambda t: False):
        norm(x)
    norm.eps = 1e-5
    _, _, saved = _saved_by_linear_after(norm, x)
    t = _norm_output(saved)
    recipe = graph.graph_recipe(t, t.numel() * 4, lambda p: p)
    assert recipe is not None
    with pytest.raises(tierstore.TierstoreError, match="the eps noted for this norm is not"):
        recipe.rebuild(lambda *a: None)


def test_norms_whose_weights_share_one_flat_buffer_keep_their_own_eps() -> None:
    # NOTE [ A norm's eps ]: two norms' weights, views of one buffer (as a
    # flat parameter holds them), each with its eps: each rebuild takes its
    # own, bitwise.
    flat = torch.rand(64) + 0.5
    x = torch.randn(4, 8, 32, requires_grad=True)
    norms = []
    for k, eps in enumerate((1e-2, 1e-4)):
        weight = flat[32 * k : 32 * (k + 1)]
        norms.append(lambda t, w=weight, e=eps: F.layer_norm(t, (32,), w, None, e))
    with Recorder(everything, lambda t: False):
        for norm in norms:
            norm(x)
    for norm in norms:
        _, _, saved = _saved_by_linear_after(_Fn(norm), x)
        t = _norm_output(saved)
        recipe = graph.graph_recipe(t, t.numel() * 4, lambda p: p)
        assert recipe is not None
        assert torch.equal(recipe.rebuild(lambda *a: None), t)


class _Fn(torch.nn.Module):
    """A function as a module."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def test_a_norm_packed_by_another_hook_is_not_rebuilt_from_the_graph() -> None:
    # A block of save_on_cpu nested inside the store's: the norm's node holds
    # that hook's (device, tensor) pairs, which are not the pack hook's kept
    # forms; graph_op and graph_recipe say no, rather than fail.
    from tierstore.autograd.filters import held

    norm = torch.nn.LayerNorm(32)
    x = torch.randn(4, 8, 32, requires_grad=True)
    with Recorder(everything, lambda t: False):
        norm(x)
    with torch.autograd.graph.save_on_cpu():
        h = norm(x)
    t = h.view(-1, 32)
    assert graph.graph_op(t, held) is None
    assert graph.graph_recipe(t, t.numel() * 4, held) is None


@pytest.mark.parametrize("view", [False, True])
def test_a_recorded_rebuild_takes_an_input_rebuilt_from_the_graph(view: bool) -> None:
    # NOTE [ Rebuilt from the graph ]: where the recorder cannot rebuild a
    # save (its input was made before the recorder ran, or is kept as it is
    # without its notice), the save is rebuilt from the graph; an op the
    # recorder saw that takes it builds on that rebuild, rather than leave its
    # own save to be stored where the plan rebuilds it.
    recorder = Recorder(everything, lambda t: False)
    x = torch.randn(16, 32, requires_grad=True) * 1.0  # before the recorder: unresolved

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return t.detach(), t._version  # kept as it is, as the hooks' own kept forms

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]), recorder:
        s = F.gelu(x).t() if view else F.gelu(x)
        from_graph = graph.graph_recipe(s, s.numel() * 4, lambda p: p)
        assert from_graph is not None and recorder.recipe_for(s, s.numel() * 4) is None
        recorder.note_packed(s, from_graph, None)  # as a planned step's pack hook does
        k = s * 3.0
    recipe = recorder.recipe_for(k, k.numel() * 4)
    assert recipe is not None
    rebuilt = recipe.rebuild(lambda *a: None)
    assert torch.equal(rebuilt, k) and rebuilt.stride() == k.stride()
