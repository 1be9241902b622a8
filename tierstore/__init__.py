"""tierstore: tiered offload of PyTorch autograd's saved tensors.

Wrap a forward pass in :func:`offload` and the tensors autograd saves for
backward leave the compute device for host memory or local disk; backward
brings them back and computes exactly the gradients eager autograd computes.

Example:
    >>> import torch, tierstore
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
    >>> with tierstore.offload(device_budget=0, disk_budget=0) as store:
    ...     loss = model(torch.randn(128, 256)).sum()
    >>> loss.backward()
    >>> store.stats().tiers["host"].peak_bytes > 0
    True
"""

from __future__ import annotations

from tierstore.autograd.keep import keep, keep_module
from tierstore.config import TierConfig, load_config
from tierstore.errors import (
    ConfigError,
    CorruptDataError,
    StoreClosedError,
    TierFullError,
    TierstoreError,
    TierstoreWarning,
)
from tierstore.offloading import offload, offload_module
from tierstore.stats import Stats, TierStats
from tierstore.tier_store import TierStore

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptDataError",
    "Stats",
    "StoreClosedError",
    "TierConfig",
    "TierFullError",
    "TierStats",
    "TierStore",
    "TierstoreError",
    "TierstoreWarning",
    "__version__",
    "keep",
    "keep_module",
    "load_config",
    "offload",
    "offload_module",
]
