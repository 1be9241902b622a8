"""The dotted names of the modules a profiled step's saves were made in.

Example:
    >>> from tierstore.autograd.names import ModuleNames
    >>> ModuleNames().running()    # outside any module's forward
    ''
"""

from __future__ import annotations

import os
import sys
import types
import weakref

import torch

from tierstore.autograd.state import local

# NOTE [ Naming modules ]
# A profile names the module of each save and of each op a rebuild replays,
# so a plan's table reads per block and a planned step can record inside the
# modules it rebuilds in (NOTE [ Recording where a plan rebuilds ]). The
# names come from the Python stack, read at those moments in the profiled
# step only: the frames of nn.Module's call path hold the modules whose
# forward is running, outermost first, and each is named by its path from
# the outermost one (GPT.blocks.3.attn: the class name of the root, then
# named_modules' path). Not module hooks: a global forward pre-hook (torch's
# ModuleTracker) makes torch.compile(module) warn at every call, and Dynamo
# traced into it and failed on a whole-model compile; per-module hooks would
# need the model, which offload() is not given. Where the stack shows no
# module (ops outside every module, or a whole compiled graph's saves handed
# over as it ends) the name is the outermost module's, or "".

#: The code objects of nn.Module's call path: a frame running one holds the module.
_CALL_CODES = frozenset(
    f.__code__
    for f in (torch.nn.Module._call_impl, getattr(torch.nn.Module, "_wrapped_call_impl", None))
    if f is not None
)


#: Where a compiled region's runtime lives: on the stack, its saves are handed over at its end.
_COMPILED_RUNTIME = f"{os.sep}_aot_autograd{os.sep}"


class ModuleNames:
    """The running modules' names, read off the stack (NOTE [ Naming modules ]).

    Example:
        >>> names = ModuleNames()
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.ModuleList([torch.nn.Identity()])
        ...     def forward(self, x):
        ...         return names.running()
        >>> Net()(torch.ones(1))
        'Net'
    """

    def __init__(self) -> None:
        self._trees: dict[int, tuple[weakref.ref[torch.nn.Module], dict[int, str]]] = {}
        #: Every module named so far, by name.
        self.known: dict[str, weakref.ref[torch.nn.Module]] = {}

    def _chain(self) -> tuple[list[torch.nn.Module], bool]:
        """The modules whose forward runs now, outermost first; and whether under compiled code.

        A compiled region's runtime on the stack hands its saves over as it ends.
        """
        chain: list[torch.nn.Module] = []
        compiled = False
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code in _CALL_CODES:
                module = frame.f_locals.get("self")
                if isinstance(module, torch.nn.Module):
                    # torch.compile's wrapper stands for the module it wraps.
                    inner = getattr(module, "_orig_mod", module)
                    if not chain or chain[-1] is not inner:
                        chain.append(inner)
            elif not compiled and _COMPILED_RUNTIME in code.co_filename:
                compiled = True
            frame = frame.f_back
        chain.reverse()
        return chain, compiled

    def _tree(self, root: torch.nn.Module) -> dict[int, str]:
        """Names of ``root``'s modules by id, made once per root."""
        held = self._trees.get(id(root))
        if held is not None and held[0]() is root:
            return held[1]
        top = type(root).__name__
        names: dict[int, str] = {}
        for path, m in root.named_modules():
            names[id(m)] = name = f"{top}.{path}" if path else top
            self.known.setdefault(name, weakref.ref(m))
        self._trees[id(root)] = (weakref.ref(root), names)
        return names

    def running(self) -> str:
        """The running module: the outermost numbered one (``GPT.blocks.3``), else a top one."""
        return self._name(self._chain()[0])

    def saving(self) -> tuple[str, str, bool]:
        """:meth:`running`, the outermost module's name, and whether compiled code hands it."""
        chain, compiled = self._chain()
        root = self._tree(chain[0]).get(id(chain[0]), "") if chain else ""
        return self._name(chain), root, compiled

    def _name(self, chain: list[torch.nn.Module]) -> str:
        if not chain:
            return ""
        tree = self._tree(chain[0])
        names = [tree.get(id(m), type(m).__name__) for m in chain]
        numbered = [n for n in names if n.rsplit(".", 1)[-1].isdigit()]
        if numbered:
            return min(numbered, key=len)
        top = [n for n in names if n.count(".") == 1]
        return min(top) if top else min(names, key=len)


def module_name() -> tuple[str, str, bool]:
    """The save's module in a profiled block (NOTE [ Naming modules ]), else "".

    And its outermost module (NOTE [ Modules kept whole ]), and whether a
    compiled region hands it over (NOTE [ A peak above the budget ] in planning/checker.py).
    """
    names = local.names
    return ("", "", False) if names is None else names.saving()
