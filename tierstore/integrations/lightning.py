"""Lightning (``lightning.pytorch``): ``Trainer(callbacks=[TierstoreCallback(...)])``.

For the ``pytorch_lightning`` package use
:mod:`tierstore.integrations.pytorch_lightning`, which behaves the same.

Example:
    >>> from tierstore.integrations.lightning import TierstoreCallback
    >>> callback = TierstoreCallback(device_budget=0, disk_budget="8GiB")
    >>> callback.store is None  # created when training starts
    True
"""

from __future__ import annotations

from tierstore.integrations import EXTRA_HINT
from tierstore.integrations._lightning import LightningOffload

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - the tests run with lightning installed
    raise ImportError(
        f"tierstore: tierstore.integrations.lightning needs the lightning package; {EXTRA_HINT}"
    ) from e

__all__ = ["TierstoreCallback"]


class TierstoreCallback(LightningOffload, Callback):
    """Offloads what ``training_step`` saves; logs ``tierstore/...`` figures.

    Pass it in ``lightning.pytorch.Trainer(callbacks=[...])``. The store is
    created when training starts (``store``) and closed when it ends;
    :meth:`stats` gives its figures then and after. See NOTE [ Lightning
    callback ] in ``tierstore/integrations/_lightning.py``.

    Args:
        config: the store's configuration; ``None`` resolves one from the
            environment and TOML file (:func:`tierstore.load_config`).
        **overrides: settings that win over ``config`` or the resolved one.

    Example:
        >>> import tempfile
        >>> from tierstore.integrations.lightning import TierstoreCallback
        >>> callback = TierstoreCallback(device_budget=0, host_budget=0,
        ...                              disk_path=tempfile.mkdtemp())
        >>> int(callback.config.host_budget)
        0
        >>> # lightning.pytorch.Trainer(max_steps=100, callbacks=[callback]).fit(module, data)
    """
