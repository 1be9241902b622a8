"""This thread's hook state, and the handles on autograd's engine that the hooks read.

Every module of the autograd boundary reads the thread's state
(:data:`local`): the tier a keep() region asks for, the recorder, the open
planned block's regions, a quiet block's hooks. :func:`unrecorded` runs
tierstore's own ops inside a hook without the recorder seeing them.

Example:
    >>> from tierstore.autograd.state import local, unrecorded
    >>> local.tier is None, unrecorded(max, 1, 2)
    (True, 2)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from tierstore.stats import Tier

if TYPE_CHECKING:  # annotations only: those modules read this one
    from tierstore.autograd.names import ModuleNames
    from tierstore.autograd.quiet import Quiet
    from tierstore.autograd.recorder import Recorder
    from tierstore.autograd.regions import Regions

_R = TypeVar("_R")

#: Reads the top of autograd's stack of saved-tensor hooks; ``None`` on a torch
#: that cannot. Readers look it up here at call time (``state.TOP_HOOKS``), so
#: one assignment changes every reader.
TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

#: Autograd's engine: a final callback queued during a backward runs as it ends.
ENGINE = torch.autograd.Variable._execution_engine
#: The autograd graph task running on this thread, -1 outside backward (NOTE [ Like with like ]).
graph_task: Callable[[], int] = torch._C._current_graph_task_id
HOOKS_ENABLED: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)


class HookState(threading.local):
    """This thread's hook state.

    Class defaults: a missing attribute of a threading.local raises inside
    getattr, which costs a save microseconds.
    """

    tier: Tier | Literal["as is"] | None = None
    recompute = False
    recorder: Recorder | None = None
    names: ModuleNames | None = None  # a profiled block's (NOTE [ Naming modules ])
    active = 0
    # NOTE [ Recording where a plan rebuilds ]: the open planned block's regions
    # and the recorder they push.
    regions: Regions | None = None
    region_recorder: Recorder | None = None
    # Backward replays a checkpointed module here: the module's hooks of this
    # layer stand aside (NOTE [ Replayed modules ] in planning/planner.py).
    replaying = False
    # NOTE [ Quiet blocks ]: the store's hooks a quiet block took off, which a
    # keep() region inside it puts back; whether a keep() region ran.
    quiet: Quiet | None = None
    keeps = False


local = HookState()


def unrecorded(fn: Callable[..., _R], *args: Any) -> _R:
    """``fn(*args)``, tierstore's own ops in a hook: the recorder neither records nor times them.

    A profile timed the copies off the device as the step's compute. A
    function, not a context manager: kept parameters pay it on every save.
    """
    mode = local.recorder
    if mode is None:
        return fn(*args)
    mode.paused += 1
    try:
        return fn(*args)
    finally:
        mode.paused -= 1
