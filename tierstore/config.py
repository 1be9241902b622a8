"""Configuration: :class:`TierConfig` and where each value comes from.

Sources, strongest first: explicit arguments, ``TIERSTORE_<FIELD>``
environment variables, the TOML file named by ``TIERSTORE_CONFIG`` (else
``./tierstore.toml`` when it exists), then the defaults below. Sizes accept
``"4GiB"``, ``"512MB"``, ``"1.5 GiB"`` or a number of bytes.

Example:
    >>> from tierstore import TierConfig
    >>> cfg = TierConfig(host_budget="512MiB", disk_budget="4GiB")
    >>> cfg.host_budget
    536870912
"""

from __future__ import annotations

import contextvars
import difflib
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ByteSize,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from tierstore.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "AUTO",
    "ENV_PREFIX",
    "Origin",
    "TierConfig",
    "describe_config",
    "human_bytes",
    "load_config",
]

#: Prefix of the environment variables that set :class:`TierConfig` fields.
ENV_PREFIX = "TIERSTORE_"
#: Environment variable naming the TOML file; not itself a field.
CONFIG_ENV = "TIERSTORE_CONFIG"
#: TOML file read when ``TIERSTORE_CONFIG`` is unset, relative to the working directory.
DEFAULT_TOML = Path("tierstore.toml")

_SIZE_FORM = "a size such as '4GiB', '512MB' or a whole number of bytes"
_BOOL_FORM = "true or false (also 1/0, yes/no, on/off)"

# load_config(path=...) hands its path to the TOML source through this variable:
# pydantic-settings builds sources in a classmethod, with no per-call arguments.
_toml_override: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "tierstore_toml_override", default=None
)

# NOTE [ Size syntax ]
#
# A size is a whole number of bytes: an int, a float with no fraction, or a
# string "<number> <unit>". Pydantic's ByteSize alone is too lenient: it
# matches only a prefix of the string, so "4 GB/s" would be 4 GB and "4 GiB 7"
# 4 GiB; it truncates "0.5" to 0 bytes; it takes bits ("1 Gbit"), True as
# 1 byte, and reports -1 or a list only as "could not parse". The parser below
# takes the whole string, computes in Decimal (so "1.1 GB" is exact), and says
# what is wrong. Units are ByteSize's byte units, case-insensitive, so every
# size ByteSize reads as whole bytes means the same number here.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{p: 10 ** (3 * (i + 1)) for i, p in enumerate("kmgtpe")},
    **{p + "b": 10 ** (3 * (i + 1)) for i, p in enumerate("kmgtpe")},
    **{p + "ib": 2 ** (10 * (i + 1)) for i, p in enumerate("kmgtpe")},
}
_UNIT_NAMES = "B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB or EiB"
_SIZE_RE = re.compile(r"\s*(?P<sign>[-+]?)(?P<number>\d+\.?\d*|\.\d+)\s*(?P<unit>.*?)\s*")


def _kind(value: object) -> str:
    """``a list``, ``an int``: the type of a value, for "... is not a size"."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _size_input(value: Any) -> Any:
    # See NOTE [ Size syntax ]; returns an int of bytes for ByteSize to wrap.
    if isinstance(value, bool):
        raise ValueError("a bool is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a number of bytes")
        if value < 0:
            raise ValueError("a size cannot be negative")
        if not value.is_integer():
            raise ValueError(f"{value} is not a whole number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{_kind(value)} is not a size")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ValueError("not a number followed by a unit" if value.strip() else "an empty size")
    if match["sign"] == "-" and Decimal(match["number"]) != 0:
        raise ValueError("a size cannot be negative")
    unit = match["unit"]
    if unit.lower() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r}; the units are {_UNIT_NAMES}")
    nbytes = Decimal(match["number"]) * _UNITS[unit.lower()]
    if nbytes != nbytes.to_integral_value():
        raise ValueError(f"{value.strip()} is not a whole number of bytes")
    return int(nbytes)


def _int_input(value: Any) -> Any:
    # Pydantic's lax int takes True as 1: io_workers=True is a slip, not a count.
    if isinstance(value, bool):
        raise ValueError("a bool is not a whole number")
    return value


_BUDGET_FORM = (
    "'auto', a size such as '6GiB', a fraction of the step's saved bytes such as 0.3 or '30%', "
    "or 'none'"
)
_MARGIN_FORM = (
    "a size such as '512MiB', or a fraction of the memory's capacity such as 0.1 or '10%'"
)

#: ``activation_budget="auto"``: the budget is the room the device has left, each step
#: (NOTE [ The room a step has ] in tierstore/planning/room.py).
AUTO: Literal["auto"] = "auto"


# NOTE [ Bytes or a fraction ]
# activation_budget takes bytes or a fraction of the step's saved bytes, and
# 1 and 1.0 would mean 1 byte and all of it. A bare whole number (an int, or
# digits with no unit) below 4 KiB is refused, with both readings in the
# message: no step fits in that many bytes, so it is the fraction mistyped.
# 0 stays 0 bytes (as 0.0 is: the same thing), and '1B' is 1 byte.
_LEAST_BARE_BUDGET = 4096


def _budget_input(value: Any) -> Any:
    """``activation_budget``: ``None``, ``"auto"``, bytes (an int or a size) or a fraction."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "none":
            return None
        if text.lower() == AUTO:
            return AUTO
        if text.endswith("%"):
            try:
                percent = Decimal(text[:-1].strip())
            except ArithmeticError:
                raise ValueError(f"{text!r} is not a percentage") from None
            fraction = float(percent / 100)
            return 0 if fraction == 0 else _fraction(fraction, text)
        if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+)", text):
            return 0 if float(text) == 0 else _fraction(float(text), text)
    elif isinstance(value, float):
        return 0 if value == 0 else _fraction(value, repr(value))
    bare = value.strip() if isinstance(value, str) else value
    if (isinstance(bare, int) and not isinstance(bare, bool)) or (
        isinstance(bare, str) and re.fullmatch(r"\+?\d+", bare)
    ):
        n = int(bare)
        if 0 < n < _LEAST_BARE_BUDGET:
            # See NOTE [ Bytes or a fraction ]
            raise ValueError(
                f"{n} would be {n} byte{'s' if n > 1 else ''}, which no step fits in: "
                "write a fraction of the step's saved bytes with a decimal point or a "
                f"percent sign (1.0 or '100%' is all of it), and bytes with a unit ('{n}B', "
                "'6GiB')"
            )
    try:
        return _size_input(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("a size", "a budget")) from None


def _margin_input(value: Any) -> Any:
    """``memory_margin``: bytes (an int or a size) or a fraction of the capacity in [0, 1)."""
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                percent = Decimal(text[:-1].strip())
            except ArithmeticError:
                raise ValueError(f"{text!r} is not a percentage") from None
            return _margin_fraction(float(percent / 100), text)
        if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+)", text):
            return _margin_fraction(float(text), text)
    elif isinstance(value, float):
        return _margin_fraction(value, repr(value))
    try:
        return _size_input(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("a size", "a margin")) from None


def _margin_fraction(value: float, shown: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{shown} is not a number")
    if value < 0:
        raise ValueError("a margin cannot be negative")
    if value >= 1:
        raise ValueError(
            f"a fraction of the capacity must be below 1 (got {shown}); give bytes as a size "
            "such as '512MiB'"
        )
    return value


def _fraction(value: float, shown: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{shown} is not a number")
    if value < 0:
        raise ValueError("a budget cannot be negative")
    if value > 1:
        raise ValueError(
            f"a fraction cannot be above 1 (got {shown}); give bytes as a size such as '6GiB'"
        )
    return value


def _path_input(value: Any) -> Any:
    if isinstance(value, str):
        # Path("") is the working directory: never what an empty setting meant.
        if not value.strip():
            raise ValueError("an empty path")
    elif not isinstance(value, os.PathLike):
        raise ValueError(f"{_kind(value)} is not a path")
    if "\0" in os.fspath(value):
        raise ValueError("a path cannot contain a NUL character")
    return value


#: Bytes, given as an int or a string with a unit ("4GiB", "512MB"); NOTE [ Size syntax ].
Size = Annotated[ByteSize, BeforeValidator(_size_input)]
#: ``activation_budget``: ``"auto"``, bytes (int), a fraction of the step's saved bytes
#: (float), or None.
Budget = Annotated[Literal["auto"] | int | float | None, BeforeValidator(_budget_input)]
#: ``memory_margin``: bytes (int) or a fraction of the memory's capacity (float).
Margin = Annotated[int | float, BeforeValidator(_margin_input)]
#: A whole number that is not a bool.
Count = Annotated[int, BeforeValidator(_int_input)]


def human_bytes(n: int) -> str:
    """Format a byte count the way tierstore's messages do.

    Example:
        >>> human_bytes(3 * 2**20)
        '3.0 MiB'
        >>> human_bytes(512)
        '512 B'
    """
    if n < 1024:
        return f"{n} B"
    return ByteSize(n).human_readable(separator=" ")


class _Conflict(ValueError):
    """Settings valid alone that contradict each other (NOTE [ Conflicting settings ]).

    ``template`` names each setting as ``{name}``; the message shows its value
    and source there, e.g. ``disk_budget=0 (from argument)``.
    """

    def __init__(self, template: str, values: dict[str, Any]) -> None:
        super().__init__(template)
        self.template = template
        self.values = values

    def explain(self, origins: Mapping[str, Origin]) -> str:
        """The message, each setting shown with its value and where that came from."""
        shown = {}
        for name, value in self.values.items():
            origin = origins[name]
            source = "the default" if origin.kind == "default" else f"from {origin.describe()}"
            shown[name] = f"{name}={value!r} ({source})"
        return "tierstore: " + self.template.format(**shown)


class TierConfig(BaseSettings):
    """Budgets and placement of the tiers, validated once.

    A frozen, hashable value: two equal configs describe the same store.
    Fields not given as arguments come from the environment, then the TOML
    file, then the defaults (see the module docstring).

    A saved tensor goes to the fastest tier with room: ``device`` (left where
    autograd made it, up to ``device_budget``), ``host`` (host memory, up to
    ``host_budget``), ``disk`` (up to ``disk_budget``). For a tensor on the
    CPU the host tier is the same RAM, so while ``disk_budget > 0`` CPU
    tensors beyond ``device_budget`` go straight to disk, whatever
    ``host_budget`` says: ``device_budget`` is what keeps CPU tensors in RAM.
    With ``disk_budget=0`` they use the host tier, up to ``host_budget``. The host tier
    keeps its meaning for accelerator (CUDA) tensors. On a CPU-only machine
    the defaults therefore put every saved tensor of ``min_offload_bytes`` or
    more on disk.

    Example:
        >>> from tierstore import TierConfig
        >>> cfg = TierConfig(device_budget=0, host_budget=0, disk_budget="1GiB")
        >>> cfg.disk_backend
        'file'
        >>> cfg.model_copy(update={"compression": "zstd"}).compression
        'zstd'
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        validate_default=True,
        case_sensitive=False,
    )

    device_budget: Size = Field(
        default=ByteSize(0),
        description="Bytes of saved tensors left on the compute device (the newest ones); "
        "for CPU tensors, the bytes kept in RAM as they are.",
    )
    host_budget: Size = Field(
        default=ByteSize(8 << 30),
        description="Bytes of saved accelerator tensors held in host memory (pinned when CUDA "
        "is present). CPU tensors skip it while disk_budget > 0: it is their own RAM.",
    )
    pin_memory: bool = Field(
        default=True,
        description="Page-lock the host tier's buffers on CUDA (False: pageable, slower copies).",
    )
    host_pool_step: Size = Field(
        default=ByteSize(256 << 20),
        description="Bytes of host buffers allocated at a time: on CUDA pinned, up to "
        "host_budget; on a CPU tierstore's own buffers (disk reads, write staging), of which "
        "it may hold at least this much.",
    )
    disk_budget: Size = Field(
        default=ByteSize(32 << 30),
        description="Bytes of saved tensors on local disk; the file backend grows its file "
        "on demand up to this.",
    )
    disk_path: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()),
        description="Directory under which a private spill directory is created.",
    )
    disk_backend: Literal["file", "lmdb"] = Field(
        default="file", description="How bytes rest on disk: one file grown on demand, or LMDB."
    )
    min_offload_bytes: Size = Field(
        default=ByteSize(64 << 10),
        description="Saved tensors smaller than this stay on the device.",
    )
    prefetch_bytes: Size = Field(
        default=ByteSize(256 << 20),
        description="At most this many bytes read ahead of backward and held by it (disk "
        "reads, H2D copies on CUDA); the window below it is sized by need.",
    )
    write_queue_bytes: Size = Field(
        default=ByteSize(256 << 20),
        description="At most this many bytes queued behind forward: disk writes (sized by "
        "need below it; past it pack waits) and, on CUDA, D2H copies (past it a save waits "
        "for the oldest copy; with activation_budget it stays on the device instead).",
    )
    io_workers: Count = Field(
        default=4, ge=1, le=64, description="Disk reads and writes in flight at once."
    )
    compression: Literal["none", "zstd"] = Field(
        default="none", description="Compression of disk entries (zstd with byte shuffle)."
    )
    compression_level: Count = Field(
        default=1, ge=1, le=22, description="zstd level when compression='zstd'."
    )
    recompute: Literal["off", "cheap"] = Field(
        default="off",
        description="'cheap': saved tensors that a cheap elementwise, normalisation or view "
        "op made from inputs stored anyway are rebuilt in backward instead of stored "
        "(NOTE [ Recompute ] in tierstore/autograd/recompute.py).",
    )

    activation_budget: Budget = Field(
        default=None,
        description="Saved activations that may stay in the memory of the device that made "
        "them, tierstore's in-flight buffers included: a size, or a fraction of what the "
        "step saves (0.3, '30%'; all of it is 1.0, and a bare whole number below 4 KiB is "
        "refused: 1 would be one byte). tierstore profiles a step and plans keep / offload / "
        "rebuild per saved tensor for the fastest step within it (NOTE [ Planning ] in "
        "tierstore/planning/planner.py). 'auto': at each step's start, what the memory can "
        "still give the step's saves: its capacity (the GPU's; on a CPU the process's "
        "cgroup limit, else what the kernel says is available) less what is in use, the "
        "step's own working memory and memory_margin (NOTE [ The room a step has ] in "
        "tierstore/planning/room.py). None: placement by the budgets above. Set, it decides "
        "what stays on the device in place of device_budget.",
    )
    memory_margin: Margin = Field(
        default=0.1,
        description="Under activation_budget='auto', the memory left unclaimed: a size, or a "
        "fraction of the capacity (0.1, '10%'). It holds what no step start or backward "
        "measures: an op's temporaries, the CUDA allocator's fragmentation (reserved over "
        "allocated, commonly 5-15%), page cache a write dirtied. Half of it is also the band "
        "the room may fall by before a plan is remade (NOTE [ The room a step has ] in "
        "tierstore/planning/room.py).",
    )

    @field_validator("disk_path", mode="before")
    @classmethod
    def _path_like_disk_path(cls, value: Any) -> Any:
        return _path_input(value)

    @field_validator("disk_path")
    @classmethod
    def _absolute_disk_path(cls, value: Path) -> Path:
        # Fix the directory now: a later chdir must not move the spill files.
        try:
            path = value.expanduser().absolute()
        except RuntimeError as exc:  # "~nobody/x": no such user, or no home directory
            raise ValueError(f"cannot expand '~': {exc}") from None
        try:
            if path.exists() and not path.is_dir():
                raise ValueError("exists and is not a directory")
            # The spill directory is created on first use, parents included; a
            # parent that is a file makes that impossible, whatever the disk holds.
            for parent in path.parents:
                if parent.exists():
                    if not parent.is_dir():
                        raise ValueError(f"{parent} is not a directory")
                    break
        except OSError:
            # Not allowed to look (EACCES): opening the disk tier says what is wrong.
            pass
        return path

    # NOTE [ Conflicting settings ]
    #
    # Each value below is valid on its own; a combination is an error only
    # when the store could not do what the settings ask, whatever the model.
    # Errors:
    # - device_budget, host_budget and disk_budget all 0: no tier can hold a
    #   saved tensor, so every tensor of min_offload_bytes or more would raise
    #   TierFullError in forward. (No test or example uses all three 0 to mean
    #   "keep everything": min_offload_bytes or tierstore.keep() say that.)
    # - compression='zstd' with disk_budget=0: compression applies only to
    #   disk entries; asking for it with no disk tier is a contradiction the
    #   user should hear about, not a setting silently ignored.
    # Considered and not errors (sources layer: a TOML file or environment
    # sets the defaults of a fleet, an argument turns one thing off, and that
    # must not make the other settings fail):
    # - compression_level with compression='none' or disk_budget=0: the level
    #   is inert until compression is on.
    # - disk_backend / disk_path / io_workers with disk_budget=0: the backend
    #   is opened only when an entry reaches the disk (tiers/movers.py), i.e. never;
    #   bench train's host-only strategy passes disk_backend with disk_budget=0.
    # - min_offload_bytes larger than every budget: only tensors that large
    #   fail, and only if one shows up (TierFullError names the budget then);
    #   a huge min_offload_bytes is a way to keep everything on the device.
    # - host_pool_step larger than host_budget: HostPool caps each chunk at the
    #   room left; host_pool_step=0 gives each block a chunk of its own size.
    # - write_queue_bytes=0: writes are synchronous (pack waits for each).
    #   prefetch_bytes=0: no read-ahead; every unpack from disk is a miss.
    #   Both are upper bounds: below them the store sizes what is in flight
    #   by need (NOTE [ In-flight sizing ] in tierstore/tiers/sizing.py).
    # - prefetch_bytes or write_queue_bytes above host_budget: they bound
    #   bytes in flight, which are not counted in the host tier.
    # - pin_memory without CUDA: there is nothing to pin; ignored.
    @model_validator(mode="after")
    def _consistent(self) -> TierConfig:
        budgets = ("device_budget", "host_budget", "disk_budget")
        if all(getattr(self, name) == 0 for name in budgets):
            raise _Conflict(
                "{device_budget}, {host_budget} and {disk_budget} are all 0, so no tier can "
                "hold a saved tensor; give at least one of them a size",
                {name: int(getattr(self, name)) for name in budgets},
            )
        if self.compression != "none" and self.disk_budget == 0:
            raise _Conflict(
                "{compression} applies to the disk tier, but {disk_budget} disables it; "
                "set compression='none' or give disk_budget a size",
                {"compression": self.compression, "disk_budget": int(self.disk_budget)},
            )
        return self

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, values)) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then ``TIERSTORE_*`` variables, then the TOML file; no dotenv."""
        return (init_settings, _EnvSource(settings_cls), _TomlSource(settings_cls))


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> TierConfig:
    r"""Resolve a :class:`TierConfig` from arguments, environment, TOML and defaults.

    Args:
        path: TOML file to read instead of ``$TIERSTORE_CONFIG`` or
            ``./tierstore.toml``. It must exist.
        **overrides: field values that win over every other source.

    Returns:
        The validated configuration: the same object as last time while
        none of its sources changed (NOTE [ Resolved configurations are cached ]).

    Raises:
        ConfigError: a value is malformed, a key is unknown, or the file is
            missing or not valid TOML; the message names the source.

    Example:
        >>> import os, tempfile
        >>> from tierstore import load_config
        >>> toml = os.path.join(tempfile.mkdtemp(), "tierstore.toml")
        >>> with open(toml, "w") as f:
        ...     _ = f.write('host_budget = "1GiB"\ndisk_backend = "lmdb"\n')
        >>> cfg = load_config(toml, host_budget="2GiB")
        >>> cfg.host_budget, cfg.disk_backend
        (2147483648, 'lmdb')
    """
    if path is not None:
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(
                f"tierstore: load_config(path={path!r}) takes the path of a TOML file; "
                f"got {type(path).__name__}"
            )
        toml = Path(path)
        if not toml.is_file():
            raise ConfigError(
                f"tierstore: load_config(path={str(path)!r}): no such TOML file; "
                "pass the path of an existing file"
            )

        def from_file() -> TierConfig:
            token = _toml_override.set(toml)
            try:
                return TierConfig(**overrides)
            finally:
                _toml_override.reset(token)

        return _cached(_sources_key(toml, overrides), from_file)
    return _cached(_sources_key(None, overrides), lambda: TierConfig(**overrides))


def with_overrides(config: TierConfig, overrides: Mapping[str, Any]) -> TierConfig:
    """``config`` with ``overrides`` applied, validated; cached as :func:`load_config` is.

    Example:
        >>> from tierstore.config import TierConfig, with_overrides
        >>> with_overrides(TierConfig(disk_budget=0), {"host_budget": "1KiB"}).host_budget
        1024
    """
    if not overrides:
        return config
    return _cached(
        _sources_key(None, overrides, config),
        lambda: TierConfig(**{**config.model_dump(), **overrides}),
    )


# NOTE [ Resolved configurations are cached ]
# tierstore.offload(**settings) resolves its configuration every time it is
# entered, and a training loop enters it every step. pydantic-settings takes
# about half a millisecond to build one (it walks every field's annotation
# and every source), more than the hooks cost on a small model's whole
# step. So a resolved TierConfig (immutable) is kept under a key that holds
# everything it was resolved from: the arguments, every TIERSTORE_*
# variable, the TOML file that would be read (its path, size, inode and
# modification time in nanoseconds), the working directory (the default
# TOML file and a relative disk_path resolve against it) and tempfile's
# directory (disk_path's default). Any change to one of them resolves
# afresh, so a cached value is always the one a fresh resolution would give;
# building the key costs tens of microseconds. A resolution that raises is
# not kept: it raises again next time. Arguments that cannot be hashed skip
# the cache.
_MAX_RESOLVED = 32
_resolved: dict[tuple[Any, ...], TierConfig] = {}


def _sources_key(
    toml: Path | None, overrides: Mapping[str, Any], base: TierConfig | None = None
) -> tuple[Any, ...] | None:
    """What resolving depends on (NOTE [ Resolved configurations are cached ]); None: unhashable."""
    environ = os.environ  # its keys only: reading every value would double the cost
    env = tuple(
        sorted((k, environ[k]) for k in environ if k[: len(ENV_PREFIX)].upper() == ENV_PREFIX)
    )
    if toml is None and base is None:
        toml = _toml_path()
    file: tuple[Any, ...] | None = None
    if toml is not None:
        try:
            st = toml.stat()
        except OSError:  # resolving reports it
            return None
        file = (str(toml.resolve()), st.st_size, st.st_ino, st.st_mtime_ns)
    key = (base, tuple(sorted(overrides.items())), env, file, os.getcwd(), tempfile.tempdir)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _cached(key: tuple[Any, ...] | None, resolve: Callable[[], TierConfig]) -> TierConfig:
    """The configuration kept under ``key``, else ``resolve()``'s, kept; ``None``: not kept."""
    if key is None:
        return resolve()
    config = _resolved.get(key)
    if config is None:
        config = resolve()
        if len(_resolved) >= _MAX_RESOLVED:
            _resolved.clear()
        _resolved[key] = config
    return config


@dataclass(frozen=True)
class Origin:
    """Where one setting's value came from.

    Example:
        >>> Origin("env", "TIERSTORE_HOST_BUDGET").describe()
        'environment variable TIERSTORE_HOST_BUDGET'
    """

    kind: Literal["argument", "env", "toml", "default"]
    where: str = ""

    def describe(self) -> str:
        """A phrase for messages: ``argument``, ``environment variable X``, ..."""
        if self.kind == "env":
            return f"environment variable {self.where}"
        if self.kind == "toml":
            return f"TOML file {self.where}"
        return self.kind


def describe_config(**overrides: Any) -> list[tuple[str, Any, Origin]]:
    """Resolve the configuration and say where each value came from.

    This is what ``tierstore config`` prints.

    Example:
        >>> from tierstore.config import describe_config
        >>> rows = describe_config(host_budget="1GiB")
        >>> [(name, origin.kind) for name, _, origin in rows if name == "host_budget"]
        [('host_budget', 'argument')]
    """
    cfg = TierConfig(**overrides)
    origins = _origins(overrides)
    return [(name, getattr(cfg, name), origins[name]) for name in TierConfig.model_fields]


# --------------------------------------------------------------------------
# Sources


def _toml_path() -> Path | None:
    override = _toml_override.get()
    if override is not None:
        return override
    named = os.environ.get(CONFIG_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise ConfigError(
                f"tierstore: {CONFIG_ENV}={named!r} names no file; "
                f"unset {CONFIG_ENV} or point it at a TOML file"
            )
        return path
    return DEFAULT_TOML if DEFAULT_TOML.is_file() else None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:  # binary, as tomllib requires
            data: dict[str, Any] = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"tierstore: cannot read TOML file {path}: {exc}") from exc
    for key in data:
        if key not in TierConfig.model_fields:
            raise ConfigError(_unknown(key, f"TOML file {path}: key {key!r}"))
    return data


class _TomlSource(PydanticBaseSettingsSource):
    """Top-level keys of the TOML file; an unknown key is an error."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        path = _toml_path()
        self.path = path
        self.data = _read_toml(path) if path is not None else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


class _EnvSource(EnvSettingsSource):
    """``TIERSTORE_<FIELD>`` variables; a misspelt ``TIERSTORE_*`` is an error, not ignored."""

    def __call__(self) -> dict[str, Any]:
        for name in os.environ:
            if not name.upper().startswith(ENV_PREFIX) or name.upper() == CONFIG_ENV:
                continue
            field = name[len(ENV_PREFIX) :].lower()
            if field not in TierConfig.model_fields:
                raise ConfigError(_unknown(field, f"environment variable {name}", env=True))
        return super().__call__()


def _env_names() -> dict[str, str]:
    """Field name -> the variable that sets it, spelt as in the environment."""
    return {
        name[len(ENV_PREFIX) :].lower(): name
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX) and name.upper() != CONFIG_ENV
    }


def _origins(arguments: Mapping[str, Any]) -> dict[str, Origin]:
    env = _env_names()
    toml_path = _toml_path()
    toml = _read_toml(toml_path) if toml_path is not None else {}
    out: dict[str, Origin] = {}
    for name in TierConfig.model_fields:
        if name in arguments:
            out[name] = Origin("argument", name)
        elif name in env:
            out[name] = Origin("env", env[name])
        elif name in toml:
            out[name] = Origin("toml", f"{toml_path}, key {name}")
        else:
            out[name] = Origin("default")
    return out


# --------------------------------------------------------------------------
# Messages


def _expected(name: str) -> str:
    if name == "activation_budget":
        return _BUDGET_FORM
    if name == "memory_margin":
        return _MARGIN_FORM
    field = TierConfig.model_fields[name]
    annotation = field.annotation
    if annotation is ByteSize:
        return _SIZE_FORM
    args = getattr(annotation, "__args__", ())
    if args and all(isinstance(a, str) for a in args):
        return "one of " + ", ".join(repr(a) for a in args)
    if annotation is Path:
        return "a path to a writable directory"
    if annotation is bool:
        return _BOOL_FORM
    if annotation is int:
        bounds = [m for m in field.metadata if hasattr(m, "ge") or hasattr(m, "le")]
        lo = next((m.ge for m in bounds if hasattr(m, "ge")), None)
        hi = next((m.le for m in bounds if hasattr(m, "le")), None)
        if lo is not None and hi is not None:
            return f"a whole number from {lo} to {hi}"
        return "a whole number"
    # A new field of another type: the matrix in tests/test_config_matrix.py
    # fails until it has a form of its own here.
    return f"a {getattr(annotation, '__name__', annotation)}"


def _unknown(key: str, source: str, *, env: bool = False) -> str:
    known = sorted(TierConfig.model_fields)
    close = difflib.get_close_matches(key, known, n=1)
    hint = ""
    if close:
        hint = f"; did you mean {ENV_PREFIX + close[0].upper() if env else close[0]}?"
    return f"tierstore: unknown setting in {source}{hint or '.'} Known settings: {', '.join(known)}"


def _explain(exc: ValidationError, arguments: Mapping[str, Any]) -> str:
    origins = _origins(arguments)
    lines = []
    for error in exc.errors():
        loc = error["loc"]
        name = str(loc[0]) if loc else ""
        if error["type"] == "extra_forbidden":
            lines.append(_unknown(name, f"argument {name}={error.get('input')!r}"))
        elif name in TierConfig.model_fields:
            origin = origins[name]
            value = error.get("input")
            lines.append(
                f"tierstore: {name}={value!r} from {origin.describe()} is not valid "
                f"({error['msg'].removeprefix('Value error, ')}); expected {_expected(name)}"
            )
        elif isinstance(conflict := error.get("ctx", {}).get("error"), _Conflict):
            lines.append(conflict.explain(origins))
        else:  # pragma: no cover - every model-level check raises _Conflict
            lines.append(f"tierstore: {error['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)
