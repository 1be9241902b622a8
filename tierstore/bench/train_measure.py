"""How ``tierstore bench train`` measures a strategy's steps: time, memory, gradients.

:class:`_Bench` runs one training step at a time under a strategy, with the
same samplers in every strategy's steps, and fills a :class:`StrategyResult`
(NOTE [ What bench train measures ] in ``tierstore/bench/train.py``).

Example:
    >>> from tierstore.bench.train_measure import StrategyResult
    >>> StrategyResult("none", step_s=[0.2, 0.1]).step_s
    [0.2, 0.1]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from tierstore.bench.memory import AnonRss, release_free_memory
from tierstore.bench.report import median
from tierstore.bench.train_settings import TrainSettings, make_optimizer
from tierstore.bench.train_strategies import _planning_steps, _Strategy, _Tierstore
from tierstore.errors import TierstoreError
from tierstore.models import GPT
from tierstore.stats import TIERS, Stats
from tierstore.tier_store import TierStore

__all__ = ["StrategyResult"]

#: Memory sampling period (NOTE [ What bench train measures ]).
_SAMPLE_S = 0.001
#: Tier-bytes sampling period: stats() takes the store's lock, so less often.
_TIER_SAMPLE_S = 0.005
#: Timeline points a run keeps per step in memory (peaks kept when thinning);
#: the JSON keeps fewer (``train_report.JSON_TIMELINE_POINTS``).
_TIMELINE_POINTS = 2000


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
    #: Under ``--memory-limit``: the kernel killed the row's process for memory
    #: (its step and memory figures are then blank), and the cgroup's peak
    #: charge: the process's whole memory with its page cache, as the limit
    #: counts it (NOTE [ Rows under a memory limit ] in tierstore/bench/train_runs.py).
    killed: bool = False
    cgroup_peak_bytes: int | None = None
    #: Tokens each measured step trained on (batch times its length; ``--vary-seq``).
    tokens: list[int] = field(default_factory=list)
    #: The measured steps' time over their tokens, seconds per token.
    s_per_token: float | None = None
    #: Budget rows: the measured steps that ran under a plan to the end of their forward.
    planned_steps: int | None = None
    #: ``planned_steps`` over the measured steps.
    planned_share: float | None = None


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


def _peaks_of_buckets(values: list[float], points: int) -> list[int]:
    """Indices of at most ``points`` values: the largest of each run of equal length.

    A timeline thinned this way keeps its peak (and every bucket's).
    """
    if len(values) <= points:
        return list(range(len(values)))
    size = -(-len(values) // points)
    return [
        max(range(i, min(i + size, len(values))), key=values.__getitem__)
        for i in range(0, len(values), size)
    ]


def _thin(samples: list[tuple[float, Any]], key: Callable[[Any], float]) -> list[tuple[float, Any]]:
    # At most _TIMELINE_POINTS, keeping the largest sample of each bucket:
    # a timeline must not lose its peak.
    keep = _peaks_of_buckets([key(v) for _, v in samples], _TIMELINE_POINTS)
    return [samples[i] for i in keep]


def _tokens(settings: TrainSettings, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    length = settings.seq
    if settings.vary_seq is not None:  # the same length at each step in every row
        low, high = settings.vary_seq
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
    shape = (settings.batch, length + 1)
    return torch.randint(0, settings.vocab, shape, generator=gen).to(device)


def _stat(stats: Stats | None, name: str) -> Any:
    # The prefetch counters arrive with the asynchronous pipeline; until then
    # a store has none and the figures read n/a.
    return getattr(stats, name, None) if stats is not None else None


def _delta(after: Stats | None, before: Stats | None, name: str) -> float | None:
    a, b = _stat(after, name), _stat(before, name)
    return None if a is None or b is None else a - b


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
        #: The last step's tokens (batch times length) and whether its forward ran planned.
        self.last_tokens = 0
        self.last_planned: bool | None = None

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
        opt = make_optimizer(settings, self.model.parameters())
        if self.trim:
            release_free_memory(full=True)
        base = self.base()
        before: Stats | None = None
        budgeted = (
            isinstance(strategy, _Tierstore) and strategy.config.activation_budget is not None
        )
        warmup = settings.warmup + _planning_steps(settings)  # See NOTE [ Budget rows ]
        n = warmup + settings.steps
        for step in range(n):
            if step == warmup:
                before = strategy.stats()
            with progress.phase(f"{strategy.name} step {step + 1}/{n}"):
                # See NOTE [ What bench train measures ]: the tiers in untimed steps only.
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
                result.tokens.append(self.last_tokens)
                if self.last_planned is not None:
                    result.planned_steps = (result.planned_steps or 0) + self.last_planned
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
        self.last_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
        # In place: the gradients' memory then belongs to the baseline.
        self.model.zero_grad(set_to_none=False)
        if self.trim:
            release_free_memory(full=full_gc)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if base is None:
            base = self.base()
        # See NOTE [ What bench train measures ]: the same samplers run in every
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
                self.last_planned = strategy.planned()
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
    if sum(result.tokens):
        result.s_per_token = sum(result.step_s) / sum(result.tokens)
    if result.planned_steps is not None and result.step_s:
        result.planned_share = result.planned_steps / len(result.step_s)
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
