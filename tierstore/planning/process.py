"""The planning process: plans made in a process of its own, off the training thread.

:class:`PlanningProcess` starts ``worker.py`` by its path: an interpreter
and the pure planner, neither torch nor the package, so a start stays
cheap. The profile goes in and the plan comes out as JSON lines (NOTE
[ Planning off the training thread ] in planning/checker.py says why a
process).

Example:
    >>> from tierstore.planning.planner import Profile, Save
    >>> from tierstore.planning.process import PlanningProcess
    >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
    >>> worker = PlanningProcess()
    >>> worker.plan(p, 1 << 20).choices
    ('keep',)
    >>> worker.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
from typing import IO, Any

from tierstore.planning.planner import Plan, Profile

__all__ = ["WORKER", "PlanningProcess"]

# NOTE [ The planning process's life ]
# The planning process runs in a session of its own (start_new_session):
# Ctrl-C in a terminal signals the terminal's foreground process group, and
# the training process alone must get it, as a KeyboardInterrupt it may
# catch; a worker in the same group would die with a traceback, and the
# plan in flight with it. The worker reads requests from its stdin until it
# closes, so it ends when its parent does, however the parent ends (the
# kernel closes the pipe even after a SIGKILL). close() ends it at once.
# No finalizer ends it (NOTE [ Finalizers and interrupts ] in
# tierstore/tiers/release.py): a PlanningProcess collected unclosed drops
# its pipes, and the worker sees the end of its input. The pipe to the
# worker's stdin is the PlanningProcess's, not its Popen's: CPython keeps
# the Popen of a child still running (subprocess._active, to reap it
# later), which would keep that pipe open, and the worker with it, for as
# long as the training process runs. An exchange cut
# short by an interrupt on the thread that waits for it ends the process,
# so that its late answer is never read as the next request's: the next
# plan starts another.

#: The planning process's program, run by its path (``python -I WORKER``):
#: the planner module beside it alone, without the package's ``__init__``
#: (which imports torch).
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")

#: Profile fields the planning process is not sent (the planner reads none).
_HOOKS_ONLY = ("stays_in", "stored_in", "between_s")


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields by name, as they are: no deep copy.

    ``dataclasses.asdict`` deep-copies every save, on a thread that holds
    the interpreter lock the training thread needs.
    """
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}


class PlanningProcess:
    """A process of its own that makes plans.

    NOTE [ Planning off the training thread ] in planning/checker.py says why.

    Started on first use; :meth:`close` ends it (idempotent). ``plan`` blocks
    the calling thread, not the interpreter: it waits on a pipe.

    Example:
        >>> from tierstore.planning.planner import Profile, Save
        >>> from tierstore.planning.process import PlanningProcess
        >>> p = Profile((Save(1000, "aten.mm", "m", 0.0, 0.0),), 1.0, 1.0, 0.0, 1e9, 1e9, 1000)
        >>> worker = PlanningProcess()
        >>> worker.plan(p, 10).floor_bytes
        1000
        >>> worker.close(); worker.close()
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        # Its stdin's pipe, ours alone (NOTE [ The planning process's life ]).
        self._requests: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the process now, ahead of its first plan (NOTE [ The first plan ]).

        Example:
            >>> from tierstore.planning.process import PlanningProcess
            >>> worker = PlanningProcess()
            >>> worker.start(); worker.start()  # one process: the second finds it running
            >>> worker.close()
        """
        with self._lock:
            if not self._closed:
                self._running()

    def _running(self) -> subprocess.Popen[bytes]:
        """The process, started where none runs (under the lock)."""
        process = self._process
        if process is None or process.poll() is not None:
            if process is not None:
                _end(process, self._requests)  # one that ended: its pipes, before another's
            process = self._process = _start()
            self._requests, process.stdin = process.stdin, None
        return process

    def plan(self, profile: Profile, budget: int) -> Plan:
        """``make_plan(profile, budget)``, made in the planning process."""
        with self._lock:
            if self._closed:
                raise RuntimeError("tierstore: the planning process was closed")
            process = self._running()
            requests = self._requests
            assert requests is not None and process.stdout is not None
            fields = _fields(profile, _HOOKS_ONLY)  # not the hooks layer's
            fields["saves"] = [_fields(save) for save in profile.saves]
            request = {"profile": fields, "budget": budget}
            try:
                requests.write(json.dumps(request).encode() + b"\n")
                requests.flush()
                line = process.stdout.readline()
            except BaseException:
                # Ctrl-C mid-exchange: its answer would be read as the next
                # request's. NOTE [ The planning process's life ].
                self._process = self._requests = None
                _end(process, requests)
                raise
            if not line:
                raise RuntimeError("tierstore: the planning process ended without a plan")
            made = json.loads(line)
        return Plan(
            profile=profile,
            choices=tuple(made["choices"]),
            budget_bytes=budget,
            window_bytes=made["window_bytes"],
            predicted_step_s=made["predicted_step_s"],
            predicted_peak_bytes=made["predicted_peak_bytes"],
            floor_bytes=made["floor_bytes"],
            exposed_s=tuple(made["exposed_s"]),
        )

    def close(self) -> None:
        """End the process. Idempotent."""
        self._closed = True
        process, self._process = self._process, None
        requests, self._requests = self._requests, None
        if process is not None:
            _end(process, requests)


def _start() -> subprocess.Popen[bytes]:
    """A planning process: NOTE [ The planning process's life ]."""
    return subprocess.Popen(
        [sys.executable, "-I", WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
        start_new_session=True,
    )


def _end(process: subprocess.Popen[bytes], requests: IO[bytes] | None) -> None:
    """Close a planning process's pipes (``requests``: its stdin's) and end it.

    At ``close``, for one that ended, or for one an interrupt cut short.
    """
    for pipe in (requests, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    if process.poll() is None:
        process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
