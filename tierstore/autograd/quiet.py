"""Quiet blocks: a step that repeats one whose saves all stayed runs without the hooks.

Example:
    >>> import torch
    >>> from tierstore.autograd.quiet import device_bytes
    >>> device_bytes(torch.device("cpu")) is None   # only CUDA's allocator is read
    True
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any, NamedTuple

import torch

from tierstore.autograd import state
from tierstore.autograd.state import local
from tierstore.stats import PackTally


class Quiet:
    """A quiet block's hooks, off the stack (NOTE [ Quiet blocks ]).

    ``woken``: a keep() region put them back on top; ``open``: the block is.
    """

    __slots__ = ("hooks", "open", "woken")

    def __init__(self, hooks: tuple[Any, Any]) -> None:
        self.hooks = hooks
        self.open = True
        self.woken = False


def woken() -> Quiet | None:
    """A keep() region begins: a quiet block's hooks back on for it (NOTE [ Quiet blocks ]).

    Only where nothing was pushed over the block since (an inner offload()
    or a checkpoint takes the saves, as it would over the store's hooks).
    """
    local.keeps = True
    quiet = local.quiet
    if (
        quiet is None
        or quiet.woken
        or not quiet.open
        or state.TOP_HOOKS(False) is not None  # type: ignore[misc]
        or not state.HOOKS_ENABLED()
    ):
        return None
    torch._C._autograd._push_saved_tensors_default_hooks(*quiet.hooks)
    quiet.woken = True
    return quiet


def asleep(quiet: Quiet | None) -> None:
    """A keep() region ends: the hooks :func:`woken` put back come off, if still ours to pop."""
    if quiet is not None and quiet.woken:
        quiet.woken = False
        if quiet.open:  # else the block's close took them off
            torch._C._autograd._pop_saved_tensors_default_hooks()


# NOTE [ Quiet blocks ]
# A save that stays still costs a decision and a count in Python (NOTE
# [ Saves that stay ] in tiers/manager.py), most of a small step's time. A step
# that repeats one whose saves all stayed needs neither, so after its first
# save it runs without the store's hooks, as a module a plan keeps whole does
# (NOTE [ Modules kept whole ]). The rules:
#   1. Only a block nothing else needs the hooks for may go quiet: the
#      outermost offload() block of its thread, no plan, no recorder, no
#      keep() region open, nothing beneath it on autograd's stack of hooks
#      (an outer checkpoint's or user's hooks would take the saves), no
#      tracing, and a torch that can read the stack. It begins with a pack
#      hook of its own (TierStore._pack_first).
#   2. Its first save decides. It goes quiet only if it repeats a measured
#      block: the step before was that one block, which ran alone, moved
#      nothing, ran no keep() region and did not grow (rule 5); this block
#      opens at the same line (opened_at) and its first save has the same
#      shape, dtype, device and size or reason to stay (never a nested or
#      sparse one); and that block's bytes fit QUIET_ROOM times in the room
#      device_budget leaves. Then its saves count as that block's did
#      (TierManager.stayed_as_before) and the hooks come off the stack.
#   3. Otherwise the store's own hooks take over for the rest of the block,
#      which is measured for the next step. One step in MEASURED_EVERY is
#      measured all the same, and at most one block a step goes quiet.
#   4. A keep() region inside a quiet block puts the hooks back on top for
#      its length (its tier is theirs to carry out) where nothing was pushed
#      over the block since; that block is not repeated. The block's close
#      puts the hooks back for its own pop unless such a region did.
#   5. On CUDA the allocator's allocated bytes at the first save and at the
#      close say what forward left: a block that left GREW times the
#      measured one's (and a MiB) is not repeated.
#   6. The first save's unpack counts a backward (NOTE [ Step log ]).
# Autograd holds a quiet block's saves as it does without tierstore, so an
# in-place change raises autograd's own error, and retain_graph, double
# backward and threads are autograd's own. What rule 2 takes on trust is
# that a block opened at the same line with the same first save saves what
# the measured block saved; saves that differ behind the same first save (a
# decoder growing behind a fixed encoder, routed experts) stay on the
# device, as autograd would keep them, for at most MEASURED_EVERY - 1 steps
# (on CUDA one step once forward leaves GREW times the memory). A backward
# that never reaches the first save ends no step: the next block is the
# step's second and is measured.

#: NOTE [ Quiet blocks ]: of the steps that could repeat the one before, one
#: in this many is measured all the same.
MEASURED_EVERY = 16
#: NOTE [ Quiet blocks ]: a quiet block whose device memory grew past the
#: measured block's by this factor (and a MiB) is not repeated.
GREW = 1.25


class Repeat(NamedTuple):
    """A measured block, as a quiet one repeats it (NOTE [ Quiet blocks ])."""

    first: tuple[Any, ...]  # where it was opened and its first save
    tally: PackTally  # what its saves came to
    grew: int | None  # the device memory its forward left allocated; None off CUDA


def device_bytes(device: torch.device) -> int | None:
    """Bytes the caching allocator holds allocated on ``device``; ``None`` off CUDA."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


#: tierstore's own files, and contextlib's: no frame of them opened a block
#: (NOTE [ Quiet blocks ]).
_OWN_FILES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), contextlib.__file__)


def opened_at() -> tuple[str, int]:
    """The file and line of the code that opened an offload() block (NOTE [ Quiet blocks ]).

    The first frame outside tierstore and contextlib: offload_module's and
    the trainer callbacks' blocks are opened where their module is called.
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame = frame.f_back
    return ("", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)
