"""A hard memory limit for a child process: a memory cgroup of its own, made and removed here.

``tierstore bench train --memory-limit`` and the tests that need a real
limit run a command in a fresh child cgroup under this process's own
(cgroup v2 ``memory.max``, or v1 ``memory.limit_in_bytes``), as a
container's limit is: the kernel charges the child's memory to it, and
kills the child (SIGKILL) when reclaim cannot keep it below the limit.
:func:`why_no_memory_limit` says, as a sentence, why none can be made here
(not root, no memory controller, no writable cgroup); :func:`run_limited`
runs a command under one and reports its exit status, whether the kernel
killed it for memory, and its peak; :class:`MemoryCgroup` is the cgroup
itself, for a caller that reads the child's output as it runs.

NOTE [ A cgroup per limited run ]
* One child cgroup per run, named after this process's pid and a counter
  (``tierstore-<pid>-<n>``), under this process's own memory cgroup (read
  from ``/proc/self/cgroup``): it stays inside whatever limit a container
  already sets, and leaves sibling cgroups alone.
* Swap does not hide the limit: v2 sets ``memory.swap.max`` to 0, v1 sets
  ``memory.memsw.limit_in_bytes`` (memory plus swap) to the same limit
  where the kernel has it.
* The child joins the cgroup before it runs anything (a ``preexec_fn``
  writes its pid to ``cgroup.procs``), so its whole life is charged, and
  every process it starts (torchrun's ranks) joins it too.
* Killed for memory means the cgroup's own count of OOM kills rose
  (v2 ``memory.events`` ``oom_kill``, v1 ``memory.oom_control``
  ``oom_kill``); where a v1 kernel has no such count, a SIGKILL with the
  limit hit (``memory.failcnt`` above 0).
* The cgroup is removed when the run ends, however it ends (an exception,
  Ctrl-C): any process still in it is one this run started, and is killed
  by pid first, since a cgroup with processes cannot be removed.

Example:
    >>> import sys
    >>> from tierstore.bench.memory_limit import run_limited, why_no_memory_limit
    >>> if why_no_memory_limit() is None:
    ...     run = run_limited([sys.executable, "-c", "print('ok')"], 256 << 20)
    ...     print(run.returncode, run.oom_killed, run.stdout.strip())
    ... else:
    ...     print(0, False, "ok")
    0 False ok
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tierstore.errors import TierstoreError

__all__ = ["LimitedRun", "MemoryCgroup", "run_limited", "why_no_memory_limit"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: How long closing waits for the processes left in a cgroup to exit once killed.
_DRAIN_S = 10.0
_names = itertools.count()


@dataclass(frozen=True)
class _Layout:
    """Where this process's memory cgroup is, and which interface it speaks."""

    path: Path  # this process's own memory cgroup
    version: int  # 1 or 2


@dataclass(frozen=True)
class LimitedRun:
    """What :func:`run_limited` saw: exit status, a kill for memory, the peak, the output.

    ``returncode`` is negative for a signal, as :mod:`subprocess` reports it
    (``-9``: SIGKILL). ``peak_bytes`` is the cgroup's peak charge (anonymous
    memory and page cache of every process in it), ``None`` where the kernel
    does not keep one (v2 before 5.19).

    Example:
        >>> LimitedRun(-9, True, 104857600, "", "").oom_killed
        True
    """

    returncode: int
    oom_killed: bool
    peak_bytes: int | None
    stdout: str
    stderr: str


def _own_cgroups() -> dict[str, str]:
    """``/proc/self/cgroup`` as {controller or '' for v2: path}."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
    return out


def _find_layout() -> _Layout | str:
    """This process's memory cgroup, or why there is none."""
    try:
        own = _own_cgroups()
    except OSError as exc:
        return f"/proc/self/cgroup cannot be read ({exc.strerror}): not Linux, or no cgroups"
    if "memory" in own:
        path = _CGROUP_ROOT / "memory" / own["memory"].lstrip("/")
        if (path / "memory.limit_in_bytes").exists():
            return _Layout(path, 1)
        return f"the cgroup v1 memory controller is not mounted at {path.parent}"
    if "" in own:
        path = _CGROUP_ROOT / own[""].lstrip("/")
        controllers = path / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return _Layout(path, 2)
        return f"the memory controller is not enabled in the cgroup v2 hierarchy at {path}"
    return "this process is in no memory cgroup (/proc/self/cgroup has no memory line)"


def why_no_memory_limit() -> str | None:
    """Why no memory limit can be set for a child here, as a sentence; ``None`` where one can.

    One can where this process runs as root and its own memory cgroup (v1
    or v2) is writable; on v2 its ``cgroup.subtree_control`` must also hand
    the memory controller to children (NOTE [ A cgroup per limited run ]).

    Example:
        >>> why = why_no_memory_limit()
        >>> why is None or why.startswith("no memory limit can be set here: ")
        True
    """
    why = _why_not()
    return None if why is None else f"no memory limit can be set here: {why}"


def _why_not() -> str | None:
    if not hasattr(os, "geteuid"):
        return "cgroups are Linux's"
    if os.geteuid() != 0:
        return f"this process runs as uid {os.geteuid()}, not root, and cgroups need root"
    layout = _find_layout()
    if isinstance(layout, str):
        return layout
    if not os.access(layout.path, os.W_OK):
        return f"{layout.path}, this process's memory cgroup, is not writable (read-only mount)"
    if layout.version == 2:
        control = layout.path / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            try:
                control.write_text("+memory")
            except OSError as exc:
                return (
                    f"{control} does not hand the memory controller to child cgroups, and "
                    f"enabling it failed ({exc.strerror}: a cgroup v2 with processes in it "
                    "cannot have children with controllers)"
                )
    return None


class MemoryCgroup:
    """A fresh memory cgroup with a hard limit, under this process's own; removed on close.

    Start a process in it with ``preexec_fn=cgroup.enter`` (the child joins
    before it runs anything), or move one in with :meth:`add`. See
    NOTE [ A cgroup per limited run ].

    Args:
        limit_bytes: the hard limit (memory, and memory plus swap).

    Raises:
        TierstoreError: no cgroup can be made here (:func:`why_no_memory_limit`).

    Example:
        >>> import subprocess, sys
        >>> if why_no_memory_limit() is None:
        ...     with MemoryCgroup(256 << 20) as cgroup:
        ...         child = [sys.executable, "-c", "pass"]
        ...         code = subprocess.run(child, preexec_fn=cgroup.enter, check=False).returncode
        ...     print(code, cgroup.path.exists())
        ... else:
        ...     print(0, False)
        0 False
    """

    def __init__(self, limit_bytes: int) -> None:
        why = why_no_memory_limit()
        if why is not None:
            raise TierstoreError(f"tierstore: {why}")
        layout = _find_layout()
        assert isinstance(layout, _Layout)  # why_no_memory_limit checked it
        self.version = layout.version
        self.limit_bytes = limit_bytes
        self.path = layout.path / f"tierstore-{os.getpid()}-{next(_names)}"
        self.path.mkdir()
        try:
            self._set_limit(limit_bytes)
            self._oom_kills_before = self._oom_kills()
        except BaseException:
            self.path.rmdir()
            raise
        self._procs = str(self.path / "cgroup.procs")

    def _set_limit(self, limit: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            return
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # set after memory's: v1 keeps memsw >= memory
            memsw.write_text(str(limit))

    def enter(self) -> None:
        """Move the calling process into the cgroup: a ``preexec_fn`` for :mod:`subprocess`."""
        with open(self._procs, "w") as f:
            f.write(str(os.getpid()))

    def add(self, pid: int) -> None:
        """Move the process ``pid`` into the cgroup (its later charges count here)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def peak_bytes(self) -> int | None:
        """The cgroup's peak charge so far; ``None`` where the kernel keeps none."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except FileNotFoundError:
            return None

    def _counter(self, name: str, key: str) -> int | None:
        for line in (self.path / name).read_text().splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
        return None

    def _oom_kills(self) -> int | None:
        if self.version == 2:
            return self._counter("memory.events", "oom_kill")
        return self._counter("memory.oom_control", "oom_kill")

    def oom_killed(self, returncode: int | None = None) -> bool:
        """Whether the kernel killed a process of the cgroup for memory since it was made.

        Args:
            returncode: the child's exit status, for a v1 kernel that counts no
                OOM kills (then: a SIGKILL with the limit hit).
        """
        kills = self._oom_kills()
        if kills is not None and self._oom_kills_before is not None:
            return kills > self._oom_kills_before
        failed = int((self.path / "memory.failcnt").read_text()) if self.version == 1 else 0
        return returncode == -signal.SIGKILL and failed > 0

    def close(self) -> None:
        """Kill what is left in the cgroup (processes this run started), then remove it."""
        if not self.path.exists():
            return
        deadline = time.monotonic() + _DRAIN_S
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise TierstoreError(
                    f"tierstore: the memory cgroup {self.path} still holds processes "
                    f"{pids} {_DRAIN_S:.0f} s after they were killed; remove it by hand "
                    "once they exit"
                )
            time.sleep(0.01)
        deadline = time.monotonic() + _DRAIN_S
        while True:  # the last exit may still be being torn down: EBUSY for a moment
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def run_limited(
    argv: Sequence[str],
    limit_bytes: int,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    on_start: Callable[[subprocess.Popen[str]], None] | None = None,
) -> LimitedRun:
    """Run ``argv`` to its end in a fresh memory cgroup of ``limit_bytes``; the cgroup is removed.

    Args:
        argv: the command.
        limit_bytes: the hard limit (NOTE [ A cgroup per limited run ]).
        env: the child's environment (default: this process's).
        cwd: the child's working directory.
        timeout: seconds before the child is killed and ``TimeoutExpired``
            raised (the cgroup is removed all the same).
        on_start: called with the started process (tests: its pid).

    Returns:
        The exit status, whether the kernel killed it for memory, the
        cgroup's peak, and the output.

    Raises:
        TierstoreError: no cgroup can be made here (:func:`why_no_memory_limit`).
        subprocess.TimeoutExpired: the child ran past ``timeout``.

    Example:
        >>> import sys
        >>> touch = [sys.executable, "-c", "bytearray(300 << 20)"]
        >>> if why_no_memory_limit() is None:
        ...     run = run_limited(touch, 100 << 20)
        ...     print(run.returncode, run.oom_killed)
        ... else:
        ...     print(-9, True)
        -9 True
    """
    with MemoryCgroup(limit_bytes) as cgroup:
        with subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            preexec_fn=cgroup.enter,  # noqa: PLW1509  (the child joins before it runs)
        ) as proc:
            if on_start is not None:
                on_start(proc)
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                proc.kill()
                proc.communicate()
                raise
        return LimitedRun(
            proc.returncode, cgroup.oom_killed(proc.returncode), cgroup.peak_bytes(), out, err
        )
