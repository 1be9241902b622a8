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

``--sweep`` runs, side by side in one run per model, ``none``,
``checkpoint-N`` for every N below the number of blocks, ``checkpoint``,
``disk-naive``, ``tierstore-file`` and ``budget=F`` for each of
:data:`SWEEP_BUDGETS`, on a small and a large model
(:data:`SWEEP_MODELS`; the model of the size options alone when any is
given), and draws memory against step time, one panel per model
(:func:`plot_sweeps`): a PNG at ``--plot``, else beside ``--json``.

The code is split by concern: the settings (``train_settings``), the
strategies (``train_strategies``), measuring a step (``train_measure``),
where strategies run (``train_runs``), the report and its tables
(``train_report``), the sweep and the plots (``train_sweep``); this module
runs them and is the command line.

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
  ``none``'s. ``--in-process`` (``isolate=False``: ``--quick``, tests,
  doctests) runs every strategy in this process instead, with the garbage
  collector and
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
  NOTE [ Handing the heap back ] in tierstore/tiers/host_pool.py: that is
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
* Timelines: memory over the last measured step (``timeline``) and bytes per
  tier over the last warm-up step (``tier_timeline``), as sampled; the JSON
  keeps the largest sample of each of at most a few hundred runs of samples
  (NOTE [ Timelines in the JSON ] in ``tierstore/bench/train_report.py``).

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
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from tierstore.bench.memory_limit import why_no_memory_limit
from tierstore.bench.report import Progress, load_pyplot, machine_info, write_results
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.bench.storage import parse_size
from tierstore.bench.train_measure import StrategyResult, _memory_measure
from tierstore.bench.train_measure import _tokens as _step_tokens
from tierstore.bench.train_report import (
    TARGET_SAVED_BYTES,
    TrainReport,
    _add_ratios,
    _describe,
    _targets,
    format_train,
    report_json,
)
from tierstore.bench.train_runs import _LIVE_STEPS, _live_pass, _run_in_process, _run_isolated
from tierstore.bench.train_settings import (
    MODEL_OPTIONS,
    OPTIMIZERS,
    TrainSettings,
    check_shape,
    default_settings,
    parse_vary_seq,
    quick_settings,
)
from tierstore.bench.train_strategies import (
    BUDGET,
    CPU_STRATEGIES,
    CUDA_STRATEGIES,
    RECOMPUTE_SUFFIX,
    STRATEGIES,
    _known,
    _torchtune_offload,
    _with_recompute,
    check_strategies,
)
from tierstore.bench.train_sweep import (
    SWEEP_BUDGETS,
    SWEEP_MODELS,
    plot_sweep,
    plot_sweeps,
    plot_train,
    sweep_settings,
    sweep_strategies,
)
from tierstore.config import human_bytes
from tierstore.errors import TierstoreError
from tierstore.models import add_model_arguments, build_model, saved_bytes

__all__ = [
    "CPU_STRATEGIES",
    "CUDA_STRATEGIES",
    "STRATEGIES",
    "SWEEP_BUDGETS",
    "SWEEP_MODELS",
    "TARGET_SAVED_BYTES",
    "StrategyResult",
    "TrainReport",
    "TrainSettings",
    "add_arguments",
    "bench_train",
    "default_settings",
    "format_train",
    "plot_sweep",
    "plot_sweeps",
    "plot_train",
    "quick_settings",
    "run",
    "runs_from_args",
    "settings_from_args",
]

_MIB = 1 << 20

#: A step's tokens; ``tierstore.bench.recording`` takes its batches from here.
_tokens = _step_tokens


def _check_settings(settings: TrainSettings) -> torch.device:
    """Raise on a setting no run can have; the device the run uses."""
    check_shape(settings)
    check_strategies(settings)
    if settings.steps < 1 or settings.warmup < 0:
        raise TierstoreError(
            f"tierstore: bench train: steps={settings.steps}, warmup={settings.warmup}; "
            "expected steps >= 1 and warmup >= 0"
        )
    try:
        device = torch.device(settings.device)
    except RuntimeError:
        device = torch.device("meta")  # named in the error below
    if device.type not in ("cpu", "cuda"):
        raise TierstoreError(
            f"tierstore: bench train: --device {settings.device} is not cpu or cuda"
        )
    _check_memory_limit(settings, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TierstoreError(
            "tierstore: bench train: --device cuda, but torch.cuda.is_available() is False; "
            "use --device cpu or a CUDA build of torch"
        )
    return device


def _check_memory_limit(settings: TrainSettings, device: torch.device) -> None:
    """Raise unless ``--memory-limit`` can hold here (NOTE [ Rows under a memory limit ])."""
    limit = settings.memory_limit_bytes
    if limit is None:
        return
    what = f"tierstore: bench train: --memory-limit {human_bytes(limit)}"
    if device.type != "cpu" or not settings.isolate:
        raise TierstoreError(
            f"{what} runs each row in a fresh process of its own on the CPU; drop "
            "--in-process (and --quick's default of it: add --fresh-processes) or --device cuda"
        )
    why = why_no_memory_limit()
    if why is not None:
        raise TierstoreError(f"{what}: {why}; run as root, or without --memory-limit")


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
    # At the longest length, where lengths vary: the disk budget holds every step.
    saved_all, saved_activations = saved_bytes(
        model, _tokens(replace(settings, vary_seq=None), 0, device)
    )
    budget = settings.disk_budget_bytes
    if budget is None:
        # Parameters are never offloaded: only the activations need room.
        budget = -(-(saved_activations * 3 // 2 + 64 * _MIB) // _MIB) * _MIB

    cuda = device.type == "cuda"
    isolate = settings.isolate and not cuda
    # See NOTE [ Rows under a memory limit ]: the live pass would run every row in one process.
    live_pass = settings.live_pass and not cuda and settings.memory_limit_bytes is None
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
    settings_doc["grad_reference"] = _grad_reference(rows)
    return TrainReport(
        rows=rows, settings=settings_doc, targets=_targets(rows, cuda), model=model_info
    )


def _grad_reference(rows: list[StrategyResult]) -> str | None:
    """Whose gradients the grad diff compares with (NOTE [ Rows under a memory limit ])."""
    none = next((r for r in rows if r.name == "none"), None)
    if none is None:
        return None
    return "none run again with no memory limit" if none.killed else "none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench train``; ``--quick`` sets the defaults of some.

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
        help="a tiny model (2 blocks, d_model 64, seq 64, batch 4), every strategy in this "
        "process, no live pass: a check that the benchmark runs, about 6 s on two idle cores "
        "and 15 s on busy ones (with --fresh-processes --live-pass: 30 to 50 s)",
    )
    add_model_arguments(parser, full)
    parser.add_argument(
        "--vary-seq",
        default=None,
        metavar="MIN:MAX",
        help="draw each step's sequence length from MIN to MAX (seeded by --seed, the same "
        "lengths in every row); the model's context (--seq) is MAX unless given; the table "
        "adds step time per token and the share of measured steps that ran planned",
    )
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
        action="store_const",
        const=False,
        default=None,
        help="CPU: run every strategy in this process, not each in a fresh one (fast; "
        "earlier strategies' freed heap can inflate later ones' RSS; the default with --quick)",
    )
    parser.add_argument(
        "--fresh-processes",
        dest="isolate",
        action="store_const",
        const=True,
        help="CPU: each strategy in a fresh process of its own (the default without --quick)",
    )
    parser.add_argument(
        "--no-live-pass",
        "--no-memory-pass",
        dest="live_pass",
        action="store_const",
        const=False,
        default=None,
        help="CPU: skip the live-memory pass (a fresh process with glibc "
        "M_MMAP_THRESHOLD=1MiB, so RSS follows live tensors), shown beside the headline "
        "(skipped by default with --quick)",
    )
    parser.add_argument(
        "--live-pass",
        dest="live_pass",
        action="store_const",
        const=True,
        help="CPU: run the live-memory pass (the default without --quick)",
    )
    parser.add_argument(
        "--budget",
        default="",
        metavar="F[,F...]",
        help="add a row per activation_budget F (a fraction such as 0.3, a size such as "
        "512MiB, or auto: what the memory there is leaves for the step's saves): a store "
        "with only that set, which plans keep / offload / rebuild",
    )
    small, large = (_shape(SWEEP_MODELS[name]) for name in ("small", "large"))
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="memory against step time: none, checkpoint on the first N blocks for each N, "
        f"disk-naive, tierstore-file and budgets {','.join(SWEEP_BUDGETS)}, side by side, on "
        f"a small model ({small}) and a large one ({large}), or on the model the size "
        "options or --quick give; writes the curves as a PNG (--plot, else next to --json)",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="run each row in a fresh process inside a memory cgroup of SIZE (such as 1GiB or "
        "900MiB), as a container's limit; rows the kernel kills are shown killed. Needs root "
        "and a writable cgroup v1 or v2 memory controller: otherwise the command says why and "
        "runs nothing",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=full.optimizer,
        help="the update after backward (default sgd); adamw's state appears in the first step",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a memory timeline (PNG); with --sweep, the curves",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _shape(sizes: dict[str, int]) -> str:
    """A model's size options as a command line takes them."""
    return " ".join(f"{MODEL_OPTIONS[name]} {value}" for name, value in sizes.items())


def _sized(args: argparse.Namespace) -> dict[str, int]:
    """The model sizes the command line gave."""
    return {name: getattr(args, name) for name in MODEL_OPTIONS if getattr(args, name) is not None}


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    """:class:`TrainSettings` from parsed options: ``--quick`` picks the defaults, flags win.

    With ``--sweep``, the sweep's rows on the model the options give (the
    default model without size options; :func:`runs_from_args` adds the
    small one then).

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> settings_from_args(p.parse_args(["--d-model", "256"])).d_model
        256
    """
    base = quick_settings() if args.quick else default_settings()
    sizes = _sized(args)
    vary_seq = parse_vary_seq(args.vary_seq) if args.vary_seq else None
    if vary_seq is not None:
        sizes.setdefault("seq", vary_seq[1])
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.sweep:
        strategies = list(sweep_strategies(sizes.get("layers", base.layers)))
    budgets = [BUDGET + b.strip() for b in args.budget.split(",") if b.strip()]
    if budgets and not strategies:
        strategies = ["none", "checkpoint", "disk-naive", "tierstore-file"]
    return replace(
        base,
        **sizes,
        vary_seq=vary_seq,
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
        isolate=not args.quick if args.isolate is None else args.isolate,
        live_pass=not args.quick if args.live_pass is None else args.live_pass,
        optimizer=args.optimizer,
        memory_limit_bytes=(
            None if args.memory_limit is None else parse_size(args.memory_limit, "--memory-limit")
        ),
    )


def runs_from_args(args: argparse.Namespace) -> list[TrainSettings]:
    """One :class:`TrainSettings` per model the command runs, in order.

    One model, but for ``--sweep`` without ``--quick`` and size options:
    each of :data:`SWEEP_MODELS`, smallest first.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> [s.d_model for s in runs_from_args(p.parse_args(["--sweep"]))]
        [256, 512]
        >>> [s.d_model for s in runs_from_args(p.parse_args(["--sweep", "--d-model", "128"]))]
        [128]
    """
    settings = settings_from_args(args)
    if not args.sweep or args.quick or _sized(args):
        return [settings]
    extra = tuple(s for s in settings.strategies if s.startswith(BUDGET))
    return sweep_settings(replace(settings, strategies=extra), models=tuple(SWEEP_MODELS))


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore bench train`` with parsed options; print the tables.

    Returns 0, or 1 when a strategy's gradients differ from ``none``'s.

    Example:
        >>> import argparse, tempfile
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> args = p.parse_args(["--quick", "--steps", "1", "--warmup", "0", "--quiet",
        ...                      "--strategies", "none,disk-naive", "--dir", tempfile.mkdtemp()])
        >>> run(args)  # doctest: +ELLIPSIS
        tierstore bench train: GPT 2 blocks, ...
        0
    """
    runs = runs_from_args(args)
    for settings in runs:  # every model's settings, before the first one runs
        _check_settings(settings)
    if args.plot or args.sweep:
        load_pyplot()  # fail before the benchmark runs, not after
    info = machine_info(Path(args.dir or tempfile.gettempdir()).absolute())
    reports = []
    for settings in runs:
        report = bench_train(settings, show_progress=not args.quiet)
        reports.append(report)
        if len(reports) > 1:
            print()
        print(_describe(report))
        print()
        print(format_train(report))
    if hasattr(os, "getloadavg"):
        info["loadavg_after_1_5_15min"] = list(os.getloadavg())
    if args.json:
        results: dict[str, Any] = (
            report_json(reports[0])
            if len(reports) == 1
            else {"runs": [report_json(r) for r in reports]}
        )
        write_results(args, "train", info, results)
    if args.sweep:
        path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
        if path:
            plot_sweeps(reports, path)
            print(f"curve: {path}")
    elif args.plot:
        plot_train(reports[0], args.plot)
        print(f"plot: {args.plot}")
    unequal = [r.name for report in reports for r in report.rows if r.grads_bitwise_equal is False]
    if unequal:
        print(f"gradients differ from none's: {', '.join(unequal)}")
        return 1
    return 0
