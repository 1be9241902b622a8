"""Scratch directories: removed at the end of their block, on error, and on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tierstore.bench import scratch
from tierstore.bench.scratch import make_scratch_dir, remove_scratch_dir, scratch_dir


def test_a_scratch_dir_is_private_tracked_and_removed(tmp_path: Path) -> None:
    with scratch_dir("tierstore-t-", tmp_path) as path:
        assert path.parent == tmp_path and path.name.startswith("tierstore-t-")
        assert path.stat().st_mode & 0o777 == 0o700
        assert str(path) in scratch._live
        (path / "sub").mkdir()
        (path / "sub" / "data").write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []
    assert str(path) not in scratch._live


def test_a_scratch_dir_goes_on_error_and_removal_is_idempotent(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), scratch_dir("tierstore-t-", tmp_path):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    path = make_scratch_dir("tierstore-t-", tmp_path)
    remove_scratch_dir(path)
    remove_scratch_dir(path)
    assert not path.exists() and str(path) not in scratch._live


def test_removed_on_sigterm_restores_the_default_and_keeps_a_callers_handler() -> None:
    with scratch.removed_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is scratch._remove_all_and_exit
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def mine(signum: int, frame: object) -> None: ...

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with scratch.removed_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_a_soak_stopped_by_sigterm_leaves_nothing(tmp_path: Path, backend: str) -> None:
    # Sent at several moments of a step (forward, backward, a handle's
    # finalizer): each time the soak's directory, with the store's spill
    # files inside, is gone and the status is 143. NOTE [ SIGTERM ].
    for delay in (0.0, 0.13, 0.37, 0.71):
        root = tmp_path / f"{delay}"
        root.mkdir()
        argv = [sys.executable, "-m", "tierstore.cli", "bench", "soak", "--tiny"]
        argv += ["--steps", "100000", "--warmup", "2", "--quiet", "--backends", backend]
        argv += ["--dir", str(root)]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            # Running: the soak's directory holds the store's spill directory.
            while not any(p.name.startswith("tierstore-") for p in root.glob("tierstore-soak-*/*")):
                assert child.poll() is None, child.communicate()
                assert time.monotonic() < deadline, "the soak never spilled"
                time.sleep(0.02)
            time.sleep(delay)
            child.send_signal(signal.SIGTERM)
            _, err = child.communicate(timeout=30)
        finally:
            child.kill()
        assert child.returncode == 128 + signal.SIGTERM, err
        assert list(root.iterdir()) == []
