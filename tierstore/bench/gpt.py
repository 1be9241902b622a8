"""A small GPT-style model built in the package: no downloads, deterministic from a seed.

Used by ``tierstore demo`` and the benchmarks.

Example:
    >>> import torch
    >>> from tierstore.bench.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16))
    >>> tokens = torch.randint(0, 64, (2, 16))
    >>> model.loss(tokens).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. The defaults make a model small enough for a CPU demo.

    Example:
        >>> from tierstore.bench.gpt import GPTConfig
        >>> GPTConfig().d_model
        256
    """

    vocab: int = 512
    d_model: int = 256
    heads: int = 4
    layers: int = 4
    seq: int = 256
    dropout: float = 0.1


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Written out rather than F.scaled_dot_product_attention, whose fused
        # kernels differ by backend: this saves the same tensors everywhere.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(causal, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        out: torch.Tensor = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return out


class GPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks, a tied-free head.

    Example:
        >>> import torch
        >>> from tierstore.bench.gpt import GPT, GPTConfig
        >>> GPT(GPTConfig(layers=1, seq=8))(torch.zeros(1, 8, dtype=torch.long)).shape
        torch.Size([1, 8, 512])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for each position."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` of shape ``(batch, seq)``."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
