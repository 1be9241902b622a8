"""``tierstore bench train --sweep`` and the plots: memory against step time, timelines.

A sweep runs, side by side in one run per model, ``none``, ``checkpoint-N``
for every N below the number of blocks, ``checkpoint``, ``disk-naive``,
``tierstore-file`` and ``budget=F`` for each of :data:`SWEEP_BUDGETS`; by
default on each model of :data:`SWEEP_MODELS`: a small one, where
checkpointing every block holds less than a 0.3 budget of what the step
saves, and a large one (the default model). :func:`plot_sweeps` draws the
curves, one panel per model.

Example:
    >>> from tierstore.bench.train_sweep import sweep_strategies
    >>> sweep_strategies(3)[:5]
    ('none', 'checkpoint-1', 'checkpoint-2', 'checkpoint', 'disk-naive')
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tierstore.bench.report import load_pyplot
from tierstore.bench.train_measure import StrategyResult
from tierstore.bench.train_report import TrainReport
from tierstore.bench.train_settings import TrainSettings
from tierstore.bench.train_strategies import BUDGET, CHECKPOINT_FIRST
from tierstore.config import human_bytes
from tierstore.errors import TierstoreError
from tierstore.stats import TIERS

__all__ = [
    "AUTO",
    "SWEEP_BUDGETS",
    "SWEEP_MODELS",
    "plot_sweep",
    "plot_sweeps",
    "plot_train",
    "sweep_settings",
    "sweep_strategies",
]

_MIB = 1 << 20

#: The ``budget=auto`` row (``--budget auto``): drawn as a point of its own beside the budgets.
AUTO = "budget=auto"

#: The budgets ``--sweep`` runs, as fractions of what the step saves.
SWEEP_BUDGETS = ("0.05", "0.1", "0.2", "0.35", "0.5", "0.75")

#: The models ``--sweep`` runs when no size option is given, smallest first.
#: ``small`` saves 184.5 MiB a step, of which checkpointing every block holds
#: about 40 MiB (block inputs, the saves outside the blocks, one block rebuilt
#: in backward): less than a 0.3 budget of it. ``large`` is the default model
#: (2.0 GiB).
SWEEP_MODELS: dict[str, dict[str, int]] = {
    "small": {"layers": 6, "d_model": 256, "heads": 4, "seq": 256, "batch": 4, "vocab": 512},
    "large": {"layers": 6, "d_model": 512, "heads": 8, "seq": 512, "batch": 8, "vocab": 512},
}


def sweep_strategies(layers: int) -> tuple[str, ...]:
    """The rows of a sweep on a model of ``layers`` blocks, in the order they run.

    Example:
        >>> sweep_strategies(2)
        ('none', 'checkpoint-1', 'checkpoint', 'disk-naive', 'tierstore-file', 'budget=0.05', \
'budget=0.1', 'budget=0.2', 'budget=0.35', 'budget=0.5', 'budget=0.75')
    """
    return (
        "none",
        *(f"{CHECKPOINT_FIRST}{n}" for n in range(1, layers)),
        "checkpoint",
        "disk-naive",
        "tierstore-file",
        *(BUDGET + b for b in SWEEP_BUDGETS),
    )


def sweep_settings(settings: TrainSettings, *, models: Sequence[str] = ()) -> list[TrainSettings]:
    """One run per model of a sweep: ``settings`` with each model's shape and its sweep rows.

    Args:
        settings: what every run shares (steps, directory, device, ...). Its
            strategies beyond the sweep's rows (``--budget``) are added to
            every run.
        models: names from :data:`SWEEP_MODELS`; ``()`` sweeps the model of
            ``settings`` alone.

    Example:
        >>> from tierstore.bench.train_settings import default_settings
        >>> [s.d_model for s in sweep_settings(default_settings(), models=SWEEP_MODELS)]
        [256, 512]
    """
    shapes: list[dict[str, Any]] = [SWEEP_MODELS[name] for name in models] or [{}]
    runs = []
    for shape in shapes:
        run = replace(settings, **shape)
        rows = sweep_strategies(run.layers)
        extra = tuple(s for s in settings.strategies if s not in rows)
        runs.append(replace(run, strategies=(*rows, *extra)))
    return runs


def plot_train(report: TrainReport, path: str | os.PathLike[str]) -> None:
    """Memory over the last measured step per strategy; a store's tiers over a warm-up step (PNG).

    Raises:
        TierstoreError: matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> from tierstore.bench.train import bench_train, quick_settings
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
    """The curve of a sweep on one model: peak memory against step time, relative to ``none``.

    Checkpointing the first N blocks and tierstore's budgets are lines; the
    other offloaders are points. A budget row's predicted step is a cross.

    Raises:
        TierstoreError: matplotlib is not installed, or the report has no
            ``none`` row to divide by.

    Example:
        >>> import os, tempfile
        >>> from tierstore.bench.train import bench_train, quick_settings
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none", "checkpoint-1"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> plot_sweep(bench_train(s, show_progress=False),
        ...            os.path.join(tempfile.mkdtemp(), "sweep.png"))  # doctest: +SKIP
    """
    plot_sweeps([report], path)


def plot_sweeps(reports: Sequence[TrainReport], path: str | os.PathLike[str]) -> None:
    """The curves of a sweep, one panel per model, side by side in one PNG.

    Raises:
        TierstoreError: matplotlib is not installed, or a report has no
            ``none`` row to divide by.

    Example:
        >>> import os, tempfile
        >>> from tierstore.bench.train import bench_train, quick_settings
        >>> runs = [quick_settings(steps=1, warmup=0, strategies=["none", "checkpoint-1"],
        ...                        seq=seq, directory=tempfile.mkdtemp(), isolate=False,
        ...                        live_pass=False) for seq in (32, 64)]
        >>> reports = [bench_train(s, show_progress=False) for s in runs]  # doctest: +SKIP
        >>> plot_sweeps(reports, os.path.join(tempfile.mkdtemp(), "sweep.png"))  # doctest: +SKIP
    """
    for report in reports:
        none = report.row("none")
        if none is None or not (none.killed or (none.median_step_s and none.peak_memory_bytes)):
            raise TierstoreError("tierstore: bench train --sweep: the curve needs the none row")
    plt = load_pyplot()
    fig, axes = plt.subplots(1, len(reports), figsize=(8 * len(reports), 5.5), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        _draw_sweep(ax, report)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _scale(report: TrainReport) -> tuple[float, float, str, str]:
    """What the curve divides by and its axes' units: none's figures, or MiB and s if killed.

    Under ``--memory-limit`` ``none`` may be killed (NOTE [ Rows under a
    memory limit ] in tierstore/bench/train_runs.py): then there is nothing
    to divide by, and the axes are absolute.
    """
    none = report.row("none")
    assert none is not None  # checked by plot_sweeps
    memory = "reserved" if report.model["device"].startswith("cuda") else "anonymous RSS"
    if none.killed:
        return float(_MIB), 1.0, f"peak memory, MiB ({memory})", "step time, s"
    return (
        float(none.peak_memory_bytes),
        none.median_step_s,
        f"peak memory / none's ({memory})",
        "step time / none's",
    )


def _draw_sweep(ax: Any, report: TrainReport) -> None:
    """One model's curve on ``ax`` (a matplotlib Axes)."""
    memory_unit, step_unit, xlabel, ylabel = _scale(report)

    def point(r: StrategyResult) -> tuple[float, float]:
        return r.peak_memory_bytes / memory_unit, r.median_step_s / step_unit

    # Each line in the order of its knob (blocks checkpointed, budget), not of
    # its measured memory: a line that doubles back is a finding, not noise.
    layers = report.model["layers"]
    done = [r for r in report.rows if not r.killed]
    checkpoints = sorted(
        (r for r in done if r.name.startswith(CHECKPOINT_FIRST) or r.name == "checkpoint"),
        key=lambda r: (
            int(r.name.removeprefix(CHECKPOINT_FIRST)) if r.name[-1].isdigit() else layers
        ),
    )
    budgets = sorted(
        (r for r in done if r.name.startswith(BUDGET) and r.name != AUTO),
        key=lambda r: r.plan["budget_bytes"] if r.plan is not None else 0,
    )
    for rows, label, style in (
        (checkpoints, "checkpoint the first N blocks", "o-"),
        (budgets, "tierstore activation_budget", "s-"),
    ):
        if rows:
            xs, ys = zip(*(point(r) for r in rows), strict=True)
            ax.plot(xs, ys, style, label=label)
            for r, x, y in zip(rows, xs, ys, strict=True):
                ax.annotate(r.name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    planned = [*budgets, *(r for r in done if r.name == AUTO)]
    predicted = [
        (point(r)[0], r.plan["predicted_step_s"] / step_unit) for r in planned if r.plan is not None
    ]
    if predicted:
        xs, ys = zip(*predicted, strict=True)
        ax.plot(xs, ys, "x", color="grey", label="the budget's plan: predicted step")
    for r in done:
        if r in checkpoints or r in budgets:
            continue
        x, y = point(r)
        ax.plot(
            x,
            y,
            "*" if r.name == AUTO else "D",
            markersize=12 if r.name == AUTO else 6,
            label=r.name,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    m = report.model
    ax.set_title(
        f"My step does not fit: memory against step time\n{m['layers']} blocks, d_model "
        f"{m['d_model']}, seq {m['seq']}, batch {m['batch']}: "
        f"{human_bytes(m['saved_activation_bytes_per_step'])} saved per step"
        + _killed_line(report),
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _killed_line(report: TrainReport) -> str:
    """The title's line naming the rows the memory limit killed; ``""`` without a limit."""
    limit = report.settings.get("memory_limit_bytes")
    if limit is None:
        return ""
    killed = [r.name for r in report.rows if r.killed]
    return f"\nin a {human_bytes(limit)} memory cgroup; killed: {', '.join(killed) or 'none'}"
