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
So do the directories the store made to reach ``root`` (``disk_path`` and
its missing parents), deepest first, each only while it is empty: ranks
share ``disk_path``, so it goes when the store that made it closes last, and
otherwise stays, empty (no other store can tell that a store, not the user,
made it).

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
  directory without one is never touched. An error or a Ctrl-C
  (KeyboardInterrupt) anywhere between the ``mkdir`` and the rename removes
  the directory again. (A process killed with SIGKILL inside that window of
  a few system calls leaves a directory no sweep removes; that is the price
  of never removing a live one.)
* Two sweepers: the one that holds the lock removes the directory; the other
  fails to take the lock and moves on, or finds the directory already gone.
* A store that made ``disk_path`` closes while another sets up under it: the
  other may find it there and then gone before its own directory is in it.
  Setup then starts over, making ``disk_path`` again (up to
  :data:`_ROOT_TRIES` times), rather than fail with a path that was valid.
* ``fork()``: a child shares the parent's lock (same open file description),
  so the directory stays alive while either lives; only the creating process
  removes the directory at exit, a forked child just drops its copy of the fd.

NOTE [ Spill directory on SIGTERM ]

A scheduler ends a job with SIGTERM, and Python's default action for it
kills the process at once: no ``close()``, no ``atexit``. A backend whose
files need their names while the store is open (LMDB opens its environment
by path) asks for its directory to go on SIGTERM too
(:meth:`SpillDir.remove_on_sigterm`): on first use, from the main thread
(the only one that may set a handler), tierstore chains a handler in front
of the one in place. It removes every such directory, then hands the signal
on: to the previous handler if it was a Python function (a trainer's own),
else with the default action (the handler is reset and the signal sent
again), so the exit status stays 143 (-15 to a parent). Where SIGTERM was
ignored, nothing is installed. Removing a directory under an open LMDB
environment unlinks its files, not the mapping: a handler of the user's that
goes on training still can, and the kernel frees the bytes when the process
ends. The handler goes back to the previous one as the last such directory
is closed, if it is still tierstore's (a handler set since stays). SIGINT
removes nothing: a caught ``KeyboardInterrupt`` trains on with the same
store. SIGKILL runs nothing: the next store's sweep removes the directory.
The ``file`` backend needs none of this (``NOTE [ File backend unlinked ]``).

NOTE [ Spill directory security ]

The threat is another local user who can write where ``root`` lives (``/tmp``,
a shared scratch disk) and plants something there first, to read the saved
activations, to make us write through a link into a file of theirs, or to
make a sweep delete what is not ours. So:

* ``root`` may be a symbolic link (``/scratch -> /mnt/nvme`` is legitimate)
  only if the link belongs to us or to root; another user's link is refused,
  not followed. The path is resolved once, and everything after works in the
  resolved directory, so swapping a link later moves nothing of ours. (Links
  among the ancestors of ``root`` are followed like the ancestors themselves:
  unchecked.)
* The resolved ``root`` must belong to us or to root: whoever owns a
  directory can rename or replace anything in it, sticky bit or not. It must
  not be writable by every user unless it is sticky (``/tmp`` is 1777): in a
  world-writable, non-sticky directory anyone can rename our directory away
  and put theirs in its place. Group write is allowed, for the user-private
  groups of a ``umask 002`` system; the ancestors of ``root`` are not
  checked.
* The private directory is always made by ``mkdir`` under a random name, so
  it never pre-exists: a name already taken (a planted symlink, another
  store's directory) is skipped, never followed or reused.
* Files inside are opened with ``O_NOFOLLOW`` (and ``O_EXCL`` when created),
  mode 0600.
* A sweep opens each candidate with ``O_DIRECTORY | O_NOFOLLOW`` (so never
  through a symlink), checks that the directory and its ``.lock`` (opened
  ``O_NOFOLLOW``, relative to that descriptor) are ours, and removes what is
  inside through the same descriptor: a directory renamed or swapped while
  the sweep runs cannot redirect the removal, and a symlink inside is
  unlinked, never followed.

Nothing is checked against the superuser: every check above trusts uid 0.

NOTE [ Spill directory in memory ]

The disk tier exists to take saved tensors out of memory. A ``root`` on a
filesystem that lives in RAM (tmpfs, ramfs: ``/dev/shm``, and ``/tmp`` on
many distributions, which is where the default ``disk_path`` points) turns
every byte spilled into a byte of memory again, and the page cache's at
that. That is not an error (it works, and a test or a machine with RAM to
spare may want it), so the store says it once, with a
:class:`~tierstore.TierstoreWarning` naming ``disk_path``, when it creates
its spill directory: once per store, since a store makes one. The
filesystem type comes from statfs(2) (``f_type``), which Python's
``os.statvfs`` does not expose; where it cannot be asked (not Linux, no
libc), nothing is said.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import signal
import stat
import sys
import threading
import warnings
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

from tierstore.errors import ConfigError, TierstoreWarning

__all__ = ["SpillDir", "memory_filesystem"]

_LOCK_NAME = ".lock"
_LOCK_TMP_NAME = ".lock-setup"

#: Random names tried for the private directory before giving up.
_NAME_TRIES = 100
#: Setups tried while ``disk_path`` vanishes under them: NOTE [ Spill directory lifecycle ].
_ROOT_TRIES = 3

_HINT = "set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
_OWN_HINT = "set disk_path (TIERSTORE_DISK_PATH) to a local directory you own"


#: statfs(2) ``f_type`` of the filesystems that live in memory (linux/magic.h).
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}

#: Bytes enough for any ``struct statfs`` (120 on 64-bit Linux); ``f_type`` comes first.
_STATFS_BYTES = 256


def memory_filesystem(path: str | os.PathLike[str]) -> str | None:
    """``"tmpfs"`` or ``"ramfs"`` if ``path`` is on a filesystem in RAM, else ``None``.

    ``None`` too where statfs(2) cannot be asked (not Linux) or fails.

    Example:
        >>> import os
        >>> from tierstore.backends._spill import memory_filesystem
        >>> memory_filesystem("/proc") is None  # procfs: not where bytes rest
        True
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has it
        return None
    statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if statfs(os.fsencode(path), buf) != 0:
        return None
    # f_type is a long on 64-bit Linux and an int on 32-bit: read the word, keep 32 bits.
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return _MEMORY_FILESYSTEMS.get(f_type)


def _warn_if_in_memory(root: Path, resolved: Path) -> None:
    """NOTE [ Spill directory in memory ]: one TierstoreWarning when ``resolved`` is in RAM."""
    kind = memory_filesystem(resolved)
    if kind is None:
        return
    where = f"disk_path='{root}'" if resolved == root else f"disk_path='{root}' (-> '{resolved}')"
    warnings.warn(
        TierstoreWarning(
            f"tierstore: {where} is on {kind}, a filesystem in memory: the disk tier there "
            "takes RAM for every byte it holds and frees none; set disk_path "
            "(TIERSTORE_DISK_PATH) to a directory on a local disk"
        ),
        stacklevel=3,
    )


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


def _remove(path: str, lock_fd: int, owner_pid: int, made: tuple[str, ...] = ()) -> None:
    # Runs from close() or at interpreter exit; must never raise.
    try:
        if os.getpid() == owner_pid:
            # The lock is held until the tree is gone, so no sweeper can see a
            # half-removed directory as stale and race us on it.
            shutil.rmtree(path, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            os.close(lock_fd)  # closing the last fd on the file releases the flock
    if os.getpid() == owner_pid:
        _unmake_dirs(made)


def _make_dirs(root: Path) -> tuple[str, ...]:
    """Create ``root`` and its missing parents, mode 0700; returns those it made, deepest first.

    Path.mkdir(parents=True) gives the parents default permissions; every
    directory made here gets 0700 (the umask can only narrow it).
    """
    missing: list[Path] = []
    p = root
    while not os.path.lexists(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    made: list[str] = []
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by someone else meanwhile
            os.mkdir(d, 0o700)
            made.append(str(d))
    return tuple(reversed(made))


def _unmake_dirs(made: tuple[str, ...]) -> None:
    """Remove the directories :func:`_make_dirs` made, deepest first, while they are empty.

    NOTE [ Spill directory lifecycle ]: other ranks' stores may share them.
    """
    for d in made:
        try:
            os.rmdir(d)  # only an empty directory: never another store's files
        except OSError:
            return  # in use, or gone: its parents hold it, or are not ours to judge


def _random_name() -> str:
    """The random part of a private directory's name: 12 lowercase hex digits."""
    return secrets.token_hex(6)


def _make_private_dir(root: Path, stem: str) -> tuple[str, int]:
    """``mkdir <root>/<stem><random>``, mode 0700, with its lock; returns its path and the lock.

    A name already taken is skipped, whatever is there (``NOTE [ Spill
    directory security ]``): mkdir never follows a symlink or reuses an entry.
    Whatever stops it once the directory is made (an error, Ctrl-C) removes
    the directory: none is left without its ``.lock`` (NOTE [ Spill
    directory lifecycle ]).
    """
    for _ in range(_NAME_TRIES):
        path = os.path.join(root, stem + _random_name())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # someone else's: never touched
        except BaseException:  # Ctrl-C as mkdir returned, say
            _unmake_private_dir(path)
            raise
        try:
            return path, SpillDir._take_lock(path)
        except BaseException:
            _unmake_private_dir(path)
            raise
    raise FileExistsError(
        errno.EEXIST, f"{_NAME_TRIES} random names all taken", os.path.join(root, stem + "*")
    )


def _unmake_private_dir(path: str) -> None:
    """Remove a private directory whose setup failed: its lock files, then it.

    The name is random and was free a moment ago, so what is there is ours;
    rmdir removes only an empty directory all the same.
    """
    for name in (_LOCK_TMP_NAME, _LOCK_NAME):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _owner(uid: int) -> str:
    return "root" if uid == 0 else f"uid {uid}"


def _checked_root(root: Path) -> Path:
    """``root`` resolved, once it passes ``NOTE [ Spill directory security ]``.

    Raises:
        ConfigError: ``root`` is another user's symlink, resolves to another
            user's directory, or to a world-writable directory without the
            sticky bit.
        OSError: ``root`` cannot be looked at, or is not a directory.
    """
    me = os.geteuid()
    trusted = (me, 0)
    link = os.lstat(root)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        raise ConfigError(
            f"tierstore: disk_path='{root}' is a symbolic link owned by {_owner(link.st_uid)}, "
            f"not by you (uid {me}) or root, and is not followed; {_OWN_HINT}"
        )
    resolved = Path(os.path.realpath(root))
    st = os.stat(resolved)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(root))
    where = f"disk_path='{root}'" if resolved == root else f"disk_path='{root}' (-> '{resolved}')"
    if st.st_uid not in trusted:
        raise ConfigError(
            f"tierstore: {where} is owned by {_owner(st.st_uid)}, not by you (uid {me}) or "
            f"root, so its owner could read or replace the spill files; {_OWN_HINT}"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"tierstore: {where} is writable by every user and not sticky "
            f"(mode {stat.S_IMODE(st.st_mode):04o}), so another user could replace the "
            f"spill directory; make it sticky (chmod +t) or {_OWN_HINT}"
        )
    return resolved


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _clear(dir_fd: int) -> None:
    """Remove everything inside the directory open at ``dir_fd``, never following a link.

    Works from descriptors, not paths, so that renaming a directory on the
    way cannot point the removal somewhere else.
    """
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                _clear(sub)
            finally:
                os.close(sub)
            os.rmdir(entry.name, dir_fd=dir_fd)
        else:
            os.unlink(entry.name, dir_fd=dir_fd)  # a symlink goes, not its target


def _sweep_one(root_fd: int, name: str, uid: int) -> bool:
    """Remove ``<root>/<name>`` if it is our directory and its owner is dead."""
    try:
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return False  # a symlink (ELOOP), a file, gone meanwhile, or not readable
    try:
        if os.fstat(dir_fd).st_uid != uid:
            return False  # another user's directory is never ours
        try:
            lock_fd = os.open(_LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False  # no lock file: still being set up, or not a spill directory
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # the owner is alive
            if os.fstat(lock_fd).st_uid != uid:
                return False
            try:
                _clear(dir_fd)
                os.rmdir(name, dir_fd=root_fd)
            except OSError:
                return False  # another sweeper was faster, or something is in the way
            return True
        finally:
            os.close(lock_fd)
    finally:
        os.close(dir_fd)


def _sweep_stale(root: Path, prefix: str) -> int:
    """Remove the spill directories of dead processes; returns how many.

    See ``NOTE [ Spill directory lifecycle ]`` for liveness and ``NOTE [ Spill
    directory security ]`` for what is never touched.
    """
    uid = os.geteuid()
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return 0  # best effort: creating our own directory reports the real problem
    try:
        with os.scandir(root_fd) as it:
            names = [e.name for e in it if e.name.startswith(prefix)]
    except OSError:
        names = []
    try:
        return sum(_sweep_one(root_fd, name, uid) for name in names)
    finally:
        os.close(root_fd)


# NOTE [ Spill directory on SIGTERM ]: the directories to remove, by id, and
# the handler tierstore's replaced (None: none installed).
_on_term: dict[int, SpillDir] = {}
_term_previous: list[Any] = []


def _removed_on_term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: remove the directories that asked, then hand the signal on."""
    previous = _term_previous[0] if _term_previous else signal.SIG_DFL
    for spill in list(_on_term.values()):
        spill.close()  # the last one puts the previous handler back
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action: exit status 143
    os.kill(os.getpid(), signum)


def _install_on_term() -> None:
    """Chain :func:`_removed_on_term` in front of SIGTERM's handler, from the main thread."""
    if _term_previous or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return  # SIGTERM ends nothing: nothing to remove
    signal.signal(signal.SIGTERM, _removed_on_term)
    _term_previous.append(previous)


def _uninstall_on_term() -> None:
    """Put SIGTERM's previous handler back, if tierstore's is still in place."""
    if _on_term or not _term_previous:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # stays chained; the next close on the main thread restores it
    if signal.getsignal(signal.SIGTERM) is _removed_on_term:
        previous = _term_previous[0]
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    _term_previous.clear()


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

    ``root`` itself must pass the checks of ``NOTE [ Spill directory
    security ]``: a symbolic link only if it is yours (or root's), resolving
    to a directory that is yours (or root's) and, if every user may write
    to it, sticky. The spill directory is made in the resolved directory.

    Raises:
        ConfigError: ``root`` is not a directory, no directory can be
            created in it, or it fails a check of ``NOTE [ Spill directory
            security ]`` (another user's symlink or directory, or a
            world-writable directory without the sticky bit).

    Warns:
        TierstoreWarning: ``root`` is on a filesystem in memory (tmpfs,
            ramfs): ``NOTE [ Spill directory in memory ]``.

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
        root = Path(os.path.abspath(root))
        for tries_left in reversed(range(_ROOT_TRIES)):
            made: tuple[str, ...] = ()
            try:
                made = _make_dirs(root)
                path, lock_fd = self._make_in(root, prefix)
                break
            except BaseException as e:
                _unmake_dirs(made)  # Ctrl-C too: NOTE [ Spill directory lifecycle ]
                if isinstance(e, FileNotFoundError) and tries_left:
                    continue  # root removed by its maker's close meanwhile: the NOTE
                if not isinstance(e, OSError):
                    raise
                raise ConfigError(
                    f"tierstore: cannot create a spill directory under disk_path='{root}': "
                    f"{e}; {_HINT}"
                ) from e
        self._path = Path(path)
        self._finalizer = weakref.finalize(self, _remove, path, lock_fd, os.getpid(), made)

    def _make_in(self, root: Path, prefix: str) -> tuple[str, int]:
        """Sweep ``root`` and make this instance's directory in it: its path and lock fd."""
        # Resolved once: NOTE [ Spill directory security ].
        resolved = _checked_root(root)
        _warn_if_in_memory(root, resolved)
        self.removed_stale = _sweep_stale(resolved, prefix)
        return _make_private_dir(resolved, f"{prefix}{_rank_part()}{os.getpid()}-")

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
        _on_term.pop(id(self), None)
        self._finalizer()
        _uninstall_on_term()

    def remove_on_sigterm(self) -> None:
        """Remove the directory on SIGTERM too: ``NOTE [ Spill directory on SIGTERM ]``.

        The handler is installed from the main thread only; called from
        another, the directory is removed by a handler installed since, or
        not at all.

        Example:
            >>> import signal, tempfile
            >>> from pathlib import Path
            >>> from tierstore.backends._spill import SpillDir
            >>> spill = SpillDir(Path(tempfile.mkdtemp()))
            >>> spill.remove_on_sigterm()
            >>> signal.getsignal(signal.SIGTERM).__name__
            '_removed_on_term'
            >>> spill.close(); signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            True
        """
        if not self.closed:
            _on_term[id(self)] = self
            _install_on_term()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"SpillDir('{self._path}', {state})"
