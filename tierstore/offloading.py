"""The process-wide stores behind ``tierstore.offload()``, and ``offload_module``.

Example:
    >>> import torch, tierstore
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    >>> with tierstore.offload_module(
    ...         model, device_budget=0, disk_budget=0, min_offload_bytes=0) as handle:
    ...     model(torch.randn(32, 64)).sum().backward()
    ...     handle.store.stats().tiers["host"].peak_bytes > 0
    True
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

from tierstore.autograd.blocks import Block
from tierstore.autograd.filters import buffers
from tierstore.autograd.recompute import never_traced
from tierstore.autograd.state import local
from tierstore.config import TierConfig
from tierstore.errors import ConfigError
from tierstore.tier_store import TierStore, resolved_config

__all__ = ["offload", "offload_module"]

# -- the process-wide stores behind tierstore.offload() ------------------------

# NOTE [ Stores behind offload() ]
# tierstore.offload(**overrides) keeps a store per configuration, so that a
# loop entering it every step with the same settings reuses one store (its
# threads, host pool, plan and step log). At most MAX_STORES are kept: the
# most recently used. Entering offload() with another configuration retires
# the least recently used one; a later offload() with that configuration
# gets a new store. A retired store may still hold the saved tensors of a
# graph whose forward ran under it and whose backward has not run yet, or
# have an offload() block open in another thread: closing it then would make
# that backward raise StoreClosedError. So a retired store is closed only
# once it is idle (no entry left, no offload() block of this registry open
# on it), checked as each offload() block is entered and left, and at
# interpreter exit. A graph dropped without backward frees its entries as
# autograd drops them, so its store closes at the next check. The store
# yielded by offload() is for use inside the block (stats(), say); create a
# TierStore to keep one for longer.

#: How many stores tierstore.offload() keeps (NOTE [ Stores behind offload() ]).

MAX_STORES = 4

_stores: dict[TierConfig, TierStore] = {}  # least recently used first
_retired: list[TierStore] = []
_blocks: dict[TierStore, int] = {}  # offload() blocks open, per store
_stores_lock = threading.Lock()
_at_exit: list[bool] = []


def _close_all() -> None:
    with _stores_lock:
        stores = [*_stores.values(), *_retired]
        _stores.clear()
        _retired.clear()
    for store in stores:
        store.close()


def _enter_store(config: TierConfig) -> TierStore:
    """The store for ``config``, now the most recently used, with one more block open on it."""
    with _stores_lock:
        store = _stores.pop(config, None)
        if store is None or store.closed:
            if not _at_exit:
                _at_exit.append(True)
                atexit.register(_close_all)
            store = TierStore(config)
        _stores[config] = store  # to the end: the most recently used
        _blocks[store] = _blocks.get(store, 0) + 1
        while len(_stores) > MAX_STORES:
            _retired.append(_stores.pop(next(iter(_stores))))
        idle = _idle_retired()
    for old in idle:
        old.close()
    return store


def _leave_store(store: TierStore) -> None:
    """One block fewer open on ``store``; close retired stores that are idle now."""
    with _stores_lock:
        left = _blocks.pop(store) - 1
        if left:
            _blocks[store] = left
        idle = _idle_retired()
    for old in idle:
        old.close()


def _idle_retired() -> list[TierStore]:
    """Retired stores that may close now (NOTE [ Stores behind offload() ]); under the lock."""
    idle = [
        s for s in _retired if s.closed or (s not in _blocks and not s._manager.holds_entries())
    ]
    for store in idle:
        _retired.remove(store)
    return idle


@contextlib.contextmanager
def offload(config: TierConfig | None = None, **overrides: Any) -> Iterator[TierStore]:
    """Offload saved tensors inside this block to a process-wide store.

    With no arguments the store's configuration comes from the environment,
    the TOML file and the defaults (:func:`tierstore.load_config`); keyword
    arguments override single settings. A store is kept per configuration,
    so a training loop that enters ``offload()`` every step reuses it; the
    four most recently used are kept, and an older one is closed once
    nothing saved in it is left (NOTE [ Stores behind offload() ]). Use the
    yielded store inside the block; create a :class:`TierStore` to keep one.

    Args:
        config: the configuration to use instead of resolving one.
        **overrides: settings that win over ``config`` or the resolved one.

    Yields:
        The store, for :meth:`TierStore.stats`.

    Example:
        >>> import torch, tierstore
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> with tierstore.offload(device_budget=0, disk_budget=0) as store:
        ...     loss = (torch.randn(512, 256) @ w).relu().sum()
        >>> loss.backward()
        >>> store.stats().tiers["host"].bytes
        0
    """
    # A policy function is not a setting (no env var or TOML can hold one): it
    # goes to the block, and the store's own setting stays as resolved.
    policy = overrides.pop("recompute") if callable(overrides.get("recompute")) else None
    config = resolved_config(config, overrides, "tierstore.offload(config=...)")
    store = _enter_store(config)
    try:
        with store.offload(policy):
            yield store
    finally:
        _leave_store(store)


# Frames a warning should not point at: tierstore's, torch's (Module.__call__
# running offload_module's hooks) and contextlib's (leaving a with block).

# -- offload_module --------------------------------------------------------------

# NOTE [ offload_module ]
# A forward pre-hook enters an offload block of the handle's store and a
# forward hook registered with always_call=True leaves it, so a forward that
# raises (or a pre-hook after ours that raises) still pops the saved-tensor
# hooks. Backward runs wherever the caller runs it: outside the block. The
# block stack is per thread (DataParallel runs replicas in threads) and gets a
# placeholder before the block is entered, so a failed entry leaves nothing
# for the forward hook to pop but its own placeholder. The module's tree is
# watched for buffers (NOTE [ Buffer watch ]) in case it was built before
# tierstore was imported.


class _OffloadModule:
    """The hooks :func:`offload_module` put on a module, and the store they use."""

    def __init__(self, module: torch.nn.Module, store: TierStore, owned: bool) -> None:
        self.store = store
        self._owned = owned
        self._name = type(module).__name__
        self._where = f"the forward of {self._name} (offload_module)"
        self._blocks = threading.local()
        buffers.watch(module)
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _stack(self) -> list[Block | None]:
        stack: list[Block | None] | None = getattr(self._blocks, "stack", None)
        if stack is None:
            stack = self._blocks.stack = []
        return stack

    @never_traced
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        stack = self._stack()
        stack.append(None)
        if not local.replaying:  # NOTE [ Replayed modules ] in planning/planner.py
            stack[-1] = self.store._open_block()

    @never_traced
    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        block = stack.pop() if stack else None
        if block is not None:
            # Inside the except clause of Module.__call__ when forward raised.
            error = sys.exc_info()[1]
            self.store._close_block(block, error is None, self._where, error)

    def remove(self) -> None:
        """Take the hooks off the module and close the store if ``offload_module`` made it.

        Idempotent. Call it after the last backward that needs the saved
        tensors: their backward raises :class:`~tierstore.StoreClosedError`
        once the store is closed. A store passed as ``store=`` stays open.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._owned:
            self.store.close()

    def __enter__(self) -> _OffloadModule:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if not self._handles else "active"
        return f"<offload_module {state} on {self._name}, {self.store!r}>"


def offload_module(
    module: torch.nn.Module,
    config: TierConfig | None = None,
    *,
    store: TierStore | None = None,
    **overrides: Any,
) -> _OffloadModule:
    """Offload every tensor saved inside ``module``'s forward, every time it runs.

    The one-line form of wrapping each forward in :meth:`TierStore.offload`:
    run forward and backward as usual; the saves made inside the module's
    forward go to the store, backward (run outside the forward) brings them
    back. Saves outside the module (a loss computed on its output, say) are
    not offloaded. A forward under ``torch.no_grad()`` (evaluation) saves
    nothing, so costs nothing.

    The handle owns the store it creates: ``handle.store`` gives its
    :meth:`~TierStore.stats`, and ``handle.remove()`` (idempotent; also on
    leaving ``with offload_module(...)``) takes the hooks off and closes the
    store. Pass ``store=`` to share one store between several modules (each
    transformer block, say); ``remove()`` then leaves it open.

    Args:
        module: the module whose forward's saves go to the store.
        config: the store's configuration; ``None`` resolves one as
            :func:`tierstore.offload` does.
        store: an open store to use instead of creating one.
        **overrides: settings that win over ``config`` or the resolved one.

    Returns:
        A handle with ``.store`` and ``.remove()``.

    Raises:
        ConfigError: ``store=`` given together with ``config`` or settings.

    Example:
        >>> import torch, tierstore
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
        >>> handle = tierstore.offload_module(model, device_budget=0, disk_budget=0,
        ...                                   min_offload_bytes=0)
        >>> loss = model(torch.randn(32, 64)).square().sum()  # forward: saves are stored
        >>> handle.store.stats().tiers["host"].entries
        2
        >>> loss.backward()  # outside the forward, as usual
        >>> handle.remove(); handle.store.closed
        True
    """
    if store is not None:
        if config is not None or overrides:
            raise ConfigError(
                "tierstore: offload_module() takes either store= or a configuration "
                f"(config={config!r}, settings {sorted(overrides)}), not both; configure "
                "the store when you create it"
            )
        store._manager.check_open()
        return _OffloadModule(module, store, owned=False)
    resolved = resolved_config(config, overrides, "tierstore.offload_module(config=...)")
    return _OffloadModule(module, TierStore(resolved), owned=True)
