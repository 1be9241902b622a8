"""benchmarks/results/README.md indexes every file there, and names only files there."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_every_results_file_has_a_row_in_the_index() -> None:
    index = (RESULTS / "README.md").read_text()
    files = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert files, "no results at all: the index would pass by listing nothing"
    listed = set(re.findall(r"^\| `([^`]+)`", index, re.M))
    named = set(re.findall(r"`(20\d\d-\d\d-\d\d-[\w.-]+\.(?:json|png|txt))`", index))
    # Each file by its full name in the first column of a row, so a search finds it.
    unlisted = sorted(name for name in files if name not in named or not _in_a_row(index, name))
    assert unlisted == [], f"not in benchmarks/results/README.md: {unlisted}"
    assert sorted(named - files) == [], "the index names files that are not there"
    assert listed <= files


def _in_a_row(index: str, name: str) -> bool:
    """Whether ``name`` is in the first column of one of the index's table rows."""
    return any(
        f"`{name}`" in line.split(" | ")[0] for line in index.splitlines() if line.startswith("| `")
    )
