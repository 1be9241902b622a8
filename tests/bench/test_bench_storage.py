"""tierstore bench storage: every row runs on tiny data, checks what it read, reports numbers."""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.bench import lmdb_path, report, storage, storage_rows
from tierstore.bench.storage_rows import PassTimes, Spread, open_session
from tierstore.errors import CorruptDataError, TierstoreError

from .conftest import parse_bench, run_bench

TIERSTORE_ROWS = ["file", "file+zstd", "lmdb", "lmdb+zstd"]


def _rows_expected(directory: Path) -> list[str]:
    # raw-buffered runs where raw can use O_DIRECT (it is raw itself otherwise).
    direct = storage_rows.direct_io_supported(directory)
    baselines = (
        ["raw", "raw-buffered", "torch.save", "safetensors"]
        if direct
        else [
            "raw",
            "torch.save",
            "safetensors",
        ]
    )
    return baselines + TIERSTORE_ROWS


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_bench(["storage", *argv])


def _run(argv: list[str]) -> int:
    return run_bench(["storage", *argv])


def _seen(path: Path) -> str:
    # What a path the bench hands over stands for, while it is open: the file
    # backend's entries.bin has no name once open, and the bench reaches it
    # through its descriptor (NOTE [ File backend unlinked ]), which links to
    # the name it was made under, marked deleted.
    return os.readlink(path) if path.parent == Path("/proc/self/fd") else str(path)


def _is_unlinked_data_file(seen: str) -> bool:
    return seen.endswith("/entries.bin (deleted)")


def _cache_is_droppable(directory: Path) -> bool:
    # tmpfs and some others keep every page whatever the advice.
    path = directory / "probe"
    path.write_bytes(b"x" * (1 << 16))
    storage_rows.fsync_files([path])
    storage_rows.drop_cache([path])
    dropped = storage_rows.resident_share([path]) == 0.0
    path.unlink()
    return dropped


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bench"
    path.mkdir()
    return path


def _check_spread(s: dict[str, float], what: str) -> None:
    assert 0 < s["min"] <= s["median"] <= s["max"], what


def test_every_row_runs_verifies_and_reports_both_phases(
    bench_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out" / "storage.json"
    argv = ["--total", "8MiB", "--sizes", "1MiB,2MiB", "--repeat", "2", "--quiet"]
    argv += ["--dir", str(bench_dir), "--json", str(out_json)]
    assert _run(argv) == 0
    rows = _rows_expected(bench_dir)

    printed = capsys.readouterr().out
    steady = printed[printed.index("steady state: ") : printed.index("first touch: ")]
    first = printed[printed.index("first touch: ") : printed.index("file: steady")]
    for table in (steady, first):
        for name in rows:
            assert f"\n{name} " in table, name
    assert "file: steady write+read" in printed and "lmdb: steady write+read" in printed
    assert "lmdb write path, steady state (2 passes" in printed
    # Every column is defined above the tables, latency per what and over what.
    described = printed[: printed.index("\nsteady state")].replace("\n", " ")
    for definition in (
        "GB/s = 1e9 tensor bytes/s, per phase, median over the repeats, [min-max] where shown",
        "vs raw, vs torch.save = write+read GB/s over that row's in the same repeat",
        "free ms = freeing the previous pass's entries",
        "p50/p99 ms = one tensor's write or read time, median and 99th percentile over every "
        "tensor of every repeat",
        "raw, file and lmdb from a tensor's submission",
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
    assert doc["settings"]["phases"] == ["steady", "first-touch"]
    assert doc["data"]["bytes"] >= 8 << 20
    assert sorted(set(doc["data"]["sizes_in_order_bytes"])) == [1 << 20, 2 << 20]
    assert [row["name"] for row in doc["rows"]] == rows
    for row in doc["rows"]:
        assert row["verified"] is True
        assert row["io_path"] in ("O_DIRECT", "buffered")
        for phase in ("steady", "first_touch"):
            figures = row[phase]
            assert figures["repeats"] == 2 and len(figures["runs"]) == 2, (row["name"], phase)
            for name in ("write_gbps", "read_gbps", "write_read_gbps", "vs_raw", "vs_torch_save"):
                _check_spread(figures[name], f"{row['name']} {phase} {name}")
            # Each repeat's write+read lies between its two phases' throughputs.
            for run in figures["runs"]:
                wr = 2 * doc["data"]["bytes"] / (run["write_s"] + run["read_s"]) / 1e9
                lo, hi = sorted(doc["data"]["bytes"] / run[k] / 1e9 for k in ("write_s", "read_s"))
                assert lo * 0.999 <= wr <= hi * 1.001
            assert figures["write_read_gbps"]["min"] == pytest.approx(
                min(
                    2 * doc["data"]["bytes"] / (r["write_s"] + r["read_s"]) / 1e9
                    for r in figures["runs"]
                )
            )
            assert figures["write_p99_ms"] >= figures["write_p50_ms"] > 0
            assert 0.0 <= figures["resident_before_read"] <= 1.0
        # Freeing only happens where a previous pass left something behind.
        assert all(r["free_s"] == 0 for r in row["first_touch"]["runs"]), row["name"]
        if row["name"] not in ("raw", "raw-buffered"):
            assert all(r["free_s"] > 0 for r in row["steady"]["runs"]), row["name"]
        if row["compression"] == "zstd":
            # gelu(randn) compresses a little once byte-shuffled; random bits would not.
            assert 1.0 < row["compression_ratio"] < 2.0
            assert row["stored_bytes"] < doc["data"]["bytes"]
        else:
            assert row["compression_ratio"] is None
            assert row["stored_bytes"] >= doc["data"]["bytes"]
    by_name = {row["name"]: row for row in doc["rows"]}
    for phase in ("steady", "first_touch"):
        assert by_name["raw"][phase]["vs_raw"] == {"min": 1.0, "median": 1.0, "max": 1.0}
        assert by_name["torch.save"][phase]["vs_torch_save"]["median"] == pytest.approx(1.0)
    assert by_name["file"]["io_path"] == by_name["raw"]["io_path"]
    assert by_name["lmdb"]["io_path"] == "buffered"

    # The targets judge the steady state, each with its baseline's noise.
    assert {(t["row"], t["against"], t["phase"]) for t in doc["targets"]} == {
        ("file", "raw", "steady"),
        ("lmdb", "raw", "steady"),
        ("file", "torch.save", "steady"),
        ("lmdb", "torch.save", "steady"),
    }
    for t in doc["targets"]:
        base = by_name[t["against"]]["steady"]["write_read_gbps"]
        assert t["baseline_spread"] == pytest.approx((base["max"] - base["min"]) / base["median"])
        assert t["margin"] == pytest.approx(t["ratio"] / t["target"] - 1)
        assert t["within_baseline_noise"] == (t["baseline_spread"] > abs(t["margin"]))
        assert t["met"] == (t["ratio"] >= t["target"])
        assert (
            t["ratio"]
            == by_name[t["row"]]["steady"]["vs_" + t["against"].replace(".", "_")]["median"]
        )
    # LMDB's write path, step by step, and the page-cache bound it is held to.
    path = doc["lmdb_write_path"]
    assert path["passes"] == 2 and path["bytes"] == doc["data"]["bytes"]
    assert list(path["steps"]) == list(lmdb_path.STEPS)
    for step in ("join", "put", "commit", "sync"):
        _check_spread(path["steps"][step], step)
    assert sum(path["shares"].values()) <= 1.0 + 1e-9
    for name in ("write_gbps", "read_gbps", "warm_copy_gbps", "new_memory_copy_gbps"):
        _check_spread(path[name], name)
    if "raw-buffered" in by_name:
        (lmdb_target,) = [t for t in doc["targets"] if t["row"] == "lmdb" and t["against"] == "raw"]
        bound = lmdb_target["best_page_cache_path"]
        assert bound["row"] == "raw-buffered"
        assert bound["vs_raw"] == by_name["raw-buffered"]["steady"]["vs_raw"]

    # The checksums: the one records carry is marked, each costs a share of the file row.
    sums = {c["name"]: c for c in doc["checksums"]}
    assert list(sums) == ["xxh3", "crc32c", "zlib.crc32"]
    assert [c["name"] for c in doc["checksums"] if c["used"]] == ["xxh3"]
    file_runs = by_name["file"]["steady"]
    file_s = file_runs["write_s"]["median"] + file_runs["read_s"]["median"]
    for c in doc["checksums"]:
        assert (c["gbps"] is None) == (c["vs_file_row"] is None)
        if c["gbps"] is not None:
            expected = 2 * doc["data"]["bytes"] / (c["gbps"] * 1e9) / file_s
            assert c["vs_file_row"] == pytest.approx(expected)
            assert f"{c['name']}{' (used)' * c['used']} {c['gbps']:.1f} GB/s" in printed
    assert sums["xxh3"]["gbps"] is not None and sums["zlib.crc32"]["gbps"] is not None
    # Nothing left behind: every row's store, steady and fresh, and the spill directories.
    assert list(bench_dir.iterdir()) == []


def test_one_phase_only(bench_dir: Path) -> None:
    report_ = storage.bench_storage(
        total_bytes=2 << 20,
        sizes=[1 << 20],
        directory=bench_dir,
        backends=["lmdb"],
        compressions=["none"],
        phases=["first-touch"],
        repeat=1,
        show_progress=False,
    )
    assert report_.phases == ["first-touch"]
    assert all(r.steady is None and r.first_touch is not None for r in report_.rows)
    assert report_.lmdb_write_path is None  # a steady-state measurement
    assert {t["phase"] for t in report_.targets} == {"first-touch"}
    assert "first touch: " in storage.format_storage(report_)
    assert "steady state: " not in storage.format_storage(report_)
    assert list(bench_dir.iterdir()) == []


def test_each_pass_writes_other_tensors_at_each_position() -> None:
    sizes = [16, 32, 16, 16, 32, 64]
    orders = [storage._pass_order(sizes, p) for p in range(4)]
    for order in orders:
        assert sorted(order) == list(range(len(sizes)))  # a permutation
        assert [sizes[i] for i in order] == sizes  # every position keeps its size
    for before, after in itertools.pairwise(orders):
        for pos, (a, b) in enumerate(zip(before, after, strict=True)):
            # A size with more than one tensor: never the same tensor twice running.
            if sizes.count(sizes[pos]) > 1:
                assert a != b, pos


@pytest.mark.parametrize(
    ("row", "backend", "compression"),
    [
        ("raw", None, "none"),
        ("raw-buffered", None, "none"),
        ("torch.save", None, "none"),
        ("safetensors", None, "none"),
        ("file", "file", "none"),
        ("file+zstd", "file", "zstd"),
        ("lmdb", "lmdb", "none"),
        ("lmdb+zstd", "lmdb", "zstd"),
    ],
)
def test_a_reused_store_reads_back_what_each_pass_wrote(
    tmp_path: Path, row: str, backend: str | None, compression: str
) -> None:
    sizes = [1 << 18, 1 << 19, 1 << 18, 1 << 19, 1 << 18]
    tensors = storage._activations(sizes, seed=3)
    direct = storage_rows.direct_io_supported(tmp_path)
    session = open_session(
        row, tmp_path / "store", tensors, direct=direct, backend=backend, compression=compression
    )
    try:
        footprints = []
        for p in range(4):
            written = [tensors[i] for i in storage._pass_order(sizes, p)]
            m = session.run_pass(written)
            assert len(m.results) == len(written)
            for got, want in zip(m.results, written, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want)
            assert (m.free_s == 0) == (p == 0)
            footprints.append(sum(f.stat().st_size for f in session.files()))
        if row in ("raw", "raw-buffered", "file"):
            # The steady state writes into the space the last pass freed: no growth.
            assert footprints[1:] == footprints[:-1]
    finally:
        session.close()
        session.close()  # idempotent
    assert not (tmp_path / "store").exists()


def test_a_store_that_hands_back_the_last_pass_fails_the_run(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store that returned the previous pass's records would read back real
    # tensors of the right sizes: the check catches it because every pass
    # writes other tensors at each position (NOTE [ Benchmark data ]).
    real = storage_rows.Session.run_pass
    last: dict[int, list[torch.Tensor]] = {}

    def stale(self: storage_rows.Session, tensors: Any, progress: Any = None) -> PassTimes:
        m = real(self, tensors, progress)
        previous = last.get(id(self))
        last[id(self)] = list(tensors)
        if previous is not None and isinstance(self, storage_rows._TierstoreSession):
            m.results = [t.clone() for t in previous]
        return m

    monkeypatch.setattr(storage_rows.Session, "run_pass", stale)
    with pytest.raises(TierstoreError, match=r"file read tensor \d+ .* back different"):
        storage.bench_storage(
            total_bytes=4 << 20,
            sizes=[1 << 20],
            directory=bench_dir,
            backends=["file"],
            compressions=["none"],
            phases=["steady"],
            repeat=1,
            show_progress=False,
        )
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
    # file (nameless: reached through its descriptor) between the write and
    # the read phase (which entry that is depends on which I/O thread
    # allocated first): the benchmark must fail, here
    # through the record's checksum (NOTE [ Record integrity ]), before its
    # own comparison would see the bytes.
    drop = storage_rows.drop_cache

    def corrupt_then_drop(paths: Any) -> None:
        for path in paths:
            if _is_unlinked_data_file(_seen(path)):
                with open(path, "r+b") as f:
                    f.seek(4000)
                    byte = f.read(1)[0]
                    f.seek(4000)
                    f.write(bytes([byte ^ 0xFF]))
        drop(paths)

    monkeypatch.setattr(storage_rows, "drop_cache", corrupt_then_drop)
    with pytest.raises(
        CorruptDataError,
        match=r"entry \d+ on the disk tier \(file backend, /proc/self/fd/\d+\) is corrupt: the \d+ "
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
    # Every row syncs and drops the files it wrote, and only those, in both phases.
    synced: list[str] = []
    dropped: list[str] = []
    fsync, drop = storage_rows.fsync_files, storage_rows.drop_cache

    def spy_fsync(paths: Any) -> None:
        synced.extend(_seen(p) for p in paths)
        fsync(paths)

    def spy_drop(paths: Any) -> None:
        dropped.extend(_seen(p) for p in paths)
        drop(paths)

    monkeypatch.setattr(storage_rows, "fsync_files", spy_fsync)
    monkeypatch.setattr(storage_rows, "drop_cache", spy_drop)
    report_ = storage.bench_storage(
        total_bytes=2 << 20,
        sizes=[1 << 20],
        directory=bench_dir,
        repeat=1,
        show_progress=False,
    )
    dirs = {Path(p).parent.name for p in dropped}
    for name in ("raw", "torch.save", "safetensors"):
        assert name in dirs, name  # the steady store
        assert any(d.startswith("fresh-") and d.endswith(name) for d in dirs), name
    assert any(_is_unlinked_data_file(p) for p in dropped)  # nameless, still dropped
    assert any("entries.lmdb" in p for p in dropped)
    assert set(synced) == set(dropped)
    assert any(p.endswith(".pt") for p in synced)
    assert any(_is_unlinked_data_file(p) for p in synced)
    if _cache_is_droppable(bench_dir):
        # Nothing of what a row wrote was in the cache when its reads began,
        # LMDB's mapped pages included (NOTE [ Dropping LMDB's mapped pages ]).
        for row in report_.rows:
            for figures in (row.steady, row.first_touch):
                assert figures is not None
                assert figures.resident_before_read < 0.05, (row.name, figures.phase)


def test_drop_cache_unmaps_shared_maps_and_leaves_private_ones(tmp_path: Path) -> None:
    if not _cache_is_droppable(tmp_path):
        pytest.skip("this filesystem keeps pages in the cache whatever the advice")
    shared_path, private_path = tmp_path / "shared", tmp_path / "private"
    for path in (shared_path, private_path):
        path.write_bytes(os.urandom(1 << 20))
    storage_rows.fsync_files([shared_path, private_path])
    with open(shared_path, "rb") as f, open(private_path, "r+b") as g:
        shared = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        private = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert sum(shared[i] for i in range(0, len(shared), 4096)) >= 0  # map every page
        assert storage_rows.resident_share([shared_path]) == 1.0
        private[:5] = b"kept!"  # the process's own copy of the first page
        storage_rows.drop_cache([shared_path, private_path])
        assert storage_rows.resident_share([shared_path]) == 0.0
        assert private[:5] == b"kept!"
        assert shared[:16] == shared_path.read_bytes()[:16]  # mapped again on access
    finally:
        shared.close()
        private.close()


def _figures(raw_wr: list[float], row_wr: list[float]) -> tuple[Any, Any]:
    def phase(values: list[float], vs_raw: list[float]) -> storage.PhaseFigures:
        s = Spread.of(values)
        return storage.PhaseFigures("steady", len(values), s, s, s, s, s, s, Spread.of(vs_raw), s)

    raw = storage.StorageRow("raw", "baseline", None, "none", steady=phase(raw_wr, [1.0]))
    ratios = [r / b for r, b in zip(row_wr, raw_wr, strict=True)]
    row = storage.StorageRow("file", "tierstore", "file", "none", steady=phase(row_wr, ratios))
    return raw, row


@pytest.mark.parametrize(
    ("raw_wr", "row_wr", "met", "noise"),
    [
        ([1.0, 1.0, 1.0], [0.5, 0.5, 0.5], False, False),  # a steady baseline: the verdict holds
        ([0.5, 1.0, 1.5], [0.47, 0.94, 1.41], False, True),  # 0.94x of a baseline that varied 100%
        ([0.95, 1.0, 1.05], [1.14, 1.2, 1.26], True, False),  # 1.2x, 10% noise, target 0.95
    ],
)
def test_a_verdict_within_the_baselines_noise_says_so(
    raw_wr: list[float], row_wr: list[float], met: bool, noise: bool
) -> None:
    rows = _figures(raw_wr, row_wr)
    (target,) = [t for t in storage._targets(rows, "steady") if t["against"] == "raw"]
    assert target["met"] is met and target["within_baseline_noise"] is noise
    text = "\n".join(
        storage._target_lines(
            storage.StorageReport(rows=list(rows), settings={}, targets=[target], data={})
        )
    )
    assert ("within the baseline's noise" in text) is noise
    assert ("MISSED" in text) is not met


def test_lmdb_write_path_times_every_step(tmp_path: Path) -> None:
    tensors = storage._activations([1 << 20, 2 << 20, 1 << 20], seed=0)
    probe = lmdb_path.LmdbWritePath(tmp_path / "probe", tensors)
    try:
        passes = [probe.run_pass(tensors) for _ in range(3)]
        assert probe.data_file.exists()
    finally:
        probe.close()
        probe.close()
    assert not (tmp_path / "probe").exists()
    assert passes[0].steps["free"] == 0.0 and all(p.steps["free"] > 0 for p in passes[1:])
    for p in passes:
        timed = sum(p.steps[k] for k in ("join", "put", "commit", "sync"))
        assert 0 < timed <= p.write_s
        assert p.bytes == sum(t.numel() * 4 for t in tensors)
    summary = lmdb_path.summarize(passes[1:])
    assert summary.passes == 2
    assert summary.steps["put"].min <= summary.steps["put"].median <= summary.steps["put"].max
    assert set(summary.shares) == {"join", "put", "commit", "sync"}


def test_plot_is_a_png(bench_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (tierstore[bench])")
    png = tmp_path / "plots" / "storage.png"
    argv = ["--total", "2MiB", "--sizes", "1MiB", "--repeat", "1", "--quiet"]
    argv += ["--phases", "steady"]
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


def test_too_little_disk_fails_first_and_names_the_ways_out(
    bench_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The steady state holds every row's store at once: the run checks the room first.
    real = storage.shutil.disk_usage
    need = storage._disk_needed(
        storage._rows(["file"], ["none"], direct=storage_rows.direct_io_supported(bench_dir)),
        4 << 20,
        steady=True,
        probe=False,
    )

    def almost(path: Any) -> Any:
        usage = real(path)
        return usage._replace(free=need - 1)

    monkeypatch.setattr(storage.shutil, "disk_usage", almost)
    with pytest.raises(TierstoreError, match=r"may hold up to .* --phases first-touch"):
        storage.bench_storage(
            total_bytes=4 << 20,
            sizes=[1 << 20],
            directory=bench_dir,
            backends=["file"],
            compressions=["none"],
            phases=["steady"],
            show_progress=False,
        )
    assert list(bench_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backends", "tape"], "backend 'tape' is unknown"),
        (["--compression", "lz4"], "compression 'lz4' is unknown"),
        (["--total", "lots"], "--total 'lots' is not a size"),
        (["--repeat", "0"], "repeat >= 1"),
        (["--phases", "steady,warm"], r"--phases 'steady,warm' is not a list of phases"),
    ],
)
def test_bad_options_name_the_option(bench_dir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(TierstoreError, match=message):
        _run([*argv, "--dir", str(bench_dir), "--quiet"])
    assert list(bench_dir.iterdir()) == []
