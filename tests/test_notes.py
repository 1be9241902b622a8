"""The code's notes hold together: one title each, and every 'NOTE [ X ] in file' finds X there.

A note (``# NOTE [ Title ]`` on a line of its own) states a rule; code and
docs point at it by title, often with the file that holds it. A move that
leaves a pointer behind sends the next engineer to the wrong file, so every
pointer that names a file is checked here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_DEFINITION = re.compile(r"\s*#\s*NOTE \[ (.+?) \]\s*$")
# "NOTE [ Title ] in path.py", the path maybe in backticks or parentheses; read
# with every line break (and a comment's leading "#") folded into one space, so
# a pointer wrapped anywhere, the title included, is found.
_POINTER = re.compile(
    r"NOTE ?\[ ([^\]]+?) \](?:[^\[\]]{0,3}|[\s*`,]*)\bin\s*[`(]?"
    r"((?:tierstore/)?(?:[a-z_]+/)*[a-z_]+\.py)"
)
_FOLD = re.compile(r"\s*\n\s*(?:#+\s*)?")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / name for name in out.split() if not name.startswith("benchmarks/results/")]


def _definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _tracked("tierstore/*.py", "backends/*.py"):
        for line in path.read_text().splitlines():
            match = _DEFINITION.match(line)
            if match:
                found.setdefault(match[1], []).append(str(path.relative_to(ROOT)))
    return found


def test_each_note_title_stands_once() -> None:
    twice = {title: homes for title, homes in _definitions().items() if len(homes) > 1}
    assert not twice


def test_a_note_named_with_its_file_is_in_that_file() -> None:
    notes = _definitions()
    assert len(notes) > 50  # the walk found the package's notes
    stale = []
    for path in _tracked("*.py", "*.md", "*.sh"):
        for match in _POINTER.finditer(_FOLD.sub(" ", path.read_text())):
            title, named = match[1], match[2]
            homes = notes.get(title)
            if homes is None:
                continue  # a note of another project (torch's), or prose
            short = named.removeprefix("tierstore/")
            if not any(home.endswith(short) for home in homes):
                stale.append(f"{path.relative_to(ROOT)}: NOTE [ {title} ] in {named}: {homes}")
    assert not stale, "\n".join(stale)
