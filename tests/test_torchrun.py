"""tierstore under torchrun: DDP and FSDP2 on gloo (CPU), two ranks, as subprocesses.

Each rank trains the benchmark GPT with and without ``offload()`` (see
``tests/torchrun_worker.py``); the parameters after the last step must be
bitwise equal, each rank must have had its own spill directory with its
rank in the name, and no parameter (FSDP's unsharded ones included) may
have reached the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("torchrun_worker.py")


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
        "2",
        "--standalone",
        str(WORKER),
        mode,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
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
    assert list(spill_root.iterdir()) == []  # nothing left behind
