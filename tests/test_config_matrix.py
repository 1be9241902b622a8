"""Issue 6, item 7: every TierConfig field, every kind of bad input, from every source.

Each case is one bad value for one field, written three ways: the Python
value passed as an argument, the text of a ``TIERSTORE_<FIELD>`` variable
and the TOML literal of a config file. Every one must raise ConfigError with
the message ``tierstore: <field>=<value> from <source> is not valid
(<reason>); expected <form>``. The matrix is built from
``TierConfig.model_fields``, so a new field fails ``test_matrix_covers_every_field``
until it has cases here.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ByteSize

import tierstore
from tierstore import ConfigError, TierConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Kind = Literal["type", "unit", "range", "enum", "toml-type"]

SIZE = "a size such as '4GiB', '512MB' or a whole number of bytes"
UNITS = "the units are B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB or EiB"
NOT_INT = "Input should be a valid integer"
NOT_BOOL = "Input should be a valid boolean"
PATH = "a path to a writable directory"
#: The expected form each field's messages end with. Written out, not derived.
FORMS = {
    "device_budget": SIZE,
    "host_budget": SIZE,
    "pin_memory": "true or false (also 1/0, yes/no, on/off)",
    "host_pool_step": SIZE,
    "disk_budget": SIZE,
    "disk_path": PATH,
    "disk_backend": "one of 'file', 'lmdb'",
    "min_offload_bytes": SIZE,
    "prefetch_bytes": SIZE,
    "write_queue_bytes": SIZE,
    "io_workers": "a whole number from 1 to 64",
    "compression": "one of 'none', 'zstd'",
    "compression_level": "a whole number from 1 to 22",
    "recompute": "one of 'off', 'cheap'",
    "activation_budget": "'auto', a size such as '6GiB', a fraction of the step's saved bytes "
    "such as 0.3 or '30%', or 'none'",
    "memory_margin": "a size such as '512MiB', or a fraction of the memory's capacity such as "
    "0.1 or '10%'",
}
#: A regular file in the working directory (each test's tmp_path), for disk_path.
A_FILE = "a-file"


@dataclass(frozen=True)
class Bad:
    """One bad value: as an argument, as env text (None: not expressible), as a TOML literal."""

    field: str
    kind: Kind
    value: Any
    reason: str
    env: str | None
    toml: str | None
    env_reason: str | None = None  # when the text from the environment reads otherwise

    @property
    def id(self) -> str:
        return f"{self.field}={self.value!r}"

    def why(self, source: Literal["argument", "env", "toml"]) -> str:
        reason = self.env_reason if source == "env" and self.env_reason else self.reason
        return reason.format(cwd=Path.cwd())


def _size_cases(field: str) -> list[Bad]:
    def bad(kind: Kind, value: Any, reason: str, env: str | None, toml: str | None) -> Bad:
        return Bad(field, kind, value, reason, env, toml)

    text = "not a number followed by a unit"
    return [
        bad("type", "abc", text, "abc", '"abc"'),
        bad("type", "", "an empty size", "", '""'),
        bad("type", "GiB", text, "GiB", '"GiB"'),
        Bad(field, "type", True, "a bool is not a size", "true", "true", env_reason=text),
        bad("type", 1.5, "1.5 is not a whole number of bytes", "1.5", "1.5"),
        bad("type", "0.5 B", "0.5 B is not a whole number of bytes", "0.5 B", '"0.5 B"'),
        Bad(field, "type", float("nan"), "nan is not a number of bytes", "nan", "nan", text),
        Bad(field, "type", float("inf"), "inf is not a number of bytes", "inf", "inf", text),
        bad("unit", "4 GB/s", f"unknown unit 'GB/s'; {UNITS}", "4 GB/s", '"4 GB/s"'),
        bad("unit", "12 parsecs", f"unknown unit 'parsecs'; {UNITS}", "12 parsecs", '"12 parsecs"'),
        bad("unit", "4GiBB", f"unknown unit 'GiBB'; {UNITS}", "4GiBB", '"4GiBB"'),
        bad("unit", "4 GiB 7", f"unknown unit 'GiB 7'; {UNITS}", "4 GiB 7", '"4 GiB 7"'),
        bad("unit", "1 Gbit", f"unknown unit 'Gbit'; {UNITS}", "1 Gbit", '"1 Gbit"'),
        bad("unit", "1e9", f"unknown unit 'e9'; {UNITS}", "1e9", '"1e9"'),
        bad("range", -1, "a size cannot be negative", "-1", "-1"),
        bad("range", -2.0, "a size cannot be negative", "-2.0", "-2.0"),
        bad("range", "-4GiB", "a size cannot be negative", "-4GiB", '"-4GiB"'),
        bad("toml-type", [1, 2], "a list is not a size", None, "[1, 2]"),
        bad("toml-type", {"size": "4GiB"}, "a dict is not a size", None, '{ size = "4GiB" }'),
        bad("toml-type", datetime.date(1979, 5, 27), "a date is not a size", None, "1979-05-27"),
        bad("type", None, "None is not a size", None, None),
        bad("type", b"4GiB", "a bytes is not a size", None, None),
    ]


#: Fields whose value is a size: each gets the whole size matrix.
SIZE_FIELDS = [name for name, f in TierConfig.model_fields.items() if f.annotation is ByteSize]


def _enum_cases(
    field: str, reason: str, rows: list[tuple[Kind, Any, str | None, str | None]]
) -> list[Bad]:
    return [Bad(field, kind, value, reason, env, toml) for kind, value, env, toml in rows]


OTHER_CASES = [
    # pin_memory
    Bad("pin_memory", "type", "abc", f"{NOT_BOOL}, unable to interpret input", "abc", '"abc"'),
    Bad("pin_memory", "type", "", f"{NOT_BOOL}, unable to interpret input", "", '""'),
    Bad("pin_memory", "range", 2, f"{NOT_BOOL}, unable to interpret input", "2", "2"),
    Bad(
        "pin_memory", "type", 0.5, NOT_BOOL, "0.5", "0.5", f"{NOT_BOOL}, unable to interpret input"
    ),
    Bad("pin_memory", "toml-type", [True], NOT_BOOL, None, "[true]"),
    Bad("pin_memory", "toml-type", {"on": True}, NOT_BOOL, None, "{ on = true }"),
    Bad("pin_memory", "type", None, NOT_BOOL, None, None),
    # disk_path
    Bad("disk_path", "type", "", "an empty path", "", '""'),
    Bad("disk_path", "type", "   ", "an empty path", "   ", '"   "'),
    Bad("disk_path", "type", "a\0b", "a path cannot contain a NUL character", None, '"a\\u0000b"'),
    Bad("disk_path", "range", A_FILE, "exists and is not a directory", A_FILE, f'"{A_FILE}"'),
    Bad(
        "disk_path",
        "range",
        f"{A_FILE}/spill",
        "{cwd}/" + A_FILE + " is not a directory",
        f"{A_FILE}/spill",
        f'"{A_FILE}/spill"',
    ),
    Bad(
        "disk_path",
        "range",
        "~no-such-user-here/spill",
        "cannot expand '~': Could not determine home directory.",
        "~no-such-user-here/spill",
        '"~no-such-user-here/spill"',
    ),
    Bad("disk_path", "toml-type", 5, "an int is not a path", None, "5"),
    Bad("disk_path", "toml-type", True, "a bool is not a path", None, "true"),
    Bad("disk_path", "toml-type", ["/tmp"], "a list is not a path", None, '["/tmp"]'),
    Bad("disk_path", "toml-type", {"root": "/tmp"}, "a dict is not a path", None, '{root="/tmp"}'),
    Bad("disk_path", "type", None, "None is not a path", None, None),
    # disk_backend
    *_enum_cases(
        "disk_backend",
        "Input should be 'file' or 'lmdb'",
        [
            ("enum", "ntfs", "ntfs", '"ntfs"'),
            ("enum", "FILE", "FILE", '"FILE"'),
            ("enum", "", "", '""'),
            ("enum", " lmdb", " lmdb", '" lmdb"'),
            ("toml-type", 1, None, "1"),
            ("toml-type", ["file"], None, '["file"]'),
            ("toml-type", {"name": "file"}, None, '{name = "file"}'),
            ("type", None, None, None),
        ],
    ),
    # compression
    *_enum_cases(
        "compression",
        "Input should be 'none' or 'zstd'",
        [
            ("enum", "lz4", "lz4", '"lz4"'),
            ("enum", "ZSTD", "ZSTD", '"ZSTD"'),
            ("enum", "gzip", "gzip", '"gzip"'),
            ("enum", "", "", '""'),
            ("toml-type", True, None, "true"),
            ("toml-type", False, None, "false"),
            ("toml-type", ["zstd"], None, '["zstd"]'),
            ("type", None, None, None),
        ],
    ),
    # recompute (a policy function is an argument of offload(), not a setting)
    *_enum_cases(
        "recompute",
        "Input should be 'off' or 'cheap'",
        [
            ("enum", "on", "on", '"on"'),
            ("enum", "CHEAP", "CHEAP", '"CHEAP"'),
            ("enum", "", "", '""'),
            ("toml-type", True, None, "true"),
            ("toml-type", ["cheap"], None, '["cheap"]'),
            ("type", None, None, None),
        ],
    ),
    # activation_budget: a size or a fraction in (0, 1]; None (or "none") is valid
    Bad(
        "activation_budget", "type", "words", "not a number followed by a unit", "words", '"words"'
    ),
    Bad("activation_budget", "type", "", "an empty size", "", '""'),
    Bad(
        "activation_budget",
        "type",
        True,
        "a bool is not a budget",
        "true",
        "true",
        "not a number followed by a unit",
    ),
    Bad("activation_budget", "range", -1, "a budget cannot be negative", "-1", "-1"),
    Bad("activation_budget", "range", -0.5, "a budget cannot be negative", "-0.5", "-0.5"),
    Bad(  # NOTE [ Bytes or a fraction ]: 1 is not 100%
        "activation_budget",
        "range",
        1,
        "1 would be 1 byte, which no step fits in: write a fraction of the step's saved bytes "
        "with a decimal point or a percent sign (1.0 or '100%' is all of it), and bytes with "
        "a unit ('1B', '6GiB')",
        "1",
        "1",
    ),
    *(
        Bad(
            "activation_budget",
            "range",
            value,
            f"a fraction cannot be above 1 (got {shown}); give bytes as a size such as '6GiB'",
            env,
            toml,
        )
        for value, shown, env, toml in [
            (1.5, "1.5", "1.5", "1.5"),
            ("150%", "150%", "150%", '"150%"'),
        ]
    ),
    Bad(
        "activation_budget", "unit", "6 GB/s", f"unknown unit 'GB/s'; {UNITS}", "6 GB/s", '"6 GB/s"'
    ),
    Bad("activation_budget", "type", "x%", "'x%' is not a percentage", "x%", '"x%"'),
    Bad("activation_budget", "toml-type", [0.3], "a list is not a budget", None, "[0.3]"),
    Bad(
        "activation_budget", "toml-type", {"f": 0.3}, "a dict is not a budget", None, "{ f = 0.3 }"
    ),
    Bad(
        "activation_budget", "type", "autos", "not a number followed by a unit", "autos", '"autos"'
    ),
    # memory_margin: a size, or a fraction of the capacity in [0, 1)
    Bad("memory_margin", "type", "auto", "not a number followed by a unit", "auto", '"auto"'),
    Bad(
        "memory_margin",
        "type",
        True,
        "a bool is not a margin",
        "true",
        "true",
        "not a number followed by a unit",
    ),
    Bad("memory_margin", "range", -1, "a margin cannot be negative", "-1", "-1"),
    Bad("memory_margin", "range", -0.1, "a margin cannot be negative", "-0.1", "-0.1"),
    *(
        Bad(
            "memory_margin",
            "range",
            value,
            f"a fraction of the capacity must be below 1 (got {shown}); give bytes as a size "
            "such as '512MiB'",
            env,
            toml,
        )
        for value, shown, env, toml in [
            (1.0, "1.0", "1.0", "1.0"),
            ("100%", "100%", "100%", '"100%"'),
        ]
    ),
    Bad("memory_margin", "unit", "1 GB/s", f"unknown unit 'GB/s'; {UNITS}", "1 GB/s", '"1 GB/s"'),
    Bad("memory_margin", "type", "x%", "'x%' is not a percentage", "x%", '"x%"'),
    Bad("memory_margin", "toml-type", [0.1], "a list is not a margin", None, "[0.1]"),
]


def _count_cases(field: str, lo: int, hi: int) -> list[Bad]:
    def bad(kind: Kind, value: Any, reason: str, env: str | None, toml: str | None) -> Bad:
        return Bad(field, kind, value, reason, env, toml)

    unparsable = f"{NOT_INT}, unable to parse string as an integer"
    return [
        bad(
            "range",
            lo - 1,
            f"Input should be greater than or equal to {lo}",
            str(lo - 1),
            str(lo - 1),
        ),
        bad("range", -1, f"Input should be greater than or equal to {lo}", "-1", "-1"),
        bad(
            "range", hi + 1, f"Input should be less than or equal to {hi}", str(hi + 1), str(hi + 1)
        ),
        bad("range", 10_000, f"Input should be less than or equal to {hi}", "10000", "10_000"),
        Bad(
            field,
            "type",
            2.5,
            f"{NOT_INT}, got a number with a fractional part",
            "2.5",
            "2.5",
            unparsable,
        ),
        bad("type", "abc", unparsable, "abc", '"abc"'),
        bad("type", "", unparsable, "", '""'),
        bad("unit", "4 threads", unparsable, "4 threads", '"4 threads"'),
        Bad(field, "type", True, "a bool is not a whole number", "true", "true", unparsable),
        bad("toml-type", [4], NOT_INT, None, "[4]"),
        bad("toml-type", {"n": 4}, NOT_INT, None, "{ n = 4 }"),
        bad("type", None, NOT_INT, None, None),
    ]


CASES: list[Bad] = [
    *(case for name in SIZE_FIELDS for case in _size_cases(name)),
    *OTHER_CASES,
    *_count_cases("io_workers", 1, 64),
    *_count_cases("compression_level", 1, 22),
]
ENV_CASES = [c for c in CASES if c.env is not None]
TOML_CASES = [c for c in CASES if c.toml is not None]


@pytest.fixture(autouse=True)
def _a_file_in_cwd(tmp_path: Path) -> Iterator[None]:
    (tmp_path / A_FILE).write_text("")  # conftest makes tmp_path the working directory
    yield


def _message(case: Bad, value: Any, source: str, reason: str) -> str:
    return (
        f"tierstore: {case.field}={value!r} from {source} is not valid "
        f"({reason}); expected {FORMS[case.field]}"
    )


def _raised(**arguments: Any) -> str:
    with pytest.raises(ConfigError) as info:
        TierConfig(**arguments)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_matrix_covers_every_field() -> None:
    fields = set(TierConfig.model_fields)
    assert set(FORMS) == fields
    assert {c.field for c in CASES} == fields
    assert {c.field for c in ENV_CASES} == fields
    assert {c.field for c in TOML_CASES} == fields
    for name in fields:
        kinds = {c.kind for c in CASES if c.field == name}
        # A wrong type and a TOML value of the wrong TOML type for every field,
        # and something wrong in the value itself: its unit, range or name.
        assert {"type", "toml-type"} <= kinds, name
        assert kinds & {"unit", "range", "enum"}, name
    assert len({c.id for c in CASES if c.field == "disk_budget"}) == len(_size_cases("x"))


def test_toml_literals_are_the_argument_values() -> None:
    # The TOML and env cases say what they say: the same value in another form.
    for case in TOML_CASES:
        parsed = tomllib.loads(f"v = {case.toml}")["v"]
        assert repr(parsed) == repr(case.value), case.id
    for case in ENV_CASES:
        if isinstance(case.value, str):
            assert case.env == case.value, case.id


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_argument(case: Bad) -> None:
    message = _raised(**{case.field: case.value})
    assert message == _message(case, case.value, "argument", case.why("argument"))


@pytest.mark.parametrize("case", ENV_CASES, ids=lambda c: c.id)
def test_bad_env(case: Bad, monkeypatch: pytest.MonkeyPatch) -> None:
    assert case.env is not None
    var = f"TIERSTORE_{case.field.upper()}"
    monkeypatch.setenv(var, case.env)
    message = _raised()
    assert message == _message(case, case.env, f"environment variable {var}", case.why("env"))


@pytest.mark.parametrize("where", ["./tierstore.toml", "TIERSTORE_CONFIG", "load_config"])
@pytest.mark.parametrize("case", TOML_CASES, ids=lambda c: c.id)
def test_bad_toml(case: Bad, where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = Path("tierstore.toml") if where == "./tierstore.toml" else tmp_path / "conf" / "ts.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"{case.field} = {case.toml}\n")
    if where == "TIERSTORE_CONFIG":
        monkeypatch.setenv("TIERSTORE_CONFIG", str(path))
    with pytest.raises(ConfigError) as info:
        if where == "load_config":
            tierstore.load_config(path)
        else:
            TierConfig()
    source = f"TOML file {path}, key {case.field}"
    assert str(info.value) == _message(case, case.value, source, case.why("toml"))


# The composed messages above could hide a bad format; a few written out in full.
FULL_MESSAGES = [
    (
        "argument",
        {"io_workers": 0},
        "tierstore: io_workers=0 from argument is not valid (Input should be greater than or "
        "equal to 1); expected a whole number from 1 to 64",
    ),
    (
        "argument",
        {"pin_memory": "abc"},
        "tierstore: pin_memory='abc' from argument is not valid (Input should be a valid "
        "boolean, unable to interpret input); expected true or false (also 1/0, yes/no, on/off)",
    ),
    (
        "env",
        {"TIERSTORE_DISK_BUDGET": "4 GB/s"},
        "tierstore: disk_budget='4 GB/s' from environment variable TIERSTORE_DISK_BUDGET is not "
        "valid (unknown unit 'GB/s'; the units are B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, "
        "TiB, PiB or EiB); expected a size such as '4GiB', '512MB' or a whole number of bytes",
    ),
    (
        "env",
        {"tierstore_compression": "lz4"},  # named as spelt in the environment
        "tierstore: compression='lz4' from environment variable tierstore_compression is not "
        "valid (Input should be 'none' or 'zstd'); expected one of 'none', 'zstd'",
    ),
    (
        "toml",
        {"min_offload_bytes": "-64"},
        "tierstore: min_offload_bytes=-64 from TOML file tierstore.toml, key min_offload_bytes "
        "is not valid (a size cannot be negative); expected a size such as '4GiB', '512MB' or a "
        "whole number of bytes",
    ),
    (
        "toml",
        {"disk_backend": '{ kind = "ntfs" }'},
        "tierstore: disk_backend={'kind': 'ntfs'} from TOML file tierstore.toml, key "
        "disk_backend is not valid (Input should be 'file' or 'lmdb'); expected one of 'file', "
        "'lmdb'",
    ),
    (
        "toml",
        {"compression_level": "23"},
        "tierstore: compression_level=23 from TOML file tierstore.toml, key compression_level "
        "is not valid (Input should be less than or equal to 22); expected a whole number from "
        "1 to 22",
    ),
]


@pytest.mark.parametrize(("source", "settings", "message"), FULL_MESSAGES)
def test_full_messages(
    source: str, settings: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if source == "argument":
        assert _raised(**settings) == message
        return
    if source == "env":
        for name, text in settings.items():
            monkeypatch.setenv(name, text)
    else:
        Path("tierstore.toml").write_text("".join(f"{k} = {v}\n" for k, v in settings.items()))
    assert _raised() == message


def test_every_bad_setting_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    Path("tierstore.toml").write_text('disk_backend = "ntfs"\n')
    monkeypatch.setenv("TIERSTORE_IO_WORKERS", "0")
    assert _raised(host_budget="12 parsecs") == "\n".join(
        [
            "tierstore: host_budget='12 parsecs' from argument is not valid (unknown unit "
            f"'parsecs'; {UNITS}); expected {SIZE}",
            "tierstore: disk_backend='ntfs' from TOML file tierstore.toml, key disk_backend is not "
            "valid (Input should be 'file' or 'lmdb'); expected one of 'file', 'lmdb'",
            "tierstore: io_workers='0' from environment variable TIERSTORE_IO_WORKERS is not "
            "valid (Input should be greater than or equal to 1); expected a whole number from 1 "
            "to 64",
        ]
    )


# --------------------------------------------------------------------------
# Conflicts (NOTE [ Conflicting settings ] in tierstore/config.py)

Source = Literal["argument", "env", "toml"]
SOURCES: list[Source] = ["argument", "env", "toml"]


def _set(settings: dict[str, tuple[Any, Source]], monkeypatch: pytest.MonkeyPatch) -> str:
    """Put each setting in its source; return the message TierConfig raises."""
    arguments = {k: v for k, (v, s) in settings.items() if s == "argument"}
    for name, (value, source) in settings.items():
        if source == "env":
            monkeypatch.setenv(f"TIERSTORE_{name.upper()}", str(value))
    toml = "".join(f"{k} = {v!r}\n" for k, (v, s) in settings.items() if s == "toml")
    Path("tierstore.toml").write_text(toml.replace("'", '"'))
    return _raised(**arguments)


def _from(name: str, source: Source) -> str:
    return {
        "argument": "from argument",
        "env": f"from environment variable TIERSTORE_{name.upper()}",
        "toml": f"from TOML file tierstore.toml, key {name}",
    }[source]


@pytest.mark.parametrize("compression_from", SOURCES)
@pytest.mark.parametrize("disk_from", SOURCES)
def test_compression_without_a_disk_tier(
    compression_from: Source, disk_from: Source, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _set(
        {"compression": ("zstd", compression_from), "disk_budget": ("0GiB", disk_from)},
        monkeypatch,
    )
    assert message == (
        f"tierstore: compression='zstd' ({_from('compression', compression_from)}) applies to "
        f"the disk tier, but disk_budget=0 ({_from('disk_budget', disk_from)}) disables it; set "
        "compression='none' or give disk_budget a size"
    )


@pytest.mark.parametrize("host_from", SOURCES)
@pytest.mark.parametrize("disk_from", SOURCES)
def test_no_tier_can_hold_a_tensor(
    host_from: Source, disk_from: Source, monkeypatch: pytest.MonkeyPatch
) -> None:
    # device_budget is 0 by default: the message says so.
    message = _set({"host_budget": (0, host_from), "disk_budget": ("0 B", disk_from)}, monkeypatch)
    assert message == (
        "tierstore: device_budget=0 (the default), "
        f"host_budget=0 ({_from('host_budget', host_from)}) and "
        f"disk_budget=0 ({_from('disk_budget', disk_from)}) are all 0, so no tier can hold a "
        "saved tensor; give at least one of them a size"
    )


def test_a_conflict_in_full(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "site.toml"
    toml.write_text("disk_budget = 0\n")
    monkeypatch.setenv("TIERSTORE_CONFIG", str(toml))
    monkeypatch.setenv("TIERSTORE_COMPRESSION", "zstd")
    assert _raised() == (
        "tierstore: compression='zstd' (from environment variable TIERSTORE_COMPRESSION) applies "
        f"to the disk tier, but disk_budget=0 (from TOML file {toml}, key disk_budget) disables "
        "it; set compression='none' or give disk_budget a size"
    )


@pytest.mark.parametrize(
    "settings",
    [
        # Inert until compression is on; a site-wide level must survive compression off.
        {"compression_level": 19, "compression": "none"},
        {"compression_level": 19, "disk_budget": 0},
        # The backend is never opened without a disk tier (bench train passes one anyway).
        {"disk_backend": "lmdb", "disk_budget": 0, "io_workers": 64, "disk_path": "spill"},
        # Only a tensor that large would fail, and keeping everything is a use.
        {"min_offload_bytes": "1TiB", "host_budget": "1GiB", "disk_budget": "1GiB"},
        {"host_budget": 0, "disk_budget": 0, "device_budget": "1GiB"},
        {"device_budget": 0, "host_budget": 0, "disk_budget": 1},
        # The pool caps a chunk at the room left; 0: a chunk per block.
        {"host_pool_step": "1TiB", "host_budget": "1MiB"},
        {"host_pool_step": 0},
        # Synchronous writes; no read-ahead.
        {"write_queue_bytes": 0, "prefetch_bytes": 0},
        {"prefetch_bytes": "1TiB", "write_queue_bytes": "1TiB", "host_budget": 0},
        {"pin_memory": False, "host_budget": 0},
    ],
)
def test_combinations_that_are_not_conflicts(settings: dict[str, Any]) -> None:
    assert set(settings) <= TierConfig(**settings).model_fields_set


def test_good_sizes_still_parse() -> None:
    # NOTE [ Size syntax ]: the stricter parser keeps every whole-byte size.
    sizes = {
        "4GiB": 4 << 30,
        " 4 gib ": 4 << 30,
        "512MB": 512 * 10**6,
        "1.5 GiB": 3 << 29,
        "1.1 GB": 1_100_000_000,
        "0.5KiB": 512,
        "4g": 4 * 10**9,
        "64k": 64_000,
        "7": 7,
        "7B": 7,
        "+7 b": 7,
        "-0": 0,
        ".5 KB": 500,
        2.0: 2,
        0: 0,
        10**20: 10**20,
    }
    for text, nbytes in sizes.items():
        assert TierConfig(prefetch_bytes=text).prefetch_bytes == nbytes, text
