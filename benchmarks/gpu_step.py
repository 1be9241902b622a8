"""A GPT training step on one GPU under each row, each row in a fresh process.

    python3 benchmarks/gpu_step.py --rows none,kept,budget=1.0 --json OUT.json

The step: 12 blocks, d_model 2048, 16 heads, seq 2048, batch 4, vocab 16384,
bf16 weights, F.scaled_dot_product_attention, AdamW-free (grads only). Per
row: ``--warmup`` steps, then ``--steps`` measured; each step ends on a
device synchronisation. Memory per step is ``max_memory_allocated`` and
``max_memory_reserved`` above what was allocated / reserved before the first
step, over every step, warm-up included (what nvidia-smi shows is reserved).
After the timed steps each tierstore row runs one more step with SDPA's math
kernel (flash's backward is not deterministic) and compares its gradients
bitwise with a step without offload in the same process.

Rows: ``none``; ``kept`` (``device_budget="64GiB"``: every save stays, only
the hooks run); ``budget=F`` (``activation_budget=F``); ``device=SIZE``
(``device_budget=SIZE``, no plan); ``checkpoint-N``
(``torch.utils.checkpoint`` on the first N blocks).

``--device cpu`` runs the same code on the CPU in float32, with memory
figures of 0: a dry run of the script at a tiny shape (``device-run.sh``'s
``DRY_RUN=1``), not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

import tierstore
from tierstore.planning.planner import recorded_rebuilds

#: The most extra warm-up steps a budget row takes while its plan is made.
MAX_STEPS_TO_A_PLAN = 60


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        mlp: torch.Tensor = self.out(F.gelu(self.fc(self.ln2(x))))
        return x + mlp


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.checkpointed = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for i, block in enumerate(self.blocks):
            if i < self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.view(-1))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter's gradient; a parameter backward did not reach is an error."""
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise RuntimeError("a parameter got no gradient")
    return [g for g in grads if g is not None]


def _cuda(args: argparse.Namespace) -> bool:
    return bool(args.device == "cuda")


def _sync(args: argparse.Namespace) -> None:
    if _cuda(args):
        torch.cuda.synchronize()


def _allocated(args: argparse.Namespace, peak: bool = False) -> int:
    """CUDA's allocated bytes (its peak since the last reset); 0 on the CPU."""
    if not _cuda(args):
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def _reserved(args: argparse.Namespace, peak: bool = False) -> int:
    """CUDA's reserved bytes (its peak since the last reset); 0 on the CPU."""
    if not _cuda(args):
        return 0
    return torch.cuda.max_memory_reserved() if peak else torch.cuda.memory_reserved()


def _row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if _cuda(args) else torch.float32
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to(dev, dtype)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    store = None
    if name == "kept":
        store = tierstore.TierStore(tierstore.TierConfig(device_budget="64GiB"))
    elif name.startswith("budget="):
        store = tierstore.TierStore(
            tierstore.TierConfig(activation_budget=float(name.removeprefix("budget=")))
        )
    elif name.startswith("device="):
        store = tierstore.TierStore(
            tierstore.TierConfig(device_budget=name.removeprefix("device="))
        )
    elif name.startswith("checkpoint-"):
        model.checkpointed = int(name.removeprefix("checkpoint-"))

    def step() -> None:
        if store is None:
            loss = model(tokens)
        else:
            with store.offload():
                loss = model(tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)

    _sync(args)
    base_alloc = _allocated(args)
    base_reserved = _reserved(args)
    steps: list[float] = []
    alloc: list[int] = []
    reserved: list[int] = []
    plans: list[list[Any] | None] = []

    def measured_step() -> None:
        if _cuda(args):
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.profiler.record_function("gpu_step"):  # benchmarks/gpu_trace.py's step
            step()
        _sync(args)
        steps.append(time.perf_counter() - start)
        alloc.append(_allocated(args, peak=True) - base_alloc)
        reserved.append(_reserved(args, peak=True) - base_reserved)
        plan = store.plan() if store is not None else None
        # One entry per step: [steps run on the plan, predicted s, last measured s,
        # bytes offloaded, bytes rebuilt, saves rebuilt op by op] (a step's
        # measured time lands as the next one begins), None before a plan.
        plans.append(
            None
            if plan is None
            else [
                plan.steps,
                plan.predicted_step_s,
                plan.measured_step_s,
                *(plan.bytes_by_choice()[c] for c in ("offload", "rebuild")),
                recorded_rebuilds(plan.profile, plan.choices),
            ]
        )

    profiled_early = False
    for _ in range(args.warmup):
        measured_step()
    if store is not None and store.config.activation_budget is not None:
        # A plan that needs a search is made in a process of its own while the
        # steps go on on the safe placement (NOTE [ Planning off the training
        # thread ] in tierstore/planning/checker.py): warm up until a plan has run
        # --settle steps in a row (a check that finds it off remakes it).
        for _ in range(MAX_STEPS_TO_A_PLAN):
            entry = plans[-1]
            if entry is not None and entry[0] >= args.settle:
                break
            now = entry is not None and not profiled_early and name in _profiled(args)
            if now and (
                args.profile_at == "first"
                or (args.profile_at == "offloading" and _offloads_only(store.plan()))
            ):
                _profile(name, args, measured_step, store)
                profiled_early = True
            measured_step()
    warmup = len(steps)
    timed_plan = None
    for _ in range(args.steps):
        measured_step()
    if name in _profiled(args) and not profiled_early:
        # After the timed steps: the profiler's steps, and the trace written
        # before the next step begins, would pass for a slow plan's (a
        # budget's runner measured 1.6 s for the step the trace was written
        # after, and remade its plan on it).
        ran, timed_plan = len(steps), store.plan() if store is not None else None
        _profile(name, args, measured_step, store)
        del steps[ran:], alloc[ran:], reserved[ran:], plans[ran:]
    timed = steps[warmup:]
    first_planned = next((i for i, p in enumerate(plans) if p is not None and p[0] >= 1), None)
    out: dict[str, Any] = {
        "row": name,
        "steps_s": steps,
        "warmup_steps": warmup,
        "median_s": statistics.median(timed),
        "mean_s": statistics.fmean(timed),
        "max_over_median": max(timed) / statistics.median(timed),
        "allocated_bytes": alloc,
        "reserved_bytes": reserved,
        "peak_allocated_bytes": max(alloc),
        "peak_reserved_bytes": max(reserved),
    }
    if store is not None:
        out["plan_history"] = plans  # per step: as measured_step() notes it
        plan = timed_plan or store.plan()  # the timed steps' plan, not one the profile remade
        if plan is not None:
            profile = plan.profile
            # The first plan's prediction, before any check rescaled it, and
            # the first step that ran on it.
            first = next((p[1] for p in plans if p is not None), None)
            planned_timed = [
                s for s, p in zip(steps[warmup:], plans[warmup:], strict=True) if p is not None
            ]
            out["planned_max_over_median"] = (
                max(planned_timed) / statistics.median(timed) if planned_timed else None
            )
            out["plan"] = {
                "predicted_step_s": plan.predicted_step_s,
                "measured_step_s": plan.measured_step_s,
                "first_predicted_step_s": first,
                "first_planned_step_s": None if first_planned is None else steps[first_planned],
                "first_planned_step": first_planned,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": plan.measured_peak_bytes,
                "bytes_by_choice": plan.bytes_by_choice(),
                "steps": plan.steps,
                "profile": {
                    "forward_s": profile.forward_s,
                    "backward_s": profile.backward_s,
                    "other_s": profile.other_s,
                    "write_bytes_per_s": profile.write_bytes_per_s,
                    "read_bytes_per_s": profile.read_bytes_per_s,
                },
                "table": str(plan),
                "choices": list(plan.choices),
                # The whole profile, for the planner offline:
                # tierstore.planning.planner.Profile(**{**p, "saves": tuple(Save(**s) ...)}).
                "profile_all": dataclasses.asdict(profile),
            }
        s = store.stats()
        out["stats"] = {
            name: getattr(s, name)
            for name in (
                "kept",
                "packed",
                "recomputed",
                "prefetch_hits",
                "prefetch_misses",
                "prefetch_stalls",
                "pack_waits",
                "bytes_prefetched",
            )
        }
        try:  # a failure here keeps the row's timed steps
            with sdpa_kernel(SDPBackend.MATH):
                model(tokens).backward()
                ref = [g.clone() for g in _grads(model)]
                model.zero_grad(set_to_none=True)
                with store.offload():
                    loss = model(tokens)
                loss.backward()
                got = _grads(model)
            out["grads_bitwise_equal"] = all(
                torch.equal(a, b) for a, b in zip(ref, got, strict=True)
            )
        except Exception as error:  # reported in the row; the run goes on
            out["grads_bitwise_equal"] = False
            out["grads_check_error"] = f"{type(error).__name__}: {error}"
        store.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="none,kept,budget=1.0")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--settle", type=int, default=3, help="steps a plan runs before timing")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default="", metavar="ROWS", help="profile 2 steps of each ROW")
    p.add_argument(
        "--profile-at",
        choices=("settled", "first", "offloading"),
        default="settled",
        help="a budget row's steps to profile: its settled plan's, its first plan's, or "
        "those of its first plan that offloads and rebuilds nothing op by op",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="PREFIX",
        help="each profile's trace: PREFIX-ROW.json ('=' in ROW as '-')",
    )
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(_row(args.one, args)))
        return 0
    rows = []
    for name in args.rows.split(","):
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=os.environ.copy(), check=False
        )
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        if name in _profiled(args):
            print(done.stderr[-20000:], flush=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        if args.json:  # each row as it ends: a run cut short keeps what it measured
            _dump(args.json, rows)
    base = next((r for r in rows if r["row"] == "none"), None)
    gib = 1 << 30
    for r in rows:
        rel = f"{r['median_s'] / base['median_s']:.3f}x" if base else ""
        mem = (
            f"alloc {r['peak_allocated_bytes'] / gib:.2f} GiB "
            f"({_over(r['peak_allocated_bytes'], base['peak_allocated_bytes'])}), reserved "
            f"{r['peak_reserved_bytes'] / gib:.2f} GiB "
            f"({_over(r['peak_reserved_bytes'], base['peak_reserved_bytes'])})"
            if base
            else ""
        )
        extra = ""
        if "plan" in r:
            pl = r["plan"]
            first, ran = pl["first_predicted_step_s"], pl["first_planned_step_s"]
            extra = f"; plan predicted {pl['predicted_step_s'] * 1e3:.1f} ms"
            if first is not None and ran is not None:
                extra += (
                    f" (first plan {first * 1e3:.1f} ms for a first planned step of "
                    f"{ran * 1e3:.1f} ms and a median of {r['median_s'] * 1e3:.1f} ms)"
                )
            prof = pl["profile"]
            out_rate, back_rate = prof["write_bytes_per_s"] / 1e9, prof["read_bytes_per_s"] / 1e9
            extra += f"; links {out_rate:.1f}/{back_rate:.1f} GB/s"
        if r.get("planned_max_over_median") is not None:
            extra += (
                f"; planned max/med {r['planned_max_over_median']:.2f} "
                f"(after {r['warmup_steps']} warm-up steps)"
            )
        if "grads_bitwise_equal" in r:
            extra += f"; grads bitwise {r['grads_bitwise_equal']}"
        if "grads_check_error" in r:
            extra += f" ({r['grads_check_error']})"
        print(
            f"{r['row']:<14} median {r['median_s'] * 1e3:7.1f} ms {rel:>8}  mean/med "
            f"{r['mean_s'] / r['median_s']:.2f} max/med {r['max_over_median']:.2f}  {mem}{extra}",
            flush=True,
        )
    if base:
        print("\n".join(_under_last_plans(rows, base)), flush=True)
    return 0


def _under_last_plans(rows: list[dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """Each budget row's steps under its last plan alone, warm-up included.

    A step counts to the plan it ran on: from the first step whose history
    entry shows the plan had run one step, while the count goes up by one.
    """
    gib = 1 << 30
    out = ["# Under each budget's last plan: its steps only, warm-up included"]
    for r in rows:
        history = r.get("plan_history")
        if not history or history[-1] is None:
            continue
        i = len(history) - 1
        while i > 0 and history[i - 1] is not None and 1 <= history[i - 1][0] == history[i][0] - 1:
            i -= 1
        steps, alloc, reserved = (
            r[k][i:] for k in ("steps_s", "allocated_bytes", "reserved_bytes")
        )
        med = statistics.median(steps)
        chosen = ""
        if len(history[-1]) >= 6:  # runs before the history held the plan's choices: none
            offload, rebuild, recorded = history[-1][3:6]
            chosen = (
                f"  offload {offload / 2**20:.0f} MiB, rebuild {rebuild / 2**20:.0f} MiB "
                f"({recorded} op by op)"
            )
        out.append(
            f"{r['row']:<12} {len(steps):2d} steps: median {med * 1e3:6.1f} ms "
            f"{med / base['median_s']:.3f}x  max/med {max(steps) / med:.2f}  alloc "
            f"{max(alloc) / gib:5.2f} GiB ({_over(max(alloc), base['peak_allocated_bytes'])})  "
            f"reserved {max(reserved) / gib:5.2f} GiB "
            f"({_over(max(reserved), base['peak_reserved_bytes'])}){chosen}"
        )
    return out


def _over(value: float, base: float) -> str:
    """``value`` over ``base`` as a ratio; ``-`` where the base is 0 (memory on the CPU)."""
    return f"{value / base:.2f}x" if base else "-"


def _profile(name: str, args: argparse.Namespace, measured_step: Any, store: Any) -> None:
    """Two steps of ``name`` under torch.profiler: its tables on stderr, its trace."""
    plan = store.plan() if store is not None else None
    before = store.stats() if store is not None else None
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if _cuda(args) else [])]
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            measured_step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)
    if _cuda(args):
        print(averages.table(sort_by="self_cuda_time_total", row_limit=20), file=sys.stderr)
    if plan is not None:
        print(f"# {name}: the plan profiled\n{plan}", file=sys.stderr)
    if before is not None:
        after = store.stats()
        moved = {
            k: v - getattr(before, k)
            for k, v in vars(after).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        print(f"# {name}: stats over the two profiled steps {moved}", file=sys.stderr)
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}-{name.replace('=', '-')}.json")


def _offloads_only(plan: Any) -> bool:
    """Whether ``plan`` offloads and replays nothing op by op (natively checkpointed: fine)."""
    return (
        plan is not None
        and plan.bytes_by_choice()["offload"] > 0
        and recorded_rebuilds(plan.profile, plan.choices) == 0
    )


def _profiled(args: argparse.Namespace) -> list[str]:
    return [r for r in args.profile.split(",") if r]


def _dump(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "argv": sys.argv,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    raise SystemExit(main())
