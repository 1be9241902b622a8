"""Hugging Face ``Trainer`` (and TRL's trainers): ``callbacks=[TierstoreCallback(...)]``.

Example:
    >>> from tierstore.integrations.transformers import TierstoreCallback
    >>> callback = TierstoreCallback(device_budget=0, disk_budget="8GiB")
    >>> callback.store is None  # created when training begins
    True
"""

from __future__ import annotations

from typing import Any

from tierstore.config import TierConfig
from tierstore.errors import TierstoreError
from tierstore.integrations import EXTRA_HINT, figures, resolve, run_stats
from tierstore.offloading import offload_module
from tierstore.stats import Stats
from tierstore.tier_store import TierStore

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - the tests run with transformers installed
    raise ImportError(
        f"tierstore: tierstore.integrations.transformers needs the transformers package; "
        f"{EXTRA_HINT}"
    ) from e

__all__ = ["TierstoreCallback"]

# NOTE [ Trainer callback ]
# on_train_begin puts offload_module() on the model the Trainer trains (the
# callback's `model`, the unwrapped one: a DDP or accelerate wrapper calls it,
# so its forward hooks run either way). Every forward of the training step
# then saves into the store and backward, which the Trainer runs after the
# forward returns, reads back. Evaluation forwards run under no_grad and save
# nothing. Gradient checkpointing composes: the checkpointed layers save their
# inputs through the store, and their recomputation in backward runs outside
# the model's forward. on_train_end takes the hooks off and closes the store.
# The Trainer calls user callbacks after its reporting ones (report_to), in
# one list: on_log adds the figures to the logs dict (seen by the callbacks
# after this one, the progress bar or printer among them) and to the entry
# state.log_history has just received.


class TierstoreCallback(TrainerCallback):
    """Offloads what the training step's forward saves; adds ``tierstore/...`` to the logs.

    Pass it in ``Trainer(callbacks=[...])``. The store is created when
    training begins (``store``) and closed when it ends; :meth:`stats` gives
    its figures then and after.

    Args:
        config: the store's configuration; ``None`` resolves one from the
            environment and TOML file (:func:`tierstore.load_config`).
        **overrides: settings that win over ``config`` or the resolved one.

    Example:
        >>> import tempfile
        >>> from tierstore.integrations.transformers import TierstoreCallback
        >>> callback = TierstoreCallback(device_budget=0, host_budget=0,
        ...                              disk_path=tempfile.mkdtemp())
        >>> int(callback.config.host_budget)
        0
        >>> # Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    """

    def __init__(self, config: TierConfig | None = None, **overrides: Any) -> None:
        self.config = resolve(config, overrides, "TierstoreCallback")
        #: The store of the current (or last) training run; ``None`` before one.
        self.store: TierStore | None = None
        self._handle: Any = None
        self._final: Stats | None = None

    def stats(self) -> Stats:
        """The store's figures now, or as they were when training ended.

        Example:
            >>> from tierstore.integrations.transformers import TierstoreCallback
            >>> import tierstore
            >>> try:
            ...     TierstoreCallback(disk_budget=0).stats()
            ... except tierstore.TierstoreError as e:
            ...     print(str(e)[:36])
            tierstore: no training run has begun
        """
        return run_stats(self.store, self._final, "Trainer.train()")

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """Put the model's forward under a new store (NOTE [ Trainer callback ])."""
        self._finish()
        if model is None:
            raise TierstoreError("tierstore: the Trainer passed no model to on_train_begin")
        self._handle = offload_module(model, self.config)
        self.store = self._handle.store
        self._final = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the store's figures to ``logs`` and to the last ``state.log_history`` entry."""
        if logs is None or self.store is None or self.store.closed:
            return
        found = figures(self.store.stats())
        logs.update(found)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(found)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Take the hooks off and close the store (its figures stay in :meth:`stats`)."""
        self._finish()

    def _finish(self) -> None:
        if self._handle is None:
            return
        store, handle, self._handle = self.store, self._handle, None
        if store is not None and not store.closed:
            self._final = store.stats()
        handle.remove()
