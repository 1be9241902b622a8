"""``tierstore bench overhead``: what tierstore's own Python costs per saved tensor.

A chain of many small ``Linear`` + GELU layers makes hundreds of saves a
step with little compute around each, so the cost of a save's trip through
the hooks and the store is not hidden behind compute. ``--block N`` groups
the layers N pairs to a module, as a transformer's blocks group their ops:
a module whose saves a plan keeps whole runs without hooks (NOTE [ Modules
kept whole ] in tierstore/autograd/regions.py), which a flat chain, one save to a
module, never shows. Rows, side by side
in one process: no hooks, identity ``saved_tensors_hooks``, the floor (hooks
that hold a detached alias and check its version at unpack: the least a
save that stays can cost, NOTE [ The floor of a save that stays ]),
tierstore with every save kept (``device_budget`` larger than the step),
and ``activation_budget`` at 1.0 and 0.5. The rows take turns in rounds of a
few steps each, and within a turn each step of the row sits between two
steps of no hooks (NOTE [ Steps paired with no hooks' ]), so the machine's
drift falls on every row alike. A budget row warms up until its plan runs
(one made in a process of its own while the steps go on), then a few steps
more. Each row reports microseconds per save over no hooks: in each turn,
its median step less the median of no hooks' steps around it, the median
of those over the rounds, over the saves of one step. The same difference
is taken in the training thread's CPU time (``time.thread_time``): with
one intra-op thread the step's compute and tierstore's Python for a save
that stays all run there, while another process's preemption of it does
not count; the per-save target is judged on that figure. And the mean and
the largest step over the median, of each step over no hooks' steps beside
it: a plan made on the training thread, or a stall every few steps, shows
there and not in the median. Gradients of every row are checked bitwise
against no hooks' on the same batch.

Example:
    >>> import argparse
    >>> from tierstore.bench.overhead import add_arguments
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> p.parse_args(["--quick"]).quick, p.parse_args([]).rounds
    (True, 8)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tierstore.config import TierConfig
from tierstore.tier_store import TierStore

__all__ = ["OverheadRow", "add_arguments", "measure", "run"]

#: The most warm-up steps a budget row takes while its plan is made.
MAX_STEPS_TO_A_PLAN = 1000
#: What the issue that asked for this bench holds a row to, on a CPU.
MAX_US_PER_KEPT_SAVE = 5.0
MAX_MEAN_OVER_MEDIAN = 1.05
MAX_MAX_OVER_MEDIAN = 1.5


@dataclass
class OverheadRow:
    """One row of :func:`measure`: its step times in seconds, and the figures judged.

    Example:
        >>> row = OverheadRow("kept", [0.010, 0.011, 0.012])
        >>> row.median_s, round(row.max_over_median, 3)
        (0.011, 1.091)
    """

    name: str
    steps_s: list[float]
    us_per_save: float = 0.0
    #: The same difference in the training thread's CPU time (time.thread_time).
    cpu_us_per_save: float = 0.0
    cpu_steps_s: list[float] = field(default_factory=list)
    #: Each step over the geometric mean of no hooks' steps either side of it
    #: (NOTE [ Steps paired with no hooks' ]); empty for no hooks' own row.
    paired: list[float] = field(default_factory=list)
    #: Python's full garbage collections that ran in the row's timed steps.
    full_collections: int = 0
    #: Seconds each timed step's store waited: backward for disk reads, and
    #: forward for the write queue (stats' unpack_wait_s, pack_wait_s); empty
    #: for a row with no store.
    read_waits_s: list[float] = field(default_factory=list)
    write_waits_s: list[float] = field(default_factory=list)
    grads_equal: bool = True
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        """The median step."""
        return statistics.median(self.steps_s)

    @property
    def mean_over_median(self) -> float:
        """The mean step over the median: stalls every few steps raise it."""
        return _over_median(self.steps_s, statistics.fmean) or 0.0

    @property
    def max_over_median(self) -> float:
        """The slowest step over the median."""
        return _over_median(self.steps_s, max) or 0.0

    @property
    def paired_mean_over_median(self) -> float | None:
        """:attr:`mean_over_median` of :attr:`paired`: the figure judged."""
        return _over_median(self.paired, statistics.fmean)

    @property
    def paired_max_over_median(self) -> float | None:
        """:attr:`max_over_median` of :attr:`paired`: the figure judged."""
        return _over_median(self.paired, max)


def _over_median(values: list[float], of: Callable[[list[float]], float]) -> float | None:
    """``of(values)`` over their median; ``None`` for no values."""
    return of(values) / statistics.median(values) if values else None


def _chain(layers: int, width: int, seed: int = 0, block: int = 1) -> torch.nn.Sequential:
    """``layers`` Linear + GELU pairs; ``block`` > 1 groups them, that many to a block."""
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    if block > 1:
        step = 2 * block
        mods = [torch.nn.Sequential(*mods[i : i + step]) for i in range(0, len(mods), step)]
    return torch.nn.Sequential(*mods)


def _identity() -> contextlib.AbstractContextManager[Any]:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


# NOTE [ The floor of a save that stays ]
# A pack hook that leaves a save where it is must still hold it: without a
# detach() a saved output would hold its own grad_fn, a cycle that only
# backward breaks (a graph dropped without one would leak), and without the
# version taken at pack an in-place change would go unnoticed. The floor row
# does exactly that and nothing more: it is what any hook-based store pays
# per kept save (a new tensor and a Python object that lives until
# backward, and the garbage collector's passes over them), so tierstore's
# own cost per kept save is the kept row less this one.


def _floor_pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t.detach(), t._version


def _floor_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError("a saved tensor was modified in place")
    return t


def _floor() -> contextlib.AbstractContextManager[Any]:
    return torch.autograd.graph.saved_tensors_hooks(_floor_pack, _floor_unpack)


# NOTE [ Steps paired with no hooks' ]
# A machine's own drift is as large as what a budget row is held to (its
# slowest step 1.5x its median, its mean 1.05x): on a small VM the same step
# with no hooks can run at up to twice its median for a second or more at a
# time with nothing else running, in the thread's CPU time as much as in
# wall time (the host under the VM runs it slower; the guest counts no
# steal). So each step of a row runs between two steps of no hooks, and
# the steadiness judged is that of the step over the geometric mean of those
# two: a slowdown of the machine longer than the three steps cancels, and
# what stays is the row's own (a plan made on the training thread, a wait on
# a copy, a collection of its garbage). A row's background work that spills
# into the steps of no hooks beside it (a disk write still under way) slows
# every such step alike, which leaves the ratios over the median as they
# were. The raw steps are reported beside them, and the identity row, whose
# hooks cannot stall, shows the noise that pairing leaves.


# NOTE [ Full collections in a row's steps ]
# Python collects its oldest generation once the objects that survived two
# younger collections since the last one pass a quarter of those it holds: a
# pass over every tracked object of the process (tens of milliseconds once
# torch is imported, most of a step of this bench, and more in a process
# that imports more). A row whose
# saves leave objects alive from forward to backward promotes them at each
# younger collection, so its steps are the ones that pay, every few dozen
# steps. The bench collects once before the timed rounds, never between
# turns (a collection before each turn of 8 steps would hide these), and
# counts the full collections that start in each row's timed steps.


def _paired(steps: list[float], around: list[float]) -> list[float]:
    """Each of ``steps`` over the geometric mean of its neighbours in ``around``.

    ``around`` holds one step more than ``steps``: the one before each, then
    the one after the last (NOTE [ Steps paired with no hooks' ]).

    Example:
        >>> _paired([0.02, 0.04], [0.01, 0.01, 0.04])
        [2.0, 2.0]
    """
    return [s / math.sqrt(a * b) for s, a, b in zip(steps, around, around[1:], strict=False)]


def _waited(store: object) -> tuple[float, float] | None:
    """Seconds ``store`` has waited for reads and for the write queue; ``None`` for no store."""
    if not isinstance(store, TierStore):
        return None
    s = store.stats()
    return s.unpack_wait_s, s.pack_wait_s


def _count_saves(model: torch.nn.Module, x: torch.Tensor) -> int:
    seen = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return seen[0]


@contextlib.contextmanager
def _stores(directory: str) -> Iterator[dict[str, Callable[[], Any]]]:
    """The rows' contexts; the stores close on exit."""
    base = {"min_offload_bytes": 0, "disk_path": directory}
    kept = TierStore(TierConfig(device_budget="64GiB", disk_budget=0, **base))
    full = TierStore(TierConfig(activation_budget=1.0, **base))
    half = TierStore(TierConfig(activation_budget=0.5, **base))
    try:
        yield {
            "none": contextlib.nullcontext,
            "identity": _identity,
            "floor": _floor,
            "kept": kept.offload,
            "budget=1.0": full.offload,
            "budget=0.5": half.offload,
        }
    finally:
        for store in (kept, full, half):
            store.close()


def measure(
    *,
    layers: int = 200,
    width: int = 64,
    batch: int = 32,
    rounds: int = 8,
    steps_per_round: int = 8,
    warmup: int = 8,
    block: int = 1,
) -> list[OverheadRow]:
    """Time every row on one model, interleaved in rounds; see the module's docstring.

    ``block``: Linear + GELU pairs to a block (1: a flat chain of them).

    Example:
        >>> rows = measure(layers=4, width=8, batch=2, rounds=1, steps_per_round=2, warmup=4)
        >>> [r.name for r in rows], all(r.grads_equal for r in rows)
        (['none', 'identity', 'floor', 'kept', 'budget=1.0', 'budget=0.5'], True)
    """
    # One intra-op thread: the model's ops are tiny, and a second thread's
    # wake-ups are the largest jitter in its steps; gc runs between rounds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(
            _chain(layers, width, block=block),
            width,
            batch,
            rounds,
            steps_per_round=steps_per_round,
            warmup=warmup,
        )
    finally:
        torch.set_num_threads(threads)


def _measure(
    model: torch.nn.Module,
    width: int,
    batch: int,
    rounds: int,
    *,
    steps_per_round: int,
    warmup: int,
) -> list[OverheadRow]:
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    saves = _count_saves(model, x)

    def step(ctx: Callable[[], Any]) -> list[torch.Tensor]:
        with ctx():
            loss = model(x).square().mean()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return grads

    with (
        tempfile.TemporaryDirectory(prefix="tierstore-bench-") as directory,
        _stores(directory) as rows,
    ):
        reference = step(rows["none"])
        out = {name: OverheadRow(name, []) for name in rows}
        for name, ctx in rows.items():
            for _ in range(warmup):
                grads = step(ctx)
            store = getattr(ctx, "__self__", None)
            if isinstance(store, TierStore) and store.config.activation_budget is not None:
                # A plan that needs a search is made in a process of its own
                # while the steps go on (NOTE [ Planning off the training
                # thread ] in tierstore/planning/checker.py): warm up until it runs.
                for _ in range(MAX_STEPS_TO_A_PLAN):
                    if store.plan() is not None:
                        break
                    grads = step(ctx)
                for _ in range(warmup):
                    grads = step(ctx)
            out[name].grads_equal = all(
                torch.equal(a, b) for a, b in zip(grads, reference, strict=True)
            )

        # See NOTE [ Full collections in a row's steps ]: counted where they fall.
        current: list[OverheadRow] = []

        def collected(phase: str, info: dict[str, int]) -> None:
            if phase == "stop" and info["generation"] == 2 and current:
                current[0].full_collections += 1

        def timed(ctx: Callable[[], Any], row: OverheadRow) -> tuple[float, float]:
            current[:] = [row]
            start, start_cpu = time.perf_counter(), time.thread_time()
            step(ctx)
            took = time.perf_counter() - start, time.thread_time() - start_cpu
            current.clear()
            return took

        none, baseline = rows["none"], out["none"]
        over_none: dict[str, list[float]] = {name: [] for name in rows}
        cpu_over_none: dict[str, list[float]] = {name: [] for name in rows}
        gc.collect()  # once: what the warm-up left is no row's
        gc.callbacks.append(collected)
        try:
            for _ in range(rounds):
                for name, ctx in rows.items():
                    if ctx is none:
                        continue
                    # See NOTE [ Steps paired with no hooks' ]: a step of no hooks
                    # before each of the row's and one after the last.
                    row = out[name]
                    around = [timed(none, baseline)]
                    mine = []
                    store = getattr(ctx, "__self__", None)
                    for _ in range(steps_per_round):
                        waited = _waited(store)
                        mine.append(timed(ctx, row))
                        if waited is not None:
                            reads, writes = _waited(store)  # type: ignore[misc]
                            row.read_waits_s.append(reads - waited[0])
                            row.write_waits_s.append(writes - waited[1])
                        around.append(timed(none, baseline))
                    steps, cpu = [w for w, _ in mine], [c for _, c in mine]
                    ref, ref_cpu = [w for w, _ in around], [c for _, c in around]
                    row.steps_s += steps
                    row.cpu_steps_s += cpu
                    row.paired += _paired(steps, ref)
                    baseline.steps_s += ref
                    baseline.cpu_steps_s += ref_cpu
                    over_none[name].append(statistics.median(steps) - statistics.median(ref))
                    cpu_over_none[name].append(statistics.median(cpu) - statistics.median(ref_cpu))
        finally:
            gc.callbacks.remove(collected)
        over_none["none"] = cpu_over_none["none"] = [0.0]
        for name, ctx in rows.items():
            store = getattr(ctx, "__self__", None)
            if isinstance(store, TierStore):
                s = store.stats()
                out[name].stats = {
                    "kept": s.kept,
                    "packed": s.packed,
                    "recomputed": s.recomputed,
                    "bytes_written": sum(t.bytes_written for t in s.tiers.values()),
                }
    for row in out.values():
        row.us_per_save = statistics.median(over_none[row.name]) / saves * 1e6
        row.cpu_us_per_save = statistics.median(cpu_over_none[row.name]) / saves * 1e6
        row.stats["saves_per_step"] = saves
    return list(out.values())


def _verdict(row: OverheadRow) -> str:
    checks = []
    if row.name in ("kept", "budget=1.0"):
        # Judged on the training thread's CPU time: on a shared machine the
        # wall-clock difference carries other processes' preemptions.
        checks.append(row.cpu_us_per_save <= MAX_US_PER_KEPT_SAVE)
    if row.name.startswith("budget="):
        # Paired with no hooks' steps (NOTE [ Steps paired with no hooks' ]).
        mean, most = row.paired_mean_over_median, row.paired_max_over_median
        checks.append(mean is not None and mean <= MAX_MEAN_OVER_MEDIAN)
        checks.append(most is not None and most <= MAX_MAX_OVER_MEDIAN)
    if not row.grads_equal:
        return "GRADIENTS DIFFER"
    if not checks:
        return ""
    return "meets" if all(checks) else "misses"


def report(rows: list[OverheadRow]) -> str:
    """The rows as a table that fits 100 columns.

    ``mean/med`` and ``max/med`` are of the steps paired with no hooks'
    (NOTE [ Steps paired with no hooks' ]), ``raw max`` the slowest step
    itself over the median, ``gc`` the full collections that ran in
    the row's steps (NOTE [ Full collections in a row's steps ]).

    Example:
        >>> rows = [OverheadRow("none", [0.01, 0.01]), OverheadRow("kept", [0.011, 0.012])]
        >>> rows[1].paired = [1.1, 1.2]
        >>> print(report(rows))  # doctest: +NORMALIZE_WHITESPACE
        row           median   us/save  cpu us/save  mean/med  max/med  raw max  steps   gc  target
        none         10.0 ms       0.0          0.0         -        -     1.00      2    0
        kept         11.5 ms       0.0          0.0      1.00     1.04     1.04      2    0  meets
    """
    lines = [
        f"{'row':<12}{'median':>8}{'us/save':>10}{'cpu us/save':>13}{'mean/med':>10}"
        f"{'max/med':>9}{'raw max':>9}{'steps':>7}{'gc':>5}  target"
    ]
    for r in rows:
        mean, most = r.paired_mean_over_median, r.paired_max_over_median
        lines.append(
            f"{r.name:<12}{r.median_s * 1e3:>5.1f} ms{r.us_per_save:>10.1f}"
            f"{r.cpu_us_per_save:>13.1f}{'-' if mean is None else f'{mean:.2f}':>10}"
            f"{'-' if most is None else f'{most:.2f}':>9}{r.max_over_median:>9.2f}"
            f"{len(r.steps_s):>7}{r.full_collections:>5}  {_verdict(r)}".rstrip()
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench overhead``."""
    p.add_argument("--layers", type=int, default=200, help="Linear + GELU pairs (default 200)")
    p.add_argument("--width", type=int, default=64, help="features per layer (default 64)")
    p.add_argument("--batch", type=int, default=32, help="rows per batch (default 32)")
    p.add_argument(
        "--block",
        type=int,
        default=1,
        help="Linear + GELU pairs to a block, as a transformer's blocks hold several ops "
        "(default 1: a flat chain, where no module holds more than one save)",
    )
    p.add_argument("--rounds", type=int, default=8, help="rounds of the rows in turn (default 8)")
    p.add_argument("--steps", type=int, default=8, help="steps per row per round (default 8)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per row (default 8)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 steps: a few seconds")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    """Run the bench as the command line asked; exit status 0 unless gradients differ."""
    rounds, steps = (2, 4) if args.quick else (args.rounds, args.steps)
    rows = measure(
        layers=args.layers,
        width=args.width,
        batch=args.batch,
        rounds=rounds,
        steps_per_round=steps,
        warmup=args.warmup,
        block=args.block,
    )
    print(report(rows))
    print(
        f"targets: kept and budget=1.0 at most {MAX_US_PER_KEPT_SAVE:g} us per save (cpu: the "
        "training thread's CPU time, which other processes' preemptions leave out); every "
        f"budget's mean at most {MAX_MEAN_OVER_MEDIAN:g}x and its slowest step at most "
        f"{MAX_MAX_OVER_MEDIAN:g}x its median, each step over no hooks' steps either side of it"
    )
    by = {r.name: r for r in rows}
    control = by["identity"]
    if control.paired:
        print(
            f"noise left after pairing: identity hooks' mean {control.paired_mean_over_median:.2f}x"
            f" and slowest step {control.paired_max_over_median:.2f}x their median"
        )
    for r in rows:
        if r.read_waits_s and r.paired:
            i = max(range(len(r.paired)), key=r.paired.__getitem__)
            print(
                f"{r.name}: its slowest step ({(r.steps_s[i] - r.median_s) * 1e3:+.1f} ms over "
                f"its median) waited {r.read_waits_s[i] * 1e3:.1f} ms for reads and "
                f"{r.write_waits_s[i] * 1e3:.1f} ms for the write queue; all its steps "
                f"{sum(r.read_waits_s) * 1e3:.1f} and {sum(r.write_waits_s) * 1e3:.1f} ms"
            )
    floor = by["floor"].cpu_us_per_save
    print(
        f"floor: {floor:.1f} us per save (cpu) for hooks that only hold a detached alias and "
        "check its version; over it, tierstore's own: "
        + ", ".join(f"{n} {by[n].cpu_us_per_save - floor:+.1f} us" for n in ("kept", "budget=1.0"))
    )
    if args.json:
        payload = {
            "settings": {
                k: getattr(args, k) for k in ("layers", "width", "batch", "block", "warmup")
            }
            | {"rounds": rounds, "steps_per_round": steps, "torch": torch.__version__},
            "rows": [
                asdict(r)
                | {
                    "median_s": r.median_s,
                    "mean_over_median": r.mean_over_median,
                    "max_over_median": r.max_over_median,
                    "paired_mean_over_median": r.paired_mean_over_median,
                    "paired_max_over_median": r.paired_max_over_median,
                    "verdict": _verdict(r),
                }
                for r in rows
            ],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0 if all(r.grads_equal for r in rows) else 1
