"""The public surface and the layering DESIGN.md promises."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
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


# Which layers each layer may import (DESIGN.md "Layers": downward only). A layer is
# a folder of tierstore/ (autograd, planning, tiers, bench, integrations), backends/,
# or a top-level module; a module of a folder may import its folder's modules too.
# "folder.module" is one module's own rule, which replaces its folder's; in a
# rule, "folder.module" allows that module of the folder alone. Every
# file of the package has a rule: a new folder or top-level module says where it stands.
LAYERS = {
    # Integrations sit on top: the public store and offload_module, and nothing
    # in tierstore imports them (test_nothing_imports_the_integrations).
    "integrations": {"config", "errors", "offloading", "stats", "tier_store"},
    "cli": {"bench", "config", "errors", "models", "stats", "tier_store"},
    "__init__": {"autograd", "config", "errors", "offloading", "stats", "tier_store"},
    # The public API: the store wires the layers below together; offload() and
    # offload_module hand out stores.
    "offloading": {"autograd", "config", "errors", "tier_store"},
    "tier_store": {"autograd", "codec", "config", "errors", "planning", "stats", "tiers"},
    # The autograd boundary: saved_tensors_hooks, ops and modules; what the plan
    # says for a save; handles. Never files or streams. The codec only for the
    # bytes a strided view rests in (its size, which the filters need).
    "autograd": {"codec", "config", "errors", "planning", "stats", "tiers"},
    # A profile and a budget make a plan; the runner reads rates off the movers.
    "planning": {"config", "errors", "stats", "tiers"},
    # The planner is a pure function over numbers (the planning process loads it
    # alone, by path): its modules import the standard library and one another.
    "planning.planner": {"planning.plan_types", "planning.simulation"},
    "planning.plan_types": set(),
    "planning.simulation": {"planning.plan_types"},
    # The planning process's program imports the planner alone (by path when run).
    "planning.worker": {"planning.plan_types", "planning.planner", "planning.simulation"},
    # The tiers never import planning: a limit reaches them as a number.
    "tiers": {"backends", "codec", "config", "errors", "stats"},
    "tiers.handle": set(),
    "tiers.schedule": set(),
    "tiers.sizing": set(),
    # NOTE [ Forked children ]: what a child leaves to its parent; stdlib only.
    "tiers.forks": set(),
    "backends": {"codec", "config", "errors"},
    "codec": {"errors"},
    "config": {"errors"},
    "stats": {"config"},
    "errors": set(),
    "models": set(),
    # What a user runs about their own machine and model; a harness that must
    # reach an internal does so here, type-checked with the package.
    "bench": {
        "autograd",
        "backends",
        "codec",
        "config",
        "errors",
        "models",
        "stats",
        "tier_store",
        "tiers",
        "tierstore",
    },
    # The old paths (CHANGELOG.md, "Deprecated") forward and import nothing else.
    "_moved": set(),
    "hooks": {"_moved"},
    "store": {"_moved"},
    "recompute": {"_moved"},
    "bench.gpt": {"_moved"},
}


def _layer(path: Path) -> str:
    """The layer a file of the package belongs to: its folder, or its own name at the top."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "backends":
        return "backends"
    if len(parts) == 2:  # tierstore/<module>.py
        return parts[1]
    return parts[1] if len(parts) == 3 and parts[2] == "__init__" else f"{parts[1]}.{parts[2]}"


def _rule(layer: str) -> set[str]:
    """What ``layer`` may import: its own rule, else its folder's and the folder itself."""
    folder = layer.split(".", maxsplit=1)[0]
    return LAYERS[layer] if "." in layer and layer in LAYERS else LAYERS[folder] | {folder}


def _first_party_imports(path: Path, *, modules: bool = False) -> set[str]:
    """The layers a file imports: ``tierstore.<layer>...``, or ``tierstore`` itself.

    ``modules``: a folder's module by its own name, ``folder.module``.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path} imports relatively"
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module == "tierstore":
            for alias in node.names:  # from tierstore import codec; from tierstore import TierStore
                is_module = (ROOT / "tierstore" / f"{alias.name}.py").exists() or (
                    ROOT / "tierstore" / alias.name
                ).is_dir()
                found.add(alias.name if is_module else "tierstore")
            continue
        if modules and isinstance(node, ast.ImportFrom) and node.module.count(".") == 1:
            # from tierstore.planning import planner: that module, by its own name
            folder = ROOT.joinpath(*node.module.split("."))
            if all(folder.joinpath(f"{alias.name}.py").exists() for alias in node.names):
                found.update(f"{folder.name}.{alias.name}" for alias in node.names)
                continue
        for name in names:
            assert not name.startswith("backends"), f"{path} imports a bare 'backends'"
            parts = name.split(".")
            if parts[0] == "tierstore":
                found.add(".".join(parts[1 : 3 if modules else 2]) or "tierstore")
    return found


def _package_files() -> list[Path]:
    return [*ROOT.joinpath("tierstore").rglob("*.py"), *ROOT.joinpath("backends").glob("*.py")]


def test_layers_import_downward_only() -> None:
    checked = 0
    for path in _package_files():
        layer = _layer(path)
        folder = layer.split(".")[0]
        assert folder in LAYERS, f"{path.relative_to(ROOT)}: no rule for layer {layer!r} in LAYERS"
        checked += 1
        rule = _rule(layer)
        extra = {
            name
            for name in _first_party_imports(path, modules=True)
            if name not in rule and name.split(".")[0] not in rule
        }
        assert not extra, f"{path.relative_to(ROOT)} ({layer}) imports {sorted(extra)}"
    assert checked >= 50


def test_nothing_imports_the_integrations() -> None:
    for path in _package_files():
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


# The old import paths (CHANGELOG.md, "Deprecated"): old module, new module, a name each holds.
DEPRECATED = [
    ("tierstore.hooks", "tierstore", "TierStore"),
    ("tierstore.hooks", "tierstore", "offload"),
    ("tierstore.hooks", "tierstore.offloading", "MAX_STORES"),
    ("tierstore.hooks", "tierstore.tier_store", "log"),
    ("tierstore.hooks", "tierstore.autograd.quiet", "MEASURED_EVERY"),
    ("tierstore.hooks", "tierstore.autograd.regions", "MAX_PLANNED_DEPTH"),
    ("tierstore.store", "tierstore.tiers.manager", "TierManager"),
    ("tierstore.recompute", "tierstore.autograd.recompute", "cheap"),
    ("tierstore.recompute", "tierstore.autograd.recorder", "Recorder"),
    ("tierstore.recompute", "tierstore.autograd.recipes", "Recipe"),
    ("tierstore.recompute", "tierstore.autograd.graph", "graph_recipe"),
    ("tierstore.bench.gpt", "tierstore.models", "GPT"),
]


def _stubs() -> dict[str, set[str]]:
    """Every module left at an old path, walked: old dotted name -> the new ones it forwards to."""
    found: dict[str, set[str]] = {}
    for path in ROOT.joinpath("tierstore").rglob("*.py"):
        match = re.search(r"moved_to\(([^)]*)\)", path.read_text())
        if match and match[1].strip().startswith("__name__"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts)] = set(re.findall(r"\"([\w.]+)\"", match[1]))
    return found


def test_every_old_path_is_tested() -> None:
    tested: dict[str, set[str]] = {}
    for old, new, _ in DEPRECATED:
        tested.setdefault(old, set()).add(new)
    assert _stubs() == tested


@pytest.mark.parametrize(("old", "new", "name"), DEPRECATED)
def test_old_import_paths_warn_and_forward(old: str, new: str, name: str) -> None:
    module = importlib.import_module(old)
    message = (
        f"tierstore: {old}.{name} moved to {new}.{name}; import it from {new} "
        f"({old} is removed in the next release, see CHANGELOG.md)"
    )
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(message)}$"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


# What `from <old path> import *` gave before the move (each old module's __all__).
OLD_ALL = {
    "tierstore.hooks": ["TierStore", "keep", "keep_module", "offload", "offload_module"],
    "tierstore.store": ["TierManager", "resting_nbytes"],
    "tierstore.recompute": [
        *("CHEAP_OPS", "GRAPH_OPS", "GraphOp", "Policy", "Recipe", "Recorder"),
        *("cheap", "everything", "graph_op", "graph_recipe", "never_traced"),
    ],
    "tierstore.bench.gpt": [
        *("GPT", "GPTConfig", "ModelShape", "add_model_arguments", "build_model"),
        "saved_bytes",
    ],
}


@pytest.mark.parametrize("old", sorted(OLD_ALL))
def test_a_star_import_of_an_old_path_gives_its_old_names(old: str) -> None:
    names: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec(f"from {old} import *", names)
    assert sorted(n for n in names if not n.startswith("__")) == sorted(OLD_ALL[old])


def test_an_old_path_has_only_the_new_paths_names() -> None:
    import tierstore.store

    message = "module 'tierstore.store' has no attribute 'Nope'"
    with pytest.raises(AttributeError, match=re.escape(message)):
        tierstore.store.Nope  # noqa: B018


def test_changelog_names_every_old_path() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old, homes in _stubs().items():
        row = [line for line in changelog.splitlines() if line.startswith(f"| `{old}` |")]
        assert row, f"CHANGELOG.md does not list {old}"
        for new in homes:
            assert f"`{new}`" in row[0], f"CHANGELOG.md's row for {old} does not name {new}"
