"""The tiers: where a stored save's bytes rest and how they move between tiers.

The tier manager (:mod:`tierstore.tiers.manager`) places each stored save on
the device, in the host pool or on disk, dedupes and releases entries, and
keeps the schedule backward reads in; the read-ahead, the write-behind and
the copies in flight move the bytes; the host pool owns the (pinned) host
buffers. This layer knows budgets and limits as numbers, placement and bytes
in flight; it knows nothing of autograd, plans or file formats, and never
imports :mod:`tierstore.planning`. Importing it starts nothing.

Example:
    >>> import torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> manager = TierManager(TierConfig(device_budget=0, disk_budget=0, min_offload_bytes=0))
    >>> handle = manager.put(torch.ones(4))
    >>> manager.get(handle).tolist()
    [1.0, 1.0, 1.0, 1.0]
    >>> manager.close()
"""
