"""A real memory limit for a child: the kernel kills it over the limit, reports its peak under it.

Each test makes a memory cgroup of its own (NOTE [ A cgroup per limited run ]
in tierstore/bench/memory_limit.py) and is skipped, with the reason, where
none can be made (not root, no writable memory controller).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tierstore.bench.memory_limit import MemoryCgroup, run_limited, why_no_memory_limit
from tierstore.errors import TierstoreError

_MIB = 1 << 20
LIMIT = 100 * _MIB

needs_cgroup = pytest.mark.skipif(
    why_no_memory_limit() is not None, reason=str(why_no_memory_limit())
)

#: Touches N MiB one page at a time (a bytearray is zero-filled: every page is written).
TOUCH = "import sys; b = bytearray(int(sys.argv[1]) << 20); print(len(b) >> 20, flush=True)"


def _children(cgroup_parent: str) -> list[str]:
    return sorted(n for n in os.listdir(cgroup_parent) if n.startswith(f"tierstore-{os.getpid()}-"))


@needs_cgroup
def test_a_child_touching_three_times_the_limit_is_killed_and_reported_killed() -> None:
    seen: list[str] = []
    run = run_limited(
        [sys.executable, "-c", TOUCH, "300"],
        LIMIT,
        on_start=lambda proc: seen.append(str(proc.pid)),
    )
    assert (run.returncode, run.oom_killed) == (-signal.SIGKILL, True), run.stderr
    assert run.stdout == ""  # killed before it could print
    assert run.peak_bytes is not None and LIMIT * 0.9 <= run.peak_bytes <= LIMIT
    assert seen  # it did start


@needs_cgroup
def test_a_child_under_the_limit_completes_with_its_peak_and_leaves_no_cgroup() -> None:
    with MemoryCgroup(LIMIT) as cgroup:
        parent = str(cgroup.path.parent)
        assert _children(parent) == [cgroup.path.name]
    assert _children(parent) == []
    run = run_limited([sys.executable, "-c", TOUCH, "50"], LIMIT)
    assert (run.returncode, run.oom_killed, run.stdout) == (0, False, "50\n")
    # The 50 MiB it touched, the interpreter beside it, and nothing near the limit.
    assert run.peak_bytes is not None and 50 * _MIB < run.peak_bytes < 90 * _MIB
    assert _children(parent) == []


@needs_cgroup
def test_the_cgroup_goes_on_an_interrupt_with_its_child_still_running() -> None:
    with pytest.raises(KeyboardInterrupt), MemoryCgroup(LIMIT) as cgroup:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            preexec_fn=cgroup.enter,  # noqa: PLW1509
        )
        assert cgroup.pids() == [proc.pid]
        raise KeyboardInterrupt
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not cgroup.path.exists()


def test_no_cgroup_says_why() -> None:
    why = why_no_memory_limit()
    if why is None:
        pytest.skip("a memory cgroup can be made here: there is no reason to show")
    assert why.startswith("no memory limit can be set here: ")
    with pytest.raises(TierstoreError, match=r"^tierstore: no memory limit can be set here: "):
        MemoryCgroup(LIMIT)
