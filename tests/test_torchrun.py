"""tierstore under torchrun: DDP and FSDP2 on gloo (CPU), two ranks, as subprocesses.

Each rank trains the benchmark GPT with and without ``offload()`` (see
``tests/torchrun_worker.py``); the parameters after the last step must be
bitwise equal, each rank must have had its own spill directory with its
rank in the name, and no parameter (FSDP's unsharded ones included) may
have reached the store.

The job is judged by its own output, not only torchrun's exit status: with
torch 2.13 on gloo, even plain DDP without tierstore aborts at interpreter
exit in about one run of twelve (``terminate called without an active
exception``, SIGABRT, after every rank is done), and torchrun then exits 1.
:func:`check_job` accepts that one failure, and only after every rank has
printed its completion line; anything else nonzero fails, with the output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("torchrun_worker.py")
RANKS = 2
#: The worker's ``COMPLETION`` line, printed by each rank as the last thing it does.
#: Not anchored to a line: two ranks' lines can run together on torchrun's stdout.
_DONE = re.compile(r"tierstore-torchrun: rank (\d+) done")
#: What libstdc++ prints when gloo's threads are torn down unjoined at exit.
TEARDOWN_ABORT = "terminate called without an active exception"
#: Exit codes torchrun reports for a rank: killed by SIGABRT, or by the
#: SIGTERM the agent sends the other ranks once one has failed.
_SIGABRT, _SIGTERM = -6, -15
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def check_job(returncode: int, stdout: str, stderr: str, ranks: int = RANKS) -> str:
    """Judge a torchrun job by what it printed; returns how it ended, or raises AssertionError.

    Passes when every rank printed its completion line and torchrun exited 0,
    or exited nonzero only because a rank aborted at exit in gloo's teardown
    (the abort message, every failed rank SIGABRT or the agent's SIGTERM,
    at least one SIGABRT). The message of a failure shows stdout and stderr.
    """

    def fail(why: str) -> AssertionError:
        return AssertionError(
            f"torchrun exited {returncode}: {why}\n"
            f"--- stdout (tail) ---\n{stdout[-3000:]}\n--- stderr (tail) ---\n{stderr[-5000:]}"
        )

    done = {int(rank) for rank in _DONE.findall(stdout)}
    missing = sorted(set(range(ranks)) - done)
    if missing:
        raise fail(f"rank(s) {missing} never printed their completion line")
    if returncode == 0:
        return "clean exit"
    exitcodes = [int(code) for code in _EXITCODE.findall(stderr)]
    if TEARDOWN_ABORT not in stderr or _SIGABRT not in exitcodes:
        raise fail("every rank was done, but it is not gloo's teardown abort")
    if any(code not in (_SIGABRT, _SIGTERM) for code in exitcodes):
        raise fail(f"every rank was done, but a rank failed otherwise (exit codes {exitcodes})")
    return "teardown abort after every rank was done"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_rank_offloads_to_its_own_directory_and_trains_the_same(
    mode: str, tmp_path: Path
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--standalone",
        str(WORKER),
        mode,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    check_job(proc.returncode, proc.stdout, proc.stderr)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    spill_root = tmp_path / "spill"
    dirs = []
    for r, result in enumerate(results):
        assert result["rank"] == r
        assert result["equal"] is True, result
        assert result["parameters"] > 0
        assert result["disk_bytes_written"] > 0
        assert result["parameter_puts"] == 0
        assert result["kept"] > 0  # the weights Linear saves (weight.t()) stayed
        spill = Path(result["spill_dir"])
        assert spill.parent == spill_root
        assert spill.name.startswith(f"tierstore-rank{r}-")
        assert result["spill_dir_exists_after_close"] is False
        dirs.append(spill)
    assert dirs[0] != dirs[1]
    # Nothing left behind. disk_path goes only with the rank that made it, if
    # that rank closes last (NOTE [ Spill directory lifecycle ]); else it stays, empty.
    assert not spill_root.exists() or list(spill_root.iterdir()) == []


# What torchrun printed (trimmed), for check_job's own tests.
_BANNER = """
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid \
your system being overloaded, please further tune the variable for optimal performance in \
your application as needed.
*****************************************
"""
_BOTH_DONE = "tierstore-torchrun: rank 1 done\ntierstore-torchrun: rank 0 done\n"


def _report(*failures: tuple[int, int, str]) -> str:
    """torchrun's ChildFailedError report: (rank, exit code, traceback) per failed rank."""
    entries = [
        f"[{i}]:\n  time      : 2026-11-23_22:02:54\n  host      : localhost\n"
        f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {400 + rank})\n"
        f"  error_file: <N/A>\n  traceback : {why}\n"
        for i, (rank, code, why) in enumerate(failures)
    ]
    root = failures[0][0]
    return (
        f"E1123 22:02:54.575000 3932 torch/distributed/elastic/multiprocessing/api.py:1002] "
        f"failed (exitcode: {failures[0][1]}) local_rank: {root} (pid: {400 + root}) "
        "of binary: /work/main/.venv/bin/python\n"
        "Traceback (most recent call last):\n"
        '  File "torch/distributed/launcher/api.py", line 383, in launch_agent\n'
        "    raise ChildFailedError(\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================\n"
        "tests/torchrun_worker.py FAILED\n"
        "--------------------------------------------\n"
        "Root Cause (first observed failure):\n" + "".join(entries)
    )


_TEARDOWN = (
    _BANNER
    + TEARDOWN_ABORT
    + "\nW1123 22:02:54.510000 3932 torch/distributed/elastic/multiprocessing/api.py:1028] "
    "Sending process 400 closing signal SIGTERM\n"
    + _report(
        (1, -6, "Signal 6 (SIGABRT) received by PID 401"),
        (0, -15, "Signal 15 (SIGTERM) received by PID 400"),
    )
)
_CRASH = (
    _BANNER + "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "tests/torchrun_worker.py", line 96, in main\n'
    "[rank0]: RuntimeError: No space left on device\n"
    + _report(
        (0, 1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    )
)


def test_check_job_passes_a_clean_exit() -> None:
    assert check_job(0, _BOTH_DONE, _BANNER) == "clean exit"


def test_check_job_tolerates_the_teardown_abort_after_every_rank_is_done() -> None:
    verdict = check_job(1, _BOTH_DONE, _TEARDOWN)
    assert verdict == "teardown abort after every rank was done"


def test_check_job_reads_completion_lines_that_ran_together() -> None:
    # Seen on torchrun: one rank's text, the other's, then both newlines.
    stdout = "tierstore-torchrun: rank 1 donetierstore-torchrun: rank 0 done\n\n"
    assert check_job(0, stdout, _BANNER) == "clean exit"


def test_check_job_fails_a_crash_before_the_output_and_shows_it() -> None:
    with pytest.raises(AssertionError) as info:
        check_job(1, "", _CRASH)
    message = str(info.value)
    assert "torchrun exited 1" in message
    assert "rank(s) [0, 1] never printed" in message
    assert "No space left on device" in message  # stderr is in the message
    assert "--- stdout (tail) ---" in message


@pytest.mark.parametrize(
    ("returncode", "stdout", "stderr", "why"),
    [
        # A rank killed by the teardown abort before it printed its line.
        pytest.param(1, "tierstore-torchrun: rank 1 done\n", _TEARDOWN, "rank(s) [0]", id="one"),
        # torchrun reports success though a rank said nothing: still a failure.
        pytest.param(0, "tierstore-torchrun: rank 0 done\n", _BANNER, "rank(s) [1]", id="exit0"),
        # Every rank done, then a failure that is not the abort.
        pytest.param(1, _BOTH_DONE, _CRASH, "not gloo's teardown abort", id="other"),
        pytest.param(
            1,
            _BOTH_DONE,
            _TEARDOWN.replace("exitcode  : -15", "exitcode  : 1"),
            "failed otherwise (exit codes [-6, -6, 1])",
            id="abort-and-error",
        ),
    ],
)
def test_check_job_fails_anything_else(returncode: int, stdout: str, stderr: str, why: str) -> None:
    with pytest.raises(AssertionError, match=re.escape(why)):
        check_job(returncode, stdout, stderr)
