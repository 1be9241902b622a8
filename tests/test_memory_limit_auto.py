"""``activation_budget="auto"`` under a real memory limit: a memory cgroup each test makes.

The training process is ``tests/limit_worker.py`` (an 8-block GPT with
AdamW). Eager training peaks at about twice :data:`LIMIT_BYTES`: in a cgroup
of that size the kernel kills it in its first step. Under ``"auto"`` the
same training completes there with gradients bitwise equal to eager's, and
under torchrun two ranks in one cgroup each plan for their share of it.

The eager reference runs with no limit, in a process of its own. Skipped,
with the reason, where no cgroup can be made (not root, no writable memory
controller), and while ``TierConfig`` refuses ``"auto"``.
``TIERSTORE_TEST_LIMIT_BUDGET`` runs the tests with a fixed budget in its
place (``0.2``), which checks the harness, the kill and the sizes alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from tierstore.bench.memory_limit import run_limited, why_no_memory_limit
from tierstore.config import TierConfig
from tierstore.errors import TierstoreError

WORKER = Path(__file__).with_name("limit_worker.py")
_MIB = 1 << 20
#: The cgroup of one training process: about half of eager's peak (1.1 GiB
#: with this interpreter and torch); a 0.2 budget peaks at about 480 MiB.
LIMIT_BYTES = 540 * _MIB
#: The cgroup the torchrun job shares: its agent (an interpreter with torch)
#: and two ranks. Eager ranks peak at 2.2 GiB together; at a 0.2 budget, 1.1 GiB.
TORCHRUN_LIMIT_BYTES = 1250 * _MIB
BUDGET = os.environ.get("TIERSTORE_TEST_LIMIT_BUDGET", "auto")
RANKS = 2
STEPS = 3


def _refuses_auto() -> str | None:
    try:
        TierConfig(activation_budget="auto")
    except TierstoreError as exc:
        return f"TierConfig refuses activation_budget='auto' ({exc})"
    return None


_no_auto = _refuses_auto() if BUDGET == "auto" else None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(why_no_memory_limit() is not None, reason=str(why_no_memory_limit())),
    pytest.mark.skipif(_no_auto is not None, reason=str(_no_auto)),
]


def _env(**extra: str) -> dict[str, str]:
    # The worker imports the tierstore this test imports; one thread per process.
    root = str(Path(__file__).parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "LIMIT_WORKER_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Eager training's last gradients, with no limit, in a process of its own."""
    out = tmp_path_factory.mktemp("eager")
    cmd = [sys.executable, str(WORKER), "eager", str(out), str(STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "grads-eager.safetensors")


def _equal(grads: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose gradients differ from eager's (none: bitwise equal)."""
    assert grads.keys() == eager.keys()
    return [name for name in eager if not torch.equal(grads[name], eager[name])]


def test_a_step_the_limit_kills_without_tierstore_trains_under_auto(
    eager: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    killed = run_limited(
        [sys.executable, str(WORKER), "eager", str(tmp_path), str(STEPS)],
        LIMIT_BYTES,
        env=_env(),
        timeout=600,
    )
    assert (killed.returncode, killed.oom_killed) == (-signal.SIGKILL, True), killed.stderr[-3000:]
    assert not (tmp_path / "grads-eager.safetensors").exists()  # killed before its end

    run = run_limited(
        [sys.executable, str(WORKER), BUDGET, str(tmp_path), str(STEPS)],
        LIMIT_BYTES,
        env=_env(),
        timeout=600,
    )
    assert (run.returncode, run.oom_killed) == (0, False), run.stderr[-3000:]
    assert f"limit-worker: {BUDGET} done" in run.stdout
    assert run.peak_bytes is not None and run.peak_bytes <= LIMIT_BYTES
    assert _equal(load_file(tmp_path / f"grads-{BUDGET}.safetensors"), eager) == []
    plan = json.loads((tmp_path / f"result-{BUDGET}.json").read_text())
    assert plan["plan_budget_bytes"] is not None and plan["plan_budget_bytes"] < LIMIT_BYTES
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # no spill left


def _torchrun_check() -> ModuleType:
    """``tests/test_torchrun.py``, for its judge of a torchrun job (gloo's teardown abort)."""
    spec = importlib.util.spec_from_file_location(
        "_tierstore_test_torchrun", Path(__file__).with_name("test_torchrun.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_ranks_in_one_cgroup_each_plan_for_their_share_and_complete(
    eager: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    limit = TORCHRUN_LIMIT_BYTES
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--standalone",
        str(WORKER),
        BUDGET,
        str(tmp_path),
        str(STEPS),
    ]
    run = run_limited(cmd, limit, env=_env(), timeout=600)
    assert not run.oom_killed, run.stderr[-3000:]
    # Every rank done, and torchrun's exit clean or gloo's teardown abort after it.
    done = run.stdout.replace(f"limit-worker: {BUDGET}-rank", "tierstore-torchrun: rank ")
    done = done.replace(" done", " done\n")
    _torchrun_check().check_job(run.returncode, done, run.stderr, ranks=RANKS)
    for rank in range(RANKS):
        tag = f"{BUDGET}-rank{rank}"
        result = json.loads((tmp_path / f"result-{tag}.json").read_text())
        assert result["world"] == str(RANKS)
        # Its share of the room: at most the limit over the ranks that share it.
        assert result["plan_budget_bytes"] is not None
        assert result["plan_budget_bytes"] <= limit // RANKS
        assert _equal(load_file(tmp_path / f"grads-{tag}.safetensors"), eager) == []
