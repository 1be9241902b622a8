"""Soak (issue 6, item 6): 50 steps of the tiny GPT on disk; nothing grows, and a leak shows.

The 500-step soak of the default model is ``tierstore bench soak`` (see
benchmarks/README.md); these run the same :func:`run_soak` on the tiny model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore.bench.cli import add_bench_parser
from tierstore.bench.report import command_line
from tierstore.bench.soak import MetricCheck, SoakResult, run_soak, tiny_settings
from tierstore.tiers.release import close_collected

STEPS = 50


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The tiny model's ops are small: one OpenMP thread is faster on 2 busy cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _row(result: SoakResult, name: str) -> MetricCheck:
    row = result.row(name)
    assert row is not None, name
    return row


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_fifty_steps_on_disk_stay_flat(backend: str, tmp_path: Path) -> None:
    result = run_soak(
        tiny_settings(steps=STEPS, backend=backend, directory=str(tmp_path)), show_progress=False
    )
    assert result.ok, result.problems
    assert len(result.samples["step_s"]) == STEPS
    assert result.settings["warmup_steps"] == 5

    for name in (
        "open file descriptors",
        "threads (threading)",
        "threads (/proc/self/task)",
        "spill files",
    ):
        row = _row(result, name)
        assert row.low == row.high == row.baseline, (name, row)
    for name in ("spill allocated bytes", "spill logical bytes"):
        row = _row(result, name)
        if backend == "file":  # grown on demand by the first steps, within the budget
            assert row.high == row.baseline <= result.store["disk_budget"], (name, row)
        else:  # NOTE [ What bench soak measures ]: LMDB's file may creep up to its map
            assert row.high <= result.store["lmdb_map_size"], (name, row)
    assert _row(result, "spill allocated bytes").baseline > 0  # the disk tier was used
    rss = _row(result, "anonymous RSS")
    assert rss.growth < 64 << 20 and rss.slope_per_100_steps is not None
    assert rss.slope_per_100_steps < 8 << 20
    # Backward released every entry, in every step.
    assert set(result.samples["tier_bytes_after_backward"]) == {0}
    assert set(result.samples["entries_after_backward"]) == {0}
    assert all(t["met"] for t in result.targets), result.targets
    assert result.model["nonfinite_steps"] == []
    assert result.samples["loss"][0] == result.model["eager_step1_loss"]


def test_a_store_left_unclosed_before_the_soak_is_not_counted_against_it(tmp_path: Path) -> None:
    # NOTE [ Finalizers and interrupts ]: a store collected unclosed is closed by
    # the next store made or closed, here the soak's; its threads and file
    # descriptors must not read as the soak's store giving back more than it took.
    gc.collect()
    close_collected()  # those earlier tests left
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    config = tierstore.TierConfig(
        device_budget=0,
        host_budget=0,
        disk_budget="4MiB",
        disk_path=tmp_path / "left",
        min_offload_bytes=0,
    )
    left = tierstore.TierStore(config)
    x = torch.randn(4096, requires_grad=True)
    with left.offload():
        y = x.exp()
    y.sum().backward()
    spill = left.disk_directory
    assert spill is not None and os.path.isdir(spill)
    del left, x, y
    assert threading.active_count() > threads and len(os.listdir("/proc/self/fd")) > fds
    result = run_soak(
        tiny_settings(steps=6, warmup=2, directory=str(tmp_path)), show_progress=False
    )
    assert result.ok, result.problems
    assert not os.path.exists(spill)  # closed, before the soak counted
    assert threading.active_count() == threads and len(os.listdir("/proc/self/fd")) == fds


def test_a_leaked_file_descriptor_per_step_is_caught(tmp_path: Path) -> None:
    leaked: list[int] = []

    def leak(step: int, store: tierstore.TierStore) -> None:
        leaked.append(os.open(os.devnull, os.O_RDONLY))

    try:
        result = run_soak(
            tiny_settings(steps=12, warmup=2, directory=str(tmp_path)),
            on_step=leak,
            show_progress=False,
        )
    finally:
        for fd in leaked:
            os.close(fd)
    row = _row(result, "open file descriptors")
    assert not row.flat and not result.flat and not result.ok
    assert row.growth == 10
    assert (
        row.reason
        == f"moved between {row.baseline:g} and {row.high:g} after step 2 (was {row.baseline:g})"
    )
    assert any(p.startswith("open file descriptors: moved") for p in result.problems)


def test_a_leaked_thread_per_step_is_caught(tmp_path: Path) -> None:
    stop = threading.Event()
    started: list[threading.Thread] = []

    def leak(step: int, store: tierstore.TierStore) -> None:
        thread = threading.Thread(target=stop.wait, daemon=True)
        thread.start()
        started.append(thread)

    try:
        result = run_soak(
            tiny_settings(steps=10, warmup=2, directory=str(tmp_path)),
            on_step=leak,
            show_progress=False,
        )
    finally:
        stop.set()
        for thread in started:
            thread.join()
    assert not _row(result, "threads (threading)").flat
    assert not _row(result, "threads (/proc/self/task)").flat
    assert not result.flat


def test_leaked_memory_is_caught_by_the_rss_slope(tmp_path: Path) -> None:
    # 2 MiB a step: 60 MiB after the warm-up, under the 64 MiB growth limit;
    # the slope (200 MiB per 100 steps) is what catches it.
    kept: list[torch.Tensor] = []

    def leak(step: int, store: tierstore.TierStore) -> None:
        kept.append(torch.ones(2 << 20, dtype=torch.uint8))  # ones: resident pages

    result = run_soak(
        tiny_settings(steps=35, warmup=5, directory=str(tmp_path)),
        on_step=leak,
        show_progress=False,
    )
    rss = _row(result, "anonymous RSS")
    assert not rss.flat and not result.flat
    assert rss.slope_per_100_steps is not None and rss.slope_per_100_steps > 100 << 20
    assert "per 100 steps" in rss.reason, rss.reason


def test_saved_tensors_kept_past_backward_are_caught(tmp_path: Path) -> None:
    # A graph that is never backpropagated keeps its entries on disk.
    kept: list[torch.Tensor] = []
    x = torch.randn(64, 64, requires_grad=True)

    def leak(step: int, store: tierstore.TierStore) -> None:
        with store.offload():
            kept.append(x.exp())

    result = run_soak(
        tiny_settings(steps=8, warmup=2, directory=str(tmp_path)),
        on_step=leak,
        show_progress=False,
    )
    entries = _row(result, "entries after backward")
    assert not entries.flat and entries.final == 8
    assert not _row(result, "tier bytes after backward").flat
    assert result.samples["entries_after_backward"] == list(range(1, 9))


def test_bench_soak_command_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tierstore")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "out" / "soak.json"
    argv = ["bench", "soak", "--tiny", "--steps", "8", "--warmup", "2", "--quiet"]
    argv += ["--backends", "file,lmdb", "--dir", str(tmp_path), "--json", str(out)]
    args = parser.parse_args(argv)
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    assert "tierstore bench soak (file)" in printed and "tierstore bench soak (lmdb)" in printed
    assert printed.count("flat: yes; checks: all met") == 2
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "soak" and doc["ok"] is True and doc["flat"] is True
    assert doc["command"] == command_line()  # this process's argv (pytest's, here)
    assert [r["settings"]["backend"] for r in doc["runs"]] == ["file", "lmdb"]
    assert len(doc["runs"][0]["samples"]["open_fds"]) == 8
    assert {r["name"] for r in doc["runs"][1]["rows"]} >= {"open file descriptors", "anonymous RSS"}
