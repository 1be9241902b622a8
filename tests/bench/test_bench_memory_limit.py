"""tierstore bench train --memory-limit, --budget auto, --optimizer: rows in a real memory cgroup.

NOTE [ Rows under a memory limit ] in tierstore/bench/train_runs.py. The
run under a limit makes real cgroups and is skipped, with the reason, where
none can be made.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from tierstore.bench import train, train_report, train_strategies, train_sweep
from tierstore.bench.memory_limit import why_no_memory_limit
from tierstore.bench.train_measure import StrategyResult
from tierstore.errors import TierstoreError

from .conftest import parse_bench

_MIB = 1 << 20
#: 8 blocks, d_model 128, seq 256, batch 8: in a cgroup, none peaks at about
#: 560 MiB (this interpreter and torch included), checkpoint at about 370 MiB.
SHAPE = ["--layers", "8", "--d-model", "128", "--heads", "2", "--seq", "256", "--batch", "8"]
LIMIT = "460MiB"


def _parse(argv: list[str]) -> train.TrainSettings:
    return train.settings_from_args(parse_bench(["train", *argv]))


def _cgroups_left() -> list[str]:
    cgroup = next(
        line.split(":", 2)[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if line.split(":")[1] in ("memory", "")
    )
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        here = root / cgroup.lstrip("/")
        if here.is_dir():
            return [n for n in os.listdir(here) if n.startswith(f"tierstore-{os.getpid()}-")]
    return []


@pytest.mark.slow
@pytest.mark.skipif(why_no_memory_limit() is not None, reason=str(why_no_memory_limit()))
def test_a_row_the_limit_kills_is_shown_killed_and_the_others_check_their_gradients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SHAPE, "--vocab", "128", "--steps", "1", "--warmup", "0", "--no-live-pass"]
    argv += ["--strategies", "none,checkpoint", "--memory-limit", LIMIT, "--dir", str(tmp_path)]
    settings = _parse(argv)
    assert settings.memory_limit_bytes == 460 * _MIB and settings.isolate
    report = train.bench_train(settings, show_progress=False)
    none, ckpt = report.rows
    assert (none.name, none.killed, none.median_step_s, none.grads_bitwise_equal) == (
        "none",
        True,
        0.0,
        None,
    )
    assert none.cgroup_peak_bytes is not None and none.cgroup_peak_bytes <= 460 * _MIB
    assert (ckpt.name, ckpt.killed, ckpt.grads_bitwise_equal) == ("checkpoint", False, True)
    assert ckpt.median_step_s > 0 and ckpt.peak_memory_bytes > 0
    assert ckpt.cgroup_peak_bytes is not None and ckpt.cgroup_peak_bytes <= 460 * _MIB
    assert ckpt.step_vs_none is None and ckpt.memory_vs_none is None  # nothing to divide by
    assert report.settings["grad_reference"] == "none run again with no memory limit"
    lines = train_report.format_train(report).splitlines()
    none_line = next(line for line in lines if line.startswith("none "))
    assert none_line.split() == ["none", "killed", "n/a", "n/a", "killed", "n/a", "n/a", "n/a"]
    beside = next(line for line in lines if line.startswith("strategy") and "cgroup peak" in line)
    assert beside.split()[:3] == ["strategy", "cgroup", "peak"]
    assert "each row in a memory cgroup of 460.0 MiB" in train_report._describe(report)
    assert _cgroups_left() == []
    assert list(tmp_path.iterdir()) == []  # the scratch directory and every file in it


def test_a_memory_limit_needs_a_fresh_process_per_row() -> None:
    settings = _parse(["--quick", "--memory-limit", "1GiB"])
    with pytest.raises(TierstoreError) as info:
        train.bench_train(settings, show_progress=False)
    assert str(info.value).startswith(
        "tierstore: bench train: --memory-limit 1.0 GiB runs each row in a fresh process"
    )


def test_a_memory_limit_that_is_no_size_names_the_option() -> None:
    with pytest.raises(TierstoreError, match=r"^tierstore: --memory-limit 'lots' is not a size"):
        _parse(["--memory-limit", "lots"])


@pytest.mark.skipif(why_no_memory_limit() is None, reason="a memory cgroup can be made here")
def test_where_no_cgroup_can_be_made_the_command_says_why_and_runs_nothing() -> None:
    settings = _parse(["--quick", "--fresh-processes", "--memory-limit", "1GiB"])
    with pytest.raises(TierstoreError, match=r"no memory limit can be set here: "):
        train.bench_train(settings, show_progress=False)


def test_budget_auto_passes_auto_to_the_store() -> None:
    settings = _parse(["--budget", "auto,0.2", "--strategies", "none"])
    assert settings.strategies == ("none", "budget=auto", "budget=0.2")
    assert train_strategies._budget_value("auto") == "auto"


def test_adamw_is_the_update_when_asked(tmp_path: Path) -> None:
    reports = {}
    for optimizer in ("sgd", "adamw"):
        settings = _parse(["--quick", "--optimizer", optimizer, "--steps", "1", "--warmup", "0"])
        assert settings.optimizer == optimizer
        settings = replace(settings, strategies=("none",), directory=str(tmp_path))
        reports[optimizer] = train.bench_train(settings, show_progress=False)
    assert "+ AdamW update" in train_report._describe(reports["adamw"])
    assert "+ SGD update" in train_report._describe(reports["sgd"])


def _row(name: str, step: float, peak: int) -> StrategyResult:
    return StrategyResult(name, median_step_s=step, peak_memory_bytes=peak)


def test_the_sweep_draws_auto_and_the_survivors_when_none_is_killed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        StrategyResult("none", killed=True, cgroup_peak_bytes=460 * _MIB),
        _row("checkpoint", 1.3, 130 * _MIB),
        _row("budget=0.2", 1.2, 100 * _MIB),
        _row("budget=auto", 1.1, 110 * _MIB),
    ]
    model = {"layers": 4, "d_model": 256, "seq": 256, "batch": 4, "device": "cpu"}
    model["saved_activation_bytes_per_step"] = 124 * _MIB
    report = train.TrainReport(
        rows=rows, settings={"memory_limit_bytes": 460 * _MIB}, targets=[], model=model
    )
    assert train_sweep._scale(report)[2:] == ("peak memory, MiB (anonymous RSS)", "step time, s")
    assert "killed: none" in train_sweep._killed_line(report)
    path = tmp_path / "sweep.png"
    train_sweep.plot_sweeps([report], path)
    assert path.stat().st_size > 0
