"""``tierstore bench storage``, ``train``, ``soak`` and ``recording``: the benchmark commands.

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
from typing import Any

from tierstore.bench import recording, soak, storage, train

__all__ = ["add_bench_parser"]


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
        dest="bench_command", required=True, metavar="{storage,train,soak,recording}"
    )
    p = sub.add_parser(
        "storage",
        help="write/read GB/s and latency of the disk backends against raw I/O, "
        "torch.save and safetensors",
        description=(storage.__doc__ or "").splitlines()[0],
    )
    storage.add_arguments(p)
    p.set_defaults(run=storage.run)
    p = sub.add_parser(
        "train",
        help="GPT training steps under none, save_on_cpu, checkpoint, disk-naive and tierstore",
        description=(train.__doc__ or "").splitlines()[0],
    )
    train.add_arguments(p)
    p.set_defaults(run=train.run)
    p = sub.add_parser(
        "soak",
        help="hundreds of GPT training steps with every activation on disk: file descriptors, "
        "threads, RSS and spill size must stay flat",
        description=(soak.__doc__ or "").splitlines()[0],
    )
    soak.add_arguments(p)
    p.set_defaults(run=soak.run)
    p = sub.add_parser(
        "recording",
        help="what recompute's op recorder costs in forward: us per op, share of a step",
        description=(recording.__doc__ or "").splitlines()[0],
    )
    recording.add_arguments(p)
    p.set_defaults(run=recording.run)
