"""The development harnesses in benchmarks/ import, and what device-run.sh names exists.

Several harnesses reach the package's internals, and device-run.sh names test
files: a move that breaks one fails here (and in ``make typecheck``), not on a
lent GPU machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))

# Imports each script as a module of its own name (not "__main__", so main() does not
# run), in a fresh interpreter: a script may set environment variables at import.
_IMPORT_ALL = """
import importlib.util, sys, torch
for path in sys.argv[1:]:
    name = "benchmarks_" + path.rsplit("/", 1)[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path} has no main()"
assert not torch.cuda.is_initialized(), "a harness touched CUDA at import"
print(len(sys.argv) - 1)
"""


def test_every_harness_imports_without_running() -> None:
    assert len(SCRIPTS) >= 6
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *map(str, SCRIPTS)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(len(SCRIPTS))]


def test_device_run_names_files_that_exist() -> None:
    script = (BENCHMARKS / "device-run.sh").read_text()
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/.-]+\.(?:py|sh))\b", script))
    assert any(n.startswith("tests/") for n in named)
    assert any(n.startswith("benchmarks/") for n in named)
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert missing == [], f"benchmarks/device-run.sh names {missing}"
