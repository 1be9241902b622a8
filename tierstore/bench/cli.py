"""``tierstore bench storage``, ``train``, ``soak``, ``recording`` and ``overhead``: the benchmarks.

:func:`add_bench_parser` adds them to the ``tierstore`` command's
subparsers; each sets ``run`` to the function that runs it.

Example:
    >>> import argparse
    >>> from tierstore.bench.cli import add_bench_parser
    >>> parser = argparse.ArgumentParser(prog="tierstore")
    >>> add_bench_parser(parser.add_subparsers(dest="command", required=True))
    >>> args = parser.parse_args(["bench", "train", "--quick", "--steps", "2"])
    >>> args.steps, args.run.__module__
    (2, 'tierstore.bench.train')
"""

from __future__ import annotations

import argparse
import re
import textwrap
from typing import Any

from tierstore.bench import overhead, recording, soak, storage, train

__all__ = ["add_bench_parser", "summary"]

#: Each ``tierstore bench`` command: the module that runs it, and its help line.
_COMMANDS: dict[str, tuple[Any, str]] = {
    "storage": (
        storage,
        "write/read GB/s and latency of the disk backends against raw I/O, "
        "torch.save and safetensors",
    ),
    "train": (
        train,
        "GPT training steps under none, save_on_cpu, checkpoint, disk-naive and tierstore",
    ),
    "soak": (
        soak,
        "hundreds of GPT training steps with every activation on disk: file descriptors, "
        "threads, RSS and spill size must stay flat",
    ),
    "recording": (
        recording,
        "what recompute's op recorder costs in forward: us per op, share of a step",
    ),
    "overhead": (
        overhead,
        "microseconds per saved tensor that tierstore's own Python costs, and the "
        "slowest step against the median",
    ),
}

# ``name`` (a literal) and :func:`name` (a cross-reference; ~ shows its last part).
_MARKUP = re.compile(r"``(.+?)``|:[a-z]+:`(~?)(.+?)`")


def summary(doc: str | None) -> str:
    """A docstring's first line as a command line shows it: reStructuredText markup removed.

    Module docstrings are written for Sphinx and the doctests; ``--help`` is
    read in a terminal, where literal double backticks are noise.

    Args:
        doc: a module's or function's ``__doc__`` (``None`` under ``python -OO``).

    Example:
        >>> summary(":func:`~tierstore.bench.train.bench_train` runs ``tierstore bench train``.")
        'bench_train runs tierstore bench train.'
    """
    first = (doc or "").strip().splitlines()[:1]
    return _MARKUP.sub(_plain, first[0]) if first else ""


def _plain(match: re.Match[str]) -> str:
    literal, short, target = match.groups()
    if literal is not None:
        return literal
    return target.rsplit(".", 1)[-1] if short else target


class _Help(argparse.HelpFormatter):
    """Help text wrapped at spaces only: a name such as ``disk-naive`` is never split."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_bench_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``bench`` with its ``storage``, ``train``, ``soak`` and ``recording`` subcommands.

    Each subcommand sets ``run=callable(args) -> int`` (exit status), as the
    other ``tierstore`` commands do.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned.

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="tierstore")
        >>> add_bench_parser(parser.add_subparsers(dest="command", required=True))
        >>> parser.parse_args(["bench", "storage", "--total", "64MiB"]).total
        '64MiB'
    """
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: disk throughput, training under each offload strategy, a soak",
        description="Benchmarks that print ratios measured side by side in one run.",
    )
    sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{" + ",".join(_COMMANDS) + "}"
    )
    for name, (module, help_) in _COMMANDS.items():
        p = sub.add_parser(
            name, help=help_, description=summary(module.__doc__), formatter_class=_Help
        )
        module.add_arguments(p)
        p.set_defaults(run=module.run)
