"""tierstore bench train: every strategy trains the quick GPT with the gradients of ``none``."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.bench import train
from tierstore.bench.cli import add_bench_parser
from tierstore.bench.gpt import GPT, GPTConfig
from tierstore.errors import TierstoreError


def _parse(argv: list[str]) -> argparse.Namespace:
    # The same wiring the tierstore command uses.
    parser = argparse.ArgumentParser(prog="tierstore")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "train", *argv])


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    code: int = args.run(args)
    return code


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The quick model's ops are tiny: on a busy 2-core machine two OpenMP
    # threads wait on each other far longer than the work takes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bench"
    path.mkdir()
    return path


def test_every_strategy_matches_none_bitwise(
    bench_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out" / "train.json"
    argv = ["--quick", "--steps", "2", "--quiet", "--dir", str(bench_dir)]
    assert _run([*argv, "--json", str(out_json)]) == 0

    printed = capsys.readouterr().out
    table = printed[printed.index("strategy ") :]
    for name in train.CPU_STRATEGIES:
        assert f"\n{name} " in table, name
    assert "gradients differ" not in printed

    doc = json.loads(out_json.read_text())
    for key in ("benchmark", "command", "options", "machine", "torch", "settings", "model"):
        assert key in doc, key
    assert doc["benchmark"] == "train"
    assert doc["model"]["layers"] == 2 and doc["model"]["d_model"] == 64
    assert doc["model"]["saved_activation_bytes_per_step"] > 0
    assert doc["settings"]["memory_measure"] == "a fresh process, glibc M_MMAP_THRESHOLD=1 MiB"
    assert [r["name"] for r in doc["rows"]] == list(train.CPU_STRATEGIES)
    for r in doc["rows"]:
        name = r["name"]
        assert r["max_grad_diff"] == 0, name
        assert r["grads_bitwise_equal"] is True, name
        assert len(r["warmup_s"]) == 1 and len(r["step_s"]) == 2, name
        assert all(s > 0 for s in r["step_s"]), name
        assert r["median_step_s"] > 0 and r["peak_activation_bytes"] >= 0, name
        # Memory comes from the second pass, in a fresh process.
        assert r["memory_step_s"] > 0 and r["peak_bytes"] == [r["peak_activation_bytes"]]
        assert r["timeline"]["pass"] == "memory", name
        assert len(r["peak_bytes_default_allocator"]) == 2, name
        assert len(r["timeline"]["t_s"]) == len(r["timeline"]["memory_bytes"]) >= 2, name
        assert r["step_vs_none"] > 0 and r["step_vs_naive"] > 0, name
        if name.startswith("tierstore-"):
            disk = r["tiers"]["disk"]
            # Everything offloadable went to disk (budgets 0 above it) and came back.
            assert disk["peak_bytes"] > 0 and disk["written_per_step"] > 0, name
            assert disk["read_per_step"] > 0, name
            assert r["tiers"]["host"]["peak_bytes"] == 0, name
            assert r["config"]["disk_backend"] == name.removeprefix("tierstore-")
            assert r["config"]["device_budget"] == 0 and r["config"]["host_budget"] == 0
            tiers = r["timeline"]["tiers"]
            assert len(tiers["t_s"]) == len(tiers["disk"]) >= 2 and max(tiers["disk"]) > 0
            rate = r["prefetch"]["hit_rate"]
            assert rate is None or 0.0 <= rate <= 1.0
        elif name == "checkpoint+tierstore":
            # Only the block inputs are offloaded: less than full offload writes.
            disk = r["tiers"]["disk"]
            full = next(x for x in doc["rows"] if x["name"] == "tierstore-file")
            assert 0 < disk["written_per_step"] < full["tiers"]["disk"]["written_per_step"]
            assert r["config"]["disk_backend"] == "file"
        else:
            assert r["tiers"] is None and r["prefetch"] is None, name
            assert r["timeline"]["tiers"] == {}, name
    none = doc["rows"][0]
    assert none["step_vs_none"] == pytest.approx(1.0)
    assert none["memory_vs_none"] in (None, pytest.approx(1.0))
    checks = {(t["strategy"], t["check"]) for t in doc["targets"]}
    assert ("tierstore-file", "max |grad diff| vs none") in checks
    assert ("tierstore-lmdb", "peak activation memory vs none") in checks
    # disk-naive's files and the stores' spill directories are gone.
    assert list(bench_dir.iterdir()) == []


def test_a_strategy_with_other_gradients_is_reported(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # disk-naive hands back a slightly different tensor: the check must see it.
    unpack = train._NaiveDisk._unpack

    def off_by_a_bit(self: Any, temp_file: Any) -> torch.Tensor:
        t = unpack(self, temp_file)
        return t + 1e-3 if t.is_floating_point() else t

    monkeypatch.setattr(train._NaiveDisk, "_unpack", off_by_a_bit)
    argv = ["--quick", "--steps", "1", "--warmup", "0", "--quiet", "--dir", str(bench_dir)]
    assert _run([*argv, "--no-memory-pass", "--strategies", "none,disk-naive"]) == 1
    printed = capsys.readouterr().out
    assert "gradients differ from none's: disk-naive" in printed
    assert "disk-naive: " not in printed  # targets are printed for tierstore rows only


def test_gradients_are_compared_on_the_last_step(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A difference in the warm-up step only still shows: the weights it
    # updated differ in every later step.
    class OnceOff(train._NaiveDisk):
        calls = 0

        def _unpack(self, temp_file: Any) -> torch.Tensor:
            # The first ten unpacks lie in the warm-up's backward, which
            # unpacks many more. (The very first, log_softmax's output for
            # nll_loss, is used for its shape only: changing it alone is a
            # no-op.)
            t = super()._unpack(temp_file)
            OnceOff.calls += 1
            return t * 1.5 if OnceOff.calls <= 10 and t.is_floating_point() else t

    monkeypatch.setattr(train, "_NaiveDisk", OnceOff)
    settings = train.quick_settings(
        steps=1,
        warmup=1,
        strategies=("none", "disk-naive"),
        directory=str(bench_dir),
        memory_pass=False,
    )
    report = train.bench_train(settings, show_progress=False)
    row = report.row("disk-naive")
    assert row is not None and OnceOff.calls > 20
    assert row.max_grad_diff is not None and row.max_grad_diff > 0
    assert row.grads_bitwise_equal is False


def test_a_failing_memory_pass_says_why(bench_dir: Path) -> None:
    settings = train.quick_settings(directory=str(bench_dir / "missing"))
    with pytest.raises(TierstoreError, match=r"memory pass .* failed with exit status 1"):
        train._memory_pass(settings, ["disk-naive"], 64 << 20, train.Progress(2, enabled=False))


def test_peak_memory_sees_a_step_that_allocates(bench_dir: Path) -> None:
    # A strategy that holds 64 MiB more during its forward must show it: the
    # sampler and the malloc_trim baseline work.
    class Hog(train._Strategy):
        @contextlib.contextmanager
        def forward(self) -> Iterator[None]:
            ballast = torch.ones(16 << 20)  # 64 MiB, written, so resident
            time.sleep(0.02)  # several sampling periods
            yield
            del ballast

    settings = train.quick_settings(directory=str(bench_dir))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, d_model=64, heads=2, layers=2, seq=64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    bench = train._Bench(settings, model, torch.device("cpu"), bench_dir, 1 << 26)
    try:
        plain = [bench._step(train._Strategy("none"), opt, i)[1] for i in range(3)]
        hog = [bench._step(Hog("hog"), opt, i)[1] for i in range(3)]
    finally:
        bench.close()
    # The first step of each allocates the gradients; compare the others.
    assert min(hog[1:]) - max(plain[1:]) > 48 << 20


def test_plot_is_a_png(bench_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (tierstore[bench])")
    png = tmp_path / "plots" / "train.png"
    argv = ["--quick", "--steps", "1", "--quiet", "--dir", str(bench_dir)]
    argv += ["--strategies", "none,tierstore-file", "--no-memory-pass", "--plot", str(png)]
    assert _run(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_quick_picks_a_tiny_model_and_flags_win() -> None:
    s = train.settings_from_args(_parse(["--quick", "--layers", "3"]))
    assert (s.layers, s.d_model, s.seq) == (3, 64, 64)
    s = train.settings_from_args(_parse([]))
    assert (s.layers, s.d_model, s.heads, s.seq, s.batch) == (6, 512, 8, 512, 8)
    assert (s.steps, s.warmup, s.device, s.memory_pass) == (4, 1, "cpu", True)
    assert s.strategies == ()  # the device's defaults
    assert train.settings_from_args(_parse(["--no-memory-pass"])).memory_pass is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "none,offload"], "strategy 'offload' is unknown"),
        (["--steps", "0"], "steps >= 1"),
        (["--d-model", "65"], "not a multiple of heads"),
        (["--device", "tpu"], "--device tpu is not cpu or cuda"),
        (["--device", "meta"], "--device meta is not cpu or cuda"),
    ],
)
def test_bad_options_name_the_option(bench_dir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(TierstoreError, match=message):
        _run(["--quick", "--quiet", "--dir", str(bench_dir), *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only torch")
def test_cuda_without_a_gpu_says_so(bench_dir: Path) -> None:
    with pytest.raises(TierstoreError, match=r"torch\.cuda\.is_available"):
        _run(["--quick", "--quiet", "--dir", str(bench_dir), "--device", "cuda"])
