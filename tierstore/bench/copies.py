"""Device <-> host copy rows of ``tierstore bench storage --device cuda``.

Two rows, the same tensors on the GPU, each copied to host memory (D2H) and
back (H2D):

* ``pinned copy_``: the practical limit: ``copy_(non_blocking=True)`` into
  pinned buffers allocated beforehand (untimed), on one side stream;
* ``tierstore pool``: the store's own path, :meth:`Transfers.host_copy` into
  the pinned pool and :meth:`Transfers.device_copy` back, with the streams and
  events it uses in training. An untimed pass first grows the pool, as the
  first training step does; later steps reuse it.

Each phase ends with one ``torch.cuda.synchronize()``; GB/s is 10^9 tensor
bytes per second of the phase; the results are compared with the sources
(untimed).

Example:
    >>> from tierstore.bench.copies import bench_copies
    >>> bench_copies(1 << 20, [1 << 18], repeat=1)  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.bench.report import fmt_ratio, format_table, median
from tierstore.config import TierConfig
from tierstore.errors import TierstoreError
from tierstore.tiers.transfers import Transfers

__all__ = ["CopyRow", "bench_copies", "format_copies"]


@dataclass
class CopyRow:
    """One copy path: median seconds per phase over the repeats, and GB/s.

    Example:
        >>> CopyRow("pinned copy_").d2h_gbps
        0.0
    """

    name: str
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    d2h_gbps: float = 0.0
    h2d_gbps: float = 0.0
    vs_pinned_copy: float | None = None


def _phase(fn: Callable[[], list[torch.Tensor]]) -> tuple[float, list[torch.Tensor]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _pinned_copy(tensors: list[torch.Tensor]) -> tuple[float, float, list[torch.Tensor]]:
    host = [torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors]
    stream = torch.cuda.Stream()

    def d2h() -> list[torch.Tensor]:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        return host

    def h2d() -> list[torch.Tensor]:
        out = [torch.empty_like(t) for t in tensors]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for o, h in zip(out, host, strict=True):
                o.copy_(h, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    d2h_s, _ = _phase(d2h)
    h2d_s, back = _phase(h2d)
    return d2h_s, h2d_s, back


def _pool_copy(pipe: Transfers, tensors: list[torch.Tensor]) -> tuple[float, float, Any]:
    copies: list[Any] = []

    def d2h() -> list[torch.Tensor]:
        copies.extend(pipe.host_copy(t) for t in tensors)
        return [c.tensor for c in copies]

    def h2d() -> list[torch.Tensor]:
        return [
            pipe.consume(pipe.device_copy(c.tensor, t.device, c.ready))
            for c, t in zip(copies, tensors, strict=True)
        ]

    d2h_s, _ = _phase(d2h)
    h2d_s, back = _phase(h2d)
    for c in copies:
        pipe.free_host(c.block)
    pipe.reclaim()
    return d2h_s, h2d_s, back


def bench_copies(total_bytes: int, sizes: Sequence[int], *, repeat: int = 3) -> list[CopyRow]:
    """Time D2H and H2D of the same GPU tensors through a raw pinned copy and the host pool.

    Raises:
        TierstoreError: no CUDA device, or a copy came back different.
    """
    if not torch.cuda.is_available():
        raise TierstoreError(
            "tierstore: bench storage: --device cuda, but torch.cuda.is_available() is False"
        )
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors: list[torch.Tensor] = []
    done = 0
    while done < total_bytes:
        n = sizes[len(tensors) % len(sizes)] // 4
        tensors.append(torch.randn(n, device="cuda", generator=gen))
        done += 4 * n
    total = 4 * sum(t.numel() for t in tensors)
    pipe = Transfers(TierConfig(host_budget=2 * total, disk_budget=0))
    times: dict[str, list[tuple[float, float]]] = {"pinned copy_": [], "tierstore pool": []}
    try:
        _pool_copy(pipe, tensors)  # grows the pool, as a first training step does
        for _ in range(repeat):
            for name, runs in times.items():
                if name == "pinned copy_":
                    d2h_s, h2d_s, back = _pinned_copy(tensors)
                else:
                    d2h_s, h2d_s, back = _pool_copy(pipe, tensors)
                if not all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True)):
                    raise TierstoreError(f"tierstore: bench storage: {name} copied wrong bytes")
                runs.append((d2h_s, h2d_s))
    finally:
        pipe.close()
    rows = []
    for name, runs in times.items():
        d2h_s = median([d for d, _ in runs])
        h2d_s = median([h for _, h in runs])
        rows.append(CopyRow(name, d2h_s, h2d_s, total / d2h_s / 1e9, total / h2d_s / 1e9))
    base = rows[0]
    for row in rows:
        both, base_both = row.d2h_s + row.h2d_s, base.d2h_s + base.h2d_s
        row.vs_pinned_copy = base_both / both
    return rows


def format_copies(rows: Sequence[CopyRow]) -> str:
    """The copy rows as a table, with the target (>= 0.9x the pinned copy).

    Example:
        >>> print(format_copies([CopyRow("pinned copy_", 1.0, 1.0, 1.0, 1.0, 1.0)]))
        row           D2H GB/s  H2D GB/s  vs pinned copy_
        ------------  --------  --------  ---------------
        pinned copy_      1.00      1.00            1.00x
    """
    cells = [
        [r.name, f"{r.d2h_gbps:.2f}", f"{r.h2d_gbps:.2f}", fmt_ratio(r.vs_pinned_copy)]
        for r in rows
    ]
    lines = [format_table(["row", "D2H GB/s", "H2D GB/s", "vs pinned copy_"], cells)]
    pool = next((r for r in rows if r.name == "tierstore pool"), None)
    if pool is not None and pool.vs_pinned_copy is not None:
        met = "met" if pool.vs_pinned_copy >= 0.9 else "MISSED"
        lines.append(
            f"tierstore pool: D2H + H2D vs pinned copy_ {fmt_ratio(pool.vs_pinned_copy)} "
            f"(target >= 0.9x: {met})"
        )
    return "\n".join(lines)
