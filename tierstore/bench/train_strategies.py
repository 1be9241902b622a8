"""The strategies of ``tierstore bench train``: each way of handling saved activations.

A strategy wraps a training step's forward in a context (eager autograd's
is empty) and may own resources (a store, a scratch directory) that
``close()`` releases. :func:`_make_strategy` builds one from its name;
names are the fixed ones of :data:`STRATEGIES`, ``checkpoint-N`` and
``budget=F`` (NOTE [ Budget rows ]), and the tierstore ones followed by
:data:`RECOMPUTE_SUFFIX`.

Example:
    >>> from tierstore.bench.train_settings import quick_settings
    >>> from tierstore.bench.train_strategies import check_strategies
    >>> check_strategies(quick_settings(strategies=("none", "checkpoint-1", "budget=0.3")))
    >>> check_strategies(quick_settings(strategies=("none", "offload")))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tierstore.errors.TierstoreError: tierstore: bench train: strategy 'offload' is unknown; ...
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
from tierstore.bench.train_settings import TrainSettings
from tierstore.config import TierConfig
from tierstore.errors import TierstoreError
from tierstore.models import GPT
from tierstore.stats import Stats
from tierstore.tier_store import TierStore

__all__ = [
    "BUDGET",
    "CHECKPOINT_FIRST",
    "CPU_STRATEGIES",
    "CUDA_STRATEGIES",
    "RECOMPUTE_SUFFIX",
    "STRATEGIES",
    "check_strategies",
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

# NOTE [ Budget rows ]
# A budget=F row is a TierStore with activation_budget=F and the defaults
# otherwise (disk_budget sized like the other disk rows). Its store warms up
# on the first step, profiles the second and plans the third
# (NOTE [ Planned steps ] in tierstore/planning/runner.py), and may remake the plan
# after the third step and after the fifth or sixth: a run with a budget row
# runs five more warm-up steps than --warmup, so that the measured steps all
# follow the plan that stays; every row runs them, so that all reach their
# last step from the same weights and the gradient check compares like with
# like. After them an empty offload() block ends the last step, and the row
# keeps the plan: its table, its predicted step time and peak, and the
# store's own measurement of the step. Every row runs the same steps, so a
# budget row's first plan is made where its profile ends, as the steps
# counted here expect, not while steps go on (NOTE [ Planning off the
# training thread ] in tierstore/planning/checker.py): the step waits for the planning
# process (PlanRunner.wait_for_plans), and the bench measures the planned
# steps, which that choice leaves as they are. In the planning process, as a
# user's plans are, so that the row's process runs the store a user runs,
# with no search in it. For the same reason a plan a check remakes (a step slower
# than predicted: its moved bytes or op-by-op rebuilds cost more than
# priced) is remade where the check runs, at a step boundary in the warm-up,
# and the measured steps run on it, as a user's steps do once the planning
# process has made it.

#: A tierstore strategy with this suffix runs with ``recompute="cheap"`` (``--recompute``).
RECOMPUTE_SUFFIX = "+recompute"
_RECOMPUTABLE = ("tierstore-host", "tierstore-host-disk", "tierstore-file", "tierstore-lmdb")


class _Strategy:
    """How one strategy runs a forward pass; the default is plain eager autograd."""

    def __init__(self, name: str) -> None:
        self.name = name

    def forward(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def stats(self) -> Stats | None:
        return None

    def planned(self) -> bool | None:
        """Whether the step under way follows a plan; ``None``: a row with no budget."""
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

    def planned(self) -> bool | None:
        runner = self.store._runner
        return None if runner is None else runner.planned

    def close(self) -> None:
        self.store.close()


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
        row = _Tierstore(
            name,
            TierConfig(
                activation_budget=_budget_value(name.removeprefix(BUDGET)),
                disk_budget=budget,
                disk_path=root,
                min_offload_bytes=settings.min_offload_bytes,
                compression=settings.compression,
            ),
        )
        runner = row.store._runner
        assert runner is not None
        # See NOTE [ Budget rows ]: planned by the third step, remade where checked
        runner.wait_for_plans = True
        return row
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


def check_strategies(settings: TrainSettings) -> None:
    """Raise unless every strategy and ``recompute`` setting of ``settings`` is one there is.

    ``checkpoint-N`` may name at most the model's blocks (``--layers``).

    Raises:
        TierstoreError: naming the strategy (or ``--recompute``) and what it
            could be.

    Example:
        >>> from tierstore.bench.train_settings import quick_settings
        >>> check_strategies(quick_settings(strategies=("none", "checkpoint-3")))
        Traceback (most recent call last):
        ...
        tierstore.errors.TierstoreError: tierstore: bench train: strategy 'checkpoint-3': ...
    """
    for name in settings.strategies:
        if _known(name):
            blocks = name.removeprefix(CHECKPOINT_FIRST)
            if name.startswith(CHECKPOINT_FIRST) and int(blocks) > settings.layers:
                raise TierstoreError(
                    f"tierstore: bench train: strategy {name!r}: the model has "
                    f"{settings.layers} blocks (--layers {settings.layers}); "
                    f"checkpoint-N takes N from 1 to {settings.layers}"
                )
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
