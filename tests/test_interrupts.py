"""Ctrl-C and kills through the store (issue 55).

Real child processes, real signals. SIGINT goes to the child's process
group, as a terminal sends it: each one must raise ``KeyboardInterrupt`` in
the training script, which catches it and trains on with the same store
(NOTE [ Finalizers and interrupts ] in tierstore/tiers/release.py). SIGTERM
and SIGKILL in the middle of a step must leave no spilled bytes under
``disk_path`` (NOTE [ File backend unlinked ] in backends/file.py, NOTE
[ Spill directory on SIGTERM ] in backends/_spill.py).
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierstore

# Steps on random batches until a KeyboardInterrupt; then one step on a
# fixed batch, whose gradients must equal eager's bit for bit, and a check
# that the store let go of every entry and pool block of the interrupted
# step. Prints "ready", then "ok <n>" per interrupt, then "closed".
_TRAIN = """
    import gc, sys, time

    import torch

    import tierstore

    backend, disk_path, budget, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    settings = dict(disk_backend=backend, disk_path=disk_path)
    if budget == "none":  # every save through the host pool and the disk
        settings.update(device_budget=0, host_budget="1MiB", disk_budget="256MiB",
                        min_offload_bytes=0)
    else:  # a plan, made in the planning process
        settings.update(activation_budget=float(budget))
    store = tierstore.TierStore(tierstore.TierConfig(**settings))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[m for _ in range(6) for m in (torch.nn.Linear(128, 128), torch.nn.GELU())]
    )
    batch = torch.randn(64, 128)


    def step(x, offload=True):
        model.zero_grad(set_to_none=True)
        if offload:
            with store.offload():
                loss = model(x).square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]


    eager = step(batch, offload=False)
    step(batch)
    print("ready", flush=True)
    for caught in range(1, n + 1):
        try:
            while True:
                step(torch.randn(64, 128))
        except KeyboardInterrupt:
            pass
        got = step(batch)
        if not all(torch.equal(a, b) for a, b in zip(got, eager)):
            sys.exit("the step after an interrupt differs from eager's")
        for _ in range(50):  # a read the interrupted step queued may still be landing
            gc.collect()
            stats = store.stats()
            held = {t: s.entries for t, s in stats.tiers.items() if s.entries}
            if not held and not stats.buffer_bytes_in_use:
                break
            time.sleep(0.1)
        else:
            sys.exit(f"held after the interrupt: {held}, {stats.buffer_bytes_in_use} pool bytes")
        print("ok", caught, flush=True)
    store.close()
    print("closed", flush=True)
    """


def _line(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The child's next line, or ``None`` if it printed none within ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else None


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    # A session of its own: the process group the signals go to is the
    # child's, as a terminal's foreground group would be, not pytest's. Ctrl-C
    # as a terminal's script has it: a child inherits an ignored SIGINT (an
    # earlier test's process may leave it so), and Python then raises nothing.
    prelude = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _fail(proc: subprocess.Popen[str], why: str) -> None:
    proc.kill()
    _, err = proc.communicate(timeout=60)
    pytest.fail(f"{why}; stderr:\n{err[-4000:]}")


def _interrupt(tmp_path: Path, backend: str, budget: str, n: int, seed: int) -> None:
    """Send ``n`` SIGINTs at random moments; each must reach the script, none may hang."""
    rng = random.Random(seed)
    proc = _spawn(_TRAIN, backend, str(tmp_path), budget, str(n))
    try:
        if _line(proc, 120) != "ready":
            _fail(proc, "the script did not start")
        for i in range(1, n + 1):
            # Forward, backward or between steps: a step takes tens of milliseconds.
            select.select([], [], [], rng.uniform(0.0, 0.2))
            os.killpg(proc.pid, signal.SIGINT)
            got = _line(proc, 60)
            if got != f"ok {i}":  # a lost interrupt trains on: nothing is printed
                _fail(proc, f"interrupt {i} of {n}: the script printed {got!r}")
        if _line(proc, 60) != "closed":
            _fail(proc, "close() did not return")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    # No interrupt dropped in a finalizer ("Exception ignored in ..."), and no
    # planning process killed by one (its traceback goes to the same stderr).
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("backend", "budget"),
    [("file", "none"), ("lmdb", "0.3")],
    ids=["file", "lmdb-activation_budget"],
)
def test_every_ctrl_c_reaches_the_script_which_trains_on(
    tmp_path: Path, backend: str, budget: str
) -> None:
    # 15 each: 30 in all, across a file store and an LMDB one under a plan.
    _interrupt(tmp_path, backend, budget, 15, seed=55)


# Steps forever after printing "stepping" once a step has spilled to disk.
_STEPS = """
    import sys

    import torch

    import tierstore

    backend, disk_path = sys.argv[1], sys.argv[2]
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0, host_budget=0, disk_budget="256MiB", disk_path=disk_path,
            disk_backend=backend, min_offload_bytes=0,
        )
    )
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    while True:
        with store.offload():
            loss = model(torch.randn(256, 256)).square().mean()
        if store.stats().tiers["disk"].entries:
            print("stepping", flush=True)
        loss.backward()
    """


def _spilled(root: Path) -> dict[str, int]:
    """Every file under ``root`` but the spill directories' locks, with its size."""
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


def _killed_mid_step(root: Path, backend: str, sig: signal.Signals) -> None:
    proc = _spawn(_STEPS, backend, str(root))
    try:
        if _line(proc, 120) != "stepping":
            _fail(proc, "the script did not spill")
        select.select([], [], [], random.uniform(0.0, 0.1))
        os.killpg(proc.pid, sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -sig  # the signal's own exit: 143 for SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_file_store_leaves_no_spilled_bytes(tmp_path: Path, sig: signal.Signals) -> None:
    _killed_mid_step(tmp_path, "file", sig)
    assert _spilled(tmp_path) == {}  # entries.bin had no name: the kernel freed it
    [left] = os.listdir(tmp_path)  # its private directory and .lock: a few bytes
    assert os.listdir(tmp_path / left) == [".lock"]


def test_a_terminated_lmdb_store_removes_its_spill(tmp_path: Path) -> None:
    _killed_mid_step(tmp_path, "lmdb", signal.SIGTERM)
    assert os.listdir(tmp_path) == []


def test_a_killed_lmdb_store_leaves_spill_the_next_store_removes(tmp_path: Path) -> None:
    _killed_mid_step(tmp_path, "lmdb", signal.SIGKILL)
    assert _spilled(tmp_path)  # SIGKILL runs nothing
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="4MiB",
            disk_path=tmp_path,
            disk_backend="lmdb",
            min_offload_bytes=0,
        )
    )
    try:
        x = torch.randn(1024, requires_grad=True)
        with store.offload():
            y = x.exp()  # the first spill opens the disk tier and sweeps
        assert os.listdir(tmp_path) == [Path(str(store.disk_directory)).name]
        y.sum().backward()
    finally:
        store.close()
    assert os.listdir(tmp_path) == []


def test_sigterm_goes_on_to_the_scripts_own_handler(tmp_path: Path) -> None:
    # A trainer's handler stays in charge; the spill goes first all the same.
    script = (
        "import signal, sys\n"
        "def stop(signum, frame):\n"
        "    print('handled', flush=True); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop)\n" + textwrap.dedent(_STEPS)
    )
    proc = _spawn(script, "lmdb", str(tmp_path))
    try:
        if _line(proc, 120) != "stepping":
            _fail(proc, "the script did not spill")
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7 and "handled" in out
    assert os.listdir(tmp_path) == []
