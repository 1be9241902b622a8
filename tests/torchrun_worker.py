"""One rank of the distributed test: ``python -m torch.distributed.run ... torchrun_worker.py``.

Usage: ``torchrun_worker.py {ddp,fsdp} OUTDIR``. Trains the benchmark GPT for
a few steps on gloo (CPU), once with ``tierstore.offload()`` around forward
and once without, from the same weights, data and dropout masks, and writes
``OUTDIR/rank<R>.json``: whether the final parameters are bitwise equal,
this rank's spill directory, bytes written to disk, and how many tensors
sharing a parameter's storage reached the store (must be none). Last, each
rank prints ``tierstore-torchrun: rank <R> done``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import tierstore
from tierstore.models import GPT, GPTConfig

STEPS = 3
#: Printed by each rank once its work is done and its result written.
COMPLETION = "tierstore-torchrun: rank {rank} done"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _train(
    mode: str, rank: int, store: tierstore.TierStore | None
) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model: Any = GPT(GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16, dropout=0.1))
    if mode == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parameter_puts = 0
    if store is not None:
        manager = store._manager
        put = manager.put

        def checked_put(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # FSDP registers the unsharded parameters on the modules during
            # forward: none of them (nor a view) may be offloaded.
            nonlocal parameter_puts
            storages = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
            if t.untyped_storage().data_ptr() in storages:
                parameter_puts += 1
            return put(t, *args, **kwargs)  # nbytes, tier: whatever put takes

        manager.put = checked_put  # type: ignore[method-assign]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, 64, (4, 17), generator=gen)
        torch.manual_seed(7 * step + rank)  # the same dropout masks in both runs
        with store.offload() if store is not None else contextlib.nullcontext():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = [
        p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone()
        for p in model.parameters()
    ]
    return params, parameter_puts


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        plain, _ = _train(mode, rank, None)
        config = tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="64MiB",
            disk_path=outdir / "spill",
            min_offload_bytes=0,
        )
        with tierstore.TierStore(config) as store:
            offloaded, parameter_puts = _train(mode, rank, store)
            spill_dir = store.disk_directory
            stats = store.stats()
            written = stats.tiers["disk"].bytes_written
        result = {
            "rank": rank,
            "equal": all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True)),
            "parameters": len(plain),
            "spill_dir": spill_dir,
            "spill_dir_exists_after_close": spill_dir is not None and os.path.exists(spill_dir),
            "disk_bytes_written": written,
            "parameter_puts": parameter_puts,
            "kept": stats.kept,
        }
        (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # The last thing the job does: the test reads this line to tell a rank
    # that finished from one that crashed (an abort at interpreter exit, after
    # this line, is gloo's teardown: see tests/test_torchrun.py).
    # One write: the ranks share torchrun's stdout, and print() may write the
    # text and its newline apart, so two ranks' lines can run together.
    sys.stdout.write(COMPLETION.format(rank=rank) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
