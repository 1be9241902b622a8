"""The autograd boundary: saved-tensor hooks, what not to offload, and the public store.

This layer knows autograd and nothing about bytes. Its pack hook decides
whether a saved tensor is worth offloading and hands it to the tier manager;
its unpack hook asks for it back.

Example:
    >>> import torch, tierstore
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    >>> x = torch.randn(32, 64)
    >>> with tierstore.TierStore(tierstore.TierConfig(
    ...         device_budget=0, disk_budget=0, min_offload_bytes=0)) as store:
    ...     with store.offload():
    ...         loss = model(x).square().sum()
    ...     loss.backward()
    ...     store.stats().tiers["host"].peak_bytes > 0
    True
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.config import TierConfig, load_config
from tierstore.errors import ConfigError, TierstoreError
from tierstore.handle import Handle
from tierstore.stats import Stats
from tierstore.store import TierManager, resting_nbytes

__all__ = ["TierStore", "keep", "keep_module", "offload"]

# NOTE [ What stays on the device ]
# Offloading a tensor pays only if the copy lets its memory go. These are kept
# as they are (returned detached, so the graph holds no reference cycle):
#   * parameters and views of them (nn.Linear saves weight.t()), and module
#     buffers and views of them: their modules keep them alive anyway;
#   * tensors under min_offload_bytes: the copy costs more than it frees;
#   * anything but a plain strided torch.Tensor: sparse and nested layouts,
#     subclasses (FakeTensor and FunctionalTensor while torch.compile traces,
#     DTensor), meta tensors, and lazily conjugated/negated views whose bits a
#     byte copy would lose;
#   * everything saved inside tierstore.keep().
# Buffers cannot be told from inputs by looking at a tensor (register_buffer
# stores a plain tensor), so while an offload() context is active a global
# module forward pre-hook notes the storages of the buffers of each module
# that runs; pack looks a saved tensor's storage up there. Not seen: buffers
# saved by a torch.compile'd graph (module hooks run while Dynamo traces, not
# when the graph runs), which are offloaded: a wasted copy, exact gradients.

# NOTE [ Version check ]
# Eager autograd raises if a saved tensor was modified in place before
# backward. Under saved_tensors_hooks PyTorch leaves that check to the hooks,
# so tierstore does it: kept tensors here, stored ones in the tier manager.

_local = threading.local()


class _BufferWatch:
    """Notes module buffers while any offload() context is active (NOTE [ What stays ... ])."""

    def __init__(self) -> None:
        self.storages: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hook: Any = None
        self._users = 0

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        # is_compiling() first: under Dynamo this hook is inlined into every
        # module call, and the check must fold to a constant before anything
        # (the thread-local) would need tracing.
        if torch.compiler.is_compiling() or not getattr(_local, "active", 0):
            return
        for buf in module._buffers.values():
            if buf is not None:
                self.storages.add(buf.untyped_storage())

    def use(self, delta: int) -> None:
        with self._lock:
            self._users += delta
            if self._users and self._hook is None:
                # Registered once and kept: Dynamo guards on the global hooks'
                # keys, so a hook re-registered at every offload() entry would
                # make a compiled model recompile every step. When no offload()
                # is active it returns at once.
                register = torch.nn.modules.module.register_module_forward_pre_hook
                self._hook = register(self._note)
            elif not self._users:
                self.storages.clear()


_buffers = _BufferWatch()


def _keep_depth() -> int:
    return getattr(_local, "keep", 0)


@contextlib.contextmanager
def keep() -> Iterator[None]:
    """Keep every tensor saved inside this block on the device, even under ``offload()``.

    Use it for the last layers, whose saved tensors backward needs first, or
    for anything you know fits. Nests; thread-local.

    Example:
        >>> import torch, tierstore
        >>> head = torch.nn.Linear(16, 4)
        >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0, disk_budget=0))
        >>> h = torch.randn(8, 16, requires_grad=True)
        >>> with store.offload():
        ...     z = h.exp()
        ...     with tierstore.keep():
        ...         logits = head(z)
        >>> store.stats().kept > 0
        True
        >>> logits.sum().backward(); store.close()
    """
    _local.keep = _keep_depth() + 1
    try:
        yield
    finally:
        _local.keep -= 1


class _KeepModule:
    """The hooks :func:`keep_module` put on a module; :meth:`remove` takes them off."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._depth_at_entry: list[int] = []
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            # always_call: a forward that raises still leaves the keep() block.
            module.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._depth_at_entry.append(_keep_depth())
        _local.keep = _keep_depth() + 1

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._depth_at_entry:
            _local.keep = self._depth_at_entry.pop()

    def remove(self) -> None:
        """Stop keeping this module's saved tensors on the device. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def keep_module(module: torch.nn.Module) -> _KeepModule:
    """Keep every tensor saved inside ``module``'s forward on the device, as :func:`keep` does.

    For modules whose saved tensors backward needs first or that are cheap
    to keep, such as the output head. Returns a handle whose ``remove()``
    undoes it. Thread-local, like :func:`keep`: it applies to the thread
    that runs the forward.

    Example:
        >>> import torch, tierstore
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
        ...                             torch.nn.Linear(16, 4))
        >>> handle = tierstore.keep_module(model[2])
        >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0, disk_budget=0))
        >>> with store.offload():
        ...     out = model(torch.randn(8, 16))
        >>> store.stats().kept  # the head's input stays; its weight is a parameter
        2
        >>> out.sum().backward(); handle.remove(); store.close()
    """
    return _KeepModule(module)


class _Kept:
    """A saved tensor left on the device, with its version for the check at unpack."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


def _offload_nbytes(t: torch.Tensor, min_bytes: int) -> int | None:
    """Bytes ``t`` rests in once offloaded, or ``None`` if it stays on the device.

    See NOTE [ What stays on the device ].
    """
    if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_nested:
        return None
    if t._is_zerotensor():  # no storage to copy
        return None
    if t.device.type == "meta" or t.is_conj() or t.is_neg() or t.is_quantized:
        return None
    nbytes = resting_nbytes(t)
    if nbytes < min_bytes:
        return None
    base = t._base
    if base is not None and isinstance(base, torch.nn.Parameter):
        return None
    if t.grad_fn is None and t.untyped_storage() in _buffers.storages:
        return None
    return nbytes


def _checked(config: object, where: str) -> TierConfig | None:
    if config is None or isinstance(config, TierConfig):
        return config
    raise ConfigError(
        f"tierstore: {where} takes a TierConfig; got {type(config).__name__}. "
        "Build one with tierstore.TierConfig(**settings), or pass settings as keywords "
        "to tierstore.offload(...)"
    )


class TierStore:
    """A tiered store for the tensors autograd saves for backward.

    Use :meth:`offload` around the forward pass; run backward as usual. The
    store keeps its state between steps, so create it once and reuse it.
    Resources (the spill directory, files) are created on first use and
    released by :meth:`close`, which is idempotent; ``with TierStore(...)``
    closes on exit.

    Args:
        config: budgets and placement; ``None`` resolves one from the
            environment and TOML file (see :func:`tierstore.load_config`).

    Example:
        >>> import tempfile, torch, tierstore
        >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="64MiB",
        ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU())
        >>> with tierstore.TierStore(cfg) as store:
        ...     with store.offload():
        ...         loss = model(torch.randn(64, 128)).sum()
        ...     on_disk = store.stats().tiers["disk"].entries
        ...     loss.backward()
        ...     after = store.stats().tiers["disk"].entries
        >>> on_disk > 0, after
        (True, 0)
    """

    def __init__(self, config: TierConfig | None = None) -> None:
        self.config = _checked(config, "TierStore(config=...)") or load_config()
        self._manager = TierManager(self.config)
        self._min_bytes = int(self.config.min_offload_bytes)

    @contextlib.contextmanager
    def offload(self) -> Iterator[TierStore]:
        """Offload the tensors autograd saves inside this block.

        Hooks are thread-local and removed on exit, also on an exception.
        An inner ``offload()`` (of this or another store) wins over an outer
        one; ``torch.no_grad()`` saves nothing, so nothing is packed.

        Example:
            >>> import torch, tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0,
            ...                                                  disk_budget=0))
            >>> x = torch.randn(10, requires_grad=True)
            >>> with store.offload():
            ...     y = (x * 2).sin()
            >>> y.sum().backward(); store.close()
        """
        self._manager.check_open()
        _buffers.use(+1)
        _local.active = getattr(_local, "active", 0) + 1
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            _local.active -= 1
            _buffers.use(-1)

    def stats(self) -> Stats:
        """Bytes per tier now and at peak, entries, and what moved.

        Example:
            >>> import tierstore
            >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
            ...     print(store.stats().tiers["device"].bytes)
            0
        """
        return self._manager.stats()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called.

        Example:
            >>> import tierstore
            >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
            ...     store.closed
            False
            >>> store.closed
            True
        """
        return self._manager.closed

    @property
    def disk_directory(self) -> str | None:
        """The private spill directory, once something has been written to disk.

        Example:
            >>> import tempfile, torch, tierstore
            >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="1MiB",
            ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
            >>> with tierstore.TierStore(cfg) as store:
            ...     print(store.disk_directory)
            ...     x = torch.ones(8, requires_grad=True)
            ...     with store.offload():
            ...         y = x.exp()
            ...     print(store.disk_directory.startswith(str(cfg.disk_path)))
            None
            True
        """
        return self._manager.disk_directory

    def flush(self) -> None:
        """Wait until every saved tensor queued for disk has been written.

        Forward never waits for the disk (writes run behind it, up to
        ``write_queue_bytes``); call this before measuring disk usage, say.
        Raises the error of a write that failed.

        Example:
            >>> import tempfile, torch, tierstore
            >>> cfg = tierstore.TierConfig(device_budget=0, host_budget=0, disk_budget="1MiB",
            ...                            disk_path=tempfile.mkdtemp(), min_offload_bytes=0)
            >>> with tierstore.TierStore(cfg) as store:
            ...     x = torch.ones(1000, requires_grad=True)
            ...     with store.offload():
            ...         y = x.exp()
            ...     store.flush()
            ...     store.stats().tiers["disk"].bytes
            8192
        """
        self._manager.flush()

    def close(self) -> None:
        """Free every entry and remove the spill directory. Idempotent.

        Saved tensors of graphs not yet backpropagated are gone afterwards:
        their backward raises :class:`~tierstore.StoreClosedError`.

        Example:
            >>> import tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(disk_budget=0))
            >>> store.close(); store.close(); store.closed
            True
        """
        self._manager.close()

    def __enter__(self) -> TierStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<TierStore {state} {self.config!r}>"

    # -- hooks ---------------------------------------------------------------

    # Dynamo must never trace the hooks (locks, threads, file I/O). It would:
    # eager code that runs while its frame callback is active (module.compile()
    # on a module it does not capture) calls them as new frames, and compiled
    # autograd calls the unpack hook from its graph. _disable_dynamo is
    # torch.compiler.disable, importing torch._dynamo only at the first call.
    @torch._compile._disable_dynamo
    def _pack(self, t: torch.Tensor) -> Handle | _Kept:
        nbytes = None if _keep_depth() else _offload_nbytes(t, self._min_bytes)
        if nbytes is None:
            # Only kept tensors can be tracing placeholders (subclasses are
            # never offloaded), so the offload path pays no check for them.
            if isinstance(
                t,
                (
                    torch._subclasses.FakeTensor,
                    torch._subclasses.functional_tensor.FunctionalTensor,
                ),
            ):
                # make_fx, FakeTensorMode: no data, and a size that may be
                # symbolic: nothing to count. Not detached: torch 2.11 refuses
                # a FunctionalTensor op here.
                return _Kept(t, t._version)
            self._manager.count_kept(t.numel() * t.element_size())
            return _Kept(t.detach(), t._version)
        return self._manager.put(t, nbytes)

    @torch._compile._disable_dynamo
    def _unpack(self, packed: Handle | _Kept) -> torch.Tensor:
        if type(packed) is _Kept:
            t = packed.tensor
            if t._version != packed.version:
                raise TierstoreError(
                    "tierstore: one of the variables needed for gradient computation has "
                    "been modified by an inplace operation: a saved tensor of shape "
                    f"{list(t.shape)} and dtype {t.dtype} is at version {t._version}; "
                    f"expected version {packed.version} instead. Hint: clone the tensor "
                    "before modifying it in place, or modify it before it is saved"
                )
            return t
        assert isinstance(packed, Handle)
        return self._manager.get(packed)


# -- the process-wide stores behind tierstore.offload() ------------------------

_stores: dict[TierConfig, TierStore] = {}
_stores_lock = threading.Lock()


def _close_all() -> None:
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()


def _store_for(config: TierConfig) -> TierStore:
    with _stores_lock:
        store = _stores.get(config)
        if store is None or store.closed:
            if not _stores:
                atexit.register(_close_all)
            store = _stores[config] = TierStore(config)
        return store


@contextlib.contextmanager
def offload(config: TierConfig | None = None, **overrides: Any) -> Iterator[TierStore]:
    """Offload saved tensors inside this block to a process-wide store.

    With no arguments the store's configuration comes from the environment,
    the TOML file and the defaults (:func:`tierstore.load_config`); keyword
    arguments override single settings. One store exists per distinct
    configuration and lives until the interpreter exits, so a training loop
    that enters ``offload()`` every step reuses it.

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
    config = _checked(config, "tierstore.offload(config=...)")
    if config is None:
        config = load_config(**overrides)
    elif overrides:
        config = TierConfig(**{**config.model_dump(), **overrides})
    with _store_for(config).offload() as store:
        yield store
