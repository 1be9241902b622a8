"""Every example in the docs runs (README, docs/*.md, docstrings), and the docs hold together."""

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
        "tierstore.planning.planner",
        "tierstore.planning.runner",
        "tierstore.backends.lmdb",
        "tierstore.bench.train",
    ):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def _run_blocks_cleanly(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a page's python blocks with the temp dir at tmp_path; they leave no empty directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    name = str(page.relative_to(ROOT))
    for block in _python_blocks(page):
        exec(compile(block, name, "exec"), {})
    gc.collect()
    # The examples clean up after themselves: no empty directory of theirs is
    # left; a store's own spill directory goes when the store closes (the one
    # behind offload() at exit).
    left = [p.name for p in tmp_path.iterdir() if p.is_dir() and not any(p.iterdir())]
    assert not [n for n in left if not n.startswith("torchinductor")], left  # torch's cache
    # Nothing else either, but the spill directories of offload()'s stores.
    others = [p.name for p in tmp_path.iterdir() if not p.name.startswith(("tierstore-", "torch"))]
    assert others == [], f"{name} left {others} in the temp dir"


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(_python_blocks(ROOT / "README.md")) >= 2
    _run_blocks_cleanly(ROOT / "README.md", tmp_path, monkeypatch)


def test_recipes_has_its_recipes() -> None:
    blocks = _python_blocks(ROOT / "docs" / "recipes.md")
    assert len(blocks) >= 4
    # The activation_budget recipe: a fraction, and the plan printed.
    assert [b for b in blocks if "activation_budget=0." in b and "store.plan()" in b]


@pytest.mark.parametrize("page", [p for p in DOCS if _python_blocks(p)], ids=lambda p: p.name)
def test_docs_python_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_blocks_cleanly(page, tmp_path, monkeypatch)


def test_compile_recipe_runs_without_a_warning_tierstore_causes() -> None:
    (block,) = [b for b in _python_blocks(ROOT / "docs" / "recipes.md") if "torch.compile(" in b]
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


def test_readme_stays_short() -> None:
    # The README is the way in; the depth lives in docs/.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_configuration_page_lists_every_setting() -> None:
    from tierstore import TierConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in TierConfig.model_fields:
        assert f"| `{name}` | `TIERSTORE_{name.upper()}` |" in page, name


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_cited_results_exist(page: Path) -> None:
    text = page.read_text()
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        unknown_anchor = bool(anchor) and file.suffix == ".md" and anchor not in _anchors(file)
        if not file.exists() or unknown_anchor:
            broken.append(target)
    # A results file named in the text (in a path or alone) is one that exists.
    results = ROOT / "benchmarks" / "results"
    for name in set(re.findall(r"\b(20\d\d-\d\d-\d\d-[\w.-]+\.(?:json|png|txt))", text)):
        if not (results / name).exists():
            broken.append(f"benchmarks/results/{name}")
    assert broken == [], f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_user_docs_tell_no_development_history(page: Path) -> None:
    # Words about the software, not about how it was developed.
    text = page.read_text()
    assert not re.findall(r"(?i)\bissues?\s+#?\d+|\bcommit\s+`?[0-9a-f]{7}", text)
    assert not re.findall(r"(?i)development (?:machine|vm)", text)


# Pages that name the code: the user docs, the benchmarks' README and the architecture page.
CODE_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]


def _prose(page: Path) -> str:
    """A page without its code blocks, whitespace made single spaces (a name may wrap)."""
    return re.sub(r"\s+", " ", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))


def _resolves(dotted: str) -> bool:
    """Whether ``tierstore.x.y`` is a module of the package, or a name one defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: p.name)
def test_the_code_a_page_names_exists(page: Path) -> None:
    # A file moved or a module renamed leaves no page pointing at the old place.
    text = _prose(page)
    paths = re.findall(r"`((?:tierstore|backends|benchmarks|tests)/[\w/.-]+\.(?:py|sh))`", text)
    dotted = re.findall(r"`(tierstore(?:\.\w+)+)`", text)
    missing = [p for p in paths if not (ROOT / p).exists()]
    missing += [d for d in dotted if not d.endswith(".toml") and not _resolves(d)]
    assert missing == [], f"{page.name} names {missing}"


def _notes() -> dict[str, set[str]]:
    """Every note's title -> the files that hold it (its own line, in a comment or docstring)."""
    found: dict[str, set[str]] = {}
    for path in [p for d in ("tierstore", "backends", "tests") for p in (ROOT / d).rglob("*.py")]:
        for title in re.findall(r"^[ \t]*(?:# )?NOTE \[ (.+?) \][ \t]*$", path.read_text(), re.M):
            found.setdefault(title, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: p.name)
def test_the_notes_a_page_names_exist_where_it_says(page: Path) -> None:
    notes = _notes()
    text = re.sub(r"`[^`]*NOTE \[[^`]*`", "", _prose(page))  # `NOTE [ ... ]`: the form, not a note
    wrong = []
    for title, path in re.findall(r"NOTE \[ (.+?) \](?:\)?,? in `([\w/.]+\.py)`)?", text):
        if title not in notes:
            wrong.append(f"NOTE [ {title} ] (no such note)")
        elif path and not any(f.endswith(path) for f in notes[title]):
            wrong.append(f"NOTE [ {title} ] is not in {path} but in {sorted(notes[title])}")
    assert wrong == [], f"{page.name}: {wrong}"


def test_the_architecture_page_names_every_module_of_the_layers() -> None:
    # A module added to a layer's folder gets its line on the page.
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(ROOT))
        for folder in ("autograd", "planning", "tiers")
        for path in sorted((ROOT / "tierstore" / folder).glob("[!_]*.py"))
        if f"`{path.relative_to(ROOT)}`" not in text
    ]
    assert unnamed == [], f"docs/architecture.md does not name {unnamed}"
