"""Callbacks that put a trainer's training step under tierstore: one line in the trainer.

Each submodule imports its library when it is imported, never at
``import tierstore``; without the library it raises an :class:`ImportError`
that names the extra to install (``pip install 'tierstore[integrations]'``).

* :mod:`tierstore.integrations.transformers`: ``TierstoreCallback``, a
  ``transformers.TrainerCallback`` (so also TRL's trainers).
* :mod:`tierstore.integrations.lightning`: ``TierstoreCallback``, a
  ``lightning.pytorch.Callback``; :mod:`tierstore.integrations.pytorch_lightning`
  the same for the ``pytorch_lightning`` package.

Both report the store's figures in the trainer's own logs under
``tierstore/...`` names (:func:`figures`).

Example:
    >>> import tierstore
    >>> from tierstore.integrations import figures
    >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
    ...     sorted(figures(store.stats()))[:2]
    ['tierstore/device_peak_bytes', 'tierstore/disk_peak_bytes']
"""

from __future__ import annotations

from typing import Any

from tierstore.config import TierConfig, load_config, with_overrides
from tierstore.errors import ConfigError, TierstoreError
from tierstore.stats import Stats
from tierstore.tier_store import TierStore

__all__ = ["figures"]

#: What the ImportError of a missing library says to install.
EXTRA_HINT = "install it with pip install 'tierstore[integrations]'"


def figures(stats: Stats) -> dict[str, float]:
    """The figures a callback adds to its trainer's logs, named ``tierstore/...``.

    Peak bytes per tier, the prefetch hit rate (once backward has read
    anything back), and the seconds backward and forward waited: all since
    the callback's store opened at the start of training, not per step.

    Example:
        >>> import tierstore
        >>> from tierstore.integrations import figures
        >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
        ...     figures(store.stats())["tierstore/unpack_wait_s"]
        0.0
    """
    out = {f"tierstore/{name}_peak_bytes": float(t.peak_bytes) for name, t in stats.tiers.items()}
    rate = stats.prefetch_hit_rate
    if rate is not None:
        out["tierstore/prefetch_hit_rate"] = rate
    out["tierstore/unpack_wait_s"] = stats.unpack_wait_s
    out["tierstore/pack_wait_s"] = stats.pack_wait_s
    return out


def run_stats(store: TierStore | None, final: Stats | None, started_by: str) -> Stats:
    """A callback's figures: its store's now, or ``final``, taken when training ended.

    ``started_by`` names the call that creates the store (``Trainer.train()``).

    Example:
        >>> import tierstore
        >>> from tierstore.integrations import run_stats
        >>> try:
        ...     run_stats(None, None, "Trainer.fit()")
        ... except tierstore.TierstoreError as e:
        ...     print(e)
        tierstore: no training run has begun; the callback's store is created by Trainer.fit()
    """
    if store is not None and not store.closed:
        return store.stats()
    if final is None:
        raise TierstoreError(
            f"tierstore: no training run has begun; the callback's store is created by {started_by}"
        )
    return final


def resolve(config: object, overrides: dict[str, Any], where: str) -> TierConfig:
    """The configuration a callback's store uses: ``config`` (or the resolved one) and overrides.

    Resolved when the callback is created, so a bad setting fails there and
    not at the first training step.

    Example:
        >>> from tierstore.integrations import resolve
        >>> resolve(None, {"disk_budget": 0}, "TierstoreCallback").disk_budget
        0
    """
    if config is not None and not isinstance(config, TierConfig):
        raise ConfigError(
            f"tierstore: {where}(config=...) takes a TierConfig; got {type(config).__name__}. "
            f"Build one with tierstore.TierConfig(**settings), or pass settings as keywords "
            f"to {where}(...)"
        )
    if config is None:
        return load_config(**overrides)
    return with_overrides(config, overrides)
