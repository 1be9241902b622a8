"""PyTorch Lightning (the ``pytorch_lightning`` package): the same callback as ``lightning``'s.

Example:
    >>> from tierstore.integrations.pytorch_lightning import TierstoreCallback
    >>> TierstoreCallback(disk_budget=0).store is None
    True
"""

from __future__ import annotations

from tierstore.integrations import EXTRA_HINT
from tierstore.integrations._lightning import LightningOffload

try:
    from pytorch_lightning import Callback
except ImportError as e:  # pragma: no cover - the tests run with pytorch_lightning installed
    raise ImportError(
        "tierstore: tierstore.integrations.pytorch_lightning needs the pytorch_lightning "
        f"package; {EXTRA_HINT}"
    ) from e

__all__ = ["TierstoreCallback"]


class TierstoreCallback(LightningOffload, Callback):
    """Offloads what ``training_step`` saves; logs ``tierstore/...`` figures.

    Pass it in ``pytorch_lightning.Trainer(callbacks=[...])``; otherwise as
    :class:`tierstore.integrations.lightning.TierstoreCallback`.

    Args:
        config: the store's configuration; ``None`` resolves one from the
            environment and TOML file (:func:`tierstore.load_config`).
        **overrides: settings that win over ``config`` or the resolved one.

    Example:
        >>> from tierstore.integrations.pytorch_lightning import TierstoreCallback
        >>> int(TierstoreCallback(disk_budget=0).config.disk_budget)
        0
    """
