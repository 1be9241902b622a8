"""Deprecated: the demo GPT moved to :mod:`tierstore.models`.

``tierstore.bench.gpt`` keeps working for a release: each name read from it
warns with a :class:`DeprecationWarning` and comes from ``tierstore.models``.

Example:
    >>> import warnings
    >>> import tierstore.bench.gpt
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     config = tierstore.bench.gpt.GPTConfig
    >>> config.__module__, caught[0].category.__name__
    ('tierstore.models', 'DeprecationWarning')
"""

from tierstore._moved import moved_to

# The old names, as they were; each resolves through __getattr__ below.
__all__ = [  # noqa: F822
    "GPT",
    "GPTConfig",
    "ModelShape",
    "add_model_arguments",
    "build_model",
    "saved_bytes",
]

__getattr__ = moved_to(__name__, "tierstore.models")
