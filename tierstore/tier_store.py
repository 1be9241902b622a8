"""The public store: :class:`TierStore`, which wires the layers below together.

A store owns a tier manager (:mod:`tierstore.tiers`) and, under
``activation_budget``, a plan's runner (:mod:`tierstore.planning`), and hands
the manager its limits through the runner. Each ``offload()`` block pushes
the store's saved-tensor hooks (:mod:`tierstore.autograd.hooks`) and keeps the
block's state: quiet blocks, a plan's regions, the recorder, the step log.

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

import contextlib
import functools
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.autograd import state
from tierstore.autograd.blocks import Block, tracing
from tierstore.autograd.filters import (
    Kept,
    buffers,
    sized,
)
from tierstore.autograd.hooks import SaveHooks
from tierstore.autograd.names import ModuleNames
from tierstore.autograd.quiet import GREW, MEASURED_EVERY, Quiet, Repeat, device_bytes, opened_at
from tierstore.autograd.recipes import Recipe
from tierstore.autograd.recompute import (
    Policy,
    RecomputeSetting,
    everything,
    never_traced,
    policy_of,
)
from tierstore.autograd.recorder import Recorder
from tierstore.autograd.regions import MAX_PLANNED_DEPTH, Regions
from tierstore.autograd.state import local
from tierstore.config import TierConfig, load_config, with_overrides
from tierstore.errors import ConfigError, TierstoreWarning, out_of_memory
from tierstore.planning.planner import Plan
from tierstore.planning.runner import PlanRunner
from tierstore.stats import Stats, step_summary
from tierstore.tiers.handle import Handle
from tierstore.tiers.manager import TierManager

__all__ = ["TierStore"]

#: The ``tierstore`` logger: one INFO line per training step (NOTE [ Step log ]).
log = logging.getLogger("tierstore")
#: How long :meth:`TierStore.plan` waits for the first plan, seconds (NOTE [ The first
#: plan ] in planning/checker.py): a search takes seconds on a busy machine.
PLAN_TIMEOUT_S = 60.0

#: What a step was under activation_budget, as its INFO line says it (PlanRunner.step_kind).
_KINDS = {
    "": "",
    "profiled": "profiled",
    "planned": "planned",
    "carried": "planned, carried over",
    "safe": "safe placement",
}


# NOTE [ Step log ]
# A step ends when a backward has run (the store saw an unpack) and then the
# next offload() block starts, or the store closes: the first point after a
# backward where the hooks run again without being inside autograd. Only then
# is the tierstore logger asked whether INFO is on, so a disabled logger costs
# one integer comparison per block. Moved bytes, hits and waits in a line are
# those since the previous line; peaks are the store's.


# NOTE [ A step that raised ]
# A step that raises (out of memory, say, NOTE [ Out of memory ] in
# tierstore/errors.py) inside a block of the store, or in the backward after
# it, ends there: the store drops it and the next block begins a new step,
# so a loop that catches the error, drops what the step held and runs it
# again (smaller, as accelerate's find_executable_batch_size does) begins
# clean. A block sees the error that leaves it. A backward that raises is
# seen at the next block: its final callback (NOTE [ Like with like ] in
# planning/runner.py) never ran; its error is known only where it came out
# of the store's own unpack (a read, a rebuild). The dropped step is no
# profile and no measurement (its times stop part way) and no recording of
# the unpack order; its saves count in stats() as any others, and their
# entries go as autograd drops the graph, as any graph's do: once the caller
# lets go of the error, whose frames hold the forward's tensors. A step out
# of memory was short of at least what the failed allocation asked, and at
# least one save: under activation_budget the plan of its shape (the one it
# ran, or the one being remade while it ran on the safe placement) is
# remade for a budget that much lower, the safe placement running the steps
# until it is ready; a plan already on its way counts none of it, so it is
# made again before any step runs it. The safe placement keeps that much
# less on the device from then on. A later step of another size (the smaller
# retry) follows its own profile. What the store cannot see it cannot count:
# an error raised between the store's blocks (a loss computed outside
# offload()) leaves the step under way, and a kill by a cgroup's limit or
# the kernel's OOM killer is a SIGKILL, which no process survives.


def _checked(config: object, where: str) -> TierConfig | None:
    if config is None or isinstance(config, TierConfig):
        return config
    raise ConfigError(
        f"tierstore: {where} takes a TierConfig; got {type(config).__name__}. "
        "Build one with tierstore.TierConfig(**settings), or pass settings as keywords "
        "to tierstore.offload(...)"
    )


def _warn_device_budget_unused(config: TierConfig) -> None:
    """activation_budget decides what stays on the device: a device_budget set too is unused."""
    if "device_budget" not in config.model_fields_set:
        return
    warnings.warn(
        TierstoreWarning(
            f"tierstore: device_budget={int(config.device_budget)} is not used: "
            f"activation_budget={config.activation_budget!r} decides what stays on the device "
            "(the plan, or the safe placement before one). Unset device_budget "
            "(TIERSTORE_DEVICE_BUDGET), or activation_budget (TIERSTORE_ACTIVATION_BUDGET) to "
            "place by the tiers' budgets"
        ),
        stacklevel=3,
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
        # The store owns both and wires them: the runner measures through the
        # manager's clocks, and the manager takes its limits from the runner
        # (NOTE [ Planned saves ]). The tiers never import planning.
        self._runner: PlanRunner | None = None
        if self.config.activation_budget is not None:
            self._runner = PlanRunner(self.config, **self._manager.measures())
            self._manager.follow(self._runner)
            _warn_device_budget_unused(self.config)
        self._min_bytes = int(self.config.min_offload_bytes)
        self._recompute = policy_of(self.config.recompute)
        self._warned = False  # NOTE [ Is it working? ] in tierstore/stats.py
        # NOTE [ One decision, one call ]: the hooks each block pushes. Bound
        # here, so that a block reads them as attributes of the store.
        self._hooks = SaveHooks(self._manager, self._runner, self._min_bytes)
        self._pack = self._hooks.pack
        self._unpack = self._hooks.unpack
        # NOTE [ Step log ]: unpack calls at the last step's end.
        self._step_unpacks = 0
        self._steps = 0
        self._logged: Stats | None = None
        # NOTE [ Recording where a plan rebuilds ]: the profiled step's modules by name.
        self._modules: dict[str, weakref.ref[torch.nn.Module]] = {}
        self._regions = Regions(everything, self._hooks.stays, self._pack)
        # NOTE [ Quiet blocks ]: the block a quiet one repeats (its first save
        # and what its saves came to), for this step and for the next.
        self._quiet: Repeat | None = None
        self._next_quiet: Repeat | None = None
        self._step_blocks = 0
        self._quiet_steps = 0  # quiet steps since one was measured
        self._opened = 0  # blocks opened so far, in every thread
        self._open = 0  # and open now

    @contextlib.contextmanager
    def offload(self, recompute: RecomputeSetting | None = None) -> Iterator[TierStore]:
        """Offload the tensors autograd saves inside this block.

        Hooks are thread-local and removed on exit, also on an exception.
        An inner ``offload()`` (of this or another store) wins over an outer
        one; ``torch.no_grad()`` saves nothing, so nothing is packed.

        ``recompute`` overrides the store's ``recompute`` setting for this
        block: ``"off"``, ``"cheap"``, or a policy function
        ``(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``
        as selective activation checkpointing takes (NOTE [ Recompute ] in
        ``tierstore/autograd/recompute.py``).

        The first block whose saves all stayed on the device, while nothing
        has left it since the store opened, issues a
        :class:`~tierstore.TierstoreWarning` that says why in numbers and
        which setting to change (once per store). With the ``tierstore``
        logger at INFO, each step (a forward and its backward) logs a line.

        Example:
            >>> import torch, tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(min_offload_bytes=0,
            ...                                                  disk_budget=0))
            >>> x = torch.randn(10, requires_grad=True)
            >>> with store.offload():
            ...     y = (x * 2).sin()
            >>> y.sum().backward(); store.close()
        """
        block = self._open_block(recompute)
        error: BaseException | None = None
        try:
            yield self
        except BaseException as raised:  # NOTE [ A step that raised ]
            error = raised
            raise
        finally:
            self._close_block(block, error is None, "this offload() block", error)
            error = None  # its frames hold the step's tensors

    def _open_block(self, recompute: RecomputeSetting | None = None) -> Block:
        """Push the hooks; :meth:`_close_block` pops them (LIFO, as any hooks)."""
        self._manager.check_open()
        policy = self._recompute if recompute is None else policy_of(recompute)
        if self._hooks.unpacks != self._step_unpacks:  # a backward ran: a step ended
            self._step_ended()
        self._step_blocks += 1
        may_quiet = self._may_go_quiet(policy)
        # Only while the warning could still be due, or for a block that may
        # go quiet (NOTE [ Quiet blocks ]): it costs a lock.
        watch = may_quiet or (not self._warned and not self._manager.moved)
        block = Block(self._manager.pack_tally() if watch else None)
        if may_quiet:
            block.where = opened_at()
        pack = functools.partial(self._pack_first, block) if may_quiet else self._pack
        block.hooks = saved_tensors_hooks(pack, self._unpack)
        buffers.use(+1)
        local.active += 1
        try:
            block.hooks.__enter__()
        except BaseException:
            local.active -= 1
            buffers.use(-1)
            raise
        # NOTE [ Quiet blocks ]: a block is repeated only if it ran alone.
        self._opened += 1
        block.alone = self._opened if not self._open else 0
        self._open += 1
        block.outer_keeps, local.keeps = local.keeps, False
        # See NOTE [ Recompute in blocks ] in autograd/blocks.py.
        block.outer_recompute = local.recompute
        runner, timed, depth = self._runner, False, None
        if runner is not None:  # NOTE [ Planned saves ]
            timed = runner.will_time
            policy = everything if timed or runner.rebuilds else None
            depth = MAX_PLANNED_DEPTH
            plan = runner.plan
            if not timed and plan is not None:
                # NOTE [ Recording where a plan rebuilds ], NOTE [ Modules kept whole ]
                regions = self._regions
                regions.follow(plan, self._modules, *self._hooks.regions_hooks())
                if not regions.whole and (policy is not None or regions.keeps):
                    policy = None
                    block.outer_regions = (local.regions, local.region_recorder)
                    local.regions = regions
                    local.region_recorder = regions.recorder() if regions.records else None
        if policy is not None and tracing():
            policy = None  # make_fx, FakeTensorMode: tracing keeps today's path
        if timed and policy is not None and local.names is None:
            block.names = local.names = ModuleNames()
        if policy is not None and local.recorder is None:
            where = block.names.running if block.names is not None else None
            timer = runner.profile_timer() if timed and runner is not None else None
            recorder = Recorder(
                policy, self._hooks.stays, timer=timer, max_depth=depth or 8, where=where
            )
            try:
                recorder.__enter__()  # type: ignore[no-untyped-call]
            except BaseException:
                self._close_block(block, False, "")
                raise
            block.pushed = local.recorder = recorder
        local.recompute = policy is not None
        return block

    def _close_block(
        self, block: Block, ok: bool, where: str, error: BaseException | None = None
    ) -> None:
        """Pop the hooks; warn if nothing left the device (NOTE [ Is it working? ]).

        ``error``: what leaves the block, which ends the step (NOTE [ A step that raised ]).
        """
        try:
            quiet = local.quiet
            if block.quiet is not None and quiet is not None:  # NOTE [ Quiet blocks ]
                # The hooks back on top for the pop below, unless a keep()
                # region still open put them there: then the pop is of those.
                if not quiet.woken:
                    torch._C._autograd._push_saved_tensors_default_hooks(*quiet.hooks)
                quiet.open = quiet.woken = False
                local.quiet = None
            if block.outer_regions is not None:
                self._regions.restore()  # NOTE [ Modules kept whole ]
                local.regions, local.region_recorder = block.outer_regions
            if block.names is not None:
                local.names = None
                # The modules the profile named (NOTE [ Recording where a plan rebuilds ]).
                self._modules = dict(block.names.known)
            if block.pushed is not None:
                local.recorder = None
                block.pushed.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        finally:
            local.recompute = block.outer_recompute
            try:
                block.hooks.__exit__(None, None, None)
            finally:
                local.active -= 1
                buffers.use(-1)
        self._open -= 1
        keeps, local.keeps = local.keeps, block.outer_keeps or local.keeps
        alone = block.alone == self._opened  # none opened since, none open before
        self._next_quiet = self._repeatable(block, ok and alone and not keeps)
        if error is not None and self._step_blocks:  # an outer block: dropped already
            self._step_failed(out_of_memory(error))
        before = block.before
        if not ok or before is None or self._warned or self._manager.closed:
            return
        if self._manager.moved or (self._runner is not None and self._runner.room is not None):
            return  # under "auto", saves that fit the room stay: nothing to warn of
        message = (
            self._manager.pack_tally()
            .since(before)
            .nothing_moved(where, int(self.config.device_budget), self._min_bytes)
        )
        if message is not None:
            self._warned = True
            warnings.warn(TierstoreWarning(message), stacklevel=user_stacklevel())

    def _may_go_quiet(self, policy: Policy | None) -> bool:
        """Whether a block opening now may go quiet after its first save (NOTE [ Quiet blocks ])."""
        return (
            self._runner is None
            and policy is None
            and state.TOP_HOOKS is not None
            and not local.active
            and local.tier is None
            and local.recorder is None
            and local.region_recorder is None
            and state.TOP_HOOKS(False) is None
            and state.HOOKS_ENABLED()
            and not tracing()
        )

    def _repeatable(self, block: Block, ok: bool) -> Repeat | None:
        """What a quiet block may repeat of ``block``, which closed (NOTE [ Quiet blocks ])."""
        if not ok or block.first is None or self._manager.closed:
            return None
        grew = None
        if block.allocated is not None:
            device, then = block.allocated
            now = device_bytes(device)
            grew = None if now is None else now - then
        repeated = block.quiet
        if repeated is not None:
            # Its saves cannot be seen; on CUDA the memory forward left can.
            if grew is not None and repeated.grew is not None:
                return None if grew > repeated.grew * GREW + (1 << 20) else repeated
            return repeated
        if block.before is None:
            return None
        tally = self._manager.pack_tally().since(block.before)
        return None if tally.moved else Repeat(block.first, tally, grew)

    @never_traced
    def _pack_first(
        self, block: Block, t: torch.Tensor
    ) -> Handle | Kept | tuple[torch.Tensor, int] | Recipe:
        """The pack hook until a block's first save: the block goes quiet, or on as ever.

        NOTE [ Quiet blocks ].
        """
        if block.first is not None:  # decided; a compiled graph hands its saves over at once
            return (t.detach(), t._version) if block.quiet is not None else self._pack(t)
        nbytes = sized(t, self._min_bytes)
        if nbytes == "layout":  # nested or sparse: no plain shape, and never repeated
            block.first = (object(),)
        else:
            block.first = (block.where, t.shape, t.dtype, t.device, nbytes)
            allocated = device_bytes(t.device)
            if allocated is not None:
                block.allocated = t.device, allocated
        top = state.TOP_HOOKS(False) if state.TOP_HOOKS is not None else None
        if top is None or top[0] is not block.hooks.pack_hook:
            return self._pack(t)  # called other than from the top of the stack
        autograd = torch._C._autograd
        autograd._pop_saved_tensors_default_hooks()
        quiet = self._quiet
        if (
            quiet is not None
            and quiet.first == block.first
            and local.tier is None
            and self._manager.stayed_as_before(quiet.tally)
        ):
            local.quiet = Quiet((self._pack, self._unpack))
            block.quiet, self._quiet = quiet, None  # one quiet block a step
            self._quiet_steps += 1
            return (t.detach(), t._version)
        autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self._quiet_steps = 0
        return self._pack(t)

    def _step_ended(self) -> None:
        """NOTE [ Step log ]; with activation_budget, the plan's turn (NOTE [ Planned saves ])."""
        if self._runner is not None and self._runner.backward_raised():
            self._step_failed(self._hooks.short_of)  # NOTE [ A step that raised ]
            return
        # NOTE [ Quiet blocks ]: only a step of one block is repeated, and
        # one in every MEASURED_EVERY is measured all the same.
        repeat = self._step_blocks == 1 and self._quiet_steps < MEASURED_EVERY - 1
        self._quiet = self._next_quiet if repeat else None
        self._next_quiet, self._step_blocks = None, 0
        self._step_unpacks = self._hooks.unpacks
        self._hooks.short_of = None  # raised in a backward that was run again, and ended
        self._steps += 1
        self._manager.step_ended()
        if self._runner is not None and not self._manager.closed:
            line, said = self._manager.plan_step_ended()
            if line is not None:
                log.info("%s", line)
            for message in said:
                warnings.warn(TierstoreWarning(message), stacklevel=user_stacklevel())
        if not log.isEnabledFor(logging.INFO) or self._manager.closed:
            return
        now = self._manager.stats()
        kind = _KINDS[self._runner.step_kind] if self._runner is not None else ""
        log.info("%s", step_summary(self._steps, now, self._logged, kind))
        self._logged = now

    def _step_failed(self, excess: int | None) -> None:
        """The step under way raised: dropped (NOTE [ A step that raised ]).

        ``excess``: what an out-of-memory error asked for; ``None``: another error.
        """
        self._quiet = self._next_quiet = None
        self._step_blocks = 0
        self._step_unpacks = self._hooks.unpacks
        self._hooks.short_of = None
        if self._manager.closed:
            return
        line, said = self._manager.step_failed(excess)
        if line is not None:
            log.info("%s", line)
        for message in said:
            warnings.warn(TierstoreWarning(message), stacklevel=user_stacklevel())

    def plan(self, timeout: float = PLAN_TIMEOUT_S) -> Plan | None:
        """The plan ``activation_budget`` runs on; ``None`` before a profile ended.

        The store's first step warms up, the second is profiled, and the
        profile ends where the third step begins: the plan is made there,
        and the third step waits for it up to the profiled step's time
        (NOTE [ The first plan ] in planning/checker.py). Called while the
        first plan is being made, this waits for it, up to ``timeout``
        seconds; once any plan exists it never waits (a callback may call it
        every step). A plan is kept per shape of step: this is the one the
        latest step followed or was profiled for. ``str()`` of it is a
        table: per module, the bytes kept, offloaded and rebuilt and the
        predicted exposed time, then the step's predicted time and peak
        beside the measured ones, ``-`` until a step ran on it (NOTE
        [ Planned steps ] in planning/runner.py).
        ``None`` without ``activation_budget``, before a profiled step
        ended, and where the first plan took longer than ``timeout``.

        Args:
            timeout: the most seconds to wait for the first plan.

        Example:
            >>> import torch, tierstore
            >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
            ...                             torch.nn.Linear(256, 256))
            >>> store = tierstore.TierStore(tierstore.TierConfig(
            ...     activation_budget=0.5, min_offload_bytes=0))
            >>> for step in range(3):
            ...     with store.offload():
            ...         loss = model(torch.randn(512, 256)).square().mean()
            ...     loss.backward()
            ...     print(store.plan() is None)
            True
            True
            False
            >>> str(store.plan()).splitlines()[0].split()
            ['module', 'kept', 'offloaded', 'rebuilt', 'exposed']
            >>> store.close()
        """
        runner = self._runner
        return runner.plan_now(timeout) if runner is not None else None

    def stats(self) -> Stats:
        """Bytes per tier now and at peak, entries, and what moved.

        After :meth:`close` it returns the final figures (totals and peaks
        as they were, nothing held now) rather than raising, so a summary
        can be printed once the loop is over.

        Example:
            >>> import torch, tierstore
            >>> store = tierstore.TierStore(tierstore.TierConfig(
            ...     device_budget=0, host_budget="1MiB", disk_budget=0, min_offload_bytes=0))
            >>> x = torch.ones(256, requires_grad=True)
            >>> with store.offload():
            ...     y = x.exp()
            >>> store.stats().tiers["host"].bytes
            1024
            >>> y.sum().backward(); store.close()
            >>> host = store.stats().tiers["host"]
            >>> host.bytes, host.peak_bytes
            (0, 1024)
        """
        runner = self._runner
        planned = runner.planned_steps if runner is not None else 0
        return replace(self._manager.stats(), steps=self._steps, planned_steps=planned)

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
        try:
            if self._hooks.unpacks != self._step_unpacks and not self._manager.closed:
                self._step_ended()  # the last step's line (NOTE [ Step log ])
        finally:
            self._regions.remove()
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


_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.abspath(contextlib.__file__),
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by our caller point at user code."""
    frame = sys._getframe(2)  # the caller of the function that warns
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def resolved_config(config: object, overrides: dict[str, Any], where: str) -> TierConfig:
    checked = _checked(config, where)
    if checked is None:
        return load_config(**overrides)
    return with_overrides(checked, overrides)
