"""``tierstore bench train``: GPT training steps under each way of handling saved activations.

Strategies, all training the same model from the same initial weights on
the same tokens with the same dropout masks:

* ``none``: eager autograd, everything saved stays in memory;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (pinned when the
  model runs on CUDA);
* ``checkpoint``: ``torch.utils.checkpoint`` around every block
  (``use_reentrant=False``; RNG state preserved, so dropout recomputes the
  same masks);
* ``disk-naive``: the pattern PyTorch's autograd docs show for saving to
  disk: the pack hook ``torch.save``-s each tensor to its own file and
  returns an object that deletes the file in ``__del__``; the unpack hook
  ``torch.load(weights_only=True)``-s it;
* ``tierstore-file``, ``tierstore-lmdb``: ``TierStore`` with
  ``device_budget=0, host_budget=0``: every saved tensor of at least
  ``--min-offload-bytes`` goes to disk;
* ``checkpoint+tierstore``: the recipe "checkpoint each block, offload the
  boundaries": ``checkpoint`` as above inside ``offload()`` of a store that
  sends them to disk (CPU) or to pinned host memory (CUDA);
* ``checkpoint-N``: ``checkpoint`` on the first N blocks only;
* ``budget=F`` (``--budget F[,F...]``, F a fraction of what the step saves
  such as 0.3 or '30%', or a size such as '512MiB'): a ``TierStore`` with
  only ``activation_budget=F`` set, which plans keep / offload / rebuild per
  saved tensor; its row reports the plan, predicted beside measured
  (NOTE [ Budget rows ]);

and on CUDA (where the host tier is a copy off the device):

* ``torchtune``: torchtune's ``OffloadActivations(use_streams=True)``, when
  torchtune is importable (skipped otherwise, and said so in the JSON);
* ``tierstore-host``: ``TierStore`` with ``device_budget=--device-budget``
  (default 0), the rest in pinned host memory;
* ``tierstore-host-disk``: half of the saved bytes fit in host memory, the
  rest goes on to disk.

``--sweep`` runs, side by side in one run, ``none``, ``checkpoint-N`` for
every N below the number of blocks, ``checkpoint``, ``disk-naive``,
``tierstore-file`` and ``budget=F`` for each of :data:`SWEEP_BUDGETS`, and
draws memory against step time (:func:`plot_sweep`): a PNG at ``--plot``,
else beside ``--json``.

NOTE [ What bench train measures ]
* One fresh process per strategy (CPU, the default). glibc keeps the heap
  memory a process frees (tensors of up to 32 MiB come from heaps whose
  freed pages stay resident), so strategies run one after another in one
  process pollute each other's RSS: a later strategy starts on a heap an
  earlier one grew, and its figure depends on what ran before it. A user's
  training process runs one strategy, so the benchmark runs each in a child
  interpreter of its own, in the order of :data:`STRATEGIES` (``none``
  first), one at a time, from the same seed. The child builds the model,
  allocates the gradients (zeros, zeroed in place by every step) and the
  optimizer, reads the baseline, runs the warm-up and measured steps, prints
  a JSON line per step (the progress bar) and its results (step times, peaks,
  tier statistics) on stdout, and saves its final gradients with safetensors
  in the run's scratch directory, where the parent compares them with
  ``none``'s. ``--in-process`` (``isolate=False``: tests, doctests) runs every
  strategy in this process instead, with the garbage collector and
  ``malloc_trim(0)`` before every step to limit the pollution; its memory is
  labelled so. CUDA always runs in this process: the caching allocator's
  counters are the device's, reset before every step.
* Step time: forward, backward and an SGD update, wall clock (CUDA:
  synchronized), median over the measured steps. Every strategy's steps run
  the same samplers, so none pays for measuring alone: memory every 1 ms in
  every step; the store's bytes per tier every 5 ms in the warm-up steps
  only, for every strategy (a no-op where there is no store). ``stats()``
  takes the store's lock and holds the interpreter for ~20 us a call, a cost
  only a store would pay, so no timed step polls it: the bytes-per-tier
  timeline (``tier_timeline``) is the last warm-up step's.
* Peak memory, the headline. CPU: peak anonymous RSS above the RSS just
  before the first step (model, gradients and optimizer in place), over the
  warm-up and the measured steps, on the default allocator: no ``mallopt``,
  no ``malloc_trim``, no environment variable changed, because a user's
  process calls none of them, and ``top`` shows what that leaves resident.
  (A store with an ``activation_budget`` calls ``malloc_trim`` itself,
  NOTE [ Handing the heap back ] in tierstore/backends/host.py: that is
  tierstore's behaviour, which a user's process gets too.)
  Sampled every ~1 ms by a thread (``RssAnon``, read as resident minus shared
  pages of ``/proc/self/statm``: the same kernel counters as
  ``/proc/self/status``, ten times cheaper to read). The JSON keeps the
  absolute peak too (``peak_rss_total_bytes``: the process's whole anonymous
  resident memory, torch and the model included). The gradients exist before
  the first step, so they are in the baseline: the figure is activations,
  backward's temporaries and what the allocator keeps of them. File pages
  (the page cache, LMDB's map) are not anonymous memory. CUDA:
  ``max_memory_reserved`` above the reservation before the first step (what
  ``nvidia-smi`` shows, less the context), and ``max_memory_allocated``
  above the allocation before the first step beside it; peak counters reset
  before every step, figures the maximum over all steps.
* Live memory (CPU, beside the headline; ``--no-live-pass`` skips it). RSS on
  the default allocator counts what the allocator holds, not what tensors
  use (measured on the default model with the old in-process method:
  0.8-1.2 GiB still resident after a step whose tensors were all freed, and a
  tierstore peak twice its live peak). One more fresh interpreter sets glibc
  ``M_MMAP_THRESHOLD`` to 1 MiB before the benchmark allocates, so that every
  allocation of 1 MiB or more is a mapping of its own, returned on free, and
  RSS follows live memory; it runs a warm-up and one measured step per
  strategy, with the garbage collector and ``malloc_trim(0)`` before each
  step, and reports the measured step's peak above the RSS before it
  (``peak_live_bytes``). Not the headline: no user's process runs that way,
  and the page faults cost time (measured: 1.5 s more system time per
  tierstore step on the default model), so its step times are kept apart
  (``live_step_s``).
* Gradient check: after the *last* step, the maximum absolute difference of
  every parameter's gradient from the ``none`` run (bitwise equal means 0).
  All strategies reseed torch identically before each step and start from
  the same weights, so any difference in an earlier step would also show in
  the last one through the updated weights.
* Prefetch hit rate (tierstore): hits / (hits + misses) over the measured
  steps, from ``store.stats()``; ``n/a`` where the store does not count them.
  Moved per step: the disk tier's bytes written plus bytes read per measured
  step, from the same statistics.

Example:
    >>> import tempfile
    >>> from tierstore.bench.train import bench_train, quick_settings
    >>> report = bench_train(quick_settings(steps=1, warmup=0, directory=tempfile.mkdtemp(),
    ...                                     strategies=["none", "tierstore-file"],
    ...                                     isolate=False, live_pass=False),
    ...                      show_progress=False)
    >>> [(r.name, r.max_grad_diff) for r in report.rows]
    [('none', 0.0), ('tierstore-file', 0.0)]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from tierstore.bench.gpt import GPT, add_model_arguments, build_model, saved_bytes
from tierstore.bench.memory import AnonRss, release_free_memory
from tierstore.bench.report import (
    NA,
    Progress,
    Report,
    fmt_ratio,
    format_table,
    load_pyplot,
    machine_info,
    median,
    write_results,
)
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.config import TierConfig, human_bytes
from tierstore.errors import TierstoreError
from tierstore.hooks import TierStore
from tierstore.stats import TIERS, Stats

__all__ = [
    "CPU_STRATEGIES",
    "CUDA_STRATEGIES",
    "STRATEGIES",
    "StrategyResult",
    "TrainReport",
    "TrainSettings",
    "add_arguments",
    "bench_train",
    "default_settings",
    "format_train",
    "plot_sweep",
    "plot_train",
    "quick_settings",
    "run",
]

#: Every strategy, in the order they run (``none`` first: the reference).
STRATEGIES = (
    "none",
    "save_on_cpu",
    "torchtune",
    "checkpoint",
    "disk-naive",
    "tierstore-host",
    "tierstore-host-disk",
    "tierstore-file",
    "tierstore-lmdb",
    "checkpoint+tierstore",
)
#: What runs on CPU unless ``--strategies`` says otherwise.
CPU_STRATEGIES = (
    "none",
    "save_on_cpu",
    "checkpoint",
    "disk-naive",
    "tierstore-file",
    "tierstore-lmdb",
    "checkpoint+tierstore",
)
#: What runs on CUDA unless ``--strategies`` says otherwise (disk-naive: minutes per step).
CUDA_STRATEGIES = (
    "none",
    "save_on_cpu",
    "torchtune",
    "checkpoint",
    "tierstore-host",
    "tierstore-host-disk",
    "checkpoint+tierstore",
)

#: ``checkpoint-N``: ``torch.utils.checkpoint`` on the first N blocks only.
CHECKPOINT_FIRST = "checkpoint-"
#: ``budget=F``: a TierStore with only ``activation_budget=F`` set (``--budget``).
BUDGET = "budget="
#: The budgets ``--sweep`` runs, as fractions of what the step saves.
SWEEP_BUDGETS = ("0.05", "0.1", "0.2", "0.35", "0.5", "0.75")

# NOTE [ Budget rows ]
# A budget=F row is a TierStore with activation_budget=F and the defaults
# otherwise (disk_budget sized like the other disk rows). Its store warms up
# on the first step, profiles the second and plans the third
# (NOTE [ Planned steps ] in tierstore/plans.py), and may remake the plan
# after the third step and after the fifth or sixth: a run with a budget row
# runs five more warm-up steps than --warmup, so that the measured steps all
# follow the plan that stays; every row runs them, so that all reach their
# last step from the same weights and the gradient check compares like with
# like. After them an empty offload() block ends the last step, and the row
# keeps the plan: its table, its predicted step time and peak, and the
# store's own measurement of the step.

#: A tierstore strategy with this suffix runs with ``recompute="cheap"`` (``--recompute``).
RECOMPUTE_SUFFIX = "+recompute"
_RECOMPUTABLE = ("tierstore-host", "tierstore-host-disk", "tierstore-file", "tierstore-lmdb")

_MIB = 1 << 20
#: Memory sampling period (NOTE [ What bench train measures ]).
_SAMPLE_S = 0.001
#: Tier-bytes sampling period: stats() takes the store's lock, so less often.
_TIER_SAMPLE_S = 0.005
#: Timeline points kept per strategy in the JSON (peaks kept when thinning).
_TIMELINE_POINTS = 2000


@dataclass(frozen=True)
class TrainSettings:
    """What ``bench train`` runs: the model, the steps, the strategies, where files go.

    ``disk_budget_bytes=None`` sizes the tierstore disk tier from a counting
    pass: 1.5 times the activation bytes the forward saves, plus 64 MiB;
    ``tierstore-host-disk`` gets a third of that as its host budget (half
    the activations), so the other half goes on to disk.
    ``isolate=False`` runs every strategy in this process instead of one
    fresh process each (CPU; CUDA always runs here), and ``live_pass=False``
    skips the CPU live-memory pass (NOTE [ What bench train measures ]).

    Example:
        >>> default_settings().d_model, quick_settings().d_model
        (512, 64)
    """

    layers: int = 6
    d_model: int = 512
    heads: int = 8
    seq: int = 512
    batch: int = 8
    vocab: int = 512
    dropout: float = 0.1
    steps: int = 4
    warmup: int = 1
    strategies: tuple[str, ...] = ()  # () = the device's defaults
    directory: str | None = None
    device: str = "cpu"
    seed: int = 0
    lr: float = 1e-3
    min_offload_bytes: int = 0
    compression: str = "none"
    recompute: tuple[str, ...] = ("off",)
    disk_budget_bytes: int | None = None
    device_budget_bytes: int = 0
    isolate: bool = True
    live_pass: bool = True


def default_settings(**changes: Any) -> TrainSettings:
    """The issue's target size: 6 blocks, d_model 512, seq 512, batch 8 (~1.3 GiB saved, fp32).

    Example:
        >>> default_settings(steps=2).steps
        2
    """
    return replace(TrainSettings(), **changes)


def quick_settings(**changes: Any) -> TrainSettings:
    """A tiny model that runs every strategy in a few seconds (``--quick``, tests, demo).

    Example:
        >>> quick_settings().layers
        2
    """
    tiny = TrainSettings(layers=2, d_model=64, heads=2, seq=64, batch=4, vocab=128)
    return replace(tiny, **changes)


@dataclass
class StrategyResult:
    """One strategy's measurements; see ``NOTE [ What bench train measures ]``.

    ``peak_memory_bytes`` is the headline: CPU, peak anonymous RSS above the
    RSS before the first step; CUDA, ``max_memory_reserved`` above the
    reservation before it. ``peak_bytes`` holds the same figure per step,
    warm-up included. Ratios are ``None`` where the reference strategy did not
    run; figures a device does not have are ``None``.

    Example:
        >>> StrategyResult("none").max_grad_diff is None
        True
    """

    name: str
    warmup_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    median_step_s: float = 0.0
    peak_bytes: list[int] = field(default_factory=list)
    peak_memory_bytes: int = 0
    peak_rss_total_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_live_bytes: int | None = None
    live_step_s: float | None = None
    step_vs_none: float | None = None
    step_vs_naive: float | None = None
    memory_vs_none: float | None = None
    memory_vs_naive: float | None = None
    live_vs_none: float | None = None
    max_grad_diff: float | None = None
    grads_bitwise_equal: bool | None = None
    tiers: dict[str, dict[str, float]] | None = None
    prefetch: dict[str, float | None] | None = None
    moved_per_step: float | None = None
    config: dict[str, Any] | None = None
    timeline: dict[str, Any] = field(default_factory=dict)
    #: The last warm-up step's timeline with bytes per tier (stores only; see
    #: NOTE [ What bench train measures ]); ``{}`` without a warm-up step.
    tier_timeline: dict[str, Any] = field(default_factory=dict)
    #: ``budget=F`` rows: the plan after the measured steps (NOTE [ Budget rows ]).
    plan: dict[str, Any] | None = None


@dataclass
class TrainReport(Report[StrategyResult]):
    """What :func:`bench_train` measured.

    Example:
        >>> TrainReport(rows=[], settings={}, targets=[], model={}).row("none") is None
        True
    """

    model: dict[str, Any]


# -- memory (NOTE [ What bench train measures ]) --------------------------------


class _Sampler:
    """Calls ``read`` every ``period_s`` on a thread, keeping ``(seconds, value)`` pairs."""

    def __init__(self, read: Callable[[], Any], period_s: float) -> None:
        self._read = read
        self._period = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: list[tuple[float, Any]] = []
        self._start = 0.0
        self.error: BaseException | None = None

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="tierstore-bench-sampler")
        self._thread.daemon = True
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                self.samples.append((time.perf_counter() - self._start, self._read()))
                if self._stop.wait(self._period):
                    break
        except BaseException as exc:  # reported by stop(): a silent sampler would lie
            self.error = exc

    def stop(self) -> list[tuple[float, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            raise TierstoreError(f"tierstore: bench train: memory sampler failed: {self.error}")
        # One last sample after the step, so that a short step has two.
        self.samples.append((time.perf_counter() - self._start, self._read()))
        return self.samples


def _thin(samples: list[tuple[float, Any]], key: Callable[[Any], float]) -> list[tuple[float, Any]]:
    # At most _TIMELINE_POINTS, keeping the largest sample of each bucket:
    # a timeline must not lose its peak.
    if len(samples) <= _TIMELINE_POINTS:
        return samples
    size = -(-len(samples) // _TIMELINE_POINTS)
    return [
        max(samples[i : i + size], key=lambda s: key(s[1])) for i in range(0, len(samples), size)
    ]


# -- strategies -------------------------------------------------------------------


class _Strategy:
    """How one strategy runs a forward pass; the default is plain eager autograd."""

    def __init__(self, name: str) -> None:
        self.name = name

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def stats(self) -> Stats | None:
        return None

    def after_step(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SaveOnCpu(_Strategy):
    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name)
        # Pinned staging only pays for copies from a GPU; on a CPU model the
        # saved tensors already are CPU tensors.
        self._pin = device.type == "cuda"

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.graph.save_on_cpu(pin_memory=self._pin)


class _Checkpoint(_Strategy):
    """``torch.utils.checkpoint`` around every block (or the first ``blocks``), code unchanged."""

    def __init__(self, name: str, model: GPT, blocks: int | None = None) -> None:
        super().__init__(name)
        self._model = model
        self._blocks = list(model.blocks)[:blocks]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        # An instance attribute ``forward`` shadows the class's, so model.loss
        # (the same code every strategy runs) calls the blocks checkpointed.
        # Only during forward: the recomputation in backward calls the bound
        # original captured here.
        for block in self._blocks:
            original = block.forward

            def wrapped(x: torch.Tensor, _f: Callable[..., Any] = original) -> Any:
                return checkpoint(_f, x, use_reentrant=False)

            block.__dict__["forward"] = wrapped
        try:
            yield
        finally:
            for block in self._blocks:
                block.__dict__.pop("forward", None)


class _SelfDeletingTempFile:
    """PyTorch's autograd docs example, as users copy it (see ``_NaiveDisk``)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.name = os.path.join(directory, str(uuid.uuid4()))

    def __del__(self) -> None:
        os.remove(self.name)


class _NaiveDisk(_Strategy):
    """Pack: ``torch.save`` to a file of its own; unpack: ``torch.load(weights_only=True)``."""

    def __init__(self, name: str, root: Path) -> None:
        super().__init__(name)
        self._dir = make_scratch_dir("tierstore-bench-naive-", root)

    def _pack(self, tensor: torch.Tensor) -> _SelfDeletingTempFile:
        temp_file = _SelfDeletingTempFile(self._dir)
        torch.save(tensor, temp_file.name)
        return temp_file

    def _unpack(self, temp_file: _SelfDeletingTempFile) -> torch.Tensor:
        out: torch.Tensor = torch.load(temp_file.name, weights_only=True)
        return out

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return saved_tensors_hooks(self._pack, self._unpack)

    def after_step(self) -> None:
        left = os.listdir(self._dir)
        if left:
            raise TierstoreError(
                f"tierstore: bench train: disk-naive left {len(left)} files in {self._dir} "
                "after backward"
            )

    def close(self) -> None:
        remove_scratch_dir(self._dir)


class _CheckpointTierstore(_Strategy):
    """``checkpoint`` per block inside ``offload()``: only block inputs reach the store."""

    def __init__(self, name: str, checkpointed: _Checkpoint, store: _Tierstore) -> None:
        super().__init__(name)
        self._checkpointed = checkpointed
        self._store = store
        self.config = store.config

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        with self._checkpointed.forward(), self._store.forward():
            yield

    def stats(self) -> Stats:
        return self._store.stats()

    def close(self) -> None:
        self._store.close()


class _TorchTune(_Strategy):
    """torchtune's ``OffloadActivations``: pinned host copies on a side stream."""

    def __init__(self, name: str, offload: Callable[[], Any]) -> None:
        super().__init__(name)
        self._offload = offload

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        context: contextlib.AbstractContextManager[Any] = self._offload()
        return context


def _torchtune_offload() -> Callable[[], Any] | str:
    """The context factory of torchtune's offloader, or why it cannot be imported."""
    try:  # optional and heavy: imported only when asked for
        from torchtune.training import (  # type: ignore[import-not-found]  # noqa: PLC0415
            OffloadActivations,
        )
    except Exception as e:  # whatever fails, it is not usable here
        return f"torchtune is not importable: {type(e).__name__}: {e}".strip()
    return functools.partial(OffloadActivations, use_pin_memory=True, use_streams=True)


class _Tierstore(_Strategy):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name)
        self.config = config
        self.store = TierStore(config)

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return self.store.offload()

    def stats(self) -> Stats:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()


# -- the run --------------------------------------------------------------------


def _tokens(settings: TrainSettings, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    shape = (settings.batch, settings.seq + 1)
    return torch.randint(0, settings.vocab, shape, generator=gen).to(device)


def _base(name: str) -> str:
    return name.removesuffix(RECOMPUTE_SUFFIX)


def _with_recompute(names: list[str], recompute: tuple[str, ...]) -> list[str]:
    """Each tierstore store strategy once per ``recompute`` setting, side by side."""
    out = []
    for name in names:
        if name not in _RECOMPUTABLE:
            out.append(name)
            continue
        out += [name] if "off" in recompute else []
        out += [name + RECOMPUTE_SUFFIX] if "cheap" in recompute else []
    return out


def _make_strategy(
    name: str, *, settings: TrainSettings, model: GPT, root: Path, budget: int, device: torch.device
) -> _Strategy:
    if name == "none":
        return _Strategy(name)
    if name == "save_on_cpu":
        return _SaveOnCpu(name, device)
    if name == "checkpoint":
        return _Checkpoint(name, model)
    if name.startswith(CHECKPOINT_FIRST):
        return _Checkpoint(name, model, int(name.removeprefix(CHECKPOINT_FIRST)))
    if name.startswith(BUDGET):
        return _Tierstore(
            name,
            TierConfig(
                activation_budget=_budget_value(name.removeprefix(BUDGET)),
                disk_budget=budget,
                disk_path=root,
                min_offload_bytes=settings.min_offload_bytes,
                compression=settings.compression,
            ),
        )
    if name == "disk-naive":
        return _NaiveDisk(name, root)
    if name == "torchtune":
        offload = _torchtune_offload()
        if isinstance(offload, str):
            raise TierstoreError(f"tierstore: bench train: {offload}")
        return _TorchTune(name, offload)
    if name == "checkpoint+tierstore":
        store_name = "tierstore-host" if device.type == "cuda" else "tierstore-file"
        store = _make_strategy(
            store_name, settings=settings, model=model, root=root, budget=budget, device=device
        )
        assert isinstance(store, _Tierstore)
        return _CheckpointTierstore(name, _Checkpoint("checkpoint", model), store)
    # Budgets per strategy: the disk one is 1.5x the saved bytes (see bench_train).
    base = _base(name)
    host = {"tierstore-host": budget, "tierstore-host-disk": budget // 3}.get(base, 0)
    config = TierConfig(
        device_budget=settings.device_budget_bytes if host else 0,
        host_budget=host,
        disk_budget=0 if base == "tierstore-host" else budget,
        disk_path=root,
        disk_backend="lmdb" if base == "tierstore-lmdb" else "file",
        min_offload_bytes=settings.min_offload_bytes,
        compression=settings.compression if base != "tierstore-host" else "none",
        recompute="cheap" if name.endswith(RECOMPUTE_SUFFIX) else "off",
    )
    return _Tierstore(name, config)


def _stat(stats: Stats | None, name: str) -> Any:
    # The prefetch counters arrive with the asynchronous pipeline; until then
    # a store has none and the figures read n/a.
    return getattr(stats, name, None) if stats is not None else None


def _delta(after: Stats | None, before: Stats | None, name: str) -> float | None:
    a, b = _stat(after, name), _stat(before, name)
    return None if a is None or b is None else a - b


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _planning_steps(settings: TrainSettings) -> int:
    """Warm-up steps every row adds when a budget row runs (NOTE [ Budget rows ])."""
    return 5 if any(n.startswith(BUDGET) for n in settings.strategies) else 0


def _budget_value(text: str) -> int | float | str:
    """``budget=F``'s value as TierConfig takes it: a fraction, or a size as written."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def _known(name: str) -> bool:
    """``checkpoint-N`` and ``budget=F`` beside the fixed names."""
    if name.startswith(CHECKPOINT_FIRST):
        return name.removeprefix(CHECKPOINT_FIRST).isdigit()
    if name.startswith(BUDGET):
        try:
            TierConfig(activation_budget=_budget_value(name.removeprefix(BUDGET)))
        except TierstoreError as exc:  # what is wrong with the value, as TierConfig says it
            raise TierstoreError(
                f"tierstore: bench train: strategy {name!r}: {str(exc).removeprefix('tierstore: ')}"
            ) from None
        return True
    return False


def _check_settings(settings: TrainSettings) -> torch.device:
    for name in settings.strategies:
        if _known(name):
            continue
        if name.removesuffix(RECOMPUTE_SUFFIX) not in STRATEGIES or (
            name.endswith(RECOMPUTE_SUFFIX) and _base(name) not in _RECOMPUTABLE
        ):
            raise TierstoreError(
                f"tierstore: bench train: strategy {name!r} is unknown; expected some of "
                f"{', '.join(STRATEGIES)}, checkpoint-N (the first N blocks), budget=F "
                f"(activation_budget=F), or one of {', '.join(_RECOMPUTABLE)} followed "
                f"by {RECOMPUTE_SUFFIX}"
            )
    bad = [r for r in settings.recompute if r not in ("off", "cheap")]
    if bad or not settings.recompute:
        raise TierstoreError(
            f"tierstore: bench train: --recompute {','.join(settings.recompute)} is not a list "
            "of 'off' and 'cheap'"
        )
    if settings.steps < 1 or settings.warmup < 0:
        raise TierstoreError(
            f"tierstore: bench train: steps={settings.steps}, warmup={settings.warmup}; "
            "expected steps >= 1 and warmup >= 0"
        )
    if settings.d_model % settings.heads:
        raise TierstoreError(
            f"tierstore: bench train: d_model={settings.d_model} is not a multiple of "
            f"heads={settings.heads}; change --d-model or --heads"
        )
    try:
        device = torch.device(settings.device)
    except RuntimeError:
        device = torch.device("meta")  # named in the error below
    if device.type not in ("cpu", "cuda"):
        raise TierstoreError(
            f"tierstore: bench train: --device {settings.device} is not cpu or cuda"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TierstoreError(
            "tierstore: bench train: --device cuda, but torch.cuda.is_available() is False; "
            "use --device cpu or a CUDA build of torch"
        )
    return device


def _named_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name, as copies (the next strategy zeroes them)."""
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def _compare_grads(
    result: StrategyResult, reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]
) -> None:
    if grads.keys() != reference.keys():
        result.max_grad_diff = float("inf")
        result.grads_bitwise_equal = False
        return
    pairs = [(reference[name], grads[name]) for name in reference]
    diffs = [float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in pairs]
    result.max_grad_diff = max(diffs, default=0.0)
    result.grads_bitwise_equal = all(torch.equal(a, b) for a, b in pairs)


def _grads_in_place(model: GPT) -> None:
    # Allocated before the baseline is read and zeroed in place by every
    # step: the gradients' memory is the baseline's, as in a training loop
    # past its first step.
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


class _Base(NamedTuple):
    """Memory before the steps: the headline's (RSS, CUDA reserved) and the sampled one's."""

    headline: int
    sampled: int


class _Peaks(NamedTuple):
    """One step's peaks: the headline above its baseline, and the figures beside it."""

    above: int
    total: int | None  # CPU: the absolute peak anonymous RSS
    allocated: int | None  # CUDA: max_memory_allocated above the baseline


class _Reporter(Protocol):
    """What a run reports its steps to: :class:`Progress`, or a child's :class:`_Events`."""

    def phase(self, description: str) -> contextlib.AbstractContextManager[None]: ...

    def advance(self, units: float) -> None: ...


class _Events:
    """A child's progress: one JSON line per step on stdout, read by the parent."""

    def __init__(self, name: str) -> None:
        self._name = name

    def phase(self, description: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def advance(self, units: float) -> None:
        print(json.dumps({"event": "step", "name": self._name}), flush=True)


def _max_or_none(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class _Bench:
    """Runs the strategies' steps on one model; measures each step the same way.

    ``trim``: collect garbage and ``malloc_trim`` before every step (in-process
    runs and the live pass); a fresh process per strategy leaves the default
    allocator alone, as a user's process does.
    """

    def __init__(
        self,
        settings: TrainSettings,
        model: GPT,
        device: torch.device,
        root: Path,
        budget: int,
        *,
        trim: bool = True,
    ) -> None:
        self.settings = settings
        self.model = model
        self.device = device
        self.root = root
        self.budget = budget
        self.trim = trim
        self.cuda = device.type == "cuda"
        self._rss = None if self.cuda else AnonRss()

    def memory_now(self) -> int:
        if self._rss is None:
            return torch.cuda.memory_allocated(self.device)
        return self._rss()

    def base(self) -> _Base:
        """The memory now, as the baseline of the peaks."""
        if self._rss is not None:
            rss = self._rss()
            return _Base(rss, rss)
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return _Base(reserved, torch.cuda.memory_allocated(self.device))

    def close(self) -> None:
        if self._rss is not None:
            self._rss.close()
            self._rss = None

    def timed(self, strategy: _Strategy, result: StrategyResult, progress: _Reporter) -> None:
        """Warm-up and measured steps of one strategy, from the weights loaded now."""
        settings = self.settings
        _grads_in_place(self.model)
        opt = torch.optim.SGD(self.model.parameters(), lr=settings.lr)
        if self.trim:
            release_free_memory(full=True)
        base = self.base()
        before: Stats | None = None
        budgeted = (
            isinstance(strategy, _Tierstore) and strategy.config.activation_budget is not None
        )
        warmup = settings.warmup + _planning_steps(settings)  # NOTE [ Budget rows ]
        n = warmup + settings.steps
        for step in range(n):
            if step == warmup:
                before = strategy.stats()
            with progress.phase(f"{strategy.name} step {step + 1}/{n}"):
                # NOTE [ What bench train measures ]: the tiers in untimed steps only.
                took, peaks, timeline = self._step(
                    strategy, opt, step, base, poll_tiers=step < warmup
                )
                progress.advance(1)
            result.peak_bytes.append(peaks.above)
            result.peak_rss_total_bytes = _max_or_none(result.peak_rss_total_bytes, peaks.total)
            result.peak_allocated_bytes = _max_or_none(result.peak_allocated_bytes, peaks.allocated)
            if step < warmup:
                result.warmup_s.append(took)
                if timeline["tiers"]:
                    result.tier_timeline = {"step": step + 1, **timeline}
            else:
                result.step_s.append(took)
                result.timeline = {"step": step + 1, **timeline}
        _summarize(result, before, strategy.stats(), settings.steps)
        if budgeted:
            assert isinstance(strategy, _Tierstore)
            result.plan = _plan_of(strategy.store, result)

    def _step(
        self,
        strategy: _Strategy,
        opt: torch.optim.Optimizer,
        step: int,
        base: _Base | None = None,
        *,
        full_gc: bool = False,
        poll_tiers: bool = False,
    ) -> tuple[float, _Peaks, dict[str, Any]]:
        """One training step: seconds, peaks above ``base`` (default: now), the timeline.

        ``poll_tiers`` also samples the store's bytes per tier (untimed steps).
        """
        tokens = _tokens(self.settings, step, self.device)
        # In place: the gradients' memory then belongs to the baseline.
        self.model.zero_grad(set_to_none=False)
        if self.trim:
            release_free_memory(full=full_gc)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if base is None:
            base = self.base()
        # NOTE [ What bench train measures ]: the same samplers run in every
        # strategy's steps; the tier one reads a store's tiers where there is one.
        samplers = [_Sampler(self.memory_now, _SAMPLE_S)]
        if poll_tiers:
            samplers.append(_Sampler(lambda: _tier_bytes(strategy.stats()), _TIER_SAMPLE_S))
        for sampler in samplers:
            sampler.start()
        try:
            torch.manual_seed(self.settings.seed * 7919 + step)  # the same dropout masks
            start = time.perf_counter()
            with strategy.forward():
                loss = self.model.loss(tokens)
            loss.backward()
            opt.step()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            took = time.perf_counter() - start
            del loss
        finally:
            samples, *polled = [sampler.stop() for sampler in samplers]
            tier_samples = [(t, v) for t, v in (polled[0] if polled else []) if v is not None]
        strategy.after_step()
        return took, self._peaks(samples, base), _timeline(samples, tier_samples, base.sampled)

    def _peaks(self, samples: list[tuple[float, Any]], base: _Base) -> _Peaks:
        if self.cuda:
            reserved = torch.cuda.max_memory_reserved(self.device) - base.headline
            allocated = torch.cuda.max_memory_allocated(self.device) - base.sampled
            return _Peaks(max(reserved, 0), None, max(allocated, 0))
        top = max(v for _, v in samples)
        return _Peaks(max(top - base.headline, 0), top, None)


def _timeline(
    samples: list[tuple[float, Any]], tier_samples: list[tuple[float, Any]], baseline: int
) -> dict[str, Any]:
    """A step's memory above ``baseline`` over time, and bytes per tier (tierstore)."""
    thinned = _thin(samples, float)
    tier_timeline: dict[str, list[Any]] = {}
    if tier_samples:
        tier_timeline["t_s"] = [round(t, 4) for t, _ in tier_samples]
        for tier in TIERS:
            tier_timeline[tier] = [v[tier] for _, v in tier_samples]
    return {
        "t_s": [round(t, 4) for t, _ in thinned],
        "memory_bytes": [v - baseline for _, v in thinned],
        "tiers": tier_timeline,
    }


def _tier_bytes(stats: Stats | None) -> dict[str, int] | None:
    """Bytes per tier now; ``None`` for a strategy with no store (sampled all the same)."""
    if stats is None:
        return None
    return {tier: stats.tiers[tier].bytes for tier in TIERS}


# -- child processes (NOTE [ What bench train measures ]) -------------------------

#: Steps per strategy in the live pass: a warm-up, then the measured one.
_LIVE_STEPS = 2

#: One strategy in a fresh process, on the default allocator.
_STRATEGY_CHILD = """
import sys
from tierstore.bench import train
train._strategy_child(sys.argv[1])
"""

#: Every strategy in one fresh process whose RSS follows live memory.
_LIVE_CHILD = """
import sys
from tierstore.bench import memory, train
# Before the benchmark allocates: NOTE [ What bench train measures ].
live = memory.follow_live_memory()
train._live_child(sys.argv[1], live)
"""

#: Linux prctl option: the signal a process gets when its parent ends.
_PR_SET_PDEATHSIG = 1


def _payload(
    settings: TrainSettings, names: list[str], budget: int, work: Path, **extra: Any
) -> dict[str, Any]:
    """What a child needs: the settings (writing under ``work``), the strategies, the budget."""
    return {
        "settings": asdict(replace(settings, directory=str(work))),
        "names": names,
        "budget": budget,
        "threads": torch.get_num_threads(),
        "parent": os.getpid(),
        **extra,
    }


def _run_child(
    script: str, payload: dict[str, Any], log: Path, progress: _Reporter, what: str
) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter; advance per step event; return its result event.

    Its stderr goes to ``log`` (a file, so that a chatty child cannot block
    on a full pipe while the parent reads stdout).
    """
    cmd = [sys.executable, "-c", script, json.dumps(payload)]
    with log.open("w+", encoding="utf-8") as err:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc:
            assert proc.stdout is not None
            try:
                result = _read_events(proc.stdout, progress)
            except BaseException:
                proc.kill()  # not left running after the parent gives up on it
                raise
        err.seek(0)
        tail = err.read()[-2000:].strip()
    if proc.returncode != 0 or result is None:
        raise TierstoreError(
            f"tierstore: bench train: {what} (a child process) failed with exit status "
            f"{proc.returncode}: {tail}"
        )
    return result


def _read_events(lines: Iterator[str], progress: _Reporter) -> dict[str, Any] | None:
    result: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith('{"event"'):
            continue  # anything else a library prints
        event = json.loads(line)
        if event["event"] == "step":
            progress.advance(1)
        elif event["event"] == "result":
            result = event["result"]
    return result


def _child_setup(payload_json: str) -> tuple[dict[str, Any], TrainSettings]:
    """A child's first steps: end with the parent, read the settings, match its threads."""
    payload = json.loads(payload_json)
    # SIGTERM to the parent removes the scratch directory and ends it with
    # os._exit (NOTE [ SIGTERM ] in tierstore/bench/scratch.py): no finally
    # runs there to stop a child, so the kernel does (Linux only).
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != payload["parent"]:
        sys.exit("tierstore: bench train: the parent process ended before this child started")
    fields = payload["settings"]
    fields["strategies"] = tuple(fields["strategies"])
    torch.set_num_threads(payload["threads"])
    return payload, TrainSettings(**fields)


def _strategy_child(payload_json: str) -> None:
    """One strategy's steps in this fresh process; results to stdout, gradients to a file."""
    payload, settings = _child_setup(payload_json)
    (name,) = payload["names"]
    device = torch.device("cpu")
    model = build_model(settings, device)
    root = Path(settings.directory or ".")
    bench = _Bench(settings, model, device, root, payload["budget"], trim=False)
    result = StrategyResult(name)
    try:
        strategy = _make_strategy(
            name, settings=settings, model=model, root=root, budget=bench.budget, device=device
        )
        try:
            if isinstance(strategy, (_Tierstore, _CheckpointTierstore)):
                result.config = strategy.config.model_dump(mode="json")
            bench.timed(strategy, result, _Events(name))
        finally:
            strategy.close()
    finally:
        bench.close()
    save_file({k: v.contiguous() for k, v in _named_grads(model).items()}, payload["grads"])
    print(json.dumps({"event": "result", "result": asdict(result)}), flush=True)


def _live_child(payload_json: str, live: bool) -> None:
    """The live pass: a warm-up and one measured step per strategy, peaks to stdout."""
    payload, settings = _child_setup(payload_json)
    device = torch.device("cpu")
    model = build_model(settings, device)
    initial = copy.deepcopy(model.state_dict())
    bench = _Bench(settings, model, device, Path(settings.directory or "."), payload["budget"])
    out: dict[str, Any] = {
        "allocator": (
            "live memory (M_MMAP_THRESHOLD=1MiB, a fresh process)"
            if live
            else "live memory? (a fresh process, not glibc: RSS may keep freed memory)"
        )
    }
    try:
        for name in payload["names"]:
            model.load_state_dict(initial)
            _grads_in_place(model)
            opt = torch.optim.SGD(model.parameters(), lr=settings.lr)
            strategy = _make_strategy(
                name,
                settings=settings,
                model=model,
                root=bench.root,
                budget=bench.budget,
                device=device,
            )
            try:
                for step in range(_LIVE_STEPS):
                    took, peaks, _ = bench._step(strategy, opt, step, full_gc=True)
                    print(json.dumps({"event": "step", "name": name}), flush=True)
            finally:
                strategy.close()
            out[name] = {"step_s": took, "peak_bytes": peaks.above}
    finally:
        bench.close()
    print(json.dumps({"event": "result", "result": out}), flush=True)


# -- the run ----------------------------------------------------------------------


def _new_result(strategy: _Strategy) -> StrategyResult:
    result = StrategyResult(strategy.name)
    if isinstance(strategy, (_Tierstore, _CheckpointTierstore)):
        result.config = strategy.config.model_dump(mode="json")
    return result


def _run_in_process(
    settings: TrainSettings,
    names: list[str],
    *,
    model: GPT,
    budget: int,
    work: Path,
    progress: Progress,
) -> list[StrategyResult]:
    """Every strategy in this process, one after another (CUDA; ``--in-process`` on CPU)."""
    device = next(model.parameters()).device
    initial = copy.deepcopy(model.state_dict())
    bench = _Bench(settings, model, device, work, budget)
    rows: list[StrategyResult] = []
    reference: dict[str, torch.Tensor] | None = None
    strategies: dict[str, _Strategy] = {}
    try:
        for name in names:
            strategies[name] = _make_strategy(
                name, settings=settings, model=model, root=work, budget=budget, device=device
            )
        for name, strategy in strategies.items():
            model.load_state_dict(initial)
            result = _new_result(strategy)
            bench.timed(strategy, result, progress)
            grads = _named_grads(model)
            if name == "none":
                reference = grads
            if reference is not None:
                _compare_grads(result, reference, grads)
            rows.append(result)
    finally:
        for strategy in strategies.values():
            strategy.close()
        bench.close()
    return rows


def _run_isolated(
    settings: TrainSettings, names: list[str], *, budget: int, work: Path, progress: _Reporter
) -> list[StrategyResult]:
    """Each strategy in a fresh process of its own, one at a time (CPU)."""
    rows: list[StrategyResult] = []
    reference: dict[str, torch.Tensor] | None = None
    n = settings.warmup + settings.steps
    for name in names:
        grads_path = work / f"grads-{name}.safetensors"
        payload = _payload(settings, [name], budget, work, grads=str(grads_path))
        with progress.phase(f"{name}: {n} steps in a fresh process"):
            doc = _run_child(
                _STRATEGY_CHILD, payload, work / f"{name}.stderr", progress, f"strategy {name}"
            )
        result = StrategyResult(**doc)
        grads = load_file(grads_path)
        grads_path.unlink()
        if name == "none":
            reference = grads
        if reference is not None:
            _compare_grads(result, reference, grads)
        rows.append(result)
    return rows


def _live_pass(
    settings: TrainSettings,
    names: list[str],
    *,
    budget: int,
    work: Path,
    progress: _Reporter,
) -> dict[str, Any]:
    """The live pass (:func:`_live_child`): per strategy its peak and step time, and a label."""
    payload = _payload(settings, names, budget, work)
    with progress.phase(f"live memory pass: {_LIVE_STEPS} steps per strategy"):
        return _run_child(_LIVE_CHILD, payload, work / "live.stderr", progress, "the live pass")


def _add_ratios(rows: list[StrategyResult]) -> None:
    none = next((r for r in rows if r.name == "none"), None)
    naive = next((r for r in rows if r.name == "disk-naive"), None)
    for r in rows:
        if none is not None:
            r.step_vs_none = _ratio(r.median_step_s, none.median_step_s)
            r.memory_vs_none = _ratio(r.peak_memory_bytes, none.peak_memory_bytes)
            r.live_vs_none = _ratio(r.peak_live_bytes, none.peak_live_bytes)
        if naive is not None:
            r.step_vs_naive = _ratio(r.median_step_s, naive.median_step_s)
            r.memory_vs_naive = _ratio(r.peak_memory_bytes, naive.peak_memory_bytes)


def _memory_measure(cuda: bool, isolate: bool) -> str:
    """How the headline memory was measured, for the JSON and the table's description."""
    if cuda:
        return (
            "reserved = max_memory_reserved above the reservation before the first step "
            "(what nvidia-smi shows); allocated = max_memory_allocated above the allocation "
            "before the first step; over warm-up and measured steps, all in this process"
        )
    where = (
        "default allocator, each strategy in a fresh process"
        if isolate
        else "default allocator with gc + malloc_trim(0) before each step, every strategy in "
        "this one process (earlier strategies' freed heap can inflate later ones)"
    )
    return (
        "peak RSS = peak anonymous RSS above the RSS before the first step, over warm-up and "
        f"measured steps, sampled every 1 ms, {where}"
    )


def bench_train(settings: TrainSettings, *, show_progress: bool = True) -> TrainReport:
    """Train the same GPT a few steps under each strategy and compare time, memory, gradients.

    See the module docstring and ``NOTE [ What bench train measures ]``.

    Args:
        settings: model size, steps and strategies (:func:`default_settings`,
            :func:`quick_settings`).
        show_progress: draw a progress bar (or print a line per step) on stderr.

    Returns:
        One :class:`StrategyResult` per strategy, in the order of
        :data:`STRATEGIES`, and the issue's targets for the tierstore rows.

    Raises:
        TierstoreError: a bad setting, a strategy that leaves files behind, or
            a child process that fails (with the end of its stderr).

    Example:
        >>> import tempfile
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none", "checkpoint"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> report = bench_train(s, show_progress=False)
        >>> report.row("checkpoint").grads_bitwise_equal
        True
    """
    device = _check_settings(settings)
    wanted = settings.strategies or (CUDA_STRATEGIES if device.type == "cuda" else CPU_STRATEGIES)
    skipped: dict[str, str] = {}
    if "torchtune" in wanted and not settings.strategies:
        why = _torchtune_offload()
        if isinstance(why, str):
            skipped["torchtune"] = why
    names = (
        _with_recompute(
            [n for n in STRATEGIES if n in wanted and n not in skipped], settings.recompute
        )
        + [n for n in wanted if n.endswith(RECOMPUTE_SUFFIX)]
        + [n for n in wanted if _known(n)]  # checkpoint-N, budget=F: in the order given
    )
    root = Path(settings.directory or tempfile.gettempdir()).absolute()
    if not root.is_dir():
        raise TierstoreError(f"tierstore: bench train: --dir {root} is not a directory")
    model = build_model(settings, device)
    saved_all, saved_activations = saved_bytes(model, _tokens(settings, 0, device))
    budget = settings.disk_budget_bytes
    if budget is None:
        # Parameters are never offloaded: only the activations need room.
        budget = -(-(saved_activations * 3 // 2 + 64 * _MIB) // _MIB) * _MIB

    cuda = device.type == "cuda"
    isolate = settings.isolate and not cuda
    live_pass = settings.live_pass and not cuda
    live_measure = None
    per_strategy = settings.warmup + settings.steps + (_LIVE_STEPS if live_pass else 0)
    # Everything the run writes (the stores' spill directories, disk-naive's
    # files, the children's gradients and stderr) goes under one scratch
    # directory: removed at the end, and on SIGTERM (NOTE [ SIGTERM ] in
    # tierstore/bench/scratch.py).
    work = make_scratch_dir("tierstore-bench-train-", root)
    try:
        with Progress(len(names) * per_strategy, unit="step", enabled=show_progress) as progress:
            if isolate:
                rows = _run_isolated(settings, names, budget=budget, work=work, progress=progress)
            else:
                rows = _run_in_process(
                    settings, names, model=model, budget=budget, work=work, progress=progress
                )
            if live_pass:
                live = _live_pass(settings, names, budget=budget, work=work, progress=progress)
                live_measure = live.pop("allocator")
                for r in rows:
                    r.peak_live_bytes = live[r.name]["peak_bytes"]
                    r.live_step_s = live[r.name]["step_s"]
    finally:
        remove_scratch_dir(work)
    _add_ratios(rows)

    params = sum(p.numel() for p in model.parameters())
    model_info = {
        **asdict(model.cfg),
        "batch": settings.batch,
        "parameters": params,
        "dtype": "float32",
        "device": str(device),
        "saved_bytes_per_step": saved_all,
        "saved_activation_bytes_per_step": saved_activations,
        "tierstore_disk_budget_bytes": budget,
    }
    settings_doc = asdict(settings)
    settings_doc["strategies"] = names
    settings_doc["skipped"] = skipped
    settings_doc["memory_measure"] = _memory_measure(cuda, isolate)
    settings_doc["live_measure"] = live_measure
    return TrainReport(
        rows=rows, settings=settings_doc, targets=_targets(rows, cuda), model=model_info
    )


def _plan_of(store: TierStore, result: StrategyResult) -> dict[str, Any] | None:
    """NOTE [ Budget rows ]: the plan, predicted beside measured."""
    with store.offload():
        pass  # ends the last measured step: the plan gets its measurement
    plan = store.plan()
    if plan is None:
        return None
    return {
        "table": str(plan),
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
        "floor_bytes": plan.floor_bytes,
        "predicted_step_s": plan.predicted_step_s,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_by_store_step_s": None if plan.measured_before else plan.measured_step_s,
        "measured_by_store_peak_bytes": None if plan.measured_before else plan.measured_peak_bytes,
        "measured_vs_predicted": result.median_step_s / plan.predicted_step_s,
        "bytes": plan.bytes_by_choice(),
    }


def _summarize(
    result: StrategyResult, before: Stats | None, after: Stats | None, steps: int
) -> None:
    result.median_step_s = median(result.step_s)
    result.peak_memory_bytes = max(result.peak_bytes)
    if after is None:
        return
    result.tiers = {
        tier: {
            "peak_bytes": after.tiers[tier].peak_bytes,
            "written_per_step": (
                after.tiers[tier].bytes_written
                - (before.tiers[tier].bytes_written if before else 0)
            )
            / steps,
            "read_per_step": (
                after.tiers[tier].bytes_read - (before.tiers[tier].bytes_read if before else 0)
            )
            / steps,
        }
        for tier in TIERS
    }
    disk = result.tiers["disk"]
    result.moved_per_step = disk["written_per_step"] + disk["read_per_step"]
    hits = _delta(after, before, "prefetch_hits")
    misses = _delta(after, before, "prefetch_misses")
    result.prefetch = {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses)
        if hits is not None and misses is not None and hits + misses
        else None,
        "bytes_prefetched": _delta(after, before, "bytes_prefetched"),
        "unpack_wait_s": _delta(after, before, "unpack_wait_s"),
        "pack_wait_s": _delta(after, before, "pack_wait_s"),
    }


_Check = tuple[str, float | None, str, float]


def _cpu_checks(r: StrategyResult, by_name: dict[str, StrategyResult]) -> list[_Check]:
    # Issue 11: full disk offload against what users see, in the same run.
    hit = r.prefetch["hit_rate"] if r.prefetch else None
    rivals = [
        (f"peak RSS vs {name}", _ratio(r.peak_memory_bytes, other.peak_memory_bytes))
        if (other := by_name.get(name))
        else (f"peak RSS vs {name}", None)
        for name in ("checkpoint", "disk-naive")
    ]
    return [
        ("peak RSS vs none", r.memory_vs_none, "<=", 0.25),
        ("step time vs none", r.step_vs_none, "<=", 1.10),
        *[(what, value, "<=", 1.0) for what, value in rivals],
        ("prefetch hit rate after warm-up", hit, ">=", 0.95),
        ("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0),
    ]


def _recompute_checks(r: StrategyResult, off: StrategyResult | None) -> list[_Check]:
    # Issue 13: recompute="cheap" against the same store without it, in the same run.
    def vs_off(get: Callable[[StrategyResult], float | None]) -> float | None:
        return _ratio(get(r), get(off)) if off is not None else None

    return [
        ("bytes moved vs recompute off", vs_off(lambda x: x.moved_per_step), "<=", 0.8),
        ("step time vs recompute off", vs_off(lambda x: x.median_step_s), "<=", 1.05),
        ("peak memory vs recompute off", vs_off(lambda x: x.peak_memory_bytes), "<=", 1.0),
        ("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0),
    ]


def _cuda_checks(r: StrategyResult, by_name: dict[str, StrategyResult]) -> list[_Check]:
    # Issue 11: the host tier against save_on_cpu, the offloader users would pick.
    rival = by_name.get("save_on_cpu")
    reserved = _ratio(r.peak_memory_bytes, rival.peak_memory_bytes) if rival else None
    allocated = _ratio(r.peak_allocated_bytes, rival.peak_allocated_bytes) if rival else None
    return [
        ("step time vs none", r.step_vs_none, "<=", 1.04),
        ("reserved vs save_on_cpu", reserved, "<=", 1.0),
        ("allocated vs save_on_cpu", allocated, "<=", 1.0),
        ("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0),
    ]


def _targets(rows: list[StrategyResult], cuda: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    by_name = {r.name: r for r in rows}
    budget_rows = [r for r in rows if r.name.startswith(BUDGET)]
    for r in rows:
        if "tierstore" not in r.name and r not in budget_rows:
            continue
        checks: list[_Check]
        if r in budget_rows:
            checks = _budget_checks(r, by_name, cuda)
        elif r.name.endswith(RECOMPUTE_SUFFIX):
            checks = _recompute_checks(r, by_name.get(_base(r.name)))
        elif not cuda and r.name.startswith("tierstore-"):
            checks = _cpu_checks(r, by_name)
        elif cuda and r.name == "tierstore-host":
            checks = _cuda_checks(r, by_name)
        else:
            checks = [("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0)]
        for what, value, op, target in checks:
            out.append(_target(r.name, what, value, op, target))
    if budget_rows and not cuda:
        out += _budget_run_checks(budget_rows, by_name)
    return out


def _target(name: str, what: str, value: float | None, op: str, target: float) -> dict[str, Any]:
    met = None if value is None else _compare(value, op, target)
    return {"strategy": name, "check": what, "value": value, "op": op, "target": target, "met": met}


# NOTE [ Budget targets ]
# Issue 21, CPU, with only activation_budget set: each budget row's peak RSS
# is at most checkpoint's plus the budget's share of none's (the share: the
# plan's budget over the bytes the step saves), and the plan's predicted
# step is within 15% of the measured one. Across the budget rows, some row
# reaches checkpoint's peak RSS in less step time than checkpoint, and some
# disk-naive's in less than disk-naive: the larger of a row's two ratios to
# the rival is below 1, printed for the row where it is lowest.
_PREDICTION_WITHIN = 0.15


def _budget_checks(
    r: StrategyResult, by_name: dict[str, StrategyResult], cuda: bool
) -> list[_Check]:
    grads: _Check = ("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0)
    if cuda:
        return [grads]
    plan, none, ckpt = r.plan, by_name.get("none"), by_name.get("checkpoint")
    allowed = None
    if plan is not None and none is not None and ckpt is not None:
        share = plan["budget_bytes"] / max(sum(plan["bytes"].values()), 1)
        allowed = ckpt.peak_memory_bytes + share * none.peak_memory_bytes
    predicted = plan["measured_vs_predicted"] if plan is not None else None
    return [
        (
            "peak RSS vs checkpoint's + the budget's share of none's",
            _ratio(r.peak_memory_bytes, allowed),
            "<=",
            1.0,
        ),
        ("step time vs the plan's prediction", predicted, "within", _PREDICTION_WITHIN),
        grads,
    ]


def _budget_run_checks(
    budget_rows: list[StrategyResult], by_name: dict[str, StrategyResult]
) -> list[dict[str, Any]]:
    """NOTE [ Budget targets ]: some budget row beats each rival on both axes."""
    out = []
    for rival_name in ("checkpoint", "disk-naive"):
        rival = by_name.get(rival_name)
        if rival is None:
            continue
        worse = {
            r.name: max(
                _ratio(r.peak_memory_bytes, rival.peak_memory_bytes) or float("inf"),
                _ratio(r.median_step_s, rival.median_step_s) or float("inf"),
            )
            for r in budget_rows
        }
        best = min(worse, key=worse.__getitem__)
        what = f"the larger of peak RSS and step time vs {rival_name}, lowest of the budgets"
        value = worse[best] if worse[best] != float("inf") else None
        out.append(_target(best, what, value, "<", 1.0))
    return out


def _compare(value: float, op: str, target: float) -> bool:
    if op == "within":  # a ratio within target of 1
        return abs(value - 1.0) <= target
    return {"<=": value <= target, "<": value < target, ">=": value >= target}[op]


def _bytes(value: float | None) -> str:
    return NA if value is None else human_bytes(int(value))


def format_train(report: TrainReport) -> str:
    """The results table, then the issue's targets for the tierstore rows, as text.

    A model that saves less than :data:`TARGET_SAVED_BYTES` per step gets a
    note above the table instead of the step-time and memory targets
    (NOTE [ Targets at size ]).

    The memory column is the headline: ``peak RSS`` on CPU (default
    allocator), ``reserved`` on CUDA; ``live peak`` appears when the live
    pass ran, ``allocated`` on CUDA.

    Example:
        >>> import tempfile
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> print(format_train(bench_train(s, show_progress=False)))  # doctest: +ELLIPSIS
        A small model (... of saved activations per step, a ... ms step under none): ...
        <BLANKLINE>
        strategy  step s  vs none  vs naive  peak RSS  ...
        --------  ...
        none  ...
    """
    cuda = report.model["device"].startswith("cuda")
    live = any(r.peak_live_bytes is not None for r in report.rows)
    headers = ["strategy", "step s", "vs none", "vs naive"]
    headers += ["reserved" if cuda else "peak RSS", "vs none", "vs naive"]
    headers += ["allocated"] if cuda else ["live peak", "vs none"] if live else []
    headers += ["disk peak", "written/step", "moved/step", "prefetch hit", "max |grad diff|"]
    cells = []
    for r in report.rows:
        disk = r.tiers["disk"] if r.tiers else None
        hit = r.prefetch["hit_rate"] if r.prefetch else None
        row = [r.name, f"{r.median_step_s:.3f}", fmt_ratio(r.step_vs_none)]
        row += [fmt_ratio(r.step_vs_naive), human_bytes(r.peak_memory_bytes)]
        row += [fmt_ratio(r.memory_vs_none), fmt_ratio(r.memory_vs_naive)]
        if cuda:
            row.append(_bytes(r.peak_allocated_bytes))
        elif live:
            row += [_bytes(r.peak_live_bytes), fmt_ratio(r.live_vs_none)]
        row += [_bytes(disk["peak_bytes"]) if disk else NA]
        row += [_bytes(disk["written_per_step"]) if disk else NA, _bytes(r.moved_per_step)]
        row.append(f"{hit:.1%}" if hit is not None else NA)
        row.append(f"{r.max_grad_diff:g}" if r.max_grad_diff is not None else NA)
        cells.append(row)
    saved = report.model.get("saved_activation_bytes_per_step", 0)
    lines = [format_table(headers, cells)]
    targets = report.targets
    if saved < TARGET_SAVED_BYTES:
        # NOTE [ Targets at size ]
        lines.insert(0, _small_model_note(report, saved))
        targets = [t for t in targets if "grad" in t["check"]]
    lines += [_format_target(t) for t in targets]
    lines += [_format_plan(r) for r in report.rows if r.name.startswith(BUDGET)]
    return "\n".join(lines)


def _format_plan(r: StrategyResult) -> str:
    """A budget row's plan: predicted beside measured (NOTE [ Budget rows ])."""
    plan = r.plan
    if plan is None:
        return f"{r.name}: plan {NA} (the store made none)"
    by = plan["bytes"]
    fits = "" if plan["fits"] else f", below its floor {human_bytes(plan['floor_bytes'])}"
    peak = plan["measured_by_store_peak_bytes"]
    measured_peak = NA if peak is None else human_bytes(peak)
    return (
        f"{r.name}: planned keep {human_bytes(by['keep'])}, offload "
        f"{human_bytes(by['offload'])}, rebuild {human_bytes(by['rebuild'])} within "
        f"{human_bytes(plan['budget_bytes'])}{fits}; step predicted "
        f"{plan['predicted_step_s']:.3f} s, measured {r.median_step_s:.3f} s "
        f"({plan['measured_vs_predicted']:.2f}x); saved bytes resident at peak predicted "
        f"{human_bytes(plan['predicted_peak_bytes'])}, measured by the store {measured_peak}"
    )


# NOTE [ Targets at size ]
# The step-time and memory targets are for models that save >= 1 GiB per step
# (TARGET_SAVED_BYTES). On a smaller one, --quick's 3 MiB above all, a step
# takes milliseconds and the ratios measure fixed costs: a store's threads and
# spill file, per-tensor bookkeeping, a buffer pool sized for large steps.
# Such a run says so above its table and prints only the targets that hold at
# any size (gradients); the JSON keeps every target with its verdict.

#: Saved activation bytes per step from which the step-time and memory targets apply.
TARGET_SAVED_BYTES = 1 << 30


def _small_model_note(report: TrainReport, saved: int) -> str:
    none = report.row("none")
    step = f", a {none.median_step_s * 1000:.0f} ms step under none" if none else ""
    return (
        f"A small model ({human_bytes(saved)} of saved activations per step{step}): its "
        "step-time and memory ratios measure fixed costs (threads, a spill file, per-tensor "
        "bookkeeping), not the cost of moving activations. The targets for them apply from "
        f"{human_bytes(TARGET_SAVED_BYTES)} saved per step and are not checked here: run "
        "tierstore bench train without --quick.\n"
    )


def _format_target(t: dict[str, Any]) -> str:
    value = t["value"]
    if value is None:
        shown = NA
    elif "rate" in t["check"]:
        shown = f"{value:.1%}"
    elif "grad" in t["check"]:
        shown = f"{value:g}"
    else:
        shown = fmt_ratio(value)
    target = f"{t['target']:.0%}" if "rate" in t["check"] else f"{t['target']:g}"
    if t["op"] == "within":
        target = f"1 ± {target}"
    if "vs" in t["check"] and "grad" not in t["check"]:
        target += "x"
    verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
    return f"{t['strategy']}: {t['check']} {shown} (target {t['op']} {target}: {verdict})"


def _describe(report: TrainReport) -> str:
    m, s = report.model, report.settings
    cuda = m["device"].startswith("cuda")
    step_where = "" if cuda or not s["isolate"] else ", each strategy in a fresh process"
    live = s.get("live_measure")
    return (
        f"tierstore bench train: GPT {m['layers']} blocks, d_model {m['d_model']}, "
        f"heads {m['heads']}, seq {m['seq']}, batch {m['batch']}, vocab {m['vocab']} "
        f"({m['parameters'] / 1e6:.1f}M parameters), fp32 on {m['device']}; saved activations "
        f"{human_bytes(m['saved_activation_bytes_per_step'])} per step; "
        f"{s['warmup']} warm-up + {s['steps']} measured steps per strategy; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"step = forward + backward + SGD update, median{step_where}; "
        f"{s['memory_measure']};\n"
        + (
            f"live peak = peak anonymous RSS above the RSS before one measured step, {live};\n"
            if live
            else ""
        )
        + "vs none, vs naive = the column to the left over none's, over disk-naive's; "
        "disk peak = the disk tier's peak bytes; written/step, moved/step = disk bytes "
        "written, written + read, per measured step; prefetch hit = unpacks that found their "
        "entry read ahead, over all that needed a read or copy, in the measured steps;\n"
        "tierstore-file/-lmdb: device_budget=0, host_budget=0; tierstore-host: "
        f"device_budget={human_bytes(s['device_budget_bytes'])}, the rest in host memory; "
        "tierstore-host-disk: host_budget = 1/3 of the disk budget; "
        f"min_offload_bytes={s['min_offload_bytes']}, compression={s['compression']}; "
        f"{RECOMPUTE_SUFFIX}: the same store with recompute='cheap'; "
        "max |grad diff| vs none over all parameters after the last step"
        + "".join(f"\nskipped {name}: {why}" for name, why in s.get("skipped", {}).items())
    )


def plot_train(report: TrainReport, path: str | os.PathLike[str]) -> None:
    """Memory over the last measured step per strategy; a store's tiers over a warm-up step (PNG).

    Raises:
        TierstoreError: matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none", "tierstore-file"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> report = bench_train(s, show_progress=False)
        >>> plot_train(report, os.path.join(tempfile.mkdtemp(), "train.png"))  # doctest: +SKIP
    """
    plt = load_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5))
    for r in report.rows:
        tl = r.timeline
        if tl:
            top.plot(tl["t_s"], [v / _MIB for v in tl["memory_bytes"]], label=r.name)
    memory = "allocated" if report.model["device"].startswith("cuda") else "anonymous RSS"
    top.set_title(f"{memory} above the baseline before the first step, during the last step")
    top.set_xlabel("seconds into the step")
    top.set_ylabel("MiB")
    top.legend()
    shown = next((r for r in report.rows if r.tier_timeline), None)
    if shown is None:
        why = "no tierstore strategy ran, or no warm-up step (the tiers are polled there)"
        bottom.text(0.5, 0.5, why, ha="center", va="center")
        bottom.set_axis_off()
    else:
        tl = shown.tier_timeline
        tiers = tl["tiers"]
        for tier in TIERS:
            bottom.plot(tiers["t_s"], [v / _MIB for v in tiers[tier]], label=f"{tier} tier")
        bottom.plot(
            tl["t_s"],
            [v / _MIB for v in tl["memory_bytes"]],
            label=memory,
            color="grey",
            linewidth=0.8,
        )
        bottom.set_title(
            f"{shown.name}: bytes per tier during step {tl['step']}, the last warm-up step "
            "(no timed step polls the store)"
        )
        bottom.set_xlabel("seconds into the step")
        bottom.set_ylabel("MiB")
        bottom.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(report: TrainReport, path: str | os.PathLike[str]) -> None:
    """The curve of ``--sweep``: peak memory against step time, both relative to ``none``.

    Checkpointing the first N blocks and tierstore's budgets are lines; the
    other offloaders are points. A budget row's predicted step is a cross.

    Raises:
        TierstoreError: matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none", "checkpoint-1"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> plot_sweep(bench_train(s, show_progress=False),
        ...            os.path.join(tempfile.mkdtemp(), "sweep.png"))  # doctest: +SKIP
    """
    plt = load_pyplot()
    none = report.row("none")
    if none is None or not none.median_step_s or not none.peak_memory_bytes:
        raise TierstoreError("tierstore: bench train --sweep: the curve needs the none row")

    def point(r: StrategyResult) -> tuple[float, float]:
        return r.peak_memory_bytes / none.peak_memory_bytes, r.median_step_s / none.median_step_s

    # Each line in the order of its knob (blocks checkpointed, budget), not of
    # its measured memory: a line that doubles back is a finding, not noise.
    layers = report.model["layers"]
    checkpoints = sorted(
        (r for r in report.rows if r.name.startswith(CHECKPOINT_FIRST) or r.name == "checkpoint"),
        key=lambda r: (
            int(r.name.removeprefix(CHECKPOINT_FIRST)) if r.name[-1].isdigit() else layers
        ),
    )
    budgets = sorted(
        (r for r in report.rows if r.name.startswith(BUDGET)),
        key=lambda r: r.plan["budget_bytes"] if r.plan is not None else 0,
    )
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for rows, label, style in (
        (checkpoints, "checkpoint the first N blocks", "o-"),
        (budgets, "tierstore activation_budget", "s-"),
    ):
        if rows:
            xs, ys = zip(*(point(r) for r in rows), strict=True)
            ax.plot(xs, ys, style, label=label)
            for r, x, y in zip(rows, xs, ys, strict=True):
                ax.annotate(r.name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    predicted = [
        (point(r)[0], r.plan["predicted_step_s"] / none.median_step_s)
        for r in budgets
        if r.plan is not None
    ]
    if predicted:
        xs, ys = zip(*predicted, strict=True)
        ax.plot(xs, ys, "x", color="grey", label="the budget's plan: predicted step")
    for r in report.rows:
        if r in checkpoints or r in budgets:
            continue
        x, y = point(r)
        ax.plot(x, y, "D", label=r.name)
    ax.set_xlabel(
        "peak memory / none's ("
        + ("reserved" if report.model["device"].startswith("cuda") else "anonymous RSS")
        + ")"
    )
    ax.set_ylabel("step time / none's")
    ax.set_title("My step does not fit: memory against step time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench train``; model sizes default by ``--quick``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> settings_from_args(p.parse_args(["--quick", "--steps", "2"])).layers
        2
    """
    full = TrainSettings()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model: about 30 s on two cores, most of it starting a fresh process "
        "per strategy (--in-process: about 10 s)",
    )
    add_model_arguments(parser, full)
    parser.add_argument("--steps", type=int, default=full.steps, help="measured steps (default 4)")
    parser.add_argument("--warmup", type=int, default=full.warmup, help="warm-up steps (default 1)")
    parser.add_argument(
        "--strategies",
        default="",
        help=f"comma-separated, from {', '.join(STRATEGIES)}, checkpoint-N (the first N "
        f"blocks), budget=F (activation_budget=F; or --budget), and the tierstore ones "
        f"followed by {RECOMPUTE_SUFFIX} (default on cpu: {', '.join(CPU_STRATEGIES)}; "
        f"on cuda: {', '.join(CUDA_STRATEGIES)})",
    )
    parser.add_argument(
        "--dir", default=None, help="where disk strategies write (default: the system temp dir)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, tokens and dropout")
    parser.add_argument(
        "--min-offload-bytes",
        type=int,
        default=0,
        help="tierstore: saved tensors below this stay in memory (default 0: all to disk)",
    )
    parser.add_argument(
        "--compression", choices=["none", "zstd"], default="none", help="tierstore disk entries"
    )
    parser.add_argument(
        "--recompute",
        default="off",
        help="tierstore recompute settings, comma-separated: off, cheap, or off,cheap to run "
        f"each tierstore strategy both ways side by side (cheap rows end in {RECOMPUTE_SUFFIX})",
    )
    parser.add_argument(
        "--device-budget",
        type=int,
        default=0,
        help="tierstore-host(-disk): bytes of the newest saved tensors kept on the device",
    )
    parser.add_argument(
        "--in-process",
        dest="isolate",
        action="store_false",
        help="CPU: run every strategy in this process, not each in a fresh one (fast; "
        "earlier strategies' freed heap can inflate later ones' RSS)",
    )
    parser.add_argument(
        "--no-live-pass",
        "--no-memory-pass",
        dest="live_pass",
        action="store_false",
        help="CPU: skip the live-memory pass (a fresh process with glibc "
        "M_MMAP_THRESHOLD=1MiB, so RSS follows live tensors), shown beside the headline",
    )
    parser.add_argument(
        "--budget",
        default="",
        metavar="F[,F...]",
        help="add a row per activation_budget F (a fraction such as 0.3, or a size such as "
        "512MiB): a store with only that set, which plans keep / offload / rebuild",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="memory against step time: none, checkpoint on the first N blocks for each N, "
        f"disk-naive, tierstore-file and budgets {','.join(SWEEP_BUDGETS)}, side by side; "
        "writes the curve as a PNG (--plot, else next to --json)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a memory timeline (PNG); with --sweep, the curve",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """:class:`TrainSettings` from parsed options: ``--quick`` picks the defaults, flags win.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> settings_from_args(p.parse_args(["--d-model", "256"])).d_model
        256
    """
    base = quick_settings() if args.quick else default_settings()
    sizes = {
        name: getattr(args, name)
        for name in ("layers", "d_model", "heads", "seq", "batch", "vocab")
        if getattr(args, name) is not None
    }
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    layers = sizes.get("layers", base.layers)
    if args.sweep:
        strategies = [
            "none",
            *(f"{CHECKPOINT_FIRST}{n}" for n in range(1, layers)),
            "checkpoint",
            "disk-naive",
            "tierstore-file",
            *(BUDGET + b for b in SWEEP_BUDGETS),
        ]
    budgets = [BUDGET + b.strip() for b in args.budget.split(",") if b.strip()]
    if budgets and not strategies:
        strategies = ["none", "checkpoint", "disk-naive", "tierstore-file"]
    return replace(
        base,
        **sizes,
        steps=args.steps,
        warmup=args.warmup,
        strategies=(*strategies, *(b for b in budgets if b not in strategies)),
        directory=args.dir,
        device=args.device,
        seed=args.seed,
        min_offload_bytes=args.min_offload_bytes,
        compression=args.compression,
        recompute=tuple(r.strip() for r in args.recompute.split(",") if r.strip()),
        device_budget_bytes=args.device_budget,
        isolate=args.isolate,
        live_pass=args.live_pass,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore bench train`` with parsed options; print the table.

    Returns 0, or 1 when a strategy's gradients differ from ``none``'s.

    Example:
        >>> import argparse, tempfile
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> args = p.parse_args(["--quick", "--steps", "1", "--warmup", "0", "--quiet",
        ...                      "--in-process", "--no-live-pass",
        ...                      "--strategies", "none,disk-naive", "--dir", tempfile.mkdtemp()])
        >>> run(args)  # doctest: +ELLIPSIS
        tierstore bench train: GPT 2 blocks, ...
        0
    """
    settings = settings_from_args(args)
    if args.plot or args.sweep:
        load_pyplot()  # fail before the benchmark runs, not after
    info = machine_info(Path(args.dir or tempfile.gettempdir()).absolute())
    report = bench_train(settings, show_progress=not args.quiet)
    if hasattr(os, "getloadavg"):
        info["loadavg_after_1_5_15min"] = list(os.getloadavg())
    print(_describe(report))
    print()
    print(format_train(report))
    if args.json:
        write_results(args, "train", info, report.as_dict())
    if args.sweep:
        path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
        if path:
            plot_sweep(report, path)
            print(f"curve: {path}")
    elif args.plot:
        plot_train(report, args.plot)
        print(f"plot: {args.plot}")
    unequal = [r.name for r in report.rows if r.grads_bitwise_equal is False]
    if unequal:
        print(f"gradients differ from none's: {', '.join(unequal)}")
        return 1
    return 0
