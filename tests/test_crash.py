"""Crash cleanup through the store (issue 6, item 3).

A training process killed with SIGKILL in the middle of a step runs no
cleanup, so its spill directory stays on disk. The next store on the same
``disk_path`` removes it when it first opens its disk tier, and leaves the
directory of a process that is still alive alone (``NOTE [ Spill directory
lifecycle ]`` in ``backends/_spill.py``). Real subprocesses, real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierstore

# A training step that stops in the middle of forward: after the first two
# layers' saved tensors reached the disk, a custom Function prints the spill
# directory and waits for a line on stdin (the parent SIGKILLs it there, or
# lets it finish the step and exit).
_STEP = """
    import sys

    import torch

    import tierstore

    disk_path, backend = sys.argv[1], sys.argv[2]
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="4MiB",
            disk_path=disk_path,
            disk_backend=backend,
            min_offload_bytes=0,
        )
    )


    class Pause(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            store.flush()  # what was saved so far is on disk now
            print(store.disk_directory, store.stats().tiers["disk"].entries, flush=True)
            sys.stdin.readline()
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad


    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh()
    )
    with store.offload():
        h = Pause.apply(model[1](model[0](torch.randn(32, 64))))
        loss = model[3](model[2](h)).sum()
    loss.backward()
    print("done", flush=True)
    """

# What a backend keeps in its spill directory, besides the lock: the file
# backend's entries.bin has no name once open (NOTE [ File backend unlinked ]).
_FILES = {"file": [], "lmdb": ["entries.lmdb/data.mdb", "entries.lmdb/lock.mdb"]}


def _spawn(disk_path: Path, backend: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_STEP), str(disk_path), backend],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _paused(proc: subprocess.Popen[str]) -> tuple[Path, int]:
    """The spill directory and the disk entries the paused step printed."""
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line:
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"the step printed nothing; stderr:\n{err}")
    directory, entries = line
    return Path(directory), int(entries)


def _contents(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``directory``."""
    return {
        str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_killed_step_leaves_a_directory_the_next_store_removes(
    spill_root: Path, backend: str
) -> None:
    dead = _spawn(spill_root, backend)
    live = _spawn(spill_root, backend)
    try:
        dead_dir, dead_entries = _paused(dead)
        live_dir, live_entries = _paused(live)
        assert dead_dir.parent == live_dir.parent == spill_root
        assert dead_dir.name.startswith(f"tierstore-{dead.pid}-")
        # Mid-forward, the input and the first layers' activations are on disk.
        assert dead_entries == live_entries >= 2
        left = _contents(dead_dir)
        assert sorted(left) == sorted([".lock", *_FILES[backend]])
        live_files = _contents(live_dir)

        dead.send_signal(signal.SIGKILL)
        dead.communicate(timeout=60)
        assert dead.returncode == -signal.SIGKILL
        assert _contents(dead_dir) == left  # SIGKILL runs no cleanup

        store = tierstore.TierStore(
            tierstore.TierConfig(
                device_budget=0,
                host_budget=0,
                disk_budget="4MiB",
                disk_path=spill_root,
                disk_backend=backend,
                min_offload_bytes=0,
            )
        )
        try:
            # A store that has not spilled yet has not touched the disk.
            assert store.disk_directory is None
            assert dead_dir.is_dir()

            x = torch.randn(32, 64, requires_grad=True)
            with store.offload():
                y = x.exp()  # saves its result: the first spill opens the disk tier
            own_dir = Path(str(store.disk_directory))
            assert not dead_dir.exists()
            # The live step's directory, and what it has written, stay.
            assert _contents(live_dir) == live_files
            assert sorted(os.listdir(spill_root)) == sorted([live_dir.name, own_dir.name])
            y.sum().backward()
            assert torch.equal(x.grad, x.detach().exp())
        finally:
            store.close()
        assert not own_dir.exists()
    finally:
        out, err = live.communicate("\n", timeout=60)
    # The live step was not disturbed: it finishes its backward and cleans up at exit.
    assert (live.returncode, out) == (0, "done\n"), err
    assert os.listdir(spill_root) == []
