"""Disk bytes of a Hugging Face Llama step with recompute off and "cheap", side by side.

A Llama built from a config (nothing downloaded: hidden 256, 4 layers, 8
heads with 4 key/value heads, SwiGLU 688, seq 256, batch 4, fp32, SDPA),
one training step per row with every saved tensor on the disk tier
(``device_budget=0, host_budget=0, min_offload_bytes=0``); the gradients of
every row are checked bitwise against eager (the run stops if one differs).
Needs ``transformers`` (the ``integrations`` extra).

    python benchmarks/hf_llama_recompute.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import transformers

import tierstore

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = [  # backend, compression, HF gradient checkpointing
    ("file", "none", False),
    ("lmdb", "none", False),
    ("file", "zstd", False),
    ("lmdb", "zstd", False),
    ("file", "none", True),
]


def build(checkpointing: bool) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        # PretrainedConfig takes it at run time; LlamaConfig's signature does not list it.
        attn_implementation="sdpa",  # type: ignore[call-arg]
        use_cache=False,
    )
    model: Any = transformers.LlamaForCausalLM(config)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def step(
    ids: torch.Tensor, checkpointing: bool, store: tierstore.TierStore | None
) -> tuple[list[torch.Tensor], float]:
    model = build(checkpointing)
    torch.manual_seed(2)
    start = time.perf_counter()
    if store is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with store.offload():
            loss = model(input_ids=ids, labels=ids).loss
        store.flush()
    loss.backward()
    return [p.grad for p in model.parameters()], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(1))
    rows = []
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("backend  compression  checkpointing  written off  written cheap  ratio  rebuilt")
    for backend, compression, checkpointing in VARIANTS:
        expected, _ = step(ids, checkpointing, None)
        row: dict[str, Any] = {
            "backend": backend,
            "compression": compression,
            "checkpointing": checkpointing,
        }
        for setting in ("off", "cheap"):
            config = tierstore.TierConfig(
                device_budget=0,
                host_budget=0,
                disk_path=tempfile.gettempdir(),
                disk_backend=backend,
                compression=compression,
                min_offload_bytes=0,
                recompute=setting,
            )
            with tierstore.TierStore(config) as store:
                grads, seconds = step(ids, checkpointing, store)
                stats = store.stats()
            if not all(torch.equal(a, b) for a, b in zip(expected, grads, strict=True)):
                raise SystemExit(f"gradients differ: {row}, recompute={setting}")
            row[setting] = {
                "bytes_written": stats.tiers["disk"].bytes_written,
                "bytes_read": stats.tiers["disk"].bytes_read,
                "recomputed": stats.recomputed,
                "recomputed_bytes": stats.recomputed_bytes,
                "step_s": seconds,
            }
        row["written_ratio"] = row["cheap"]["bytes_written"] / row["off"]["bytes_written"]
        rows.append(row)
        off_mib = row["off"]["bytes_written"] / 2**20
        cheap_mib = row["cheap"]["bytes_written"] / 2**20
        rebuilt_mib = row["cheap"]["recomputed_bytes"] / 2**20
        print(
            f"{backend:<8} {compression:<12} {checkpointing!s:<14} {off_mib:8.1f} MiB "
            f"{cheap_mib:10.1f} MiB {row['written_ratio']:6.2f}x {rebuilt_mib:6.1f} MiB"
        )
    print("gradients bitwise equal to eager in every row")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
