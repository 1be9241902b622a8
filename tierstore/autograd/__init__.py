"""The autograd boundary: saved-tensor hooks, what stays, keep(), rebuild recipes.

This layer knows autograd: saved_tensors_hooks, modules, ops and a tensor's
size (the filters need it). It decides for each saved tensor whether it
stays, is stored or is rebuilt, and knows nothing of how bytes rest or move:
a stored save goes down to the tier manager (:mod:`tierstore.tiers.manager`)
in one call and comes back as a handle (NOTE [ One decision, one call ] in
``autograd/hooks.py``).

Example:
    >>> import torch
    >>> from tierstore.autograd.filters import offload_nbytes
    >>> offload_nbytes(torch.ones(1024), min_bytes=0)
    4096
"""
