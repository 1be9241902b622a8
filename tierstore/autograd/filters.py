"""What stays on the device: the filters every save passes, and the kept save's packed form.

Example:
    >>> import torch
    >>> from tierstore.autograd.filters import offload_nbytes
    >>> offload_nbytes(torch.ones(256), min_bytes=0), offload_nbytes(torch.ones(2), 1024)
    (1024, 'min_offload_bytes')
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any

import torch

from tierstore.autograd.state import local, unrecorded
from tierstore.codec import span_nbytes
from tierstore.stats import Placement

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
#   * everything saved inside tierstore.keep() (tier="device", the default).
# Buffers cannot be told from inputs by looking at a tensor (register_buffer
# stores a plain tensor), so see NOTE [ Buffer watch ].

# NOTE [ Buffer watch ]
# A global buffer-registration hook, installed when tierstore is imported,
# keeps a weak set of the modules that register a buffer (torch calls it from
# register_buffer and from assigning to a buffer attribute). When the first
# offload() block opens, the storages of those modules' buffers, as they are
# then, are noted (Module.to() and .cuda() replace buffers without
# registering them); pack looks a saved tensor's storage up there, and the
# notes are dropped when the last block closes. A buffer registered while a
# block is open (a cache grown in forward) is noted at once. This sees the
# buffers a torch.compile'd graph saves, too: the graph runs on the real ones.
# Not a global forward hook, which noted the buffers of each module that ran:
# torch.compile(module) warns at every call while any global forward hook
# exists (in the user's code, for a hook that is ours), and Dynamo inlines
# such a hook into every module call it traces. Not seen: buffers of modules
# built before tierstore was imported, unless offload_module() wraps them (it
# watches its module's tree); saved, they are offloaded: a wasted copy, exact
# gradients.

# NOTE [ Version check of kept saves ]
# Eager autograd raises if a saved tensor was modified in place before
# backward. Under saved_tensors_hooks PyTorch leaves that check to the hooks,
# so tierstore does it: a kept save carries its version at pack and unpack
# compares it; a stored one is checked by the tier manager (NOTE [ Version
# check ] in tiers/entry.py).


class BufferWatch:
    """Storages of module buffers while any offload() block is open (NOTE [ Buffer watch ])."""

    def __init__(self) -> None:
        self.storages: weakref.WeakSet[Any] = weakref.WeakSet()
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._users = 0

    def registered(self, module: torch.nn.Module, name: str, buffer: Any) -> None:
        """The buffer-registration hook: returns None, so torch keeps the buffer as given."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            self._add(module)
            if self._users and isinstance(buffer, torch.Tensor):
                self.storages.add(buffer.untyped_storage())

    def watch(self, module: torch.nn.Module) -> None:
        """Watch ``module`` and its submodules, whenever their buffers were registered."""
        with self._lock:
            for m in module.modules():
                if m._buffers:
                    self._add(m)
            if self._users:
                self._note_all()

    def _add(self, module: torch.nn.Module) -> None:
        # A module class with __eq__ and no __hash__: its buffers go unseen (a
        # wasted copy if saved); a user's register_buffer must not fail.
        with contextlib.suppress(TypeError):
            self._modules.add(module)

    def use(self, delta: int) -> None:
        """``delta`` blocks open (+1) or close (-1): the first notes buffers, the last forgets."""
        with self._lock:
            self._users += delta
            if delta > 0 and self._users == delta:  # the first block opens
                self._note_all()
            elif not self._users:
                self.storages.clear()

    def _note_all(self) -> None:
        for module in list(self._modules):
            for buf in module._buffers.values():
                if isinstance(buf, torch.Tensor):
                    self.storages.add(buf.untyped_storage())


buffers = BufferWatch()
torch.nn.modules.module.register_module_buffer_registration_hook(buffers.registered)


@functools.cache
def placeholders() -> tuple[type, ...]:
    """Tracing placeholders (FakeTensor, FunctionalTensor): looked up once."""
    return (
        torch._subclasses.fake_tensor.FakeTensor,
        torch._subclasses.functional_tensor.FunctionalTensor,
    )


def offload_nbytes(t: torch.Tensor, min_bytes: int) -> int | Placement:
    """Bytes ``t`` rests in once offloaded, or why it stays on the device.

    See NOTE [ What stays on the device ].
    """
    nbytes = sized(t, min_bytes)
    if type(nbytes) is not int:
        return nbytes
    return unusual(t) or nbytes


# Looked up once: every save asks (NOTE [ Saves that stay ] in tiers/manager.py).
_TENSOR, _PARAMETER, _STRIDED = torch.Tensor, torch.nn.Parameter, torch.strided


def sized(t: torch.Tensor, min_bytes: int) -> int | Placement:
    """The checks every save pays: a parameter, a layout with no plain bytes, or its size.

    A save that stays by device_budget needs no more (NOTE [ Saves that stay ]
    in tiers/manager.py): whatever :func:`unusual` would say, it stays.
    """
    if type(t) is not _TENSOR:
        return "parameter" if isinstance(t, _PARAMETER) else "layout"
    base = t._base  # early: nn.Linear saves weight.t() at every call
    # type() first: isinstance() with Parameter's metaclass costs 0.3 us, and
    # most views saved are of plain activations.
    if base is not None and type(base) is not _TENSOR and isinstance(base, _PARAMETER):
        return "parameter"
    if t.layout is not _STRIDED or t.is_nested:
        return "layout"
    nbytes: int = t.nbytes if t.is_contiguous() else span_nbytes(t)
    if nbytes < min_bytes:
        return "min_offload_bytes"
    return nbytes


def unusual(t: torch.Tensor) -> Placement | None:
    """Why a plain-sized ``t`` still stays: no storage, no data, lazy bits, or a buffer."""
    if t._is_zerotensor() or t.is_meta or t.is_conj() or t.is_neg() or t.is_quantized:
        return "layout"
    if buffers.storages and t.is_leaf and t.untyped_storage() in buffers.storages:
        return "parameter"
    return None


class Kept:
    """A saved tensor left on the device, with its version for the check at unpack.

    ``planned``: bytes a plan kept, counted in its peak until the first use
    (NOTE [ Saves that stay ] in tiers/manager.py); 0 otherwise.
    """

    __slots__ = ("__weakref__", "planned", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, planned: int = 0) -> None:
        self.tensor = tensor
        self.version = version
        self.planned = planned


def kept_as_is(t: torch.Tensor, planned: int = 0) -> Kept | tuple[torch.Tensor, int]:
    """``t`` kept as it is; told to the thread's recorder if one runs (its detach not recorded).

    With no recorder and nothing for a plan's peak, a bare (alias, version)
    pair: a tuple is built in C, a Kept in Python (NOTE [ Saves that stay ]
    in tiers/manager.py).
    """
    if local.region_recorder is None and not local.recompute:  # no recorder: the usual way
        if not planned:
            return (t.detach(), t._version)
        return Kept(t.detach(), t._version, planned)
    kept = Kept(unrecorded(t.detach), t._version, planned)
    recorder = local.recorder if local.recompute else local.region_recorder
    if recorder is not None:
        recorder.note_packed(t, kept, None)
    return kept


def held(packed: object) -> tuple[torch.Tensor, int] | None:
    """The tensor and version a packed object keeps on the device as it is, else ``None``.

    Only the pack hook's own forms: another hook's tuple (``save_on_cpu``'s
    device and tensor, under a block nested in ours) is not one.
    """
    if type(packed) is tuple:
        if len(packed) == 2 and type(packed[1]) is int and isinstance(packed[0], torch.Tensor):
            return packed
        return None
    if type(packed) is Kept:
        return packed.tensor, packed.version
    return None
