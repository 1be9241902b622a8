"""The planning process's program: the pure planner alone, neither torch nor the package.

:class:`~tierstore.planning.process.PlanningProcess` runs this file by its
path (``python -I worker.py``), so that a start costs an interpreter and
the planner, not ``import tierstore`` (whose ``__init__`` imports torch).
Run so, it loads the planner's pure modules (:data:`PURE_MODULES`) from
beside it, by path, each under its full name; imported as part of the
package (tests, type checks) it imports them. It reads a profile and a
budget as JSON lines and writes each plan's choices and figures back, one
line each, until its input closes. JSON, not pickle: nothing tierstore reads can run code
(tests/test_security.py). NOTE [ Planning off the training thread ] in
planning/checker.py says why plans are made in a process.

Example:
    >>> import io, json
    >>> from tierstore.planning import worker
    >>> save = {"nbytes": 1000, "op": "aten.mm", "module": "m", "forward_s": 0.0,
    ...         "use_s": 0.0, "inputs": [], "made_in": []}
    >>> profile = {"saves": [save], "forward_s": 1.0, "backward_s": 1.0, "other_s": 0.0,
    ...            "write_bytes_per_s": 1e9, "read_bytes_per_s": 1e9, "window_bytes": 1000}
    >>> out = io.StringIO()
    >>> worker.serve([json.dumps({"profile": profile, "budget": 10})], out)
    >>> json.loads(out.getvalue())["floor_bytes"]
    1000
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import IO, TYPE_CHECKING, Any

#: The planner's modules, each before those that import it: all pure (the
#: standard library and one another, by their full names).
PURE_MODULES = ("plan_types", "simulation", "planner")

if TYPE_CHECKING or __package__:
    from tierstore.planning import planner, simulation
else:  # run by path: the modules beside this file, without the package above them
    for _name in PURE_MODULES:
        _spec = importlib.util.spec_from_file_location(
            f"tierstore.planning.{_name}",
            os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{_name}.py"),
        )
        _module = importlib.util.module_from_spec(_spec)
        # Before it runs: its dataclasses look it up, and a later module's
        # "from tierstore.planning.<name> import" finds it here, importing no package.
        sys.modules[_spec.name] = _module
        _spec.loader.exec_module(_module)
    planner = sys.modules["tierstore.planning.planner"]
    simulation = sys.modules["tierstore.planning.simulation"]

__all__ = ["PLAN_FIELDS", "PURE_MODULES", "main", "plan_of", "serve"]

#: The figures of a plan sent back, beside its choices (the profile stays with the caller).
PLAN_FIELDS = (
    "choices",
    "window_bytes",
    "predicted_step_s",
    "predicted_peak_bytes",
    "floor_bytes",
    "exposed_s",
)


def plan_of(request: dict[str, Any]) -> dict[str, Any]:
    """The plan for one request (``{"profile": fields, "budget": bytes}``), as JSON's values.

    Example:
        >>> from tierstore.planning.worker import plan_of
        >>> save = {"nbytes": 1000, "op": "aten.mm", "module": "m", "forward_s": 0.0,
        ...         "use_s": 0.0, "inputs": [], "made_in": []}
        >>> profile = {"saves": [save], "forward_s": 1.0, "backward_s": 1.0, "other_s": 0.0,
        ...            "write_bytes_per_s": 1e9, "read_bytes_per_s": 1e9, "window_bytes": 1000}
        >>> plan_of({"profile": profile, "budget": 1 << 20})["choices"]
        ('keep',)
    """
    fields = dict(request["profile"])
    saves = tuple(
        planner.Save(**{**save, "inputs": tuple(save["inputs"]), "made_in": tuple(save["made_in"])})
        for save in fields.pop("saves")
    )
    plan = planner.make_plan(planner.Profile(saves=saves, **fields), request["budget"])
    return {name: getattr(plan, name) for name in PLAN_FIELDS}


def serve(lines: Iterable[str], out: IO[str], answered: Callable[[], None] = lambda: None) -> None:
    """Answer each request line with its plan's line, flushed, until ``lines`` ends.

    ``answered`` is called after the first answer.

    Example:
        >>> import io
        >>> from tierstore.planning.worker import serve
        >>> out = io.StringIO()
        >>> serve([], out)  # its input closed: nothing to answer
        >>> out.getvalue()
        ''
    """
    first = True
    for line in lines:
        out.write(json.dumps(plan_of(json.loads(line))) + "\n")
        out.flush()
        if first:
            first = False
            answered()


def _lower_priority() -> None:
    with contextlib.suppress(OSError):
        os.nice(10)


def main() -> None:
    """The process's life: no yields, stdin's requests answered on stdout.

    At the training's priority until the first plan, which the step after
    the profile waits for; at a lower one after it (NOTE [ The first plan ]
    in planning/checker.py): later plans are made while the steps go on.

    Example:
        >>> from tierstore.planning.worker import main
        >>> callable(main)  # run as ``python -I worker.py``; it reads stdin until it closes
        True
    """
    simulation.YIELD_BETWEEN_SIMULATIONS = False  # nothing else runs here
    serve(sys.stdin, sys.stdout, _lower_priority)


if __name__ == "__main__":
    main()
