"""Nothing tierstore reads back is ever unpickled (issue 6, item 8: the static half)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNPICKLERS = {"pickle", "cPickle", "dill", "marshal", "shelve", "_pickle", "cloudpickle"}


def _calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            out.append((ast.unparse(node.func), node))
    return out


def test_no_module_unpickles() -> None:
    files = [*ROOT.joinpath("tierstore").rglob("*.py"), *ROOT.joinpath("backends").rglob("*.py")]
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & UNPICKLERS, f"{path.relative_to(ROOT)} imports {names}"
        for name, call in _calls(tree):
            if name != "torch.load":
                continue
            # Only the benchmark's disk-naive baseline loads with torch.load, and
            # only with weights_only=True (no arbitrary objects).
            assert path.relative_to(ROOT).parts[:2] == ("tierstore", "bench"), path
            flags = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert flags.get("weights_only") == "True", f"{path}: {ast.unparse(call)}"
