"""What ``tierstore bench train`` reports: ratios, targets, the printed tables, the JSON.

Example:
    >>> from tierstore.bench.train_measure import StrategyResult, _peaks_of_buckets
    >>> from tierstore.bench.train_report import _add_ratios
    >>> rows = [StrategyResult("none", median_step_s=2.0), StrategyResult("b", median_step_s=3.0)]
    >>> _add_ratios(rows)
    >>> rows[1].step_vs_none
    1.5
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.bench.report import NA, Report, fmt_ratio, format_table
from tierstore.bench.train_measure import StrategyResult, _peaks_of_buckets
from tierstore.bench.train_strategies import BUDGET, RECOMPUTE_SUFFIX, _base
from tierstore.config import human_bytes
from tierstore.stats import TIERS

__all__ = [
    "JSON_TIMELINE_POINTS",
    "KILLED",
    "TARGET_SAVED_BYTES",
    "WIDTH",
    "TrainReport",
    "format_train",
    "report_json",
]


@dataclass
class TrainReport(Report[StrategyResult]):
    """What :func:`bench_train` measured.

    Example:
        >>> TrainReport(rows=[], settings={}, targets=[], model={}).row("none") is None
        True
    """

    model: dict[str, Any]


# NOTE [ Timelines in the JSON ]
# A run samples memory every 1 ms and keeps up to 2000 points of a step in
# memory, which --plot draws. The JSON is a record to read and re-plot, not
# the samples: it keeps at most JSON_TIMELINE_POINTS points per timeline,
# the largest sample of each run of equal length, so every timeline keeps
# its peak and the file stays a few hundred kilobytes for a whole sweep.

#: Points per timeline in the JSON (NOTE [ Timelines in the JSON ]).
JSON_TIMELINE_POINTS = 300


def report_json(report: TrainReport, points: int | None = None) -> dict[str, Any]:
    """``report`` as plain data for the JSON, its timelines thinned to ``points`` each.

    ``points`` defaults to :data:`JSON_TIMELINE_POINTS`.

    Each row's ``timeline`` and ``tier_timeline`` keep at most ``points``
    samples, the largest of each run of equal length (the largest by the sum
    of the tiers for bytes per tier); ``settings.json_timeline_points`` says
    how many (NOTE [ Timelines in the JSON ]).

    Example:
        >>> from tierstore.bench.train_measure import StrategyResult
        >>> row = StrategyResult("none", timeline={
        ...     "step": 2, "t_s": [0.001 * i for i in range(1000)],
        ...     "memory_bytes": [7 if i == 500 else 1 for i in range(1000)], "tiers": {}})
        >>> report = TrainReport(rows=[row], settings={}, targets=[], model={})
        >>> timeline = report_json(report, points=10)["rows"][0]["timeline"]
        >>> len(timeline["t_s"]), max(timeline["memory_bytes"]), len(row.timeline["t_s"])
        (10, 7, 1000)
    """
    if points is None:
        points = JSON_TIMELINE_POINTS
    doc = report.as_dict()
    for row in doc["rows"]:
        row["timeline"] = _thin_timeline(row["timeline"], points)
        row["tier_timeline"] = _thin_timeline(row["tier_timeline"], points)
    doc["settings"]["json_timeline_points"] = points
    return doc


def _thin_timeline(timeline: dict[str, Any], points: int) -> dict[str, Any]:
    out = dict(timeline)
    if timeline.get("t_s"):
        keep = _peaks_of_buckets(timeline["memory_bytes"], points)
        out["t_s"] = [timeline["t_s"][i] for i in keep]
        out["memory_bytes"] = [timeline["memory_bytes"][i] for i in keep]
    tiers = timeline.get("tiers")
    if tiers:
        totals = [sum(values) for values in zip(*(tiers[tier] for tier in TIERS), strict=True)]
        keep = _peaks_of_buckets(totals, points)
        out["tiers"] = {key: [values[i] for i in keep] for key, values in tiers.items()}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _add_ratios(rows: list[StrategyResult]) -> None:
    none = next((r for r in rows if r.name == "none" and not r.killed), None)
    naive = next((r for r in rows if r.name == "disk-naive" and not r.killed), None)
    for r in rows:
        if r.killed:  # no figures to divide (NOTE [ Rows under a memory limit ])
            continue
        if none is not None:
            r.step_vs_none = _ratio(r.median_step_s, none.median_step_s)
            r.memory_vs_none = _ratio(r.peak_memory_bytes, none.peak_memory_bytes)
            r.live_vs_none = _ratio(r.peak_live_bytes, none.peak_live_bytes)
        if naive is not None:
            r.step_vs_naive = _ratio(r.median_step_s, naive.median_step_s)
            r.memory_vs_naive = _ratio(r.peak_memory_bytes, naive.peak_memory_bytes)


_Check = tuple[str, float | None, str, float]


def _cpu_checks(r: StrategyResult, by_name: dict[str, StrategyResult]) -> list[_Check]:
    # Full disk offload against what users see, in the same run.
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
    # recompute="cheap" against the same store without it, in the same run.
    def vs_off(get: Callable[[StrategyResult], float | None]) -> float | None:
        return _ratio(get(r), get(off)) if off is not None else None

    return [
        ("bytes moved vs recompute off", vs_off(lambda x: x.moved_per_step), "<=", 0.8),
        ("step time vs recompute off", vs_off(lambda x: x.median_step_s), "<=", 1.05),
        ("peak memory vs recompute off", vs_off(lambda x: x.peak_memory_bytes), "<=", 1.0),
        ("max |grad diff| vs none", r.max_grad_diff, "<=", 0.0),
    ]


def _cuda_checks(r: StrategyResult, by_name: dict[str, StrategyResult]) -> list[_Check]:
    # The host tier against save_on_cpu, the offloader users would pick.
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
    rows = [r for r in rows if not r.killed]  # no figures to check
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
# On the CPU, with only activation_budget set: each budget row's peak RSS
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


#: The widest line ``bench train`` prints: its tables, targets, plans and descriptions.
WIDTH = 100


def format_train(report: TrainReport) -> str:
    """The results tables, then the targets for the tierstore rows, as text at most 100 wide.

    The first table is the headline: step time and the memory a user's tools
    show (``peak RSS`` on CPU, default allocator; ``reserved`` on CUDA), each
    against ``none``'s and ``disk-naive``'s, and the gradient check. The
    second holds what is measured beside it, for the rows that have any of
    it: ``live peak`` when the live pass ran, ``allocated`` on CUDA, and a
    store's disk tier and prefetch hit rate.

    A model that saves less than :data:`TARGET_SAVED_BYTES` per step gets a
    note above the tables instead of the step-time and memory targets
    (NOTE [ Targets at size ]).

    Example:
        >>> import tempfile
        >>> from tierstore.bench.train import bench_train, quick_settings
        >>> s = quick_settings(steps=1, warmup=0, strategies=["none"],
        ...                    directory=tempfile.mkdtemp(), isolate=False, live_pass=False)
        >>> print(format_train(bench_train(s, show_progress=False)))  # doctest: +ELLIPSIS
        A small model (... of saved activations per step, a ... ms step under none): ...
        <BLANKLINE>
        strategy  step s  vs none  vs naive  peak RSS  vs none  vs naive  grad diff
        --------  ...
        none  ...
    """
    saved = report.model.get("saved_activation_bytes_per_step", 0)
    lines = [_headline_table(report)]
    beside = _beside_table(report)
    if beside:
        lines += ["", beside]
    targets = report.targets
    if saved < TARGET_SAVED_BYTES:
        # See NOTE [ Targets at size ]
        lines.insert(0, _wrap(_small_model_note(report, saved)))
        targets = [t for t in targets if "grad" in t["check"]]
    lines += [_wrap(_format_target(t)) for t in targets]
    lines += [
        _wrap(_format_plan(r)) for r in report.rows if r.name.startswith(BUDGET) and not r.killed
    ]
    return "\n".join(lines)


def _wrap(text: str) -> str:
    """``text`` in lines of at most :data:`WIDTH`, continued two spaces in; names never split."""
    return "\n".join(
        textwrap.fill(
            paragraph,
            WIDTH,
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        for paragraph in text.split("\n")
    )


def _headline_table(report: TrainReport) -> str:
    """Step time and the headline memory per row, against none's and disk-naive's; gradients."""
    cuda = report.model["device"].startswith("cuda")
    varying = report.settings.get("vary_seq") is not None
    headers = ["strategy", "step s", "vs none", "vs naive"]
    headers += ["us/token", "planned"] if varying else []
    headers += ["reserved" if cuda else "peak RSS", "vs none", "vs naive", "grad diff"]
    cells = []
    for r in report.rows:
        if r.killed:  # See NOTE [ Rows under a memory limit ]
            row = [r.name, KILLED, NA, NA] + ([NA, NA] if varying else [])
            row += [KILLED, NA, NA, NA]
            cells.append(row)
            continue
        row = [r.name, f"{r.median_step_s:.3f}", fmt_ratio(r.step_vs_none)]
        row.append(fmt_ratio(r.step_vs_naive))
        if varying:  # --vary-seq: steps differ in length, so time per token
            per_token = NA if r.s_per_token is None else f"{r.s_per_token * 1e6:.1f}"
            share = NA if r.planned_share is None else f"{r.planned_share:.0%}"
            row += [per_token, share]
        row += [human_bytes(r.peak_memory_bytes)]
        row += [fmt_ratio(r.memory_vs_none), fmt_ratio(r.memory_vs_naive)]
        # Three digits: the magnitude of a difference; the JSON keeps all of it.
        row.append(f"{r.max_grad_diff:.3g}" if r.max_grad_diff is not None else NA)
        cells.append(row)
    return format_table(headers, cells)


#: What a row the memory limit killed shows for its step time and peak.
KILLED = "killed"


def _beside_table(report: TrainReport) -> str:
    """What is measured beside the headline, for the rows that have any of it; else ``""``."""
    cuda = report.model["device"].startswith("cuda")
    live = any(r.peak_live_bytes is not None for r in report.rows)
    limited = report.settings.get("memory_limit_bytes") is not None
    headers = ["strategy", "cgroup peak"] if limited else ["strategy"]
    headers += ["allocated"] if cuda else ["live peak", "vs none"] if live else []
    headers += ["disk peak", "written/step", "moved/step", "hit rate"]
    cells = []
    for r in report.rows:
        disk = r.tiers["disk"] if r.tiers else None
        hit = r.prefetch["hit_rate"] if r.prefetch else None
        row: list[str] = [_bytes(r.cgroup_peak_bytes)] if limited else []
        if cuda:
            row.append(_bytes(r.peak_allocated_bytes))
        elif live:
            row += [_bytes(r.peak_live_bytes), fmt_ratio(r.live_vs_none)]
        row += [_bytes(disk["peak_bytes"]) if disk else NA]
        row += [_bytes(disk["written_per_step"]) if disk else NA, _bytes(r.moved_per_step)]
        row.append(f"{hit:.1%}" if hit is not None else NA)
        if any(cell != NA for cell in row):
            cells.append([r.name, *row])
    return format_table(headers, cells) if cells else ""


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
    step = (
        f", a {none.median_step_s * 1000:.0f} ms step under none"
        if none and not none.killed
        else ""
    )
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


#: How the description names each ``--optimizer``.
_OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}


def _limit_line(settings: dict[str, Any]) -> str:
    """The memory limit's line of the description; ``""`` without one."""
    limit = settings.get("memory_limit_bytes")
    if limit is None:
        return ""
    return (
        f"each row in a memory cgroup of {human_bytes(limit)} (--memory-limit); killed = the "
        "kernel killed the row's process for memory; cgroup peak = the cgroup's peak charge "
        "(the whole process and its page cache); grad diff against "
        f"{settings.get('grad_reference') or NA}; no live pass under a limit;\n"
    )


def _describe(report: TrainReport) -> str:
    """What ran and how each column is measured, in lines of at most :data:`WIDTH`."""
    m, s = report.model, report.settings
    cuda = m["device"].startswith("cuda")
    step_where = "" if cuda or not s["isolate"] else ", each strategy in a fresh process"
    live = s.get("live_measure")
    return _wrap(
        f"tierstore bench train: GPT {m['layers']} blocks, d_model {m['d_model']}, "
        f"heads {m['heads']}, seq {m['seq']}{_lengths(s)}, batch {m['batch']}, "
        f"vocab {m['vocab']} "
        f"({m['parameters'] / 1e6:.1f}M parameters), fp32 on {m['device']}; saved activations "
        f"{human_bytes(m['saved_activation_bytes_per_step'])} per step; "
        f"{s['warmup']} warm-up + {s['steps']} measured steps per strategy; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"step = forward + backward + {_OPTIMIZER_NAMES[s.get('optimizer', 'sgd')]} update, "
        f"median{step_where}; {s['memory_measure']};\n"
        + _limit_line(s)
        + (
            f"live peak = peak anonymous RSS above the RSS before one measured step, {live};\n"
            if live
            else ""
        )
        + "vs none, vs naive = the column to the left over none's, over disk-naive's; "
        "disk peak = the disk tier's peak bytes; written/step, moved/step = disk bytes "
        "written, written + read, per measured step; hit rate = unpacks that found their entry "
        "read ahead, over all that needed a read or copy, in the measured steps;\n"
        "tierstore-file/-lmdb: device_budget=0, host_budget=0; tierstore-host: "
        f"device_budget={human_bytes(s['device_budget_bytes'])}, the rest in host memory; "
        "tierstore-host-disk: host_budget = 1/3 of the disk budget; "
        f"min_offload_bytes={s['min_offload_bytes']}, compression={s['compression']}; "
        f"{RECOMPUTE_SUFFIX}: the same store with recompute='cheap'; "
        "grad diff = max |grad diff| vs none over all parameters after the last step"
        + "".join(f"\nskipped {name}: {why}" for name, why in s.get("skipped", {}).items())
    )


def _lengths(settings: dict[str, Any]) -> str:
    """How ``--vary-seq`` drew the steps' lengths, for the description; ``""`` without it."""
    vary = settings.get("vary_seq")
    if vary is None:
        return ""
    low, high = vary
    return (
        f" (each step's length drawn from {low}-{high}, seed {settings['seed']}; us/token = "
        "the measured steps' time over their tokens; planned = the measured steps whose "
        "forward ran under a plan)"
    )
