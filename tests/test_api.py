"""The public surface and the layering DESIGN.md promises."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

import tierstore
import tierstore.backends.base

ROOT = Path(__file__).resolve().parent.parent

EXPORTED = {
    "ConfigError",
    "CorruptDataError",
    "Stats",
    "StoreClosedError",
    "TierConfig",
    "TierFullError",
    "TierStats",
    "TierStore",
    "TierstoreError",
    "TierstoreWarning",
    "__version__",
    "keep",
    "keep_module",
    "load_config",
    "offload",
    "offload_module",
}


def test_all_is_what_we_mean_to_export() -> None:
    assert set(tierstore.__all__) == EXPORTED
    for name in tierstore.__all__:
        assert hasattr(tierstore, name), name


def test_every_public_name_has_a_typed_signature_and_an_example() -> None:
    for name in tierstore.__all__:
        obj = getattr(tierstore, name)
        if name == "__version__":
            continue
        doc = inspect.getdoc(obj) or ""
        assert "Example" in doc or ">>>" in doc, f"{name} has no example"
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name


def test_error_hierarchy() -> None:
    assert issubclass(tierstore.TierstoreError, RuntimeError)
    assert issubclass(tierstore.ConfigError, ValueError)
    for cls in (
        tierstore.ConfigError,
        tierstore.TierFullError,
        tierstore.StoreClosedError,
        tierstore.CorruptDataError,
    ):
        assert issubclass(cls, tierstore.TierstoreError)


def test_store_uses_the_shipped_backend_class(tmp_path: Path) -> None:
    cfg = tierstore.TierConfig(
        device_budget=0, host_budget=0, disk_budget="1MiB", disk_path=tmp_path, min_offload_bytes=0
    )
    with tierstore.TierStore(cfg) as store:
        x = torch.randn(64, requires_grad=True)
        with store.offload():
            y = x.exp()
        backend = store._manager._pipeline.backend_if_open
        assert isinstance(backend, tierstore.backends.base.Backend)
        assert type(backend).__module__ == "tierstore.backends.file"
        y.sum().backward()


# Which first-party modules each layer may import (DESIGN.md "Layers": downward only).
LAYERS = {
    # Integrations sit on top: the public store and offload_module, and nothing
    # in tierstore imports them (test_nothing_imports_the_integrations).
    "integrations": {"config", "errors", "hooks", "integrations", "stats"},
    # planner: the Plan that TierStore.plan() returns, and the choice a save gets.
    "hooks": {"config", "errors", "handle", "planner", "recompute", "stats", "store"},
    # The autograd boundary's recorder (NOTE [ Recompute ]): ops, never bytes.
    "recompute": {"errors", "handle"},
    "store": {
        "codec",
        "config",
        "entry",
        "errors",
        "forks",
        "handle",
        "pipeline",
        "plans",
        "readahead",
        "schedule",
        "stats",
        "transfers",
        "writebehind",
    },
    # activation_budget: the runner (the tier manager's layer) and the pure planner.
    "plans": {"config", "pipeline", "planner"},
    "planner": set(),
    "schedule": set(),
    "handle": set(),
    "stats": {"config"},
    # In flight: each called under the manager's lock, none imports another but
    # transfers (the copies they start) and sizing.
    "readahead": {
        "codec",
        "config",
        "entry",
        "errors",
        "pipeline",
        "schedule",
        "sizing",
        "transfers",
    },
    "writebehind": {"config", "entry", "errors", "pipeline", "sizing", "stats", "transfers"},
    "transfers": {"backends", "codec", "config", "entry", "errors", "forks"},
    "sizing": set(),
    "entry": {"backends", "codec", "pipeline", "stats"},
    "pipeline": {"backends", "codec", "config", "errors", "forks"},
    "backends": {"codec", "config", "errors", "backends"},
    "codec": {"errors"},
    "config": {"errors"},
    "errors": set(),
    # NOTE [ Forked children ]: what a child leaves to its parent; stdlib only.
    "forks": set(),
}


def _layer(path: Path) -> str:
    if path.parent.name in ("backends", "integrations"):
        return path.parent.name
    return path.stem


def _first_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module == "tierstore":
            found.update(a.name for a in node.names)  # from tierstore import codec
        for name in names:
            assert not name.startswith("backends"), f"{path} imports a bare 'backends'"
            parts = name.split(".")
            if parts[0] == "tierstore" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_layers_import_downward_only() -> None:
    files = [
        *ROOT.joinpath("tierstore").glob("*.py"),
        *ROOT.joinpath("tierstore", "integrations").glob("*.py"),
        *ROOT.joinpath("backends").glob("*.py"),
    ]
    checked = 0
    for path in files:
        layer = _layer(path)
        if layer not in LAYERS:
            continue
        checked += 1
        extra = _first_party_imports(path) - LAYERS[layer]
        assert not extra, f"{path.relative_to(ROOT)} ({layer}) imports {sorted(extra)}"
    assert checked >= 15


def test_nothing_imports_the_integrations() -> None:
    files = [
        *ROOT.joinpath("tierstore").rglob("*.py"),
        *ROOT.joinpath("backends").glob("*.py"),
    ]
    for path in files:
        if path.parent.name == "integrations":
            continue
        assert "integrations" not in _first_party_imports(path), path.relative_to(ROOT)


def test_nothing_touches_cuda_or_disk_at_import(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import os, torch; before = set(os.listdir(os.environ['TMPDIR']));"
        "import tierstore, tierstore.backends.file, tierstore.backends.lmdb;"
        "assert not torch.cuda.is_initialized();"
        "assert set(os.listdir(os.environ['TMPDIR'])) == before"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
