"""The private spill directory a disk backend keeps its files in.

NOTE [ Spill directory lifecycle ]

A backend's files live in one directory of its own, ``<root>/<prefix><pid>-<random>``
(``<root>/<prefix>rank<R>-<pid>-<random>`` under a distributed launcher: ``RANK``,
as torchrun sets it, else ``LOCAL_RANK``), mode 0700, files 0600. The rank
only comes after the prefix, so the sweep below treats every rank's
directories alike: it removes those of dead processes of any rank, and no
live one, since liveness is the lock, not the name.

The directory goes away on ``close()``, and at interpreter exit through a
``weakref.finalize`` (which runs from ``atexit``) for a store nobody closed.

A process killed with SIGKILL, or by the OOM killer, runs neither, so every
new :class:`SpillDir` first sweeps ``root`` for directories left by dead
processes. Liveness is an ``flock`` on ``<dir>/.lock``, held by the owner for
the life of the directory: the kernel drops it when the owner dies, however
it dies, and unlike a pid check it cannot be fooled by pid reuse. A sweep
removes a directory only when it can take that lock itself.

Races the sweep has to survive:

* A directory still being set up has no ``.lock`` yet. The owner creates the
  lock file under a temporary name, locks it, and only then renames it to
  ``.lock``, so a ``.lock`` that can be locked always means a dead owner; a
  directory without one is never touched. (A process killed inside that
  window of a few system calls leaves a directory no sweep removes; that is
  the price of never removing a live one.)
* Two sweepers: the one that holds the lock removes the directory; the other
  fails to take the lock and moves on, or finds the directory already gone.
* ``fork()``: a child shares the parent's lock (same open file description),
  so the directory stays alive while either lives; only the creating process
  removes the directory at exit, a forked child just drops its copy of the fd.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path

from tierstore.errors import ConfigError

__all__ = ["SpillDir"]

_LOCK_NAME = ".lock"
_LOCK_TMP_NAME = ".lock-setup"


def _rank_part() -> str:
    """``"rank<R>-"`` under a distributed launcher, else ``""``.

    ``R`` is ``RANK`` (the global rank, which torchrun sets), else
    ``LOCAL_RANK`` for a launcher that sets only that; a value that is not a
    number is ignored. Ranks on one machine share ``disk_path``; the rank in
    the name tells their directories apart at a glance. Each is private to
    its process anyway (0700, flock-owned), so no rank ever reads another's
    files. Read from the environment: this layer knows nothing of
    ``torch.distributed``.
    """
    for var in ("RANK", "LOCAL_RANK"):
        rank = os.environ.get(var, "")
        if rank.isascii() and rank.isdigit():
            return f"rank{int(rank)}-"
    return ""


def _remove(path: str, lock_fd: int, owner_pid: int) -> None:
    # Runs from close() or at interpreter exit; must never raise.
    try:
        if os.getpid() == owner_pid:
            # The lock is held until the tree is gone, so no sweeper can see a
            # half-removed directory as stale and race us on it.
            shutil.rmtree(path, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(lock_fd)  # closing the last fd on the file releases the flock


def _make_dirs(root: Path) -> None:
    # Path.mkdir(parents=True) gives the parents default permissions; every
    # directory we create gets 0700 (the umask can only narrow it).
    missing: list[Path] = []
    p = root
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by someone else meanwhile
            os.mkdir(d, 0o700)


def _sweep_stale(root: Path, prefix: str) -> int:
    """Remove the spill directories of dead processes; returns how many."""
    removed = 0
    uid = os.getuid()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0  # best effort: creating our own directory reports the real problem
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue  # symlinks, files and other users' directories are never ours
        try:
            fd = os.open(
                os.path.join(entry.path, _LOCK_NAME),
                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
            )
        except OSError:
            continue  # no lock file: still being set up, or not ours
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # the owner is alive
            if os.fstat(fd).st_uid != uid:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed += 1
        finally:
            os.close(fd)
    return removed


class SpillDir:
    """A private directory for one backend's files, removed when done with.

    See ``NOTE [ Spill directory lifecycle ]`` in this module: the directory
    is mode 0700, its files 0600; it is removed by :meth:`close` and at
    interpreter exit, and a directory left behind by a process that died is
    removed by the next :class:`SpillDir` made under the same ``root``.

    Args:
        root: The directory to create the spill directory in
            (``TierConfig.disk_path``). Created, mode 0700, if missing.
        prefix: The start of the spill directory's name; directories under
            ``root`` with this prefix are swept for stale ones.

    Raises:
        ConfigError: ``root`` is not a directory, or no directory can be
            created in it.

    Example:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> from tierstore.backends._spill import SpillDir
        >>> spill = SpillDir(Path(tempfile.mkdtemp()))
        >>> oct(spill.path.stat().st_mode & 0o777)
        '0o700'
        >>> fd = spill.open_file("data.bin", os.O_RDWR | os.O_CREAT)
        >>> os.close(fd)
        >>> spill.close()
        >>> spill.path.exists()
        False
    """

    removed_stale: int
    """How many stale directories of dead processes this instance removed."""

    def __init__(self, root: Path, prefix: str = "tierstore-") -> None:
        root = Path(root)
        try:
            _make_dirs(root)
            if not root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
            self.removed_stale = _sweep_stale(root, prefix)
            path = tempfile.mkdtemp(prefix=f"{prefix}{_rank_part()}{os.getpid()}-", dir=root)
        except OSError as e:
            raise ConfigError(
                f"tierstore: cannot create a spill directory under disk_path='{root}': {e}; "
                "set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
            ) from e
        try:
            lock_fd = self._take_lock(path)
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise ConfigError(
                f"tierstore: cannot create a spill directory under disk_path='{root}': {e}; "
                "set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
            ) from e
        self._path = Path(path)
        self._finalizer = weakref.finalize(self, _remove, path, lock_fd, os.getpid())

    @staticmethod
    def _take_lock(path: str) -> int:
        # Created, locked and only then renamed into place: see the NOTE.
        tmp = os.path.join(path, _LOCK_TMP_NAME)
        fd = os.open(
            tmp,
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(tmp, os.path.join(path, _LOCK_NAME))
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def path(self) -> Path:
        """The spill directory.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> spill.path.name.startswith("tierstore-")
            True
            >>> spill.close()
        """
        return self._path

    @property
    def closed(self) -> bool:
        """Whether the directory has been removed.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> spill.close()
            >>> spill.closed
            True
        """
        return not self._finalizer.alive

    def file(self, name: str) -> Path:
        """The path of the file ``name`` inside the spill directory.

        Args:
            name: A plain file name, without any directory part.

        Raises:
            ValueError: ``name`` is empty, ``.``, ``..`` or contains a ``/``.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> spill.file("entries.bin").parent == spill.path
            True
            >>> spill.close()
        """
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"tierstore: {name!r} is not a plain file name")
        return self._path / name

    def open_file(self, name: str, flags: int) -> int:
        """Open the file ``name`` in the spill directory; returns the fd.

        The file is created mode 0600 when ``flags`` has ``os.O_CREAT``;
        ``O_NOFOLLOW`` and ``O_CLOEXEC`` are always added.

        Args:
            name: A plain file name.
            flags: ``os.open`` flags, e.g. ``os.O_RDWR | os.O_CREAT | os.O_EXCL``.

        Example:
            >>> import os, tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> fd = spill.open_file("x", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            >>> oct(os.fstat(fd).st_mode & 0o777)
            '0o600'
            >>> os.close(fd)
            >>> spill.close()
        """
        return os.open(self.file(name), flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        """Remove the directory and everything in it, then drop the lock.

        Idempotent: calling it again does nothing.

        Example:
            >>> import tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> spill.close()
            >>> spill.close()
        """
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"SpillDir('{self._path}', {state})"
