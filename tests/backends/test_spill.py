"""The private spill directory: permissions, removal, stale sweeps, bad roots."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.backends import FileBackend, LmdbBackend, _spill
from tierstore.backends._spill import SpillDir
from tierstore.backends.base import Backend
from tierstore.errors import ConfigError, TierstoreError

HINT = "; set disk_path (TIERSTORE_DISK_PATH) to a writable local directory"
BACKENDS = [FileBackend, LmdbBackend]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def no_umask() -> Iterator[None]:
    """Umask 0, so only the modes tierstore asks for explicitly protect the files."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


def _first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        assert proc.stderr is not None
        pytest.fail(f"subprocess printed nothing; stderr:\n{proc.stderr.read()}")
    return line


# -- permissions and removal ---------------------------------------------------


def test_spill_dir_is_private_locked_and_removed_on_close(tmp_path: Path, no_umask: None) -> None:
    root = tmp_path / "a" / "b"
    spill = SpillDir(root)
    # Every directory tierstore creates is 0700, missing parents included.
    assert (_mode(tmp_path / "a"), _mode(root), _mode(spill.path)) == (0o700, 0o700, 0o700)
    assert spill.path.parent == root
    assert spill.path.name.startswith(f"tierstore-{os.getpid()}-")
    assert sorted(os.listdir(spill.path)) == [".lock"]
    lock = spill.path / ".lock"
    assert _mode(lock) == 0o600
    assert lock.read_text() == f"{os.getpid()}\n"
    # The lock is held: another open file description cannot take it.
    fd = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)

    fd = spill.open_file("data", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.close(fd)
    assert _mode(spill.file("data")) == 0o600
    assert repr(spill) == f"SpillDir('{spill.path}', open)"
    spill.close()
    assert spill.closed
    assert not spill.path.exists()
    assert os.listdir(tmp_path) == []  # a/ and a/b/, made for it, went with it
    spill.close()  # idempotent


def test_directories_made_for_it_stay_while_another_store_uses_them(tmp_path: Path) -> None:
    root = tmp_path / "made" / "spill"
    first, second = SpillDir(root), SpillDir(root)  # two ranks sharing disk_path
    first.close()
    assert os.listdir(root) == [second.path.name]  # still in use: stays
    second.close()
    assert os.listdir(tmp_path) == ["made"]  # made by the first; the second found it there
    (tmp_path / "kept").mkdir()
    SpillDir(tmp_path / "kept").close()
    assert sorted(os.listdir(tmp_path)) == ["kept", "made"]  # there before it: never removed


def test_a_store_set_up_while_the_maker_of_disk_path_closes_makes_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second finds disk_path there, then the first's close removes it
    # (empty) before the second's directory is in it: NOTE [ Spill directory
    # lifecycle ], setup starts over, and the second now made disk_path.
    root = tmp_path / "spill"
    first = SpillDir(root)
    checked = _spill._checked_root

    def maker_closes_first(path: Path) -> Path:
        first.close()
        return checked(path)

    monkeypatch.setattr(_spill, "_checked_root", maker_closes_first)
    second = SpillDir(root)
    assert os.listdir(root) == [second.path.name]
    second.close()
    assert os.listdir(tmp_path) == []


def test_an_interrupt_while_a_spill_dir_is_set_up_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C lands right after the lock file is made, before it is renamed
    # to .lock: the directory would be one no sweep ever removes.
    def interrupted(fd: int, operation: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_spill.fcntl, "flock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        SpillDir(tmp_path / "root")
    assert os.listdir(tmp_path) == []  # neither the spill directory nor the root made for it


def test_open_file_does_not_follow_symlinks(tmp_path: Path) -> None:
    spill = SpillDir(tmp_path)
    target = tmp_path / "outside"
    target.write_bytes(b"")
    os.symlink(target, spill.file("link"))
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        spill.open_file("link", os.O_RDWR)
    spill.close()
    assert target.exists()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b"])
def test_file_takes_plain_names_only(tmp_path: Path, name: str) -> None:
    spill = SpillDir(tmp_path)
    with pytest.raises(
        ValueError, match=re.escape(f"tierstore: {name!r} is not a plain file name")
    ):
        spill.file(name)
    spill.close()


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_backend_files_are_private(tmp_path: Path, no_umask: None, cls: type[Backend]) -> None:
    backend = cls(tmp_path, 1 << 20)
    backend.write(0, [b"x" * 10_000])
    modes = {str(p.relative_to(backend.directory)): _mode(p) for p in backend.directory.rglob("*")}
    assert _mode(backend.directory) == 0o700
    expected_files = {
        "file": {".lock": 0o600},  # entries.bin, unlinked once open, is 0600 too
        "lmdb": {
            ".lock": 0o600,
            "entries.lmdb": 0o700,
            "entries.lmdb/data.mdb": 0o600,
            "entries.lmdb/lock.mdb": 0o600,
        },
    }[cls.name]
    assert modes == expected_files
    if cls.name == "file":
        assert os.stat(backend.path).st_mode & 0o777 == 0o600  # through its descriptor
    backend.close()
    assert not backend.directory.exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["file", "lmdb"])
def test_spill_dir_removed_at_interpreter_exit(tmp_path: Path, name: str) -> None:
    proc = _spawn(
        """
        import sys
        from pathlib import Path
        from tierstore.backends import backend_class

        backend = backend_class(sys.argv[1])(Path(sys.argv[2]), 1 << 20)
        backend.write(1, [b"x" * 100])
        print(backend.directory, flush=True)
        # exits without close()
        """,
        name,
        str(tmp_path),
    )
    directory = Path(_first_line(proc))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert directory.parent == tmp_path
    assert not directory.exists()
    assert os.listdir(tmp_path) == []


def test_forked_child_does_not_remove_the_parents_directory(tmp_path: Path) -> None:
    spill = SpillDir(tmp_path)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            spill.close()  # what atexit would do in a child that exits normally
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert spill.path.is_dir()
    assert (spill.path / ".lock").exists()
    spill.close()
    assert not spill.path.exists()


# -- stale directories ---------------------------------------------------------

_HOLD_SPILL = """
    import sys
    from pathlib import Path
    from tierstore.backends._spill import SpillDir

    spill = SpillDir(Path(sys.argv[1]))
    print(spill.path, flush=True)
    sys.stdin.readline()
    """


def test_stale_dir_of_killed_process_is_removed_and_live_one_kept(tmp_path: Path) -> None:
    dead = _spawn(_HOLD_SPILL, str(tmp_path))
    live = _spawn(_HOLD_SPILL, str(tmp_path))
    try:
        dead_dir = Path(_first_line(dead))
        live_dir = Path(_first_line(live))
        (dead_dir / "entries.bin").write_bytes(b"left behind")
        dead.send_signal(signal.SIGKILL)
        dead.communicate(timeout=60)
        assert dead.returncode == -signal.SIGKILL
        assert dead_dir.is_dir()  # SIGKILL runs no cleanup

        spill = SpillDir(tmp_path)
        assert spill.removed_stale == 1
        assert not dead_dir.exists()
        assert live_dir.is_dir()
        assert sorted(os.listdir(tmp_path)) == sorted([live_dir.name, spill.path.name])

        # A second sweep finds nothing: our own and the live directory are locked.
        other = SpillDir(tmp_path)
        assert other.removed_stale == 0
        assert spill.path.is_dir()
        other.close()
        spill.close()
    finally:
        _, err = live.communicate("\n", timeout=60)
    assert live.returncode == 0, err
    assert not live_dir.exists()  # the live process cleaned up at exit
    assert os.listdir(tmp_path) == []


def _fake_dir(root: Path, name: str, *, lock: bool = True) -> Path:
    d = root / name
    d.mkdir(mode=0o700)
    if lock:
        (d / ".lock").write_text("999999\n")  # unlocked: its owner is gone
    (d / "entries.bin").write_bytes(b"data")
    return d


def test_sweep_removes_only_unlocked_dirs_of_ours(tmp_path: Path) -> None:
    stale = _fake_dir(tmp_path, "tierstore-1-abc")
    no_lock = _fake_dir(tmp_path, "tierstore-2-def", lock=False)
    other_prefix = _fake_dir(tmp_path, "other-3-ghi")
    target = _fake_dir(tmp_path, "elsewhere")
    link = tmp_path / "tierstore-4-link"
    link.symlink_to(target)
    plain_file = tmp_path / "tierstore-5-file"
    plain_file.write_bytes(b"")

    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 1
    assert not stale.exists()
    for kept in (no_lock, other_prefix, target, link, plain_file):
        assert os.path.lexists(kept), kept
    assert (target / "entries.bin").exists()
    spill.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another user")
def test_sweep_never_touches_other_users_dirs(tmp_path: Path) -> None:
    theirs = _fake_dir(tmp_path, "tierstore-1-theirs")
    for p in (theirs, theirs / ".lock", theirs / "entries.bin"):
        os.chown(p, 65534, 65534)
    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 0
    assert (theirs / "entries.bin").exists()
    spill.close()


def test_sweep_is_limited_to_the_prefix(tmp_path: Path) -> None:
    rank0 = _fake_dir(tmp_path, "tierstore-rank0-1-abc")
    rank1 = _fake_dir(tmp_path, "tierstore-rank1-1-abc")
    spill = SpillDir(tmp_path, prefix="tierstore-rank1-")
    assert spill.path.name.startswith(f"tierstore-rank1-{os.getpid()}-")
    assert spill.removed_stale == 1
    assert rank0.exists()
    assert not rank1.exists()
    spill.close()


# -- unusable roots --------------------------------------------------------------


def test_root_that_is_a_regular_file(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        SpillDir(root)
    assert str(info.value) == (
        f"tierstore: cannot create a spill directory under disk_path='{root}': "
        f"[Errno 20] Not a directory: '{root}'{HINT}"
    )
    assert isinstance(info.value.__cause__, NotADirectoryError)


def test_root_under_a_regular_file(tmp_path: Path) -> None:
    parent = tmp_path / "file"
    parent.write_bytes(b"")
    root = parent / "spill"
    with pytest.raises(ConfigError) as info:
        FileBackend(root, 1 << 20)
    assert str(info.value) == (
        f"tierstore: cannot create a spill directory under disk_path='{root}': "
        f"[Errno 20] Not a directory: '{root}'{HINT}"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_root_in_proc() -> None:
    with pytest.raises(ConfigError) as info:
        SpillDir(Path("/proc"))
    assert re.fullmatch(
        r"tierstore: cannot create a spill directory under disk_path='/proc': "
        r"\[Errno \d+\] [^;]+: '/proc/tierstore-\d+-\w+'" + re.escape(HINT),
        str(info.value),
    ), str(info.value)
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(
    ("env", "part"),
    [
        ({"RANK": "3"}, "rank3-"),
        ({"RANK": "3", "LOCAL_RANK": "1"}, "rank3-"),  # the global rank wins
        ({"LOCAL_RANK": "1"}, "rank1-"),
        ({"RANK": "007"}, "rank7-"),
        ({"RANK": "not-a-rank"}, ""),
        ({"RANK": "\u00b2"}, ""),  # a digit to str.isdigit, not a number
        ({"RANK": "", "LOCAL_RANK": "2"}, "rank2-"),
        ({}, ""),
    ],
)
def test_the_rank_is_in_the_name_under_a_distributed_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], part: str
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    spill = SpillDir(tmp_path)
    assert re.fullmatch(rf"tierstore-{part}{os.getpid()}-\w+", spill.path.name), spill.path.name
    spill.close()
    assert list(tmp_path.iterdir()) == []


def test_ranks_sweep_each_others_dead_dirs_and_never_a_live_one(tmp_path: Path) -> None:
    # Two ranks of a job share disk_path. Rank 0 is SIGKILLed; its restart
    # (a new process, RANK=0 again) removes the dead rank-0 directory, and
    # the sweep of rank 1's directory is stopped by its lock, not its name.
    dead = _spawn(_HOLD_SPILL, str(tmp_path), env={"RANK": "0"})
    live = _spawn(_HOLD_SPILL, str(tmp_path), env={"RANK": "1"})
    try:
        dead_dir = Path(_first_line(dead))
        live_dir = Path(_first_line(live))
        assert dead_dir.name.startswith(f"tierstore-rank0-{dead.pid}-")
        assert live_dir.name.startswith(f"tierstore-rank1-{live.pid}-")
        (live_dir / "entries.bin").write_bytes(b"rank 1 data")
        dead.send_signal(signal.SIGKILL)
        dead.communicate(timeout=60)
        assert dead_dir.is_dir()  # SIGKILL runs no cleanup

        restarted = _spawn(_HOLD_SPILL, str(tmp_path), env={"RANK": "0"})
        try:
            new_dir = Path(_first_line(restarted))
            assert new_dir.name.startswith(f"tierstore-rank0-{restarted.pid}-")
            assert not dead_dir.exists()
            assert (live_dir / "entries.bin").read_bytes() == b"rank 1 data"
            assert sorted(os.listdir(tmp_path)) == sorted([live_dir.name, new_dir.name])
        finally:
            _, err = restarted.communicate("\n", timeout=60)
        assert restarted.returncode == 0, err
    finally:
        _, err = live.communicate("\n", timeout=60)
    assert live.returncode == 0, err
    assert os.listdir(tmp_path) == []


# -- planted entries and untrusted roots (NOTE [ Spill directory security ]) ----

OWN_HINT = "; set disk_path (TIERSTORE_DISK_PATH) to a local directory you own"
NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="needs root to give a path to another user (uid 65534)"
)


def _names(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the spill directory's random part come out as ``names``, in order."""
    it = iter(names)
    monkeypatch.setattr(_spill, "_random_name", lambda: next(it))


def _tree(root: Path) -> dict[str, bytes | str]:
    """Everything under ``root``, without following links: file bytes, link targets, dirs."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


@pytest.mark.parametrize("planted", ["symlink", "dangling symlink", "directory", "file"])
def test_an_entry_planted_at_the_private_name_is_skipped_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs").write_bytes(b"not yours")
    name = root / f"tierstore-{os.getpid()}-planted"
    if planted == "symlink":
        name.symlink_to(outside)
    elif planted == "dangling symlink":
        name.symlink_to(tmp_path / "nowhere")
    elif planted == "directory":
        name.mkdir(mode=0o777)
    else:
        name.write_bytes(b"")
    before = _tree(tmp_path)
    _names(monkeypatch, "planted", "fresh")

    spill = SpillDir(root)
    assert spill.path == root / f"tierstore-{os.getpid()}-fresh"
    os.close(spill.open_file("entries.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL))
    assert sorted(os.listdir(spill.path)) == [".lock", "entries.bin"]
    spill.close()
    # Nothing was written through the planted entry, and it is still there.
    assert _tree(tmp_path) == before
    assert not (tmp_path / "nowhere").exists()


def test_no_free_private_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"tierstore-{os.getpid()}-taken").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(_spill, "_random_name", lambda: "taken")
    with pytest.raises(ConfigError) as info:
        SpillDir(tmp_path)
    assert str(info.value) == (
        f"tierstore: cannot create a spill directory under disk_path='{tmp_path}': "
        f"[Errno 17] 100 random names all taken: '{tmp_path}/tierstore-{os.getpid()}-*'{HINT}"
    )
    assert os.listdir(tmp_path) == [f"tierstore-{os.getpid()}-taken"]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_backend_does_not_follow_a_symlink_planted_at_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[Backend]
) -> None:
    # Only we (or root) can write in a 0700 spill directory; this plants the
    # link there the moment it is made, before the backend creates its file.
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    file_name = {"file": "entries.bin", "lmdb": "entries.lmdb"}[cls.name]
    make = _spill._make_private_dir

    def make_and_plant(root: Path, stem: str) -> tuple[str, int]:
        path, lock_fd = make(root, stem)
        os.symlink(target, os.path.join(path, file_name))
        return path, lock_fd

    monkeypatch.setattr(_spill, "_make_private_dir", make_and_plant)
    _names(monkeypatch, "planted")
    spill_dir = root / f"tierstore-{os.getpid()}-planted"
    # O_CREAT | O_EXCL | O_NOFOLLOW (file), or LMDB's own open: refused, not followed.
    opening = {"file": "cannot create the spill file", "lmdb": "cannot open an LMDB environment in"}
    with pytest.raises(TierstoreError) as info:
        cls(root, 1 << 20)
    assert str(info.value) == (
        f"tierstore: {opening[cls.name]} {spill_dir / file_name}: "
        f"[Errno 17] File exists: '{spill_dir / file_name}'{HINT}"
    )
    assert target.read_bytes() == b"keep me"
    assert os.listdir(root) == []  # the spill directory went with the failure


def test_a_symlinked_root_of_ours_is_resolved_once(tmp_path: Path) -> None:
    real = tmp_path / "nvme"
    real.mkdir()
    link = tmp_path / "scratch"
    link.symlink_to(real)
    spill = SpillDir(link)
    assert spill.path.parent == real
    # Repointing the link afterwards moves nothing: the files go where the
    # directory was made, never through the link again.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / spill.path.name).mkdir()
    link.unlink()
    link.symlink_to(elsewhere)
    os.close(spill.open_file("entries.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL))
    assert sorted(os.listdir(real / spill.path.name)) == [".lock", "entries.bin"]
    assert os.listdir(elsewhere / spill.path.name) == []
    spill.close()
    assert os.listdir(real) == []


@needs_root
def test_another_users_symlink_as_root_is_refused_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "scratch"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as info:
        SpillDir(link)
    assert str(info.value) == (
        f"tierstore: disk_path='{link}' is a symbolic link owned by uid {NOBODY}, "
        f"not by you (uid 0) or root, and is not followed{OWN_HINT}"
    )
    assert os.listdir(target) == []


@needs_root
@pytest.mark.parametrize("through_link", [False, True], ids=["directory", "link to it"])
def test_another_users_directory_as_root_is_refused(tmp_path: Path, through_link: bool) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    stale = _fake_dir(theirs, "tierstore-1-abc")  # a sweep there would remove it
    root = theirs
    where = f"disk_path='{theirs}'"
    if through_link:
        root = tmp_path / "mine"
        root.symlink_to(theirs)
        where = f"disk_path='{root}' (-> '{theirs}')"
    with pytest.raises(ConfigError) as info:
        SpillDir(root)
    assert str(info.value) == (
        f"tierstore: {where} is owned by uid {NOBODY}, not by you (uid 0) or root, "
        f"so its owner could read or replace the spill files{OWN_HINT}"
    )
    assert os.listdir(theirs) == [stale.name]  # no sweep, no directory made


@pytest.mark.parametrize(
    ("mode", "ok"),
    [(0o700, True), (0o770, True), (0o1777, True), (0o777, False), (0o703, False)],
    ids=oct,
)
def test_a_world_writable_root_must_be_sticky(tmp_path: Path, mode: int, ok: bool) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    if ok:
        SpillDir(root).close()
        return
    with pytest.raises(ConfigError) as info:
        SpillDir(root)
    assert str(info.value) == (
        f"tierstore: disk_path='{root}' is writable by every user and not sticky "
        f"(mode {mode:04o}), so another user could replace the spill directory; "
        f"make it sticky (chmod +t) or{OWN_HINT.removeprefix(';')}"
    )
    assert os.listdir(root) == []


def test_sweep_does_not_follow_a_lock_symlink(tmp_path: Path) -> None:
    # The .lock of a directory of ours is a link to an unlocked lock file
    # elsewhere: taking that lock would say nothing about the owner.
    elsewhere = _fake_dir(tmp_path, "elsewhere")
    stale = _fake_dir(tmp_path, "tierstore-1-abc", lock=False)
    (stale / ".lock").symlink_to(elsewhere / ".lock")
    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 0
    assert (stale / "entries.bin").read_bytes() == b"data"
    assert (elsewhere / ".lock").read_text() == "999999\n"
    spill.close()


def test_sweep_unlinks_symlinks_inside_never_their_targets(tmp_path: Path) -> None:
    victim = _fake_dir(tmp_path, "victim", lock=False)
    (victim / "sub").mkdir()
    (victim / "sub" / "deep").write_bytes(b"deep")
    stale = _fake_dir(tmp_path, "tierstore-1-abc")
    (stale / "dir-link").symlink_to(victim)
    (stale / "file-link").symlink_to(victim / "entries.bin")
    (stale / "nested").mkdir()
    (stale / "nested" / "link").symlink_to(victim / "sub")
    before = _tree(victim)
    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 1
    assert not os.path.lexists(stale)
    assert _tree(victim) == before
    spill.close()


@needs_root
def test_sweep_never_trusts_another_users_lock(tmp_path: Path) -> None:
    stale = _fake_dir(tmp_path, "tierstore-1-abc")
    os.chown(stale / ".lock", NOBODY, NOBODY)
    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 0
    assert (stale / "entries.bin").read_bytes() == b"data"
    spill.close()


def test_sweep_of_a_directory_swapped_for_a_link_mid_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep checks a directory, then removes it; in between, its name is
    # made a link to another directory of ours. The removal goes through the
    # descriptor of the directory it checked, never through the new link.
    victim = _fake_dir(tmp_path, "victim", lock=False)
    stale = _fake_dir(tmp_path, "tierstore-1-abc")
    moved = tmp_path / "moved"
    clear = _spill._clear

    def swap_then_clear(dir_fd: int) -> None:
        stale.rename(moved)
        stale.symlink_to(victim)
        clear(dir_fd)

    monkeypatch.setattr(_spill, "_clear", swap_then_clear)
    spill = SpillDir(tmp_path)
    assert spill.removed_stale == 0  # the name is a link now: rmdir refuses it
    assert (victim / "entries.bin").read_bytes() == b"data"
    assert os.listdir(moved) == []  # what was checked and locked got emptied
    assert stale.is_symlink()
    spill.close()
