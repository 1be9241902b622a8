"""Scratch directories of the ``tierstore`` command, removed at the end and on SIGTERM.

The demo and the benchmarks write under a private directory each. A normal
end, or an exception, removes it through ``finally``; SIGTERM (``kill``, a job
scheduler) would end Python without running any ``finally``.

NOTE [ SIGTERM ]
Raising SystemExit from the signal handler is not a safe way to run that
cleanup: Python runs the handler wherever the main thread is, and (tried)
an exit raised inside a saved tensor's ``weakref.finalize`` is dropped by
Python, while one raised inside ``concurrent.futures`` while it holds a
future's lock leaves the I/O thread waiting on that lock forever. So while
:func:`removed_on_sigterm` is active the handler raises nothing: it removes
every live scratch directory (the stores' spill files are inside) and
leaves with ``os._exit(143)``. Spill directories the command did not create
(a store given the user's ``--dir`` as ``disk_path``) are left to the sweep
of the next store there, as after SIGKILL.

Example:
    >>> import os
    >>> from tierstore.bench.scratch import scratch_dir
    >>> with scratch_dir("tierstore-example-") as path:
    ...     (path / "data").write_bytes(b"x")
    1
    >>> os.path.exists(path)
    False
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["make_scratch_dir", "remove_scratch_dir", "removed_on_sigterm", "scratch_dir"]

# The live scratch directories, in creation order (a dict as an ordered set).
_live: dict[str, None] = {}


def make_scratch_dir(prefix: str, root: str | os.PathLike[str] | None = None) -> Path:
    """Create a private directory under ``root`` (the temp dir by default) and track it.

    Pair with :func:`remove_scratch_dir`; :func:`scratch_dir` does both.

    Example:
        >>> from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
        >>> path = make_scratch_dir("tierstore-example-")
        >>> path.is_dir()
        True
        >>> remove_scratch_dir(path)
    """
    path = tempfile.mkdtemp(prefix=prefix, dir=root)
    _live[path] = None
    return Path(path)


def remove_scratch_dir(path: str | os.PathLike[str]) -> None:
    """Remove a directory made by :func:`make_scratch_dir` and stop tracking it. Idempotent.

    Example:
        >>> from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir
        >>> path = make_scratch_dir("tierstore-example-")
        >>> remove_scratch_dir(path); remove_scratch_dir(path)
        >>> path.exists()
        False
    """
    key = os.fspath(path)
    shutil.rmtree(key, ignore_errors=True)
    _live.pop(key, None)


@contextlib.contextmanager
def scratch_dir(prefix: str, root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A tracked private directory for the ``with`` block, removed when it ends.

    Example:
        >>> from tierstore.bench.scratch import scratch_dir
        >>> with scratch_dir("tierstore-example-") as path:
        ...     path.is_dir()
        True
    """
    path = make_scratch_dir(prefix, root)
    try:
        yield path
    finally:
        remove_scratch_dir(path)


def _remove_all_and_exit(signum: int, _frame: object) -> None:
    for path in list(_live):
        # Other threads still run: should one add a file while the tree goes,
        # the next pass takes it (for at most a second).
        for _ in range(100):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break
            time.sleep(0.01)
    os._exit(128 + signum)


@contextlib.contextmanager
def removed_on_sigterm() -> Iterator[None]:
    """While active, SIGTERM removes every scratch directory and exits with status 143.

    NOTE [ SIGTERM ] says why it raises nothing. Does nothing off the main
    thread, or where the caller has installed its own SIGTERM handler.

    Example:
        >>> from tierstore.bench.scratch import removed_on_sigterm, scratch_dir
        >>> with removed_on_sigterm(), scratch_dir("tierstore-example-") as path:
        ...     pass  # a SIGTERM here would remove path and exit with 143
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _remove_all_and_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
