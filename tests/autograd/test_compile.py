"""torch.compile and compiled autograd under ``offload()`` (issue 5, items 2 and 3).

What the installed PyTorch does, and what these tests hold it to:

* ``torch.compile``: Dynamo and AOTAutograd switch the ambient saved-tensor
  hooks off while they trace (pytorch/pytorch#123196), so the hooks never see
  a FakeTensor or FunctionalTensor there. At run time the compiled forward is
  one autograd function whose saved tensors go through the hooks: those are
  the tensors offloaded, after the graph ran.
* Compiled autograd lifts each unpack into the compiled backward graph, just
  before its first use (pytorch/pytorch#147242), so saved tensors come back
  progressively, interleaved with tensor hooks as in eager. The unit is the
  autograd node: a compiled forward region is one node, whose saves all come
  back when its backward starts. tierstore's hooks are never traced (they are
  Dynamo-disabled), so each unpack is a graph break of the compiled backward.
* ``make_fx`` and ``FakeTensorMode`` do run the hooks on placeholders; those
  must reach no tier.

Inductor on a 2-core CPU compiles slowly: its variants are marked ``slow``
and the models are tiny.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import tierstore
from tierstore.models import GPT, GPTConfig
from tierstore.planning.runner import PlanRunner

pytestmark = [
    # torch.compile(module) warns while any global module hook exists: tierstore has none.
    pytest.mark.filterwarnings("error:Using `torch.compile\\(module\\)`:UserWarning"),
    # Inductor's own use of a deprecated torch.jit API.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

BACKENDS = [
    pytest.param("aot_eager", id="aot_eager"),
    pytest.param("inductor", id="inductor", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", autouse=True)
def _inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One inductor cache for the module: the same graph compiled twice compiles once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    compiled_autograd.reset()


@pytest.fixture
def store(spill_root: Path) -> Iterator[tierstore.TierStore]:
    """Every saved tensor but parameters goes to disk (the file backend)."""
    config = tierstore.TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget="64MiB",
        disk_path=spill_root,
        min_offload_bytes=0,
    )
    with tierstore.TierStore(config) as s:
        yield s


class _Recorder:
    """Watches what reaches the tier manager: puts and gets per entry, and when.

    ``tracing`` is set while a backend compiles (see :func:`_watched`); a put
    then, a put of anything but a plain tensor, or one while Dynamo traces, is
    noted in ``wrong``.
    """

    def __init__(self, store: tierstore.TierStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.puts: collections.Counter[int] = collections.Counter()
        self.gets: collections.Counter[int] = collections.Counter()
        self.events: list[str] = []
        self.wrong: list[str] = []
        self.gets_outside_compiled_autograd = 0
        self.tracing = False
        manager = store._manager
        put, get = manager.put, manager.get

        def recording_put(t: torch.Tensor, nbytes: int | None = None) -> Any:
            if self.tracing or torch.compiler.is_compiling() or type(t) is not torch.Tensor:
                self.wrong.append(f"{type(t).__name__} {tuple(t.shape)} tracing={self.tracing}")
            handle = put(t, nbytes)
            self.puts[handle.key] += 1
            return handle

        def recording_get(handle: Any) -> torch.Tensor:
            if self.tracing or torch.compiler.is_compiling():
                self.wrong.append(f"get {handle.shape} while tracing")
            if not compiled_autograd.in_compiled_autograd_region:
                self.gets_outside_compiled_autograd += 1
            self.gets[handle.key] += 1
            self.events.append(f"unpack {list(handle.shape)}")
            return get(handle)

        monkeypatch.setattr(manager, "put", recording_put)
        monkeypatch.setattr(manager, "get", recording_get)


@pytest.fixture
def recorder(store: tierstore.TierStore, monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    return _Recorder(store, monkeypatch)


def _watched(backend: str, recorder: _Recorder | None = None) -> Callable[..., Any]:
    """``backend`` as a callable that flags ``recorder.tracing`` while it compiles."""
    compile_fn = lookup_backend(backend)

    def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if recorder is None:
            return compile_fn(gm, example_inputs)
        recorder.tracing = True
        try:
            return compile_fn(gm, example_inputs)
        finally:
            recorder.tracing = False

    return compiler


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 8),
    )


def _inputs() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    grads = [p.grad for p in model.parameters()] + [x.grad]
    assert all(g is not None for g in grads)
    return [g for g in grads if g is not None]


def _assert_bitwise(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"gradient {i} differs"


def _compiled_step(
    backend: Callable[..., Any], offload: contextlib.AbstractContextManager[Any]
) -> list[torch.Tensor]:
    model = _mlp()
    compiled = torch.compile(model, backend=backend)
    x = _inputs()
    with offload:
        loss = compiled(x).square().mean()
    loss.backward()
    return _grads(model, x)


# -- torch.compile -------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_offloads_its_saves_at_run_time(
    backend: str,
    store: tierstore.TierStore,
    recorder: _Recorder,
    empty_check: Callable[[tierstore.TierStore], None],
) -> None:
    model = _mlp()
    x = _inputs()
    model(x).square().mean().backward()
    eager = _grads(model, x)
    compiled_alone = _compiled_step(_watched(backend), contextlib.nullcontext())
    torch._dynamo.reset()

    got = _compiled_step(_watched(backend, recorder), store.offload())

    # Bitwise the compiled model's own gradients, which are eager's within
    # float32 rounding (inductor fuses and reorders reductions).
    _assert_bitwise(compiled_alone, got)
    torch.testing.assert_close(got, eager)
    # Only real tensors, only at run time: nothing packed while Dynamo traced
    # or the backend compiled, so no copy or file write of a placeholder.
    assert recorder.wrong == []
    assert recorder.puts, "the compiled graph's saves were not offloaded"
    assert recorder.gets == recorder.puts  # one unpack per pack, per entry
    stats = store.stats()
    assert stats.tiers["disk"].bytes_written > 0
    empty_check(store)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_make_fx_tracing_reaches_no_tier(store: tierstore.TierStore, mode: str) -> None:
    """Regression: symbolic sizes once made the kept-bytes counter a SymInt."""
    seen: list[type] = []
    pack = store._pack

    def watching_pack(t: torch.Tensor) -> Any:
        seen.append(type(t))
        return pack(t)

    store._pack = watching_pack  # type: ignore[method-assign]

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(torch.tanh(x @ w).sum(), w)
        return grad

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with store.offload():
        gm = make_fx(f, tracing_mode=mode)(x, w)

    assert seen and all(t is FakeTensor for t in seen)
    stats = store.stats()
    assert (stats.packed, stats.kept, stats.kept_bytes) == (0, 0, 0)
    assert type(stats.kept_bytes) is int and "kept 0" in str(stats)
    assert stats.tiers["disk"].bytes_written == 0
    assert torch.equal(gm(x, w), f(x, w))


def test_functional_tensor_passes_through(store: tierstore.TierStore) -> None:
    # Inside the mode, as functionalization calls the hooks (torch 2.11 refuses
    # to detach a FunctionalTensor outside it).
    with FunctionalTensorMode():
        t = FunctionalTensor.to_functional(torch.randn(4, 8))
        packed = store._pack(t)
        back = store._unpack(packed)
    assert type(back) is FunctionalTensor and back.shape == t.shape
    assert store.stats().packed == 0


def test_in_place_module_compile(
    store: tierstore.TierStore, empty_check: Callable[[tierstore.TierStore], None]
) -> None:
    """Regression: ``module.compile()`` left Dynamo tracing into the pack hook.

    Eager code run while Dynamo's frame callback is active (here the module's
    call, which Dynamo does not compile) calls the pack hook as a new frame,
    and Dynamo traced tierstore's locks, threads and coroutines until it
    raised ``AssertionError: Cannot generate resume function for generator``.
    The hooks are now ``torch._disable_dynamo``.
    """
    model = _mlp()
    x = _inputs()
    model(x).square().mean().backward()
    eager = _grads(model, x)

    model = _mlp()
    model.compile(backend="aot_eager")
    x = _inputs()
    with store.offload():
        loss = model(x).square().mean()
    assert store.stats().packed > 0
    loss.backward()
    _assert_bitwise(eager, _grads(model, x))
    empty_check(store)


def _train_gpt(
    backend: Callable[..., Any], store: tierstore.TierStore | None, steps: int = 2
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per-block compile, the common recipe: each transformer block compiled on its own."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, d_model=16, heads=2, layers=2, seq=8))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    grads = []
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, 8))
        with store.offload() if store is not None else contextlib.nullcontext():
            loss = model.loss(tokens)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_block_compiled_gpt_trains_bitwise(
    backend: str,
    store: tierstore.TierStore,
    recorder: _Recorder,
    empty_check: Callable[[tierstore.TierStore], None],
) -> None:
    expected_grads, expected_params = _train_gpt(_watched(backend), None)
    torch._dynamo.reset()
    grads, params = _train_gpt(_watched(backend, recorder), store)

    for step, (a, b) in enumerate(zip(expected_grads, grads, strict=True)):
        assert len(a) == len(b) == len(expected_params), step
        _assert_bitwise(a, b)
    _assert_bitwise(expected_params, params)
    assert recorder.wrong == []
    assert recorder.puts and recorder.gets == recorder.puts
    assert store.stats().tiers["disk"].bytes_written > 0
    empty_check(store)


# -- recompiles and buffers under torch.compile -----------------------------------


def test_offload_every_step_does_not_recompile(store: tierstore.TierStore) -> None:
    compiled = torch.compile(_mlp(), backend="aot_eager")
    graphs = []
    for _ in range(3):
        counters.clear()
        with store.offload():
            loss = compiled(_inputs()).sum()
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 0, 0]


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)
        self.register_buffer("scale", torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # saves the buffer for the input's gradient


def test_buffer_saved_by_compiled_graph_stays(store: tierstore.TierStore) -> None:
    # NOTE [ Buffer watch ]: the compiled graph runs on the real buffer, whose
    # module registered it; a forward hook under Dynamo would have noted nothing.
    module = _Scaled()
    compiled = torch.compile(module, backend="aot_eager")
    with store.offload():
        loss = compiled(torch.randn(4, 16)).sum()
    tally = store._manager.pack_tally().counts
    loss.backward()
    # The input goes to disk; the buffer (32 floats) stays as a parameter would.
    assert tally == {"offloaded": (1, 4 * 16 * 4), "parameter": (1, 32 * 4)}


# -- compiled autograd --------------------------------------------------------------


def _hooked_backward(
    store: tierstore.TierStore | None,
    events: list[str],
    compiler: Callable[..., Any] | None,
) -> list[torch.Tensor]:
    """Eager forward with tensor hooks on two activations; backward compiled or not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 8),
    )
    x = _inputs()
    with store.offload() if store is not None else contextlib.nullcontext():
        h1 = model[1](model[0](x))
        h1.register_hook(lambda grad: events.append("hook h1"))
        h2 = model[3](model[2](h1))
        h2.register_hook(lambda grad: events.append("hook h2"))
        loss = model[4](h2).square().sum()
    if compiler is None:
        loss.backward()
    else:
        with compiled_autograd._enable(compiler):
            loss.backward()
    return _grads(model, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_autograd_unpacks_progressively(
    backend: str,
    store: tierstore.TierStore,
    recorder: _Recorder,
    empty_check: Callable[[tierstore.TierStore], None],
) -> None:
    compiler = functools.partial(torch.compile, backend=backend)
    eager = _hooked_backward(store, recorder.events, None)
    eager_events = list(recorder.events)
    assert recorder.gets_outside_compiled_autograd == len(eager_events) - 2 > 0
    recorder.events.clear()
    recorder.gets_outside_compiled_autograd = 0
    alone = _hooked_backward(None, [], compiler)

    got = _hooked_backward(store, recorder.events, compiler)

    # Every unpack ran inside the compiled backward, each entry unpacked once
    # per pack, in eager's order: after the hook on h2 has fired, some saved
    # tensors are still on disk, and some are read only after the hook on h1.
    assert recorder.gets_outside_compiled_autograd == 0
    assert recorder.gets == recorder.puts
    assert recorder.events == eager_events
    h2, h1 = recorder.events.index("hook h2"), recorder.events.index("hook h1")
    unpacks = [i for i, e in enumerate(recorder.events) if e.startswith("unpack")]
    assert unpacks[0] < h2 < h1 < unpacks[-1]
    assert any(h2 < i < h1 for i in unpacks)
    # aot_eager runs eager's kernels: eager's gradients bit for bit. Inductor
    # fuses the backward's pointwise ops: bitwise its own result without
    # tierstore, and eager's within float32 rounding.
    _assert_bitwise(alone, got)
    if backend == "aot_eager":
        _assert_bitwise(eager, got)
    torch.testing.assert_close(got, eager)
    assert recorder.wrong == []
    empty_check(store)


def test_compiled_autograd_unpacks_a_compiled_region_at_once(
    store: tierstore.TierStore,
    recorder: _Recorder,
    empty_check: Callable[[tierstore.TierStore], None],
) -> None:
    """A compiled forward is one autograd node: its saves come back together.

    Its backward graph takes every saved tensor as an input, so in the
    compiled autograd graph all of that node's unpacks feed its prologue.
    Progress is per node: with per-block compile, block by block.
    """
    torch.manual_seed(0)
    blocks = [
        torch.compile(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)),
            backend="aot_eager",
        )
        for _ in range(2)
    ]
    x = _inputs()
    with store.offload():
        h = blocks[0](x)
        h.register_hook(lambda grad: recorder.events.append("hook h"))
        first = sum(recorder.puts.values())
        loss = blocks[1](h).tanh().sum()
        second = sum(recorder.puts.values()) - first - 1  # less the last tanh's output
    graphs: list[torch.fx.GraphModule] = []

    def compiler(gm: torch.fx.GraphModule) -> Any:
        graphs.append(gm)
        return torch.compile(gm, backend="aot_eager")

    with compiled_autograd._enable(compiler):
        loss.backward()

    (graph,) = graphs
    unpacks = {
        node
        for node in graph.graph.nodes
        if node.op == "call_function" and node.kwargs.get("hook_type") == "unpack_hook"
    }
    prologues = [n for n in graph.graph.nodes if "call_aot_bwd_prologue" in n.name]
    fed = [unpacks.intersection(p.all_input_nodes) for p in prologues]
    # Each block's saves (offloaded and kept: weights too) feed its prologue;
    # the one unpack left over is the last tanh's, outside the blocks.
    assert len(fed) == 2 and all(len(f) > 2 for f in fed)
    assert len(unpacks - fed[0] - fed[1]) == 1
    # At run time: the last tanh's output, block 2's saves, the hook, block 1's.
    assert recorder.gets_outside_compiled_autograd == 0
    assert recorder.gets == recorder.puts
    hook = recorder.events.index("hook h")
    assert first > 1 and second > 1
    assert hook == 1 + second and len(recorder.events) == hook + 1 + first
    empty_check(store)


def test_compiled_autograd_config_flag(
    store: tierstore.TierStore,
    recorder: _Recorder,
    empty_check: Callable[[tierstore.TierStore], None],
) -> None:
    """``torch._dynamo.config.compiled_autograd``, read when ``torch.compile`` is called."""

    def train(model: torch.nn.Module, x: torch.Tensor) -> None:
        model(x).square().mean().backward()

    results = []
    for offload in (contextlib.nullcontext(), store.offload()):
        torch._dynamo.reset()
        model = _mlp()
        x = _inputs()
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled = torch.compile(train, backend="aot_eager")
            with offload:
                compiled(model, x)
        results.append(_grads(model, x))

    _assert_bitwise(*results)
    assert recorder.puts and recorder.gets == recorder.puts
    assert recorder.gets_outside_compiled_autograd == 0
    empty_check(store)


# -- a budget under torch.compile (issue 34, items 1 and 2) -------------------------


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class _Net(torch.nn.Module):
    """Defined in a module file: the case where Dynamo traced into a global module hook."""

    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _budget_steps(
    model: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    root: Path,
    *,
    steps: int = 6,
    until_peak_warned: bool = False,
    planned: int = 0,
) -> tuple[tierstore.TierStore, list[str]]:
    """Steps under activation_budget=0.3; the TierstoreWarnings they raised.

    ``planned``: step on (up to a deadline) until that many steps ran a plan;
    on a busy machine a step over the budget sends the next to the safe
    placement while its plan is remade off the thread.
    """
    torch.manual_seed(0)
    x = torch.randn(8, 64, 32)
    config = tierstore.TierConfig(activation_budget=0.3, disk_path=root)
    store = tierstore.TierStore(config)
    hooks = torch.nn.modules.module
    deadline = time.monotonic() + 300
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = 0
        while step < steps:
            with store.offload():
                loss = model(x).square().mean()
                # No global module hook, on any path (item 2).
                assert not hooks._global_forward_pre_hooks and not hooks._global_forward_hooks
            loss.backward()
            for p in params:
                p.grad = None
            step += 1
            # Plans remade in their process take as many steps as they take
            # (up to a deadline); once warned, three steps more show it is
            # said once.
            if until_peak_warned:
                warned = any("the step's peak" in str(w.message) for w in caught)
                if warned and steps > step + 3:
                    steps = step + 3
                elif not warned and step == steps and time.monotonic() < deadline:
                    steps += 1
            # A step is counted as it ends, when the next block begins: one step more.
            short = store.stats().planned_steps < planned
            if short and step == steps and time.monotonic() < deadline:
                steps += 1
    store.close()
    said = [str(w.message) for w in caught if issubclass(w.category, tierstore.TierstoreWarning)]
    return store, said


def test_whole_model_compile_under_a_budget_runs_and_says_once_why_it_cannot_hold(
    spill_root: Path,
) -> None:
    # Dynamo once traced into the planner's global module hook and failed
    # ("UnspecializedNNModuleVariable(Net) is already tracked for mutation");
    # and a compiled region's saves all arrive as it ends, so the budget
    # cannot hold there: the user is told once, with the fixes.
    model = _Net()
    compiled = torch.compile(model, backend="aot_eager")
    # Warm-up, profile, a planned step over the budget, the plan remade off
    # the training thread for it, and a step under that plan: then the warning.
    store, said = _budget_steps(
        compiled, list(model.parameters()), spill_root, steps=40, until_peak_warned=True
    )
    plan = store.plan()
    assert plan is not None and plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes > 1.1 * plan.budget_bytes
    peak = [m for m in said if m.startswith("tierstore: the step's peak")]
    assert len(peak) == 1, said
    assert "torch.compile'd region" in peak[0]
    assert "block.compile()" in peak[0] and "activation_memory_budget" in peak[0]
    # The table names the model, not torch.compile's wrapper.
    assert "_Net" in str(plan) and "OptimizedModule" not in str(plan)


class _KeptHead(torch.nn.Module):
    """``layers``, the last run inside ``tierstore.keep()``."""

    def __init__(self, layers: torch.nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[:-1](x)
        with tierstore.keep():
            out: torch.Tensor = self.layers[-1](h)
        return out


def _kept_head_steps(
    root: Path, compiled: bool, keep: str | None, offload: bool = True
) -> tuple[int, list[torch.Tensor]]:
    """Three steps of ``_mlp``, its head kept by ``keep`` (or not): kept count and gradients."""
    torch._dynamo.reset()
    layers, x = _mlp(), _inputs()
    model = _KeptHead(layers) if keep == "keep()" else layers
    handle = tierstore.keep_module(layers[-1]) if keep == "keep_module" else None
    run = torch.compile(model, backend="aot_eager") if compiled else model
    config = tierstore.TierConfig(
        device_budget=0, host_budget=0, disk_path=root, min_offload_bytes=0
    )
    with tierstore.TierStore(config) as store:
        for _ in range(3):
            with store.offload() if offload else contextlib.nullcontext():
                loss = run(x).square().mean()
            loss.backward()
        kept = store.stats().kept
    if handle is not None:
        handle.remove()
    return kept, _grads(model, x)


@pytest.mark.parametrize("keep", ["keep_module", "keep()"])
def test_keep_under_a_whole_model_compile(spill_root: Path, keep: str) -> None:
    # Dynamo traced keep_module's hooks and keep()'s block into the graph,
    # guarded on the thread-local tier they set, and failed that guard in the
    # frame that made it ("Guard failed on the same frame it was created") at
    # the second step. They now run as the compiled code reaches them (a graph
    # break each), and keep what eager keeps: the head's input.
    kept, grads = _kept_head_steps(spill_root, compiled=True, keep=keep)
    eager_kept, _ = _kept_head_steps(spill_root, compiled=False, keep=keep)
    plain_kept, _ = _kept_head_steps(spill_root, compiled=True, keep=None)
    _, expected = _kept_head_steps(spill_root, compiled=True, keep=None, offload=False)
    assert kept == eager_kept > plain_kept
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert not list(spill_root.iterdir())


def test_per_block_compile_holds_the_budget(
    spill_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Net(n=8)  # a block's saves, handed over together, are 1/8 of the step's
    for block in model.blocks:
        block.compile(backend="aot_eager")
    ratios: list[float] = []  # each planned step's measured peak over its plan's budget
    step_ended = PlanRunner.step_ended

    def measured(self: PlanRunner, peak_bytes: int) -> str | None:
        plan = self.plan
        if self.planned and plan is not None:
            ratios.append(peak_bytes / plan.budget_bytes)
        return step_ended(self, peak_bytes)

    monkeypatch.setattr(PlanRunner, "step_ended", measured)
    store, said = _budget_steps(model, list(model.parameters()), spill_root, planned=3)
    plan = store.plan()
    assert plan is not None and plan.measured_peak_bytes is not None
    # Each block hands over its saves together, an eighth of the step's: the
    # plan keeps room for that. A step on a busy machine, its writes behind,
    # may run over, which the next step corrects (NOTE [ A peak above the
    # budget ] in planning/checker.py): the planned steps' median holds.
    assert len(ratios) >= 3 and sorted(ratios)[len(ratios) // 2] <= 1.25, (ratios, str(plan))
    assert not [m for m in said if "a torch.compile'd region" in m], said
    # One row per block.
    assert [line.split()[0] for line in str(plan).splitlines()[1:9]] == [
        f"_Net.blocks.{i}" for i in range(8)
    ]


def test_whole_model_compile_of_a_model_in_main_runs(spill_root: Path) -> None:
    # The same, for a model class defined in __main__, in a fresh process.
    script = f"""
import time, warnings, torch, tierstore

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

model = torch.nn.Sequential(*[Block() for _ in range(4)])
compiled = torch.compile(model, backend="aot_eager")
x = torch.randn(8, 64, 32)
config = tierstore.TierConfig(activation_budget=0.3, disk_path={str(spill_root)!r})
store = tierstore.TierStore(config)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # Plans are made in a process of their own at a lower priority: as many
    # steps as that takes on a busy machine.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with store.offload():
            compiled(x).square().mean().backward()
        if any("the step's peak" in str(w.message) for w in caught):
            break
    for _ in range(3):  # and once only
        with store.offload():
            compiled(x).square().mean().backward()
store.close()
said = [str(w.message) for w in caught if issubclass(w.category, tierstore.TierstoreWarning)]
print(sum(m.startswith("tierstore: the step's peak") for m in said))
print(sum("global hooks on modules" in str(w.message) for w in caught))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "0"], out.stdout + out.stderr[-3000:]
