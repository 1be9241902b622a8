"""The ``tierstore`` command: ``demo``, ``config`` and ``bench``.

Example:
    >>> from tierstore.cli import main
    >>> main(["config"])  # doctest: +ELLIPSIS
    setting ...
    0
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from pydantic import ByteSize

from tierstore.bench.cli import add_bench_parser, summary
from tierstore.bench.scratch import removed_on_sigterm, scratch_dir
from tierstore.bench.train import TrainSettings, bench_train
from tierstore.config import TierConfig, describe_config, human_bytes
from tierstore.errors import TierstoreError
from tierstore.models import GPT, GPTConfig
from tierstore.stats import TIERS, Stats
from tierstore.tier_store import TierStore

__all__ = ["build_parser", "main"]


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _step(model: GPT, tokens: torch.Tensor, store: TierStore | None) -> tuple[float, Stats | None]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout masks in both runs
    start = time.perf_counter()
    stats = None
    if store is None:
        loss = model.loss(tokens)
    else:
        with store.offload():
            loss = model.loss(tokens)
        stats = store.stats()
    loss.backward()
    return time.perf_counter() - start, stats


def demo(args: argparse.Namespace) -> int:
    """One GPT training step with every saved activation on disk, checked against eager."""
    cfg = GPTConfig(layers=args.layers, d_model=args.d_model, seq=args.seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1))

    _step(model, tokens, None)  # warm-up: first-call allocations are not offload's cost
    eager_times = []
    for _ in range(args.steps):  # one step is one noisy sample: the median of several
        eager_times.append(_step(model, tokens, None)[0])
    expected = _grads(model)

    with scratch_dir("tierstore-demo-") as spill:
        config = TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget=args.disk_budget,
            disk_path=spill,
            disk_backend=args.backend,
            compression=args.compression,
            min_offload_bytes=0,
        )
        with TierStore(config) as store:
            _step(model, tokens, store)  # warm-up: opens the spill file and grows it
            before = store.stats()
            first_s, after_forward = _step(model, tokens, store)
            after_backward = store.stats()
            got = _grads(model)
            offload_times = [first_s] + [
                _step(model, tokens, store)[0] for _ in range(args.steps - 1)
            ]
    assert after_forward is not None

    diff = max(float((a - b).abs().max()) for a, b in zip(expected, got, strict=True))
    equal = all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    params = sum(p.numel() for p in model.parameters())
    print(
        f"tierstore demo: GPT {cfg.layers} blocks, d_model {cfg.d_model}, seq {cfg.seq}, "
        f"batch {args.batch} ({params / 1e6:.1f}M parameters), torch {torch.__version__}"
    )
    print(
        f"config: device_budget=0, host_budget=0, disk_backend={args.backend}, "
        f"compression={args.compression}, spill under a private temp dir"
    )
    print()
    print(
        f"{'tier':>6} {'after forward':>14} {'peak':>12} {'after backward':>15} {'copied in':>12}"
    )
    for tier in TIERS:
        f = after_forward.tiers[tier]
        b = after_backward.tiers[tier]
        # Nothing is copied to the device tier: its bytes_written are bytes left in place.
        moved = b.bytes_written - before.tiers[tier].bytes_written
        print(
            f"{tier:>6} {human_bytes(f.bytes):>14} {human_bytes(b.peak_bytes):>12} "
            f"{human_bytes(b.bytes):>15} {'-' if tier == 'device' else human_bytes(moved):>12}"
        )
    packed = after_backward.packed - before.packed
    dedup = after_backward.deduplicated - before.deduplicated
    kept = after_backward.kept - before.kept
    kept_bytes = after_backward.kept_bytes - before.kept_bytes
    print(
        f"saved tensors: {packed} packed, {dedup} deduplicated, {kept} kept on the device "
        f"({human_bytes(kept_bytes)}: parameters and their views)"
    )
    hits = after_backward.prefetch_hits - before.prefetch_hits
    misses = after_backward.prefetch_misses - before.prefetch_misses
    rate = hits / (hits + misses) if hits + misses else None
    print(
        f"prefetch hit rate {'n/a' if rate is None else f'{rate:.0%}'}, "
        f"backward waited {after_backward.unpack_wait_s - before.unpack_wait_s:.2f} s for reads"
    )
    rss = _peak_rss_line(args, cfg)
    # See NOTE [ Demo output ]
    print(
        "to measure your own sizes and settings: tierstore bench train, tierstore bench "
        "storage (benchmarks/README.md)"
    )
    print()
    print("result:")
    print(f"  {rss}")
    eager_s, offload_s = statistics.median(eager_times), statistics.median(offload_times)
    print(
        f"  step time, the middle of {args.steps} steps after a warm-up step: "
        f"eager {eager_s:.2f} s, all on disk {offload_s:.2f} s ({offload_s / eager_s:.2f}x)"
    )
    verdict = "bitwise equal to eager" if equal else "NOT EQUAL to eager"
    print(f"  gradients: {verdict} (max |grad diff| = {diff:g})")
    return 0 if equal else 1


# NOTE [ Demo output ]
# `make demo` is a newcomer's first command: it ends on what they came for,
# peak memory with and without offload, step time, gradients equal to
# eager's, under one "result:" heading, and nothing after it. Checks against
# the benchmarks' targets are the benchmarks' business (their own commands, on
# models of the size the targets are for); the demo names them and runs none.


def _peak_rss_line(args: argparse.Namespace, cfg: GPTConfig) -> str:
    """Peak RSS as ``top`` shows it, eager and offloaded, each in a fresh process.

    Measured by ``bench train``'s per-strategy processes (default allocator;
    NOTE [ What bench train measures ]), on a model of the demo's sizes.
    """
    settings = replace(
        TrainSettings(),
        layers=cfg.layers,
        d_model=cfg.d_model,
        heads=cfg.heads,
        seq=cfg.seq,
        batch=args.batch,
        vocab=cfg.vocab,
        steps=1,
        warmup=1,
        strategies=("none", f"tierstore-{args.backend}"),
        compression=args.compression,
        live_pass=False,
    )
    with scratch_dir("tierstore-demo-rss-") as work:
        report = bench_train(replace(settings, directory=str(work)), show_progress=False)
    eager, offloaded = (r.peak_memory_bytes for r in report.rows)
    ratio = f" ({offloaded / eager:.2f}x)" if eager else ""
    return (
        f"peak RSS above the model's own, as top shows it (each run in a fresh process, "
        f"default allocator): eager {human_bytes(eager)}, all on disk "
        f"{human_bytes(offloaded)}{ratio}"
    )


def config(args: argparse.Namespace) -> int:
    """Print the resolved configuration and where each value came from."""
    rows = describe_config()
    print(f"{'setting':<18} {'value':<24} source")
    for name, value, origin in rows:
        print(f"{name:<18} {_shown(name, value):<24} {origin.describe()}")
    return 0


def _shown(name: str, value: object) -> str:
    """A setting's value in the units a user writes it in: sizes by their type, not their name."""
    if value is None:
        return "none"  # what TIERSTORE_ACTIVATION_BUDGET=none reads as
    is_size = TierConfig.model_fields[name].annotation is ByteSize
    # activation_budget and memory_margin: an int is bytes, a float a fraction ("auto": as is).
    if is_size or (name in ("activation_budget", "memory_margin") and type(value) is int):
        return human_bytes(int(value))  # type: ignore[call-overload]
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    """The ``tierstore`` command line's parser (``demo``, ``config``, ``bench ...``).

    Example:
        >>> from tierstore.cli import build_parser
        >>> build_parser().parse_args(["bench", "storage", "--total", "1GiB"]).total
        '1GiB'
    """
    parser = argparse.ArgumentParser(prog="tierstore", description=summary(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="one training step with every activation on disk")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", choices=["file", "lmdb"], default="file")
    p.add_argument("--compression", choices=["none", "zstd"], default="none")
    p.add_argument("--disk-budget", default="4GiB")
    p.add_argument(
        "--steps", type=int, default=5, help="steps timed each way; the middle one is shown"
    )
    p.set_defaults(run=demo)
    p = sub.add_parser("config", help="the resolved configuration and where each value came from")
    p.set_defaults(run=config)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierstore`` command line.

    Example:
        >>> from tierstore.cli import main
        >>> main(["demo", "--layers", "1", "--d-model", "32", "--seq", "16", "--batch", "2"])
        ... # doctest: +ELLIPSIS
        tierstore demo: ...
        result:
          peak RSS above the model's own, as top shows it ...
          step time, the middle of 5 steps after a warm-up step: eager ... s, all on disk ...x)
          gradients: bitwise equal to eager (max |grad diff| = 0)
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with removed_on_sigterm():  # See NOTE [ SIGTERM ] in tierstore/bench/scratch.py
            code: int = args.run(args)
    except TierstoreError as exc:
        parser.exit(2, f"{exc}\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
