"""The host's time per saved tensor that leaves a CUDA device and comes back.

    python3 benchmarks/gpu_host.py [--saves 200] [--mib 1] [--profile 25]

A GPU step under a plan that offloads is bound by the host where each moved
save costs it more than the compute it hides behind (NOTE [ Charging a slow
step ] in tierstore/planning/checker.py). This times that cost alone, with no model and
no autograd: ``--saves`` tensors of ``--mib`` MiB go through one store's
tier manager to the host tier (``put``) and back (``get``), with the device
kept busy by a spin so that no copy is ever waited for, and prints the host
microseconds per put and per get, the median of 5 rounds. Then the same
under cProfile, printing the functions that take the most time of their
own, and the host cost of the torch.cuda calls a copy makes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import timeit
from collections.abc import Callable

import torch

import tierstore
from tierstore.tiers.manager import TierManager


def _round(mgr: TierManager, tensors: list[torch.Tensor]) -> tuple[float, float]:
    torch.cuda._sleep(100_000_000)  # ~50 ms of device time: copies queue, never waited for
    began = time.perf_counter()
    handles = [mgr.put(t) for t in tensors]
    put = time.perf_counter() - began
    began = time.perf_counter()
    back = [mgr.get(h) for h in reversed(handles)]
    got = time.perf_counter() - began
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(reversed(back), tensors, strict=True))
    del handles, back
    return put / len(tensors), got / len(tensors)


def _api_costs() -> None:
    s = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    ev.record(cur)
    calls: dict[str, Callable[[], object]] = {
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.Event()": torch.cuda.Event,
        "torch.cuda.Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
        "event.record(stream)": lambda: ev.record(s),
        "stream.wait_event(event)": lambda: s.wait_event(ev),
        "stream.wait_stream(current)": lambda: s.wait_stream(cur),
        "with torch.cuda.stream(s): pass": lambda: _ctx(s),
        "torch.cuda.set_stream(s); back": lambda: (
            torch.cuda.set_stream(s),
            torch.cuda.set_stream(cur),
        ),
        "event.query()": ev.query,
        "stream == stream": lambda: s == cur,
        "torch.empty 1 MiB cuda": lambda: torch.empty(1 << 18, device="cuda"),
    }
    for name, fn in calls.items():
        n = 2000
        best = min(timeit.repeat(fn, number=n, repeat=3)) / n
        print(f"  {best * 1e6:8.2f} us  {name}")
    torch.cuda.synchronize()


def _ctx(s: torch.cuda.Stream) -> None:
    with torch.cuda.stream(s):
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=200)
    p.add_argument("--mib", type=int, default=1)
    p.add_argument("--profile", type=int, default=25, help="functions to print")
    args = p.parse_args()
    n = args.mib << 18
    tensors = [torch.full((n,), float(i), device="cuda") for i in range(args.saves)]
    cfg = tierstore.TierConfig(
        device_budget=0, host_budget=f"{2 * args.saves * args.mib}MiB", min_offload_bytes=0
    )
    mgr = TierManager(cfg)
    for _ in range(2):  # the pool pinned, the streams made
        _round(mgr, tensors)
    rounds = [_round(mgr, tensors) for _ in range(5)]
    put = statistics.median(r[0] for r in rounds)
    get = statistics.median(r[1] for r in rounds)
    print(
        f"host per moved save of {args.mib} MiB: put {put * 1e6:.1f} us, get {get * 1e6:.1f} us, "
        f"together {(put + get) * 1e6:.1f} us ({args.saves} saves, median of 5 rounds)"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        _round(mgr, tensors)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
    print(out.getvalue())
    mgr.close()
    print("torch.cuda calls, host time each:")
    _api_costs()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
