"""Every example in the docs runs: README code blocks and each module's docstring examples."""

from __future__ import annotations

import doctest
import gc
import importlib
import pkgutil
import re
import tempfile
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> list[str]:
    """Every module of the package, walked rather than listed: a new one cannot be missed."""
    names = ["tierstore", "tierstore.backends"]
    for package in ("tierstore", "tierstore.backends"):
        path = importlib.import_module(package).__path__
        names += [m.name for m in pkgutil.walk_packages(path, f"{package}.")]
    return sorted(set(names))


MODULES = _modules()


def test_the_walk_finds_every_module() -> None:
    # A walk that found nothing would pass every doctest by running none.
    for name in (
        "tierstore.planner",
        "tierstore.plans",
        "tierstore.backends.lmdb",
        "tierstore.bench.train",
    ):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    gc.collect()
    # The examples clean up after themselves (issue 34, item 10): no empty
    # directory of theirs is left; a store's own spill directory goes when
    # the store closes (the one behind offload() at exit).
    left = [p.name for p in tmp_path.iterdir() if p.is_dir() and not any(p.iterdir())]
    assert not [name for name in left if not name.startswith("torchinductor")]  # torch's cache


def test_recipes_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "recipes.md").read_text(), re.S)
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, "docs/recipes.md", "exec"), {})


def test_compile_recipe_runs_without_a_warning_tierstore_causes() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "recipes.md").read_text(), re.S)
    (block,) = [b for b in blocks if "torch.compile(" in b]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(block, "docs/recipes.md", "exec"), {})
    package = str(ROOT / "tierstore")
    # torch.compile(module) blames the caller for global module hooks: tierstore must have none.
    ours = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if w.filename.startswith(package) or "global hooks" in str(w.message)
    ]
    assert ours == []


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    fence = lines.index("```sh")
    assert lines[fence + 1].startswith("make demo") and lines[fence + 2].startswith("make test")
    assert fence < 5


def test_readme_lists_every_setting() -> None:
    from tierstore import TierConfig

    readme = (ROOT / "README.md").read_text()
    for name in TierConfig.model_fields:
        assert f"| `{name}` | `TIERSTORE_{name.upper()}` |" in readme, name
