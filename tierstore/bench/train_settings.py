"""What ``tierstore bench train`` runs: the model's shape, the steps, the strategies.

:class:`TrainSettings` is the whole configuration of one run (one model);
:func:`default_settings` and :func:`quick_settings` are the two sizes the
command starts from, and :func:`check_shape` turns a model size no GPT can
have into an error that names the option to change.

Example:
    >>> from tierstore.bench.train_settings import check_shape, quick_settings
    >>> check_shape(quick_settings(layers=0))
    Traceback (most recent call last):
    ...
    tierstore.errors.TierstoreError: tierstore: bench train: --layers 0: expected a whole number ...
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tierstore.errors import TierstoreError

__all__ = [
    "MODEL_OPTIONS",
    "OPTIMIZERS",
    "TrainSettings",
    "check_shape",
    "default_settings",
    "make_optimizer",
    "parse_vary_seq",
    "quick_settings",
]


@dataclass(frozen=True)
class TrainSettings:
    """What ``bench train`` runs: the model, the steps, the strategies, where files go.

    ``disk_budget_bytes=None`` sizes the tierstore disk tier from a counting
    pass: 1.5 times the activation bytes the forward saves, plus 64 MiB;
    ``tierstore-host-disk`` gets a third of that as its host budget (half
    the activations), so the other half goes on to disk.
    ``isolate=False`` runs every strategy in this process instead of one
    fresh process each (CPU; CUDA always runs here), and ``live_pass=False``
    skips the CPU live-memory pass (NOTE [ What bench train measures ] in
    ``tierstore/bench/train.py``). ``optimizer`` is ``"sgd"`` or ``"adamw"``
    (whose state appears in the first step). ``memory_limit_bytes`` runs
    each strategy's fresh process in a memory cgroup of that size
    (NOTE [ Rows under a memory limit ] in ``tierstore/bench/train_runs.py``).

    Example:
        >>> default_settings().d_model, quick_settings().d_model
        (512, 64)
    """

    layers: int = 6
    d_model: int = 512
    heads: int = 8
    seq: int = 512
    #: ``--vary-seq MIN:MAX``: each step's sequence length drawn from MIN to MAX, seeded
    #: (``seq``, the model's context, is MAX or more); ``None``: every step at ``seq``.
    vary_seq: tuple[int, int] | None = None
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
    optimizer: str = "sgd"
    memory_limit_bytes: int | None = None


def default_settings(**changes: Any) -> TrainSettings:
    """The default model: 6 blocks, d_model 512, seq 512, batch 8 (2.0 GiB saved, fp32).

    Example:
        >>> default_settings(steps=2).steps
        2
    """
    return replace(TrainSettings(), **changes)


def quick_settings(**changes: Any) -> TrainSettings:
    """A tiny model (2 blocks, d_model 64, seq 64, batch 4): ``--quick``, tests, the demo.

    Its steps take milliseconds; what a run of it takes is mostly starting
    processes (``--quick`` runs in this process, without the live pass).

    Example:
        >>> quick_settings().layers
        2
    """
    tiny = TrainSettings(layers=2, d_model=64, heads=2, seq=64, batch=4, vocab=128)
    return replace(tiny, **changes)


#: ``--optimizer``: what updates the weights after each step's backward.
OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(settings: TrainSettings, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``settings`` name, over ``params``, at ``settings.lr``.

    Example:
        >>> import torch
        >>> type(make_optimizer(quick_settings(optimizer="adamw"), [torch.zeros(1)])).__name__
        'AdamW'
    """
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=settings.lr)
    return torch.optim.SGD(params, lr=settings.lr)


#: The model's shape: each :class:`TrainSettings` field and the option that sets it.
MODEL_OPTIONS = {
    "layers": "--layers",
    "d_model": "--d-model",
    "heads": "--heads",
    "seq": "--seq",
    "batch": "--batch",
    "vocab": "--vocab",
}


def check_shape(settings: TrainSettings) -> None:
    """Raise if ``settings`` describe no GPT: a size below 1, or a width heads cannot split.

    Raises:
        TierstoreError: naming the option and its value.

    Example:
        >>> check_shape(quick_settings())  # a tiny model is a model
        >>> check_shape(quick_settings(d_model=65))
        Traceback (most recent call last):
        ...
        tierstore.errors.TierstoreError: tierstore: bench train: d_model=65 is not a multiple ...
    """
    for name, option in MODEL_OPTIONS.items():
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TierstoreError(
                f"tierstore: bench train: {option} {value}: expected a whole number >= 1"
            )
    if settings.vary_seq is not None:
        low, high = settings.vary_seq
        if not 1 <= low <= high <= settings.seq:
            raise TierstoreError(
                f"tierstore: bench train: --vary-seq {low}:{high} with --seq {settings.seq}: "
                "expected 1 <= MIN <= MAX <= --seq"
            )
    if settings.d_model % settings.heads:
        raise TierstoreError(
            f"tierstore: bench train: d_model={settings.d_model} is not a multiple of "
            f"heads={settings.heads}; change --d-model or --heads"
        )
    if settings.optimizer not in OPTIMIZERS:
        raise TierstoreError(
            f"tierstore: bench train: --optimizer {settings.optimizer}: expected one of "
            f"{', '.join(OPTIMIZERS)}"
        )


def parse_vary_seq(text: str) -> tuple[int, int]:
    """``--vary-seq MIN:MAX`` as ``(MIN, MAX)``.

    Raises:
        TierstoreError: naming the option and the value.

    Example:
        >>> parse_vary_seq("96:256")
        (96, 256)
        >>> parse_vary_seq("256")
        Traceback (most recent call last):
        ...
        tierstore.errors.TierstoreError: tierstore: bench train: --vary-seq 256: expected ...
    """
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        bounds = (0, 0)
    if not sep or not 1 <= bounds[0] <= bounds[1]:
        raise TierstoreError(
            f"tierstore: bench train: --vary-seq {text}: expected MIN:MAX, two whole numbers "
            "with 1 <= MIN <= MAX, such as 96:256"
        )
    return bounds
