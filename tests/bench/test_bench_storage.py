"""tierstore bench storage: every row runs on tiny data, checks what it read, reports numbers."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.bench import report, storage
from tierstore.bench.cli import add_bench_parser
from tierstore.errors import CorruptDataError, TierstoreError

ROWS = ["raw", "torch.save", "safetensors", "file", "file+zstd", "lmdb", "lmdb+zstd"]


def _parse(argv: list[str]) -> argparse.Namespace:
    # The same wiring the tierstore command uses.
    parser = argparse.ArgumentParser(prog="tierstore")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "storage", *argv])


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    code: int = args.run(args)
    return code


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bench"
    path.mkdir()
    return path


def test_every_row_runs_verifies_and_reports(
    bench_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out" / "storage.json"
    argv = ["--total", "8MiB", "--sizes", "1MiB,2MiB", "--repeat", "2", "--quiet"]
    argv += ["--dir", str(bench_dir), "--json", str(out_json)]
    assert _run(argv) == 0

    printed = capsys.readouterr().out
    table = printed[printed.index("row ") :]
    for name in ROWS:
        assert f"\n{name} " in table, name
    assert "file: write+read" in printed and "lmdb: write+read" in printed
    # Every column is defined above the table, latency per what and over what.
    described = printed[: printed.index("\nrow ")].replace("\n", " ")
    for definition in (
        "GB/s = 1e9 tensor bytes/s, per phase",
        "vs raw, vs torch.save = write+read GB/s over that row's",
        "p50/p99 ms = one tensor's write or read time, median and 99th percentile over every "
        "tensor of every repeat",
        "file and lmdb from a tensor's submission",
        "zstd ratio = tensor bytes / stored bytes",
    ):
        assert definition in described, definition

    doc = json.loads(out_json.read_text())
    for key in ("benchmark", "command", "options", "machine", "torch", "settings", "data"):
        assert key in doc, key
    assert doc["benchmark"] == "storage"
    assert doc["torch"] == torch.__version__
    assert doc["machine"]["cpu_count"] == os.cpu_count()
    assert doc["settings"]["total_bytes"] == 8 << 20
    assert doc["data"]["bytes"] >= 8 << 20
    assert sorted(set(doc["data"]["sizes_in_order_bytes"])) == [1 << 20, 2 << 20]
    assert [row["name"] for row in doc["rows"]] == ROWS
    for row in doc["rows"]:
        assert row["verified"] is True
        assert len(row["runs"]) == 2
        for field in (
            "write_gbps",
            "read_gbps",
            "write_read_gbps",
            "write_p50_ms",
            "write_p99_ms",
            "read_p50_ms",
            "read_p99_ms",
            "vs_raw",
            "vs_torch_save",
        ):
            assert row[field] > 0, (row["name"], field)
        assert row["write_p99_ms"] >= row["write_p50_ms"]
        # write+read lies between the two phases' throughputs.
        lo, hi = sorted([row["write_gbps"], row["read_gbps"]])
        assert lo * 0.999 <= row["write_read_gbps"] <= hi * 1.001
        if row["compression"] == "zstd":
            # gelu(randn) compresses a little once byte-shuffled; random bits would not.
            assert 1.0 < row["compression_ratio"] < 2.0
            assert row["stored_bytes"] < doc["data"]["bytes"]
        else:
            assert row["compression_ratio"] is None
            assert row["stored_bytes"] >= doc["data"]["bytes"]
    by_name = {row["name"]: row for row in doc["rows"]}
    assert by_name["raw"]["vs_raw"] == pytest.approx(1.0)
    assert by_name["torch.save"]["vs_torch_save"] == pytest.approx(1.0)
    assert {(t["row"], t["against"]) for t in doc["targets"]} == {
        ("file", "raw"),
        ("lmdb", "raw"),
        ("file", "torch.save"),
        ("lmdb", "torch.save"),
    }
    # The checksums: the one records carry is marked, each costs a share of the file row.
    sums = {c["name"]: c for c in doc["checksums"]}
    assert list(sums) == ["xxh3", "crc32c", "zlib.crc32"]
    assert [c["name"] for c in doc["checksums"] if c["used"]] == ["xxh3"]
    for c in doc["checksums"]:
        assert (c["gbps"] is None) == (c["vs_file_row"] is None)
        if c["gbps"] is not None:
            file_s = by_name["file"]["write_s"] + by_name["file"]["read_s"]
            expected = 2 * doc["data"]["bytes"] / (c["gbps"] * 1e9) / file_s
            assert c["vs_file_row"] == pytest.approx(expected)
            assert f"{c['name']}{' (used)' * c['used']} {c['gbps']:.1f} GB/s" in printed
    assert sums["xxh3"]["gbps"] is not None and sums["zlib.crc32"]["gbps"] is not None
    # Nothing left behind: the rows' files and the backends' spill directories are gone.
    assert list(bench_dir.iterdir()) == []


def test_data_looks_like_activations_not_zeros() -> None:
    sizes = storage._tensor_sizes(10 << 20, [1 << 20, 4 << 20], seed=0)
    assert sum(sizes) >= 10 << 20 and set(sizes) == {1 << 20, 4 << 20}
    tensors = storage._activations(sizes, seed=0)
    assert [t.numel() * 4 for t in tensors] == sizes
    x = torch.cat(tensors)
    assert x.dtype == torch.float32
    # gelu(randn): half the values negative but above gelu's floor (-0.17),
    # mean E[Z * Phi(Z)] = 1 / (2 sqrt(pi)) = 0.282.
    assert float(x.min()) > -0.2
    assert float((x < 0).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert float(x.mean()) == pytest.approx(0.282, abs=0.01)
    again = storage._activations(sizes, seed=1)
    assert not torch.equal(tensors[0], again[0])


def test_a_row_that_reads_back_wrong_bytes_fails(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Flip one payload byte of the record at the start of the file backend's
    # file between the write and the read phase (which entry that is depends
    # on which I/O thread allocated first): the benchmark must fail, here
    # through the record's checksum (NOTE [ Record integrity ]), before its
    # own comparison would see the bytes.
    drop = storage._drop_cache

    def corrupt_then_drop(paths: Any) -> None:
        for path in paths:
            if path.name == "entries.bin":
                with open(path, "r+b") as f:
                    f.seek(4000)
                    byte = f.read(1)[0]
                    f.seek(4000)
                    f.write(bytes([byte ^ 0xFF]))
        drop(paths)

    monkeypatch.setattr(storage, "_drop_cache", corrupt_then_drop)
    with pytest.raises(
        CorruptDataError,
        match=r"entry \d+ on the disk tier \(file backend, .*/entries.bin\) is corrupt: the \d+ "
        "payload bytes have checksum",
    ):
        storage.bench_storage(
            total_bytes=2 << 20,
            sizes=[1 << 20],
            directory=bench_dir,
            backends=["file"],
            compressions=["none"],
            repeat=1,
            show_progress=False,
        )
    assert list(bench_dir.iterdir()) == []


def test_page_cache_is_dropped_before_reads(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every row syncs and drops the files it wrote, and only those.
    synced: list[str] = []
    dropped: list[str] = []
    fsync, drop = storage._fsync, storage._drop_cache

    def spy_fsync(paths: Any) -> None:
        synced.extend(str(p) for p in paths)
        fsync(paths)

    def spy_drop(paths: Any) -> None:
        dropped.extend(str(p) for p in paths)
        drop(paths)

    monkeypatch.setattr(storage, "_fsync", spy_fsync)
    monkeypatch.setattr(storage, "_drop_cache", spy_drop)
    storage.bench_storage(
        total_bytes=2 << 20,
        sizes=[1 << 20],
        directory=bench_dir,
        repeat=1,
        show_progress=False,
    )
    names = {Path(p).parent.name for p in dropped}
    # raw fsyncs its own descriptor; the others sync through ours.
    assert {"raw", "torch.save", "safetensors", "warm-up"} <= names
    assert any("entries.bin" in p for p in dropped)
    assert any("entries.lmdb" in p for p in dropped)
    assert set(synced) <= set(dropped)
    assert any(p.endswith(".pt") for p in synced) and any("entries.bin" in p for p in synced)


def test_plot_is_a_png(bench_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (tierstore[bench])")
    png = tmp_path / "plots" / "storage.png"
    argv = ["--total", "2MiB", "--sizes", "1MiB", "--repeat", "1", "--quiet"]
    assert _run([*argv, "--dir", str(bench_dir), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_plot_without_matplotlib_fails_first_with_the_install_hint(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = report._optional

    def no_matplotlib(name: str) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name)

    monkeypatch.setattr(report, "_optional", no_matplotlib)
    ran: list[int] = []
    monkeypatch.setattr(storage, "bench_storage", lambda **kw: ran.append(1))
    args = _parse(["--dir", str(bench_dir), "--plot", "x.png"])
    with pytest.raises(TierstoreError, match=r"--plot needs matplotlib.*tierstore\[bench\]"):
        args.run(args)
    assert ran == []


def test_progress_without_rich_prints_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    real = report._optional

    def no_rich(name: str) -> Any:
        if name.startswith("rich"):
            raise ImportError(name)
        return real(name)

    monkeypatch.setattr(report, "_optional", no_rich)
    out = io.StringIO()
    with report.Progress(4e9, stream=out, rich=True) as progress, progress.phase("file write"):
        progress.advance(2e9)
    lines = out.getvalue().splitlines()
    assert "rich is not installed" in lines[0] and "tierstore[bench]" in lines[0]
    assert lines[1].startswith("[2.00/4.00 GB] file write: ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "tape"], "backend 'tape' is unknown"),
        (["--compression", "lz4"], "compression 'lz4' is unknown"),
        (["--total", "lots"], "--total 'lots' is not a size"),
        (["--repeat", "0"], "repeat >= 1"),
    ],
)
def test_bad_options_name_the_option(bench_dir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(TierstoreError, match=message):
        _run([*argv, "--dir", str(bench_dir), "--quiet"])
