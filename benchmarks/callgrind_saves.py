"""Instructions per saved tensor, counted by callgrind: what a row of ``bench overhead`` executes.

On a shared VM a step's time moves by more than the microseconds a save
costs; the instructions it executes do not. This runs ``bench overhead``'s
chain (200 ``Linear(64, 64)`` + GELU pairs, batch 32: 600 saves a step)
under one row's hooks: warm-up steps, then ``--steps`` steps inside
``functools.reduce``, the one C function callgrind is told to count in::

    valgrind --tool=callgrind --toggle-collect=functools_reduce \\
        --callgrind-out-file=/tmp/cg.kept python benchmarks/callgrind_saves.py kept

Rows: ``none``, ``identity``, ``floor`` (bench overhead's), ``kept``
(``device_budget="64GiB"``), ``kept-measured`` (the same store with no step
repeated: NOTE [ Quiet blocks ] in tierstore/autograd/quiet.py). A row's
instructions per save over no hooks: (its ``Collected`` less ``none``'s) /
(steps x 600). It takes about a minute and a half per row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tierstore import TierConfig, TierStore, TierstoreWarning
from tierstore.bench.overhead import _chain, _floor, _identity


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("row", choices=["none", "identity", "floor", "kept", "kept-measured"])
    p.add_argument("--steps", type=int, default=5, help="steps counted (default 5)")
    args = p.parse_args()
    warnings.simplefilter("ignore", TierstoreWarning)  # nothing leaves the device: intended
    torch.set_num_threads(1)
    store = TierStore(TierConfig(device_budget="64GiB", min_offload_bytes=0))
    if args.row == "kept-measured":
        store._may_go_quiet = lambda policy: False  # type: ignore[method-assign]
    rows: dict[str, Callable[[], Any]] = {
        "none": contextlib.nullcontext,
        "identity": _identity,
        "floor": _floor,
    }
    ctx = rows.get(args.row, store.offload)
    model, x = _chain(200, 64), torch.randn(32, 64)

    def step(*_: object) -> None:
        with ctx():
            y = model(x)
        y.sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    functools.reduce(step, range(args.steps), None)
    store.close()


if __name__ == "__main__":
    main()
