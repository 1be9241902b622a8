"""The ``tierstore`` command reads like a command line: help, config, the demo's last lines."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tierstore.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> dict[str, str]:
    """``tierstore ... --help`` of every command and subcommand, by its words."""
    out = {" ".join(("tierstore", *words)): parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_parsers(sub, (*words, name)))
    return out


def test_help_has_no_restructuredtext_markup() -> None:
    helps = _parsers(build_parser())
    assert {"tierstore", "tierstore bench", "tierstore bench train"} <= set(helps)
    for command, text in helps.items():
        assert "``" not in text, f"{command} --help:\n{text}"
        assert ":func:" not in text and ":mod:" not in text, f"{command} --help:\n{text}"


def test_help_describes_each_bench_command_in_plain_words() -> None:
    helps = _parsers(build_parser())
    assert "tierstore bench storage: disk backends against the baselines" in (
        helps["tierstore bench storage"].replace("\n", " ")
    )


def _config_rows(capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[str, str]]:
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["setting", "value", "source"]
    return {line[:18].strip(): (line[19:43].strip(), line[44:]) for line in lines[1:]}


def test_config_shows_every_size_in_units(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSTORE_HOST_POOL_STEP", "128MiB")
    rows = _config_rows(capsys)
    assert rows["host_pool_step"] == (
        "128.0 MiB",
        "environment variable TIERSTORE_HOST_POOL_STEP",
    )
    assert rows["prefetch_bytes"][0] == "256.0 MiB"
    assert rows["io_workers"][0] == "4"


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "none"), ("6GiB", "6.0 GiB"), ("30%", "0.3"), ("auto", "auto")]
)
def test_config_shows_activation_budget(
    value: str | None,
    shown: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if value is not None:
        monkeypatch.setenv("TIERSTORE_ACTIVATION_BUDGET", value)
    assert _config_rows(capsys)["activation_budget"][0] == shown


@pytest.mark.parametrize(
    ("value", "shown"), [(None, "0.1"), ("512MiB", "512.0 MiB"), ("5%", "0.05")]
)
def test_config_shows_memory_margin(
    value: str | None,
    shown: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if value is not None:
        monkeypatch.setenv("TIERSTORE_MEMORY_MARGIN", value)
    assert _config_rows(capsys)["memory_margin"][0] == shown


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"{target}:")))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_demo_runs_the_demo_and_no_benchmark_targets() -> None:
    # NOTE [ Demo output ]: make demo's last lines are the demo's.
    assert _recipe("demo") == ["$(BIN)/tierstore demo"]


def test_demo_ends_on_its_result(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--layers", "1", "--d-model", "32", "--seq", "16", "--batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4] == "result:"
    assert lines[-3].startswith("  peak RSS above the model's own, as top shows it (")
    assert re.fullmatch(r"  .*: eager \S+ \S+, all on disk \S+ \S+ \(\d+\.\d\dx\)", lines[-3])
    assert re.fullmatch(  # issue 34, item 8: the middle of several steps, and the ratio
        r"  step time, the middle of 5 steps after a warm-up step: eager \d+\.\d\d s, "
        r"all on disk \d+\.\d\d s \(\d+\.\d\dx\)",
        lines[-2],
    )
    assert lines[-1] == "  gradients: bitwise equal to eager (max |grad diff| = 0)"
    for line in lines:
        assert not re.search(r"MISSED|NOT EQUAL|fail|error", line, re.I), line
