"""tierstore bench train: model-size options, the sweep's models, output width, JSON size."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from tierstore.bench import train, train_measure, train_report, train_strategies, train_sweep
from tierstore.bench.train_settings import MODEL_OPTIONS
from tierstore.errors import TierstoreError
from tierstore.models import build_model, saved_bytes
from tierstore.stats import TIERS

from .conftest import parse_bench, run_bench


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_bench(["train", *argv])


def _run(argv: list[str]) -> int:
    return run_bench(["train", *argv])


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the model's size -------------------------------------------------------------


def test_the_size_options_build_a_model_of_that_shape() -> None:
    argv = ["--layers", "3", "--d-model", "48", "--heads", "3", "--seq", "20"]
    settings = train.settings_from_args(_parse([*argv, "--batch", "5", "--vocab", "70"]))
    model = build_model(settings, torch.device("cpu"))
    assert len(model.blocks) == 3
    assert model.tok.weight.shape == (70, 48) and model.head.weight.shape == (70, 48)
    assert model.pos.weight.shape == (20, 48)
    assert {block.heads for block in model.blocks} == {3}
    tokens = train_measure._tokens(settings, 0, torch.device("cpu"))
    assert tokens.shape == (5, 21) and int(tokens.max()) < 70
    assert model.loss(tokens).shape == ()


def test_the_size_options_win_over_quick() -> None:
    s = train.settings_from_args(_parse(["--quick", "--seq", "32", "--batch", "2"]))
    assert (s.layers, s.d_model, s.heads, s.seq, s.batch, s.vocab) == (2, 64, 2, 32, 2, 128)


@pytest.mark.parametrize("name", sorted(MODEL_OPTIONS))
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_size_below_one_names_the_option_and_the_value(
    tmp_path: Path, name: str, value: str
) -> None:
    option = MODEL_OPTIONS[name]
    with pytest.raises(TierstoreError) as caught:
        _run(["--quick", "--quiet", "--dir", str(tmp_path), option, value])
    assert str(caught.value) == (
        f"tierstore: bench train: {option} {value}: expected a whole number >= 1"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_a_size_that_is_no_number_is_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parse(["--layers", "six"])
    assert "argument --layers: invalid int value: 'six'" in capsys.readouterr().err


def test_checkpointing_more_blocks_than_the_model_has_is_refused(tmp_path: Path) -> None:
    message = (
        "tierstore: bench train: strategy 'checkpoint-3': the model has 2 blocks "
        "(--layers 2); checkpoint-N takes N from 1 to 2"
    )
    with pytest.raises(TierstoreError) as caught:
        _run(["--quick", "--quiet", "--dir", str(tmp_path), "--strategies", "none,checkpoint-3"])
    assert str(caught.value) == message
    settings = train.settings_from_args(_parse(["--quick", "--strategies", "checkpoint-2"]))
    train_strategies.check_strategies(settings)  # all the blocks: as checkpoint


# -- the sweep's models -----------------------------------------------------------


def test_the_sweep_runs_a_small_and_a_large_model() -> None:
    runs = train.runs_from_args(_parse(["--sweep", "--budget", "0.3", "--steps", "2"]))
    assert [s.d_model for s in runs] == [256, 512]
    for settings, name in zip(runs, ("small", "large"), strict=True):
        shape = {key: getattr(settings, key) for key in MODEL_OPTIONS}
        assert shape == train.SWEEP_MODELS[name]
        rows = train_sweep.sweep_strategies(settings.layers)
        # The sweep's rows, then the budgets asked for beside them.
        assert settings.strategies == (*rows, "budget=0.3")
        assert settings.steps == 2
    # The large model is the default one.
    default = train.default_settings()
    assert train.SWEEP_MODELS["large"] == {key: getattr(default, key) for key in MODEL_OPTIONS}


@pytest.mark.parametrize(
    ("argv", "shape"),
    [
        (["--quick"], (2, 64, 64, 4)),
        (["--seq", "128"], (6, 512, 128, 8)),
        (["--layers", "4", "--d-model", "128", "--heads", "4"], (4, 128, 512, 8)),
    ],
)
def test_size_options_sweep_their_model_alone(argv: list[str], shape: tuple[int, ...]) -> None:
    (settings,) = train.runs_from_args(_parse(["--sweep", *argv]))
    assert (settings.layers, settings.d_model, settings.seq, settings.batch) == shape
    assert settings.strategies == train_sweep.sweep_strategies(settings.layers)


def _block_saves(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes one block's forward saves that are not parameters."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            saved += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return saved


def test_checkpointing_every_block_of_the_small_sweep_model_fits_a_third_of_its_saves() -> None:
    # What the small model is for: checkpointing every block holds the block
    # inputs, the saves outside the blocks, and one block rebuilt in backward,
    # which is less than a 0.3 budget of what the step saves (counted, not timed).
    settings = train.default_settings(**train.SWEEP_MODELS["small"])
    model = build_model(settings, torch.device("cpu"))
    tokens = train_measure._tokens(settings, 0, torch.device("cpu"))
    _, saved = saved_bytes(model, tokens)
    x = torch.randn(settings.batch, settings.seq, settings.d_model)
    per_block = _block_saves(model.blocks[0], x)
    outside = saved - settings.layers * per_block
    inputs = settings.layers * x.numel() * x.element_size()
    held = outside + inputs + per_block
    assert 0 < outside < per_block
    assert held < 0.3 * saved, (held, saved)


def test_a_sweep_of_two_models_writes_both_and_draws_a_panel_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--sweep draws with matplotlib (tierstore[bench])")
    small = {"layers": 2, "d_model": 32, "heads": 2, "seq": 16, "batch": 2, "vocab": 64}
    monkeypatch.setitem(train.SWEEP_MODELS, "small", small)
    monkeypatch.setitem(train.SWEEP_MODELS, "large", {**small, "layers": 3, "seq": 32})
    monkeypatch.setattr(train_sweep, "SWEEP_BUDGETS", ("0.5",))  # one budget row: seconds
    out_json = tmp_path / "sweep.json"
    argv = ["--sweep", "--steps", "1", "--warmup", "0", "--in-process", "--no-live-pass"]
    assert _run([*argv, "--quiet", "--dir", str(tmp_path), "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("tierstore bench train: GPT ") == 2
    doc = json.loads(out_json.read_text())
    assert "rows" not in doc and len(doc["runs"]) == 2
    for run, layers, seq in zip(doc["runs"], (2, 3), (16, 32), strict=True):
        assert (run["model"]["layers"], run["model"]["seq"]) == (layers, seq)
        names = [r["name"] for r in run["rows"]]
        assert sorted(names) == sorted(train_sweep.sweep_strategies(layers))
        assert "budget=0.5" in names and f"checkpoint-{layers - 1}" in names
        assert all(r["grads_bitwise_equal"] for r in run["rows"])
    png = out_json.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- 100 columns ------------------------------------------------------------------


def _row(name: str, **fields: Any) -> train.StrategyResult:
    # Every figure as wide as it gets: the widest cells the table can hold.
    r = train.StrategyResult(
        name,
        median_step_s=123.456,
        peak_memory_bytes=1023 << 20,
        peak_allocated_bytes=1023 << 20,
        max_grad_diff=1.1920929e-07,
        **fields,
    )
    if name.startswith(("tierstore", "checkpoint+", "budget")):
        tier = {"peak_bytes": 1023 << 20, "written_per_step": 1023 << 20, "read_per_step": 1}
        r.tiers = {t: dict(tier) for t in TIERS}
        r.moved_per_step = float(1023 << 20)
        r.prefetch = {"hit_rate": 1.0}
    return r


def _widest_report(cuda: bool, saved: int) -> train.TrainReport:
    names = list(train.CUDA_STRATEGIES if cuda else train.CPU_STRATEGIES)
    names += [n + train_strategies.RECOMPUTE_SUFFIX for n in train_strategies._RECOMPUTABLE]
    names += ["checkpoint-12", "budget=512MiB", "budget=0.35"]
    live = {} if cuda else {"peak_live_bytes": 1023 << 20, "live_step_s": 1.0}
    rows = [_row(name, **live) for name in names]
    plan = {
        "bytes": {"keep": 1023 << 20, "offload": 1023 << 20, "rebuild": 1023 << 20},
        "fits": False,
        "floor_bytes": 1023 << 20,
        "budget_bytes": 1023 << 20,
        "predicted_step_s": 123.456,
        "predicted_peak_bytes": 1023 << 20,
        "measured_by_store_peak_bytes": 1023 << 20,
        "measured_vs_predicted": 1.0,
    }
    for r in rows:
        if r.name.startswith("budget"):
            r.plan = plan
    train_report._add_ratios(rows)
    settings = {
        "isolate": True,
        "warmup": 1,
        "steps": 4,
        "memory_measure": train_measure._memory_measure(cuda, True),
        "live_measure": None if cuda else "live memory (M_MMAP_THRESHOLD=1MiB, a fresh process)",
        "device_budget_bytes": 1 << 30,
        "min_offload_bytes": 0,
        "compression": "none",
        "skipped": {"torchtune": "torchtune is not importable: ModuleNotFoundError: no torchtune"},
    }
    model = {
        "device": "cuda:0" if cuda else "cpu",
        "saved_activation_bytes_per_step": saved,
        "layers": 12,
        "d_model": 4096,
        "heads": 32,
        "seq": 2048,
        "batch": 8,
        "vocab": 50257,
        "parameters": 2_500_000_000,
    }
    targets = train_report._targets(rows, cuda)
    return train.TrainReport(rows=rows, settings=settings, targets=targets, model=model)


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("saved", [3 << 20, train.TARGET_SAVED_BYTES])
def test_what_bench_train_prints_fits_100_columns(cuda: bool, saved: int) -> None:
    report = _widest_report(cuda, saved)
    printed = train_report._describe(report) + "\n\n" + train.format_train(report)
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    # Two tables, every row in the headline one; nothing was cut.
    assert sum(line.startswith("strategy ") for line in lines) == 2
    for r in report.rows:
        assert any(line.startswith(f"{r.name} ") for line in lines), r.name
    # Every target is printed at the targets' size; below it, the gradients' only.
    words = " ".join(printed.split())
    for t in report.targets:
        line = " ".join(train_report._format_target(t).split())
        assert (line in words) == (saved >= train.TARGET_SAVED_BYTES or "grad" in t["check"])


def test_a_run_prints_nothing_wider_than_100_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--quick", "--steps", "1", "--warmup", "0", "--quiet", "--dir", str(tmp_path)]
    assert _run([*argv, "--strategies", "none,disk-naive,tierstore-file", "--budget", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert re.match(
        r"strategy +step s +vs none +vs naive +peak RSS +vs none +vs naive ",
        "\n".join(line for line in lines if line.startswith("strategy ")),
    )


# -- the JSON ---------------------------------------------------------------------


def test_the_json_keeps_a_few_hundred_points_per_timeline_and_every_peak() -> None:
    n, tier_n = 7000, 1500
    memory = [(i * 37) % 1000 for i in range(n)]
    memory[4321] = 5000  # the step's peak: one sample among thousands
    tiers: dict[str, Any] = {"t_s": [0.005 * i for i in range(tier_n)]}
    for k, tier in enumerate(TIERS):
        tiers[tier] = [(i * (k + 3)) % 100 for i in range(tier_n)]
    tiers["disk"][777] = 10_000
    timeline = {"step": 6, "t_s": [0.001 * i for i in range(n)], "memory_bytes": memory}
    row = train.StrategyResult(
        "tierstore-file",
        timeline={**timeline, "tiers": {}},
        tier_timeline={"step": 5, **timeline, "tiers": tiers},
    )
    report = train.TrainReport(rows=[row], settings={}, targets=[], model={})
    doc = train_report.report_json(report)
    points = train_report.JSON_TIMELINE_POINTS
    assert 100 <= points <= 500 and doc["settings"]["json_timeline_points"] == points
    (out,) = doc["rows"]
    for tl in (out["timeline"], out["tier_timeline"]):
        assert len(tl["t_s"]) == len(tl["memory_bytes"]) <= points
        assert len(tl["t_s"]) > points // 2
        assert max(tl["memory_bytes"]) == 5000
        assert tl["t_s"] == sorted(tl["t_s"]) and set(tl["t_s"]) <= set(timeline["t_s"])
    assert out["timeline"]["tiers"] == {}
    thinned = out["tier_timeline"]["tiers"]
    assert {len(v) for v in thinned.values()} == {len(thinned["t_s"])}
    assert len(thinned["t_s"]) <= points and max(thinned["disk"]) == 10_000
    # A sample is kept whole: its tiers come from the same moment.
    for i, t in enumerate(thinned["t_s"]):
        j = tiers["t_s"].index(t)
        assert [thinned[tier][i] for tier in TIERS] == [tiers[tier][j] for tier in TIERS]
    # The report itself keeps every sample (--plot draws them).
    assert len(row.timeline["t_s"]) == n and out["step_s"] == row.step_s


def test_a_run_writes_its_timelines_thinned_with_their_peaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_report, "JSON_TIMELINE_POINTS", 4)
    out_json = tmp_path / "out.json"
    argv = ["--quick", "--steps", "1", "--warmup", "1", "--quiet", "--dir", str(tmp_path)]
    argv += ["--strategies", "none,tierstore-file", "--json", str(out_json)]
    assert _run(argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["json_timeline_points"] == 4
    for r in doc["rows"]:
        assert 2 <= len(r["timeline"]["t_s"]) <= 4, r["name"]
        # The last step's peak above the baseline is its timeline's largest point.
        assert max(r["timeline"]["memory_bytes"]) == r["peak_bytes"][-1], r["name"]
    tiers = doc["rows"][1]["tier_timeline"]["tiers"]
    assert 2 <= len(tiers["t_s"]) <= 4 and max(tiers["disk"]) > 0


# -- --vary-seq (issue 54, item 5) ------------------------------------------------


def test_vary_seq_draws_each_steps_length_seeded_and_the_model_holds_the_longest() -> None:
    settings = train.settings_from_args(_parse(["--quick", "--vary-seq", "8:40", "--seed", "3"]))
    assert settings.vary_seq == (8, 40) and settings.seq == 40  # the context: MAX
    lengths = [
        train_measure._tokens(settings, step, torch.device("cpu")).shape[1] - 1
        for step in range(12)
    ]
    assert all(8 <= n <= 40 for n in lengths) and len(set(lengths)) > 3
    again = [
        train_measure._tokens(settings, step, torch.device("cpu")).shape[1] - 1
        for step in range(12)
    ]
    assert again == lengths  # seeded: every row trains on the same lengths
    fixed = train.settings_from_args(_parse(["--quick", "--seed", "3"]))
    assert train_measure._tokens(fixed, 0, torch.device("cpu")).shape == (4, 65)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--vary-seq", "40"],
            "tierstore: bench train: --vary-seq 40: expected MIN:MAX, two whole numbers "
            "with 1 <= MIN <= MAX, such as 96:256",
        ),
        (
            ["--vary-seq", "40:8"],
            "tierstore: bench train: --vary-seq 40:8: expected MIN:MAX, two whole numbers "
            "with 1 <= MIN <= MAX, such as 96:256",
        ),
        (
            ["--vary-seq", "8:40", "--seq", "32"],
            "tierstore: bench train: --vary-seq 8:40 with --seq 32: "
            "expected 1 <= MIN <= MAX <= --seq",
        ),
    ],
)
def test_a_vary_seq_no_run_can_have_is_refused(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    with pytest.raises(TierstoreError) as caught:
        _run(["--quick", "--quiet", "--dir", str(tmp_path), *argv])
    assert str(caught.value) == message
    assert list(tmp_path.iterdir()) == []  # refused before anything ran


def test_a_vary_seq_run_reports_time_per_token_and_the_share_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    argv = ["--quick", "--quiet", "--dir", str(tmp_path), "--vary-seq", "16:64", "--steps", "4"]
    argv += ["--warmup", "0", "--strategies", "none,checkpoint", "--budget", "0.3"]
    assert _run([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    words = " ".join(table.split())
    assert "us/token  planned" in table and "each step's length drawn from 16-64" in words
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "checkpoint", "budget=0.3"}
    tokens = rows["none"]["tokens"]
    assert len(tokens) == 4 and len(set(tokens)) > 1 and all(t % 4 == 0 for t in tokens)
    for row in rows.values():
        assert row["tokens"] == tokens and row["grads_bitwise_equal"] is True
        assert row["s_per_token"] == pytest.approx(sum(row["step_s"]) / sum(tokens))
    budget = rows["budget=0.3"]
    assert 0 <= budget["planned_steps"] <= 4
    assert budget["planned_share"] == budget["planned_steps"] / 4
    assert rows["none"]["planned_share"] is None and rows["checkpoint"]["planned_steps"] is None
