"""A process that forks while a store is open (issue 22, item 7; NOTE [ Forked children ]).

The child gets copies of the store's objects but not its threads; at its
exit it must print nothing and leave the parent's event loop and spill
files alone, and the parent's step goes on as if nothing happened. Real
processes: the child exits through the interpreter, so atexit runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierstore

# The parent saves a step's tensors on disk, forks, waits for the child,
# then runs backward and closes. The child, its stdout and stderr in a file,
# drops its copy of the graph (its saved tensors are released), runs a step
# of its own under tierstore.offload() and exits normally.
_FORK = """
    import hashlib, json, os, sys
    from pathlib import Path

    import torch

    import tierstore

    disk_path, backend, child_out = sys.argv[1], sys.argv[2], sys.argv[3]
    settings = dict(device_budget=0, host_budget=0, disk_budget="4MiB", disk_path=disk_path,
                    disk_backend=backend, min_offload_bytes=0)


    def files(directory):
        return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(directory.rglob("*")) if p.is_file()}


    def grads_equal(model, eager):
        return all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), eager))


    torch.set_num_threads(1)  # libgomp's thread team does not survive a fork
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh()
    )
    x = torch.randn(32, 64)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with tierstore.offload(**settings) as store:
        loss = model(x).square().sum()
    store.flush()
    directory = Path(store.disk_directory)
    before = files(directory)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        out = os.open(child_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        del loss
        with tierstore.offload(**settings):
            child_loss = model(x).square().sum()
        child_loss.backward()
        sys.exit(0 if grads_equal(model, eager) else 3)

    _, status = os.waitpid(pid, 0)
    kept = files(directory) == before
    loss.backward()
    result = {
        "child_exit": os.waitstatus_to_exitcode(status),
        "child_output": Path(child_out).read_text(),
        "files_kept": kept,
        "grads_equal": grads_equal(model, eager),
        "open_after_backward": directory.is_dir() and files(directory).keys() == before.keys(),
    }
    store.close()
    result["left_after_close"] = sorted(os.listdir(disk_path))
    print(json.dumps(result))
    """


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_a_forked_child_ends_quietly_and_leaves_the_parents_disk_tier(
    spill_root: Path, tmp_path: Path, backend: str
) -> None:
    child_out = tmp_path / "child.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_FORK),
            str(spill_root),
            backend,
            str(child_out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert json.loads(proc.stdout) == {
        "child_exit": 0,
        "child_output": "",
        "files_kept": True,
        "grads_equal": True,
        "open_after_backward": True,
        "left_after_close": [],
    }


def test_a_forked_child_cannot_use_its_parents_store(disk_store: tierstore.TierStore) -> None:
    x = torch.ones(1000, requires_grad=True)
    with disk_store.offload():
        y = x.exp()
    disk_store.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            try:
                y.sum().backward()
            except tierstore.StoreClosedError as e:
                expected = (
                    f"tierstore: this TierStore belongs to process {os.getppid()}, and this "
                    f"process ({os.getpid()}) is a fork of it: a forked child cannot use its "
                    "parent's store or the saved tensors in it. Open a TierStore (or use "
                    "tierstore.offload()) in the child"
                )
                code = 0 if str(e) == expected and disk_store.closed else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not disk_store.closed
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(1000).exp())
