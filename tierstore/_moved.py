"""Old import paths that still work for a release, with a ``DeprecationWarning``.

A module that moved leaves a stub behind whose module ``__getattr__`` comes
from :func:`moved_to`: each name read from the old path warns once per call
site and returns the object from the new one. Every such path is listed in
``CHANGELOG.md``.

Example:
    >>> import warnings
    >>> import tierstore.hooks
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     store_class = tierstore.hooks.TierStore
    >>> store_class is __import__("tierstore").TierStore, caught[0].category.__name__
    (True, 'DeprecationWarning')
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved_to(old: str, new: str, *more: str) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``old`` that hands out the new modules' names, warning.

    Args:
        old: the module's old dotted path (the stub's ``__name__``).
        new: where its names live now.
        *more: further modules its names went to (a module split in several),
            looked in after ``new``, in order.

    Example:
        >>> lookup = moved_to("tierstore.store", "tierstore.tiers.manager")
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     lookup("TierManager").__module__
        'tierstore.tiers.manager'
    """

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # import machinery and tools probing the stub
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        # The module that exports the name, not one that merely imports it.
        modules = [importlib.import_module(home) for home in (new, *more)]
        owners = [m for m in modules if name in getattr(m, "__all__", ())]
        owners += [m for m in modules if m not in owners and hasattr(m, name)]
        if not owners:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module = owners[0]
        home = module.__name__
        warnings.warn(
            f"tierstore: {old}.{name} moved to {home}.{name}; import it from {home} "
            f"({old} is removed in the next release, see CHANGELOG.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, name)

    return __getattr__
