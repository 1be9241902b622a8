"""What the benchmarks share: optional imports, progress, tables, JSON and machine facts.

rich (progress bar) and matplotlib (``--plot``) are optional: they come with
``pip install 'tierstore[bench]'``. Without rich, progress is printed as
plain lines; without matplotlib, ``--plot`` fails before anything runs, with
the command that installs it.

Example:
    >>> from tierstore.bench.report import format_table
    >>> print(format_table(["row", "GB/s"], [["raw", "1.25"], ["file", "1.20"]]))
    row   GB/s
    ----  ----
    raw   1.25
    file  1.20
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TextIO, TypeVar

import torch

import tierstore
from tierstore.errors import TierstoreError

__all__ = [
    "INSTALL_HINT",
    "NA",
    "Progress",
    "Report",
    "command_line",
    "fmt_ratio",
    "format_table",
    "load_pyplot",
    "machine_info",
    "median",
    "percentile",
    "write_json",
    "write_results",
]

#: How to get the optional benchmark dependencies (rich, matplotlib).
INSTALL_HINT = "pip install 'tierstore[bench]'"
#: Shown where a figure does not exist (a baseline has no compression ratio,
#: a store has no prefetch counters yet).
NA = "n/a"


class _Named(Protocol):
    name: str


RowT = TypeVar("RowT", bound=_Named)


@dataclass
class Report(Generic[RowT]):
    """Rows a benchmark measured, the settings it ran with, and its targets.

    Example:
        >>> from dataclasses import dataclass
        >>> from tierstore.bench.report import Report
        >>> @dataclass
        ... class Row:
        ...     name: str
        >>> report = Report(rows=[Row("a")], settings={}, targets=[])
        >>> report.row("a"), report.row("b"), report.as_dict()["rows"]
        (Row(name='a'), None, [{'name': 'a'}])
    """

    rows: list[RowT]
    settings: dict[str, Any]
    targets: list[dict[str, Any]]

    def row(self, name: str) -> RowT | None:
        """The row called ``name``, if it ran."""
        return next((r for r in self.rows if r.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)


def _optional(module: str) -> Any:
    # Imported by name so that neither tierstore nor its type check needs the
    # optional packages installed.
    return importlib.import_module(module)


def load_pyplot(option: str = "--plot") -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display).

    Args:
        option: the command-line option that needs it, named in the error.

    Raises:
        TierstoreError: matplotlib is not installed; the message says how to
            install it.

    Example:
        >>> plt = load_pyplot()  # doctest: +SKIP
        >>> plt.get_backend()  # doctest: +SKIP
        'agg'
    """
    try:
        matplotlib = _optional("matplotlib")
    except ImportError:
        raise TierstoreError(
            f"tierstore: {option} needs matplotlib, which is not installed; "
            f"install it with {INSTALL_HINT}"
        ) from None
    # Agg writes PNGs without a display; switching later would be too late
    # once pyplot picked an interactive backend.
    matplotlib.use("Agg")
    return _optional("matplotlib.pyplot")


class Progress:
    """A progress bar on a terminal (rich), else one plain line per finished phase.

    Counts abstract units (bytes for the storage benchmark, steps for the
    training one). Use as a context manager; :meth:`phase` names what runs now.

    Args:
        total: units expected in all.
        unit: what a unit is, for the plain lines ("B" prints rates in GB/s).
        stream: where the plain lines go (stderr by default).
        enabled: ``False`` prints nothing (tests, ``--quiet``).
        rich: draw a rich bar; default: when ``stream`` is a terminal.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with Progress(2, unit="step", stream=out, rich=False) as progress:
        ...     with progress.phase("none step 1"):
        ...         progress.advance(1)
        >>> out.getvalue().startswith("[1/2 step] none step 1")
        True
    """

    def __init__(
        self,
        total: float,
        *,
        unit: str = "B",
        stream: TextIO | None = None,
        enabled: bool = True,
        rich: bool | None = None,
    ) -> None:
        self._total = total
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._done = 0.0
        self._bar: Any = None
        self._task: Any = None
        # A bar redraws in place: only on a terminal. Logs get plain lines.
        if rich is None:
            rich = self._stream.isatty()
        self._use_rich = enabled and rich
        self._warned = False

    def __enter__(self) -> Progress:
        if self._use_rich:
            try:
                rp = _optional("rich.progress")
                console = _optional("rich.console").Console(file=self._stream)
            except ImportError:
                self._use_rich = False
                print(
                    f"(no progress bar: rich is not installed; {INSTALL_HINT})",
                    file=self._stream,
                    flush=True,
                )
            else:
                columns = [
                    rp.TextColumn("{task.description}"),
                    rp.BarColumn(),
                    rp.TaskProgressColumn(),
                    rp.TimeElapsedColumn(),
                ]
                self._bar = rp.Progress(*columns, console=console, transient=False)
                self._bar.start()
                self._task = self._bar.add_task("starting", total=self._total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @contextmanager
    def phase(self, description: str) -> Iterator[None]:
        """Name the phase that runs inside the block; without rich, print it when it ends."""
        if self._bar is not None:
            self._bar.update(self._task, description=description)
        start = time.perf_counter()
        before = self._done
        yield
        if self._enabled and self._bar is None:
            took = time.perf_counter() - start
            moved = self._done - before
            rate = ""
            if self._unit == "B" and took > 0 and moved > 0:
                rate = f" ({moved / took / 1e9:.2f} GB/s)"
            done = f"{self._done / 1e9:.2f}/{self._total / 1e9:.2f} GB"
            if self._unit != "B":
                done = f"{self._done:g}/{self._total:g} {self._unit}"
            print(f"[{done}] {description}: {took:.2f} s{rate}", file=self._stream, flush=True)

    def advance(self, units: float) -> None:
        """Count ``units`` more as done."""
        self._done += units
        if self._bar is not None:
            self._bar.update(self._task, advance=units)


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None
) -> str:
    """Aligned plain-text columns: easy to read in a log and to paste into a README.

    Args:
        headers: column titles.
        rows: cells, already formatted.
        right: per column, whether to right-align (default: all but the first).

    Example:
        >>> print(format_table(["a", "bb"], [["x", "1"]], right=[False, False]))
        a  bb
        -  --
        x  1
    """
    if right is None:
        right = [i > 0 for i in range(len(headers))]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def fmt_ratio(x: float | None) -> str:
    """A ratio as ``1.23x``, or ``n/a``.

    Example:
        >>> fmt_ratio(0.5), fmt_ratio(None)
        ('0.50x', 'n/a')
    """
    if x is None or not math.isfinite(x):
        return NA
    return f"{x:.2f}x"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (NumPy's default).

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([5.0], 99)
        (2.5, 5.0)
    """
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median (the 50th :func:`percentile`).

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
    """
    return percentile(values, 50)


def command_line() -> str:
    """The command line of this process, quoted so that a shell runs it again.

    Example:
        >>> isinstance(command_line(), str)
        True
    """
    return shlex.join(sys.argv)


def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _mount_of(path: Path) -> dict[str, str]:
    # The longest mount point that contains ``path``: which device and
    # filesystem the benchmark's files really went to.
    best = ("", "", "")
    target = str(path.resolve())
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                device, point, fstype = fields[0], fields[1], fields[2]
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[1]):
                    best = (device, point, fstype)
    except OSError:
        return {}
    return {"device": best[0], "mount_point": best[1], "filesystem": best[2]}


def machine_info(directory: Path | None = None) -> dict[str, Any]:
    """Facts about this machine for a benchmark's JSON: CPU, memory, torch, and the disk.

    CUDA is queried only if ``torch.cuda.is_available()``.

    Args:
        directory: where the benchmark wrote; its filesystem and device are
            reported.

    Example:
        >>> import os, torch
        >>> info = machine_info()
        >>> info["cpu_count"] == os.cpu_count(), info["torch"] == torch.__version__
        (True, True)
    """
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": _first_line("/proc/cpuinfo", "model name") or platform.processor(),
        "cuda": None,
        "hostname": platform.node(),
        "memory": _first_line("/proc/meminfo", "MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tierstore": tierstore.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        # Other work on the machine skews every figure: say how busy it was.
        info["loadavg_before_1_5_15min"] = list(os.getloadavg())
    if torch.cuda.is_available():
        info["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "version": torch.version.cuda,
        }
    if directory is not None:
        info["directory"] = str(directory)
        info.update(_mount_of(directory))
    return info


def write_json(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write ``doc`` as indented JSON, creating the parent directory.

    Example:
        >>> import json, os, tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "out", "r.json")
        >>> write_json(p, {"rows": []}); json.load(open(p))
        {'rows': []}
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_results(
    args: argparse.Namespace, benchmark: str, machine: dict[str, Any], results: dict[str, Any]
) -> None:
    """Write a benchmark's JSON to ``args.json`` and say where.

    Every benchmark's file starts the same way: the benchmark's name, the
    command that ran it, its options, the machine and torch's version; then
    ``results``.

    Example:
        >>> import argparse, json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "r.json")
        >>> args = argparse.Namespace(json=path, steps=3)
        >>> write_results(args, "soak", {"cpus": 2}, {"ok": True})  # doctest: +ELLIPSIS
        JSON: .../r.json
        >>> doc = json.load(open(path)); doc["benchmark"], doc["options"], doc["ok"]
        ('soak', {'json': '...r.json', 'steps': 3}, True)
    """
    doc = {
        "benchmark": benchmark,
        "command": command_line(),
        "options": {k: v for k, v in vars(args).items() if k != "run"},
        "machine": machine,
        "torch": torch.__version__,
        **results,
    }
    write_json(args.json, doc)
    print(f"JSON: {args.json}")
