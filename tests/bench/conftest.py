"""What the bench tests share: the command line's own wiring, and one intra-op thread."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from tierstore.bench.cli import add_bench_parser


def parse_bench(argv: list[str]) -> argparse.Namespace:
    """``tierstore bench ARGV``'s arguments, parsed with the command's own wiring."""
    parser = argparse.ArgumentParser(prog="tierstore")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def run_bench(argv: list[str]) -> int:
    """``tierstore bench ARGV`` run: its exit status."""
    args = parse_bench(argv)
    code: int = args.run(args)
    return code


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while a test runs.

    The tiny models' ops are tiny: on a busy 2-core machine two OpenMP
    threads wait on each other far longer than the work takes.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
