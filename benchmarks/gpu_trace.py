"""Where a profiled GPU step's time goes, read from a torch.profiler chrome trace.

    python3 benchmarks/gpu_trace.py TRACE.json [TRACE.json ...]

``benchmarks/gpu_step.py --profile ROW --trace PATH`` writes the trace, each
step inside a ``gpu_step`` range. Per step this prints:

- the host's time to launch the step (the ``gpu_step`` range) beside the
  compute stream's span and busy time;
- the compute stream's idle gaps, split by what ended them: the kernel after
  the gap was launched late (the host was behind: ``launch``), or had been
  queued and waited on an event (``wait``: a copy, as a rule);
- the copies each way: count, bytes, busy time, the rate they ran at, and
  how many of each size;
- host calls into the CUDA runtime that took long (synchronisations,
  pinned allocations), and the longest gaps with the host range that launched
  the kernel after each.
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import Counter, defaultdict
from typing import Any

#: A compute-stream gap shorter than this is launch overhead, not a wait.
GAP_US = 50.0
#: A kernel launched within this of its gap's start counts as launched late.
LATE_US = 20.0


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"


def summarize(path: str) -> str:
    with open(path) as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted(
        (e for e in xs if e.get("name") == "gpu_step" and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    runtime = {
        e["args"]["correlation"]: e
        for e in xs
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_ranges = sorted(
        (e for e in xs if e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"]
    )
    starts = [e["ts"] for e in host_ranges]
    lines = [f"# {path}"]
    for n, st in enumerate(steps):
        t0, t1 = st["ts"], st["ts"] + st["dur"]
        # GPU work launched by this step's host range.
        mine = []
        for g in gpu:
            launch = runtime.get(g.get("args", {}).get("correlation"))
            if launch is not None and t0 <= launch["ts"] <= t1:
                mine.append((g, launch))
        if not mine:
            lines.append(f"step {n}: no GPU work found")
            continue
        by_stream: dict[Any, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
        for g, launch in mine:
            by_stream[g["args"].get("stream")].append((g, launch))
        kernel_time = {
            s: sum(g["dur"] for g, _ in gl if g["cat"] == "kernel") for s, gl in by_stream.items()
        }
        compute = max(kernel_time, key=lambda s: kernel_time[s])
        ks = sorted(by_stream[compute], key=lambda p: p[0]["ts"])
        span0, span1 = ks[0][0]["ts"], max(g["ts"] + g["dur"] for g, _ in ks)
        busy = _union([(g["ts"], g["ts"] + g["dur"]) for g, _ in ks])
        lines.append(
            f"step {n}: host launch {st['dur'] / 1e3:.1f} ms; compute stream {compute}: span "
            f"{(span1 - span0) / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
            f"last kernel ends {(span1 - t0) / 1e3:.1f} ms after the step began"
        )
        gaps = []
        end = ks[0][0]["ts"] + ks[0][0]["dur"]
        for g, launch in ks[1:]:
            gap = g["ts"] - end
            if gap > GAP_US:
                late = launch["ts"] + launch["dur"] > end - LATE_US
                i = bisect.bisect_right(starts, launch["ts"]) - 1
                owner = "?"
                while i >= 0:  # the innermost host range around the launch
                    h = host_ranges[i]
                    if h["ts"] + h["dur"] >= launch["ts"] and h["name"] != "gpu_step":
                        owner = h["name"]
                        break
                    i -= 1
                gaps.append((gap, "launch" if late else "wait", g["name"][:60], owner, end - t0))
            end = max(end, g["ts"] + g["dur"])
        for kind in ("launch", "wait"):
            mine_k = [x for x in gaps if x[1] == kind]
            lines.append(
                f"  gaps ({kind}): {len(mine_k)}, {sum(x[0] for x in mine_k) / 1e3:.2f} ms"
            )
        for gap, kind, name, owner, at in sorted(gaps, reverse=True)[:12]:
            lines.append(
                f"    {gap / 1e3:6.2f} ms at {at / 1e3:6.1f} ms  {kind:<6} next: {name}  "
                f"launched in: {owner}"
            )
        for s, gl in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
            if s == compute:
                continue
            copies = [g for g, _ in gl if g["cat"] == "gpu_memcpy"]
            if not copies:
                continue
            nbytes = sum(int(g["args"].get("bytes", 0)) for g in copies)
            t = _union([(g["ts"], g["ts"] + g["dur"]) for g in copies])
            kinds = sorted({g["name"].split(" (")[0] for g in copies})
            first = min(g["ts"] for g in copies) - t0
            last = max(g["ts"] + g["dur"] for g in copies) - t0
            sizes = Counter(int(g["args"].get("bytes", 0)) for g in copies)
            by_size = ", ".join(
                f"{n} x {_mib(size)}" for size, n in sorted(sizes.items(), reverse=True)
            )
            lines.append(
                f"  stream {s} {'/'.join(kinds)}: {len(copies)} copies, {nbytes / 2**20:.0f} MiB, "
                f"busy {t / 1e3:.2f} ms ({nbytes / max(t, 1e-9) / 1e3:.1f} GB/s), from "
                f"{first / 1e3:.1f} to {last / 1e3:.1f} ms; {by_size}"
            )
        slow: dict[str, list[float]] = defaultdict(list)
        for e in xs:
            if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1 and e["dur"] > 200:
                slow[e["name"]].append(e["dur"])
        for name, durs in sorted(slow.items(), key=lambda kv: -sum(kv[1])):
            lines.append(
                f"  host {name}: {len(durs)} calls over 0.2 ms, {sum(durs) / 1e3:.2f} ms in all"
            )
    return "\n".join(lines)


def main() -> int:
    for path in sys.argv[1:]:
        print(summarize(path), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
