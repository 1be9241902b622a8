"""``tierstore bench soak``: hundreds of training steps with every saved activation on disk.

The small GPT of :mod:`tierstore.models` trains ``steps`` steps (forward
under :meth:`~tierstore.TierStore.offload`, backward, AdamW update) with
``device_budget=0, host_budget=0, min_offload_bytes=0``: every saved
activation goes to the disk tier (``file`` or ``lmdb`` backend) and comes
back in backward. After each step the soak samples what a leak would grow,
and checks that none of it grows after the warm-up.

NOTE [ What bench soak measures ]
* Per step, after the optimizer step and in this order: ``store.stats()``
  (bytes and entries per tier: backward has released every entry, so all
  must be 0, in every step, warm-up included); then the young garbage
  generations are collected and ``malloc_trim(0)`` returns free heap pages
  (untimed; NOTE [ What bench train measures ] says why RSS needs it); then
  the samples: open file descriptors (``/proc/self/fd``), threads (Python's
  ``threading.active_count()`` and the kernel's ``/proc/self/task``),
  anonymous RSS (resident minus shared pages of ``/proc/self/statm``: file
  pages such as LMDB's map and the page cache are not counted), and the
  spill directory: files, logical size (``st_size``) and allocated size
  (``st_blocks * 512``; the ``file`` backend reserves the blocks of each
  growth with fallocate, so the logical size alone would not show them).
* Flat means: after the warm-up (``--warmup``, default the first 10% of the
  steps, at least 5), against the value at the last warm-up step: file
  descriptors, threads and spill files never differ; the spill's logical
  and allocated bytes never exceed it (``file``: the file grows on demand
  and never shrinks while the store is open), or with ``lmdb`` never exceed the map (``map_size``):
  LMDB's data file grows as freed overflow pages fragment, slower and
  slower (NOTE [ LMDB map size ]; measured on the tiny model with a 3.8 MiB
  budget: from 3.5 MiB after step 1 to 6.5 MiB by step ~2300, then flat to
  step 4000, under its 8.6 MiB map), while a leak of pages would fill the
  map within a few steps and fail the soak; anonymous RSS never exceeds it by
  more than ``--rss-growth-limit`` (default 64 MiB), and its least-squares
  slope over the steps after the warm-up stays under
  ``--rss-slope-limit`` per 100 steps (default 8 MiB; judged from 20 steps
  after the warm-up on, reported for fewer). glibc keeps freed
  heap pages and fragments, so RSS moves by a few MiB from step to step
  even after ``malloc_trim``; a leak of one saved activation per step moves
  it by that activation's size every step, which the slope shows within
  tens of steps.
* Checked too: step 1's loss and gradients bitwise equal to eager autograd
  without the store (from the same weights, tokens and dropout masks: torch
  is reseeded before both); loss and gradients finite in every step; after
  ``store.close()``, the spill directory is gone and the file descriptors
  and threads are back to what they were before the store opened. Before
  that first count, the stores this process collected unclosed are closed
  (NOTE [ Finalizers and interrupts ] leaves that to the next store made or
  closed, which would be this one), so the counts are this store's alone.
* Step time: forward + backward + optimizer step, wall clock.

Example:
    >>> import tempfile
    >>> from tierstore.bench.soak import run_soak, tiny_settings
    >>> result = run_soak(tiny_settings(steps=8, warmup=2, directory=tempfile.mkdtemp()),
    ...                   show_progress=False)
    >>> result.flat, result.row("open file descriptors").growth
    (True, 0)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tierstore.backends.lmdb import _map_size
from tierstore.bench.memory import AnonRss, release_free_memory
from tierstore.bench.report import (
    NA,
    Progress,
    Report,
    format_table,
    machine_info,
    median,
    write_results,
)
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.config import TierConfig, human_bytes
from tierstore.errors import TierstoreError
from tierstore.models import GPT, add_model_arguments, build_model, saved_bytes
from tierstore.stats import TIERS
from tierstore.tier_store import TierStore
from tierstore.tiers.release import close_collected

__all__ = [
    "BACKENDS",
    "MetricCheck",
    "OnStep",
    "SoakResult",
    "SoakSettings",
    "add_arguments",
    "default_settings",
    "format_soak",
    "run",
    "run_soak",
    "settings_from_args",
    "tiny_settings",
]

#: The disk backends a soak can run on.
BACKENDS = ("file", "lmdb")
#: Called after each step's optimizer step, before the samples: ``(step, store)``,
#: steps counted from 1. Tests inject leaks through it.
OnStep = Callable[[int, TierStore], None]

_MIB = 1 << 20
#: Steps after the warm-up below which the RSS slope is reported but not judged:
#: over a few steps, allocator noise of a few hundred KiB reads as a steep slope.
_MIN_SLOPE_STEPS = 20


@dataclass(frozen=True)
class SoakSettings:
    """What a soak runs: the model, the steps, the backend, the limits of "flat".

    ``warmup=None`` is the first 10% of the steps, at least 5.
    ``disk_budget_bytes=None`` sizes the disk tier as ``bench train`` does:
    1.5 times the activation bytes one forward saves, plus 64 MiB.
    ``directory=None`` is the system temp dir; the soak makes a private
    directory inside it for the store and removes it at the end.

    Example:
        >>> from tierstore.bench.soak import SoakSettings
        >>> SoakSettings().warmup_steps, SoakSettings(steps=50).warmup_steps
        (50, 5)
    """

    layers: int = 4
    d_model: int = 256
    heads: int = 4
    seq: int = 256
    batch: int = 8
    vocab: int = 512
    dropout: float = 0.1
    steps: int = 500
    warmup: int | None = None
    backend: str = "file"
    compression: str = "none"
    directory: str | None = None
    seed: int = 0
    lr: float = 1e-3
    disk_budget_bytes: int | None = None
    rss_growth_limit_bytes: int = 64 * _MIB
    rss_slope_limit_bytes_per_100_steps: int = 8 * _MIB

    @property
    def warmup_steps(self) -> int:
        """The warm-up steps in effect: ``warmup``, or 10% of the steps (at least 5)."""
        if self.warmup is not None:
            return self.warmup
        return max(5, math.ceil(self.steps / 10))


def default_settings(**changes: Any) -> SoakSettings:
    """The default soak: 500 steps of GPT 4x256, seq 256, batch 8 (~250 MiB to disk a step).

    Example:
        >>> default_settings(backend="lmdb").steps
        500
    """
    return replace(SoakSettings(), **changes)


def tiny_settings(**changes: Any) -> SoakSettings:
    """A tiny GPT (2 blocks, d_model 64, seq 64, batch 4) for 50 steps: seconds (tests).

    Example:
        >>> tiny_settings().steps, tiny_settings(steps=20).d_model
        (50, 64)
    """
    tiny = SoakSettings(layers=2, d_model=64, heads=2, seq=64, batch=4, vocab=128, steps=50)
    return replace(tiny, **changes)


@dataclass
class MetricCheck:
    """One sampled metric and whether it stayed flat (NOTE [ What bench soak measures ]).

    ``baseline`` is the value at ``baseline_step`` (the last warm-up step),
    or 0 with ``baseline_step=0`` for what must be 0 in every step.
    ``low``/``high`` span the checked steps; ``growth = high - baseline``;
    ``limit`` is the growth allowed; ``exact`` also fails a drop;
    ``slope_per_100_steps`` is the least-squares slope over the checked
    steps.

    Example:
        >>> check = MetricCheck("open file descriptors", "count", 12, 5, 11, 13, 12, 13, exact=True)
        >>> check.flat, check.reason
        (False, 'moved between 12 and 13 after step 5 (was 12)')
    """

    name: str
    unit: str
    baseline: float
    baseline_step: int
    first: float
    final: float
    low: float
    high: float
    growth: float = 0.0
    limit: float = 0.0
    exact: bool = False
    slope_per_100_steps: float | None = None
    slope_limit_per_100_steps: float | None = None
    flat: bool = True
    reason: str = ""

    def __post_init__(self) -> None:
        self.growth = self.high - self.baseline
        if not self.reason:
            self.flat, self.reason = self._verdict()

    def _verdict(self) -> tuple[bool, str]:
        since = f"step {self.baseline_step}" if self.baseline_step else "every step"
        show = _shower(self.unit)
        if self.exact and (self.low != self.baseline or self.high != self.baseline):
            return False, (
                f"moved between {show(self.low)} and {show(self.high)} after {since} "
                f"(was {show(self.baseline)})"
            )
        if self.growth > self.limit:
            where = f"after {since}" if self.baseline_step else "in some step"
            return False, (
                f"grew by {show(self.growth)} {where} (to {show(self.high)}; "
                f"allowed {show(self.limit)})"
            )
        slope, slope_limit = self.slope_per_100_steps, self.slope_limit_per_100_steps
        if slope is not None and slope_limit is not None and slope > slope_limit:
            return False, (
                f"grows by {show(slope)} per 100 steps after {since} (allowed {show(slope_limit)})"
            )
        if self.high == self.low == self.baseline:
            if self.baseline_step:
                return (
                    True,
                    f"{show(self.baseline)} in every step from step {self.baseline_step} on",
                )
            return True, f"{show(self.baseline)} in every step"
        if self.exact or self.limit == 0:
            return True, f"at most {show(self.baseline)} after {since}"
        return True, f"at most {show(self.growth)} above {show(self.baseline)} after {since}"


def _shower(unit: str) -> Callable[[float], str]:
    if unit == "bytes":
        return lambda v: ("-" if v < 0 else "") + human_bytes(round(abs(v)))
    return lambda v: f"{v:g}"


@dataclass
class SoakResult(Report[MetricCheck]):
    """What :func:`run_soak` measured: a :class:`MetricCheck` per metric, per-step samples.

    ``targets`` are the correctness checks (step 1 against eager autograd,
    finite values, clean close) in the form ``bench train`` uses;
    ``flat`` is whether every row is flat, ``ok`` whether the targets are met
    too; :attr:`problems` says what is not.

    Example:
        >>> r = SoakResult(rows=[], settings={}, targets=[], model={}, store={}, samples={},
        ...                wall_s=0.0, median_step_s=0.0)
        >>> r.flat, r.ok, r.problems
        (True, True, [])
    """

    model: dict[str, Any]
    store: dict[str, Any]
    samples: dict[str, list[float]]
    wall_s: float
    median_step_s: float
    flat: bool = True
    ok: bool = True

    def __post_init__(self) -> None:
        self.flat = all(r.flat for r in self.rows)
        self.ok = self.flat and all(t["met"] for t in self.targets)

    @property
    def problems(self) -> list[str]:
        """One line per metric that is not flat and per target missed."""
        out = [f"{r.name}: {r.reason}" for r in self.rows if not r.flat]
        out += [
            f"{t['check']}: {t['value']} (target {t['op']} {t['target']})"
            for t in self.targets
            if not t["met"]
        ]
        return out


# -- samples ----------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _spill_usage(directory: str | None) -> tuple[int, int, int]:
    """(files, logical bytes, allocated bytes) under ``directory``, recursively."""
    files = logical = allocated = 0
    if directory is None:
        return 0, 0, 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name), follow_symlinks=False)
            except FileNotFoundError:  # the backend replaced it while we walked
                continue
            files += 1
            logical += st.st_size
            allocated += st.st_blocks * 512
    return files, logical, allocated


def _slope_per_100(values: Sequence[float], first_step: int) -> float | None:
    """Least-squares slope of ``values`` (one per step from ``first_step``), per 100 steps."""
    n = len(values)
    if n < 2:
        return None
    xs = range(first_step, first_step + n)
    mx = sum(xs) / n
    my = sum(values) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True))
    return 100 * sxy / sxx


def _tokens(settings: SoakSettings, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    return torch.randint(0, settings.vocab, (settings.batch, settings.seq + 1), generator=gen)


def _reseed(settings: SoakSettings, step: int) -> None:
    torch.manual_seed(settings.seed * 7919 + step)  # the same dropout masks in a rerun


def _check_settings(settings: SoakSettings) -> None:
    if settings.backend not in BACKENDS:
        raise TierstoreError(
            f"tierstore: bench soak: backend {settings.backend!r} is unknown; expected one of "
            f"{', '.join(BACKENDS)}"
        )
    warmup = settings.warmup_steps
    if warmup < 1 or settings.steps < warmup + 2:
        raise TierstoreError(
            f"tierstore: bench soak: steps={settings.steps}, warmup={warmup}; expected "
            "warmup >= 1 and steps >= warmup + 2 (a slope needs two steps after the warm-up)"
        )
    if settings.d_model % settings.heads:
        raise TierstoreError(
            f"tierstore: bench soak: d_model={settings.d_model} is not a multiple of "
            f"heads={settings.heads}; change --d-model or --heads"
        )


def _target(check: str, value: float, op: str, target: float) -> dict[str, Any]:
    met = {"<=": value <= target, "==": value == target}[op]
    return {"check": check, "value": value, "op": op, "target": target, "met": met}


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, bool]:
    if len(a) != len(b):
        return math.inf, False
    diff = max(
        (float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True)),
        default=0.0,
    )
    return diff, all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- the run ----------------------------------------------------------------------


def run_soak(
    settings: SoakSettings, *, on_step: OnStep | None = None, show_progress: bool = True
) -> SoakResult:
    """Train ``settings.steps`` steps with every saved activation on disk; check nothing grows.

    See the module docstring and ``NOTE [ What bench soak measures ]``.

    Args:
        settings: model, steps, backend and limits (:func:`default_settings`,
            :func:`tiny_settings`).
        on_step: called after each optimizer step with ``(step, store)``,
            before the samples (tests inject leaks through it).
        show_progress: draw a progress bar (or print a line per 5% of the
            steps) on stderr.

    Returns:
        A :class:`SoakResult`: ``flat``, ``ok``, a row per metric, the
        samples of every step.

    Raises:
        TierstoreError: a bad setting; whatever the store raises.

    Example:
        >>> import tempfile
        >>> r = run_soak(tiny_settings(steps=7, warmup=2, backend="lmdb",
        ...                            directory=tempfile.mkdtemp()), show_progress=False)
        >>> r.ok, [t["met"] for t in r.targets]
        (True, [True, True, True, True, True, True, True])
    """
    _check_settings(settings)
    warmup = settings.warmup_steps
    model = build_model(settings, torch.device("cpu"))
    params = list(model.parameters())

    # Step 1 in eager autograd, from the same weights, tokens and dropout masks.
    reference = copy.deepcopy(model)
    _reseed(settings, 1)
    eager_loss = reference.loss(_tokens(settings, 1))
    eager_loss.backward()
    eager_grads = [p.grad.detach().clone() for p in reference.parameters() if p.grad is not None]
    eager_loss = eager_loss.detach()
    saved_all, saved_activations = saved_bytes(reference, _tokens(settings, 1))
    del reference
    budget = settings.disk_budget_bytes
    if budget is None:
        # Parameters are never offloaded: only the activations need room.
        budget = -(-(saved_activations * 3 // 2 + 64 * _MIB) // _MIB) * _MIB

    root = Path(settings.directory or tempfile.gettempdir()).absolute()
    if not root.is_dir():
        raise TierstoreError(f"tierstore: bench soak: --dir {root} is not a directory")
    private = make_scratch_dir("tierstore-soak-", root)
    config = TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget=budget,
        disk_path=private,
        disk_backend=settings.backend,
        compression=settings.compression,
        min_offload_bytes=0,
    )
    opt = torch.optim.AdamW(params, lr=settings.lr)
    rss = AnonRss()
    series: dict[str, list[float]] = {
        name: []
        for name in (
            "step_s",
            "loss",
            "anon_rss_bytes",
            "open_fds",
            "threads_python",
            "threads_os",
            "spill_files",
            "spill_logical_bytes",
            "spill_allocated_bytes",
            "tier_bytes_after_backward",
            "disk_bytes_after_backward",
            "entries_after_backward",
        )
    }
    nonfinite_steps: list[int] = []
    first_loss_diff = math.inf
    first_grad_diff = math.inf
    first_bitwise = False
    spill_dir: str | None = None
    store_doc: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        release_free_memory(full=True)
        close_collected()  # stores left unclosed before: their threads and fds are not ours
        fds_before, threads_before, os_threads_before = (
            _open_fds(),
            threading.active_count(),
            _os_threads(),
        )
        store = TierStore(config)
        store_doc = config.model_dump(mode="json")
        chunk = max(1, settings.steps // 20)
        try:
            with Progress(settings.steps, unit="step", enabled=show_progress) as progress:
                for first in range(1, settings.steps + 1, chunk):
                    last = min(first + chunk - 1, settings.steps)
                    with progress.phase(f"{settings.backend}: steps {first}-{last}"):
                        for step in range(first, last + 1):
                            _one_step(
                                settings,
                                step,
                                model=model,
                                params=params,
                                opt=opt,
                                store=store,
                                series=series,
                                nonfinite_steps=nonfinite_steps,
                            )
                            if step == 1:
                                first_loss_diff = abs(series["loss"][0] - float(eager_loss))
                                if not math.isfinite(first_loss_diff):
                                    first_loss_diff = math.inf
                                grads = [p.grad for p in params if p.grad is not None]
                                first_grad_diff, first_bitwise = _max_diff(eager_grads, grads)
                            opt.zero_grad(set_to_none=True)
                            if on_step is not None:
                                on_step(step, store)
                            _sample(store, rss, series)
                            progress.advance(1)
            spill_dir = store.disk_directory
        finally:
            store.close()
        release_free_memory(full=True)
        fds_after, threads_after, os_threads_after = (
            _open_fds(),
            threading.active_count(),
            _os_threads(),
        )
    finally:
        rss.close()
        remove_scratch_dir(private)
    wall = time.perf_counter() - start

    rows = _checks(settings, series, warmup, budget)
    targets = [
        _target("step 1 loss vs eager, |diff|", first_loss_diff, "<=", 0.0),
        _target("step 1 gradients vs eager, max |diff|", first_grad_diff, "<=", 0.0),
        _target("step 1 gradients bitwise equal to eager", float(first_bitwise), "==", 1.0),
        _target("steps with a non-finite loss or gradient", len(nonfinite_steps), "<=", 0),
        _target(
            "spill directory left after close",
            float(spill_dir is not None and os.path.exists(spill_dir)),
            "==",
            0.0,
        ),
        _target("open file descriptors after close - before", fds_after - fds_before, "==", 0),
        _target(
            "threads after close - before (threading, /proc/self/task)",
            max(abs(threads_after - threads_before), abs(os_threads_after - os_threads_before)),
            "==",
            0,
        ),
    ]
    settings_doc = asdict(settings)
    settings_doc["warmup_steps"] = warmup
    model_doc = {
        **asdict(model.cfg),
        "batch": settings.batch,
        "parameters": sum(p.numel() for p in params),
        "dtype": "float32",
        "device": "cpu",
        "optimizer": f"AdamW(lr={settings.lr})",
        "saved_bytes_per_step": saved_all,
        "saved_activation_bytes_per_step": saved_activations,
        "nonfinite_steps": nonfinite_steps,
        "eager_step1_loss": float(eager_loss),
    }
    return SoakResult(
        rows=rows,
        settings=settings_doc,
        targets=targets,
        model=model_doc,
        store={
            **store_doc,
            "spill_directory": spill_dir,
            "lmdb_map_size": _map_size(budget) if settings.backend == "lmdb" else None,
        },
        samples=series,
        wall_s=wall,
        median_step_s=median(series["step_s"]),
    )


def _one_step(
    settings: SoakSettings,
    step: int,
    *,
    model: GPT,
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    store: TierStore,
    series: dict[str, list[float]],
    nonfinite_steps: list[int],
) -> None:
    """Forward under the store, backward, optimizer step; gradients left for the caller."""
    tokens = _tokens(settings, step)
    _reseed(settings, step)
    start = time.perf_counter()
    with store.offload():
        loss = model.loss(tokens)
    loss.backward()
    opt.step()
    series["step_s"].append(time.perf_counter() - start)
    value = float(loss.detach())
    series["loss"].append(value)
    finite = math.isfinite(value) and all(
        bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None
    )
    if not finite:
        nonfinite_steps.append(step)


def _sample(store: TierStore, rss: AnonRss, series: dict[str, list[float]]) -> None:
    """The per-step samples, in NOTE [ What bench soak measures ]'s order."""
    stats = store.stats()
    series["tier_bytes_after_backward"].append(sum(stats.tiers[t].bytes for t in TIERS))
    series["disk_bytes_after_backward"].append(stats.tiers["disk"].bytes)
    series["entries_after_backward"].append(sum(stats.tiers[t].entries for t in TIERS))
    release_free_memory(full=False)
    series["anon_rss_bytes"].append(rss())
    series["open_fds"].append(_open_fds())
    series["threads_python"].append(threading.active_count())
    series["threads_os"].append(_os_threads())
    files, logical, allocated = _spill_usage(store.disk_directory)
    series["spill_files"].append(files)
    series["spill_logical_bytes"].append(logical)
    series["spill_allocated_bytes"].append(allocated)


#: (row name, series, unit, kind): "exact" never differs from the value at the
#: end of the warm-up, "max" never exceeds it, "rss" has a growth and a slope
#: limit, "zero" is 0 in every step.
_METRICS = (
    ("open file descriptors", "open_fds", "count", "exact"),
    ("threads (threading)", "threads_python", "count", "exact"),
    ("threads (/proc/self/task)", "threads_os", "count", "exact"),
    ("spill files", "spill_files", "count", "exact"),
    ("spill logical bytes", "spill_logical_bytes", "bytes", "max"),
    ("spill allocated bytes", "spill_allocated_bytes", "bytes", "max"),
    ("anonymous RSS", "anon_rss_bytes", "bytes", "rss"),
    ("tier bytes after backward", "tier_bytes_after_backward", "bytes", "zero"),
    ("entries after backward", "entries_after_backward", "count", "zero"),
)


def _checks(
    settings: SoakSettings, series: dict[str, list[float]], warmup: int, budget: int
) -> list[MetricCheck]:
    rows = []
    for name, key, unit, kind in _METRICS:
        values = series[key]
        if kind == "zero":
            rows.append(
                MetricCheck(
                    name, unit, 0.0, 0, values[0], values[-1], min(values), max(values), exact=True
                )
            )
            continue
        after = values[warmup - 1 :]  # from the last warm-up step on
        slope = _slope_per_100(after, warmup)
        rss = kind == "rss"
        limit = float(settings.rss_growth_limit_bytes) if rss else 0.0
        lmdb_map = 0
        if kind == "max" and settings.backend == "lmdb":
            # See NOTE [ What bench soak measures ]: LMDB's file may grow up to its map.
            lmdb_map = _map_size(budget)
            limit = float(lmdb_map - after[0])
        row = MetricCheck(
            name,
            unit,
            after[0],
            warmup,
            values[0],
            values[-1],
            min(after),
            max(after),
            limit=limit,
            exact=kind == "exact",
            slope_per_100_steps=slope,
            slope_limit_per_100_steps=(
                float(settings.rss_slope_limit_bytes_per_100_steps)
                if rss and len(after) > _MIN_SLOPE_STEPS
                else None
            ),
        )
        if lmdb_map and row.flat and row.growth > 0:
            row.reason = (
                f"grew by {human_bytes(round(row.growth))} after step {warmup}, to "
                f"{human_bytes(round(row.high))}: within LMDB's map_size "
                f"{human_bytes(lmdb_map)} (NOTE [ LMDB map size ])"
            )
        rows.append(row)
    return rows


# -- output ---------------------------------------------------------------------------


def format_soak(result: SoakResult) -> str:
    """A description line, the table of metrics, the correctness checks, and the verdict.

    Example:
        >>> import tempfile
        >>> r = run_soak(tiny_settings(steps=6, warmup=2, directory=tempfile.mkdtemp()),
        ...              show_progress=False)
        >>> print(format_soak(r))  # doctest: +ELLIPSIS
        tierstore bench soak (file): GPT 2 blocks, ...
        metric ...
        ...
        flat: yes; checks: all met
    """
    m, s = result.model, result.settings
    steps = len(result.samples["step_s"])
    lines = [
        f"tierstore bench soak ({s['backend']}): GPT {m['layers']} blocks, d_model "
        f"{m['d_model']}, heads {m['heads']}, seq {m['seq']}, batch {m['batch']} "
        f"({m['parameters'] / 1e6:.1f}M parameters), {m['optimizer']}; "
        f"{human_bytes(m['saved_activation_bytes_per_step'])} of activations to disk per step "
        f"(disk budget {human_bytes(int(result.store.get('disk_budget', 0)))}, "
        f"compression {s['compression']}); {steps} steps, warm-up {s['warmup_steps']}; "
        f"step {result.median_step_s:.3f} s median, {result.wall_s:.0f} s in all",
        "",
    ]
    headers = [
        "metric",
        "step 1",
        f"step {s['warmup_steps']}",
        "final",
        "min..max after",
        "growth",
        "allowed",
        "slope/100 steps",
        "flat",
    ]
    cells = []
    for r in result.rows:
        show = _shower(r.unit)
        slope = NA if r.slope_per_100_steps is None else show(r.slope_per_100_steps)
        baseline = show(r.baseline) if r.baseline_step else "(0)"
        cells.append(
            [
                r.name,
                show(r.first),
                baseline,
                show(r.final),
                f"{show(r.low)}..{show(r.high)}",
                show(r.growth),
                show(r.limit)
                + (
                    f", {show(r.slope_limit_per_100_steps)}/100"
                    if r.slope_limit_per_100_steps
                    else ""
                ),
                slope,
                "yes" if r.flat else "NO",
            ]
        )
    lines.append(format_table(headers, cells))
    for t in result.targets:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"{t['check']}: {t['value']:g} (target {t['op']} {t['target']:g}: {verdict})")
    met = all(t["met"] for t in result.targets)
    lines.append(
        f"flat: {'yes' if result.flat else 'NO'}; checks: {'all met' if met else 'MISSED'}"
    )
    lines += [f"  {p}" for p in result.problems]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench soak``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> settings_from_args(p.parse_args(["--steps", "50", "--tiny"]))[0].d_model
        64
    """
    full = SoakSettings()
    parser.add_argument(
        "--steps", type=int, default=full.steps, help="training steps (default 500)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps before the values must stay flat (default: 10%% of the steps, at least 5)",
    )
    parser.add_argument(
        "--backends",
        default="file",
        help=f"comma-separated disk backends, each soaked in turn, from {','.join(BACKENDS)} "
        "(default file)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model (2 blocks, d_model 64): seconds"
    )
    add_model_arguments(parser, full)
    parser.add_argument(
        "--compression", choices=["none", "zstd"], default="none", help="disk entries"
    )
    parser.add_argument(
        "--dir", default=None, help="where the store spills (default: the system temp dir)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, tokens and dropout")
    parser.add_argument(
        "--disk-budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="disk tier budget (default: 1.5x the activation bytes of a step, plus 64 MiB)",
    )
    parser.add_argument(
        "--rss-growth-limit",
        type=int,
        default=full.rss_growth_limit_bytes,
        metavar="BYTES",
        help="anonymous RSS allowed above its value at the end of the warm-up (default 64 MiB)",
    )
    parser.add_argument(
        "--rss-slope-limit",
        type=int,
        default=full.rss_slope_limit_bytes_per_100_steps,
        metavar="BYTES",
        help="anonymous RSS slope allowed after the warm-up, per 100 steps (default 8 MiB)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def settings_from_args(args: argparse.Namespace) -> list[SoakSettings]:
    """One :class:`SoakSettings` per backend in ``--backends``; size flags win over ``--tiny``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> [s.backend for s in settings_from_args(p.parse_args(["--backends", "file,lmdb"]))]
        ['file', 'lmdb']
    """
    base = tiny_settings() if args.tiny else default_settings()
    sizes = {
        name: getattr(args, name)
        for name in ("layers", "d_model", "heads", "seq", "batch", "vocab")
        if getattr(args, name) is not None
    }
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    return [
        replace(
            base,
            **sizes,
            steps=args.steps,
            warmup=args.warmup,
            backend=backend,
            compression=args.compression,
            directory=args.dir,
            seed=args.seed,
            disk_budget_bytes=args.disk_budget,
            rss_growth_limit_bytes=args.rss_growth_limit,
            rss_slope_limit_bytes_per_100_steps=args.rss_slope_limit,
        )
        for backend in backends
    ]


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore bench soak`` with parsed options; print a table per backend.

    Returns 0, or 1 when a metric is not flat or a check is missed.

    Example:
        >>> import argparse, tempfile
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> args = p.parse_args(["--tiny", "--steps", "6", "--warmup", "2", "--quiet",
        ...                      "--dir", tempfile.mkdtemp()])
        >>> run(args)  # doctest: +ELLIPSIS
        tierstore bench soak (file): ...
        0
    """
    all_settings = settings_from_args(args)
    for settings in all_settings:
        _check_settings(settings)
    info = machine_info(Path(args.dir or tempfile.gettempdir()).absolute())
    results = []
    for i, settings in enumerate(all_settings):
        result = run_soak(settings, show_progress=not args.quiet)
        results.append(result)
        if i:
            print()
        print(format_soak(result))
    if hasattr(os, "getloadavg"):
        info["loadavg_after_1_5_15min"] = list(os.getloadavg())
    if args.json:
        runs = {
            "flat": all(r.flat for r in results),
            "ok": all(r.ok for r in results),
            "runs": [r.as_dict() for r in results],
        }
        write_results(args, "soak", info, runs)
    return 0 if all(r.ok for r in results) else 1
