"""``tierstore bench recording``: what recompute's op recorder costs in forward.

``recompute="cheap"`` records every op of a forward in a TorchDispatchMode
(NOTE [ Recompute ] in ``tierstore/autograd/recompute.py``). This measures that cost
alone, side by side in one process: forwards of the tiny ``bench train`` GPT
with the recorder pushed and without it, alternating, nothing saved to a
store (grad mode on, graph dropped), give the cost per op; the ops of one
forward of the default GPT times that cost, over its training step (forward,
backward, SGD update) without offload, give the share of a step. On the
default GPT the difference is far below the noise of timing its forward
directly.

Example:
    >>> import argparse
    >>> from tierstore.bench.recording import add_arguments
    >>> p = argparse.ArgumentParser(); add_arguments(p)
    >>> p.parse_args(["--quick"]).repeat
    5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tierstore.autograd.recompute import cheap
from tierstore.autograd.recorder import Recorder
from tierstore.bench.train import _tokens, default_settings, quick_settings
from tierstore.models import GPT, build_model

__all__ = ["RecordingCost", "add_arguments", "measure", "run"]


@dataclass
class RecordingCost:
    """What :func:`measure` found; times in seconds.

    Example:
        >>> cost = RecordingCost(100, 0.010, 0.012, 400, 0.5)
        >>> round(cost.us_per_op, 1), round(cost.share_of_step, 4)
        (20.0, 0.016)
    """

    small_ops: int
    small_forward_s: float
    small_forward_recording_s: float
    ops_per_forward: int
    step_s: float

    @property
    def us_per_op(self) -> float:
        """Extra forward time per op, in microseconds, on the small model."""
        extra = self.small_forward_recording_s - self.small_forward_s
        return extra / self.small_ops * 1e6

    @property
    def share_of_step(self) -> float:
        """That cost for every op of the measured model's forward, over its training step."""
        return self.us_per_op * 1e-6 * self.ops_per_forward / self.step_s


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(model: GPT, tokens: torch.Tensor) -> int:
    counter = _Count()
    with counter:
        model.loss(tokens)
    return counter.ops


def measure(quick: bool = False, repeat: int = 5) -> RecordingCost:
    """Time the recorder per op, then weigh it against a training step.

    The per-op cost is measured where it can be resolved: forwards of the
    tiny GPT (``--quick``'s), whose time is mostly dispatch, ``20 * repeat``
    each way, alternating. The share is that cost times the ops of one
    forward of the measured model (the default GPT, or the tiny one with
    ``quick``), over that model's median training step without offload
    (``repeat`` steps).

    Example:
        >>> cost = measure(quick=True, repeat=1)
        >>> cost.small_ops > 50 and cost.ops_per_forward == cost.small_ops
        True
    """
    device = torch.device("cpu")
    small_settings = quick_settings(steps=1)
    small = build_model(small_settings, device)
    small_tokens = _tokens(small_settings, 0, device)
    plain: list[float] = []
    recording: list[float] = []
    for _ in range(20 * repeat):
        t = time.perf_counter()
        small.loss(small_tokens)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        with Recorder(cheap, lambda _t: False):
            small.loss(small_tokens)
        recording.append(time.perf_counter() - t)

    settings = (quick_settings if quick else default_settings)(steps=1)
    model = build_model(settings, device)
    tokens = _tokens(settings, 0, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    steps: list[float] = []
    for _ in range(repeat):
        t = time.perf_counter()
        model.loss(tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t)
    return RecordingCost(
        _ops(small, small_tokens),
        statistics.median(plain),
        statistics.median(recording),
        _ops(model, tokens),
        statistics.median(steps),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tierstore bench recording``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args([]).quick
        False
    """
    parser.add_argument("--quick", action="store_true", help="the tiny bench train GPT")
    parser.add_argument("--repeat", type=int, default=5, help="forwards each way (default 5)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    """Measure and print; write JSON if asked.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> run(p.parse_args(["--quick", "--repeat", "1"]))  # doctest: +ELLIPSIS
        tierstore bench recording: ...
        0
    """
    cost = measure(args.quick, args.repeat)
    settings = quick_settings() if args.quick else default_settings()
    print(
        f"tierstore bench recording: torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, fp32 on cpu\n"
        f"per op, on the tiny GPT ({cost.small_ops} ops per forward; medians of "
        f"{20 * args.repeat}, alternating): forward {cost.small_forward_s * 1e3:.2f} ms, with "
        f"the recorder {cost.small_forward_recording_s * 1e3:.2f} ms: "
        f"{cost.us_per_op:.1f} us per op\n"
        f"GPT {settings.layers} blocks, d_model {settings.d_model}, seq {settings.seq}, batch "
        f"{settings.batch}: {cost.ops_per_forward} ops per forward, training step "
        f"{cost.step_s * 1e3:.0f} ms (median of {args.repeat}): recording is "
        f"{cost.share_of_step:.2%} of the step"
    )
    if args.json:
        doc = {
            "benchmark": "recording",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "model": {
                k: getattr(settings, k) for k in ("layers", "d_model", "heads", "seq", "batch")
            },
            "repeat": args.repeat,
            **asdict(cost),
            "us_per_op": cost.us_per_op,
            "share_of_step": cost.share_of_step,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0
