"""A small GPT-style model built in the package: no downloads, deterministic from a seed.

Used by ``tierstore demo`` and the benchmarks, which build it from their
settings with :func:`build_model` and take its shape options from
:func:`add_model_arguments`.

Example:
    >>> import torch
    >>> from tierstore.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab=64, d_model=32, heads=2, layers=2, seq=16))
    >>> tokens = torch.randint(0, 64, (2, 16))
    >>> model.loss(tokens).shape
    torch.Size([])
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["GPT", "GPTConfig", "ModelShape", "add_model_arguments", "build_model", "saved_bytes"]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes. The defaults make a model small enough for a CPU demo.

    Example:
        >>> from tierstore.models import GPTConfig
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
        >>> from tierstore.models import GPT, GPTConfig
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


class ModelShape(Protocol):
    """What :func:`build_model` reads from a benchmark's settings (train's or soak's).

    Example:
        >>> from tierstore.models import ModelShape
        >>> from tierstore.bench.train import TrainSettings
        >>> shape: ModelShape = TrainSettings()
    """

    # Read-only properties: the settings are frozen dataclasses.
    @property
    def vocab(self) -> int:
        """Vocabulary size."""

    @property
    def d_model(self) -> int:
        """Model width."""

    @property
    def heads(self) -> int:
        """Attention heads."""

    @property
    def layers(self) -> int:
        """Transformer blocks."""

    @property
    def seq(self) -> int:
        """Sequence length."""

    @property
    def dropout(self) -> float:
        """Dropout probability."""

    @property
    def seed(self) -> int:
        """Seed of the initial weights."""


def build_model(settings: ModelShape, device: torch.device) -> GPT:
    """The GPT of ``settings``' shape, its weights from ``settings.seed``, in train mode.

    Example:
        >>> import torch
        >>> from tierstore.models import build_model
        >>> from tierstore.bench.train import quick_settings
        >>> build_model(quick_settings(), torch.device("cpu")).training
        True
    """
    cfg = GPTConfig(
        vocab=settings.vocab,
        d_model=settings.d_model,
        heads=settings.heads,
        layers=settings.layers,
        seq=settings.seq,
        dropout=settings.dropout,
    )
    torch.manual_seed(settings.seed)
    model = GPT(cfg).to(device)
    model.train()
    return model


def saved_bytes(model: GPT, tokens: torch.Tensor) -> tuple[int, int]:
    """Bytes one forward saves for backward: (every save, distinct non-parameter tensors).

    The second figure is what an offload store holds (parameters are kept,
    and a tensor saved twice is stored once); the benchmarks size their disk
    budget from it.

    Example:
        >>> import torch
        >>> from tierstore.models import GPT, GPTConfig, saved_bytes
        >>> model = GPT(GPTConfig(vocab=64, d_model=32, heads=2, layers=1, seq=16))
        >>> total, activations = saved_bytes(model, torch.randint(0, 64, (2, 16)))
        >>> 0 < activations < total
        True
    """
    total = 0
    seen: dict[tuple[Any, ...], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        nbytes = t.numel() * t.element_size()
        total += nbytes
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
            seen[key] = nbytes
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(tokens)
    del loss
    return total, sum(seen.values())


def add_model_arguments(parser: argparse.ArgumentParser, full: Any) -> None:
    """Options for the GPT's shape, each defaulting to ``None`` (use ``full``'s value).

    Shared by ``bench train`` and ``bench soak``; ``full`` is their default
    settings, whose ``layers``, ``d_model``, ``heads``, ``seq``, ``batch``
    and ``vocab`` the help texts show.

    Example:
        >>> import argparse
        >>> from tierstore.models import add_model_arguments
        >>> from tierstore.bench.train import TrainSettings
        >>> p = argparse.ArgumentParser(); add_model_arguments(p, TrainSettings())
        >>> p.parse_args(["--d-model", "64"]).d_model
        64
    """
    for flag, help_ in [
        ("--layers", f"transformer blocks (default {full.layers})"),
        ("--d-model", f"model width (default {full.d_model})"),
        ("--heads", f"attention heads (default {full.heads})"),
        ("--seq", f"sequence length (default {full.seq})"),
        ("--batch", f"batch size (default {full.batch})"),
        ("--vocab", f"vocabulary size (default {full.vocab})"),
    ]:
        parser.add_argument(flag, type=int, default=None, help=help_)
