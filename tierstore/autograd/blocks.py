"""One offload() block's state, and the recorder it pushes for rebuilds.

Example:
    >>> from tierstore.autograd.blocks import Block, active_recorder
    >>> Block(None).first is None, active_recorder() is None
    (True, True)
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.autograd.recorder import Recorder
from tierstore.autograd.state import local
from tierstore.stats import PackTally

if TYPE_CHECKING:  # annotations only: those modules read this one
    from tierstore.autograd.names import ModuleNames
    from tierstore.autograd.quiet import Repeat
    from tierstore.autograd.regions import Regions


class Block:
    """One entered offload block: its hooks, its first tally (or ``None``), its recompute state."""

    __slots__ = (
        "allocated",
        "alone",
        "before",
        "first",
        "hooks",
        "names",
        "outer_keeps",
        "outer_recompute",
        "outer_regions",
        "pushed",
        "quiet",
        "where",
    )

    hooks: saved_tensors_hooks  # set once made: a quiet block's first pack hook holds the block

    def __init__(self, before: PackTally | None) -> None:
        self.before = before
        # NOTE [ Quiet blocks ]: what its first save was (None: none yet, or a
        # block that may not go quiet); the block it repeats, if its hooks are off.
        self.first: tuple[Any, ...] | None = None
        self.quiet: Repeat | None = None
        self.outer_keeps = False
        self.alone = 0  # the store's blocks opened so far, if no other was open; else 0
        self.where: tuple[str, int] = ("", 0)  # the code that opened it
        # Its first save's device, and the bytes allocated there as it was made (CUDA).
        self.allocated: tuple[torch.device, int] | None = None
        self.pushed: Recorder | None = None
        self.outer_recompute = False
        # NOTE [ Recording where a plan rebuilds ]: what the block's regions replaced.
        self.outer_regions: tuple[Regions | None, Recorder | None] | None = None
        self.names: ModuleNames | None = None


# NOTE [ Recompute in blocks ]
# One Recorder per thread (a dispatch mode is thread-local), pushed by the
# outermost block that asks for recompute and popped when that block ends;
# an inner block that asks for it uses the one already recording. Whether a
# save may become a recipe is the innermost block's choice (local.recompute),
# as its hooks are the ones that run. Not in a block entered while make_fx or
# a FakeTensorMode traces, nor while compiled autograd is on: its graph
# unpacks saved tensors itself and must get today's handles.


_PROXY, _FAKE = torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FAKE


def tracing() -> bool:
    """Whether make_fx or a FakeTensorMode is tracing (NOTE [ Recompute in blocks ])."""
    mode = torch._C._get_dispatch_mode
    return mode(_PROXY) is not None or mode(_FAKE) is not None


def active_recorder() -> Recorder | None:
    """The thread's recorder, when the innermost offload() block asks for recompute.

    In a planned block that records in regions, their recorder also outside
    them: a save is often packed by the module after the one that made it
    (NOTE [ Recording where a plan rebuilds ]).
    """
    recorder = local.recorder if local.recompute else local.region_recorder
    if recorder is None:
        return None
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region):
        return None
    return recorder
