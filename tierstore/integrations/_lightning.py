"""What the ``lightning`` and ``pytorch_lightning`` callbacks share; neither library is imported.

Example:
    >>> from tierstore.integrations._lightning import LightningOffload
    >>> LightningOffload(disk_budget=0).store is None
    True
"""

from __future__ import annotations

import functools
from typing import Any

from tierstore.config import TierConfig
from tierstore.integrations import figures, resolve, run_stats
from tierstore.stats import Stats
from tierstore.tier_store import TierStore

__all__ = ["LightningOffload"]

# NOTE [ Lightning callback ]
# What training_step saves must go to the store, and backward must run
# outside the block: under automatic optimization Lightning runs
# training_step, then backward, inside one closure that optimizer.step()
# calls, and on_train_batch_start/on_before_backward would leave a block open
# if training_step raised. So on_train_start wraps the module's training_step
# (an instance attribute over the method, functools.wraps so Lightning still
# sees it overridden) in store.offload(), and on_train_end, on_exception and
# teardown restore it and close the store (idempotent). Under manual
# optimization manual_backward runs inside training_step, so inside the
# block: correct (a backward saves nothing unless create_graph=True), only
# the saves of a double backward are offloaded too.


class LightningOffload:
    """The hooks of a Lightning ``TierstoreCallback`` (NOTE [ Lightning callback ]).

    Example:
        >>> from tierstore.integrations._lightning import LightningOffload
        >>> int(LightningOffload(disk_budget=0).config.disk_budget)
        0
    """

    def __init__(self, config: TierConfig | None = None, **overrides: Any) -> None:
        self.config = resolve(config, overrides, "TierstoreCallback")
        #: The store of the current (or last) training run; ``None`` before one.
        self.store: TierStore | None = None
        self._module: Any = None
        self._own_attr: Any = None
        self._final: Stats | None = None

    def stats(self) -> Stats:
        """The store's figures now, or as they were when training ended.

        Example:
            >>> from tierstore.integrations._lightning import LightningOffload
            >>> import tierstore
            >>> try:
            ...     LightningOffload(disk_budget=0).stats()
            ... except tierstore.TierstoreError as e:
            ...     print(str(e)[:36])
            tierstore: no training run has begun
        """
        return run_stats(self.store, self._final, "Trainer.fit()")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Wrap ``training_step`` in a new store's ``offload()``."""
        self._finish()
        store = self.store = TierStore(self.config)
        self._final = None
        step = pl_module.training_step
        self._module, self._own_attr = pl_module, pl_module.__dict__.get("training_step")

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            with store.offload():
                return step(*args, **kwargs)

        pl_module.training_step = training_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the store's figures (``tierstore/...``) with the module's ``log_dict``."""
        if self.store is None or self.store.closed:
            return
        pl_module.log_dict(
            figures(self.store.stats()),
            on_step=True,
            on_epoch=False,
            logger=trainer.logger is not None,
        )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Restore ``training_step`` and close the store."""
        self._finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Restore ``training_step`` and close the store."""
        self._finish()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Restore ``training_step`` and close the store (if training did not end normally)."""
        self._finish()

    def _finish(self) -> None:
        module, self._module = self._module, None
        if module is not None:
            if self._own_attr is None:
                del module.training_step
            else:
                module.training_step = self._own_attr
        store = self.store
        if store is not None and not store.closed:
            self._final = store.stats()
            store.close()
