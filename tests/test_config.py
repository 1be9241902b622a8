"""TierConfig: sources in order, sizes, and the exact messages of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

import tierstore
from tierstore.config import describe_config

KNOWN = (
    "Known settings: activation_budget, compression, compression_level, device_budget, "
    "disk_backend, disk_budget, disk_path, host_budget, host_pool_step, io_workers, "
    "memory_margin, min_offload_bytes, pin_memory, "
    "prefetch_bytes, recompute, write_queue_bytes"
)
SIZE = "expected a size such as '4GiB', '512MB' or a whole number of bytes"
UNITS = "the units are B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB or EiB"


def test_sizes_accept_units_and_ints() -> None:
    cfg = tierstore.TierConfig(
        device_budget="4GiB", host_budget="512MB", disk_budget=1024, prefetch_bytes="1.5 GiB"
    )
    assert cfg.device_budget == 4 * 2**30
    assert cfg.host_budget == 512 * 10**6
    assert cfg.disk_budget == 1024
    assert cfg.prefetch_bytes == 3 * 2**29


def test_precedence_arguments_env_toml_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "tierstore.toml").write_text(
        'host_budget = "1GiB"\ndisk_budget = "2GiB"\ndisk_backend = "lmdb"\n'
    )
    monkeypatch.setenv("TIERSTORE_DISK_BUDGET", "3GiB")
    monkeypatch.setenv("TIERSTORE_DISK_BACKEND", "file")
    cfg = tierstore.load_config(disk_backend="lmdb")
    assert cfg.host_budget == 2**30  # TOML
    assert cfg.disk_budget == 3 * 2**30  # env beats TOML
    assert cfg.disk_backend == "lmdb"  # argument beats env
    assert cfg.compression == "none"  # default
    origins = {name: origin.describe() for name, _, origin in describe_config()}
    assert origins["host_budget"] == f"TOML file {Path('tierstore.toml')}, key host_budget"
    assert origins["disk_budget"] == "environment variable TIERSTORE_DISK_BUDGET"
    assert origins["compression"] == "default"


def test_config_env_names_the_toml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.toml"
    path.write_text("min_offload_bytes = 0\n")
    monkeypatch.setenv("TIERSTORE_CONFIG", str(path))
    assert tierstore.TierConfig().min_offload_bytes == 0
    explicit = tmp_path / "explicit.toml"
    explicit.write_text("min_offload_bytes = 7\n")
    assert tierstore.load_config(explicit).min_offload_bytes == 7


def test_config_is_hashable_and_frozen() -> None:
    a, b = tierstore.TierConfig(host_budget="1GiB"), tierstore.TierConfig(host_budget=2**30)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(Exception, match="frozen"):
        a.host_budget = 5  # type: ignore[misc]


BAD_ARGUMENTS = [
    (
        {"disk_budget": "4 gigs"},
        "tierstore: disk_budget='4 gigs' from argument is not valid "
        f"(unknown unit 'gigs'; {UNITS}); {SIZE}",
    ),
    (
        {"host_budget": -1},
        f"tierstore: host_budget=-1 from argument is not valid (a size cannot be negative); {SIZE}",
    ),
    (
        {"disk_budget": True},
        f"tierstore: disk_budget=True from argument is not valid (a bool is not a size); {SIZE}",
    ),
    (
        {"disk_path": ""},
        "tierstore: disk_path='' from argument is not valid (an empty path); "
        "expected a path to a writable directory",
    ),
    (
        {"bogus": 1},
        "tierstore: unknown setting in argument bogus=1. " + KNOWN,
    ),
    (
        {"disk_backend": "tape"},
        "tierstore: disk_backend='tape' from argument is not valid "
        "(Input should be 'file' or 'lmdb'); expected one of 'file', 'lmdb'",
    ),
    (
        {"compression_level": 99},
        "tierstore: compression_level=99 from argument is not valid "
        "(Input should be less than or equal to 22); expected a whole number from 1 to 22",
    ),
    (
        {"devce_budget": 1},
        "tierstore: unknown setting in argument devce_budget=1; did you mean device_budget? "
        + KNOWN,
    ),
    (
        {"device_budget": 0, "host_budget": 0, "disk_budget": 0},
        "tierstore: device_budget=0 (from argument), host_budget=0 (from argument) and "
        "disk_budget=0 (from argument) are all 0, so no tier can hold a saved tensor; give at "
        "least one of them a size",
    ),
    (
        {"compression": "zstd", "disk_budget": 0},
        "tierstore: compression='zstd' (from argument) applies to the disk tier, but "
        "disk_budget=0 (from argument) disables it; set compression='none' or give disk_budget "
        "a size",
    ),
]


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS)
def test_bad_arguments(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig(**arguments)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_disk_path_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig(disk_path=file)
    assert str(info.value) == (
        f"tierstore: disk_path={file!r} from argument is not valid "
        "(exists and is not a directory); expected a path to a writable directory"
    )


def test_bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_HOST_BUDGET", "3 gigs")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig()
    assert str(info.value) == (
        "tierstore: host_budget='3 gigs' from environment variable TIERSTORE_HOST_BUDGET is not "
        f"valid (unknown unit 'gigs'; {UNITS}); {SIZE}"
    )


def test_misspelt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_HOST_BUGDET", "3GiB")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig()
    assert str(info.value) == (
        "tierstore: unknown setting in environment variable TIERSTORE_HOST_BUGDET; "
        f"did you mean TIERSTORE_HOST_BUDGET? {KNOWN}"
    )


def test_bad_toml_value_and_key(tmp_path: Path) -> None:
    toml = tmp_path / "tierstore.toml"
    toml.write_text('disk_budget = "2 parsecs"\n')
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig()
    assert str(info.value) == (
        f"tierstore: disk_budget='2 parsecs' from TOML file {Path('tierstore.toml')}, key "
        f"disk_budget is not valid (unknown unit 'parsecs'; {UNITS}); {SIZE}"
    )
    toml.write_text("disk_budgt = 1\n")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig()
    assert str(info.value) == (
        f"tierstore: unknown setting in TOML file {Path('tierstore.toml')}: key 'disk_budgt'; "
        f"did you mean disk_budget? {KNOWN}"
    )


def test_malformed_toml_and_missing_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "tierstore.toml").write_text("disk_budget = = 1\n")
    with pytest.raises(
        tierstore.ConfigError,
        match=r"^tierstore: cannot read TOML file "
        r"tierstore\.toml: .*line 1",
    ):
        tierstore.TierConfig()
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.load_config(tmp_path / "missing.toml")
    assert str(info.value) == (
        f"tierstore: load_config(path={str(tmp_path / 'missing.toml')!r}): no such TOML file; "
        "pass the path of an existing file"
    )
    monkeypatch.setenv("TIERSTORE_CONFIG", "nope.toml")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierConfig()
    assert str(info.value) == (
        "tierstore: TIERSTORE_CONFIG='nope.toml' names no file; "
        "unset TIERSTORE_CONFIG or point it at a TOML file"
    )


def test_relative_disk_path_is_fixed_at_creation(tmp_path: Path) -> None:
    cfg = tierstore.TierConfig(disk_path="spill")
    assert cfg.disk_path == tmp_path / "spill"


def test_configs_that_are_not_configs() -> None:
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.TierStore({"host_budget": 1})  # type: ignore[arg-type]
    assert str(info.value) == (
        "tierstore: TierStore(config=...) takes a TierConfig; got dict. Build one with "
        "tierstore.TierConfig(**settings), or pass settings as keywords to tierstore.offload(...)"
    )
    with (
        pytest.raises(tierstore.ConfigError, match=r"offload\(config=\.\.\.\) takes a TierConfig"),
        tierstore.offload({"host_budget": 1}),  # type: ignore[arg-type]
    ):
        pass
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.load_config(123)  # type: ignore[arg-type]
    assert str(info.value) == (
        "tierstore: load_config(path=123) takes the path of a TOML file; got int"
    )


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (None, None),
        ("none", None),
        (0, 0),
        (0.0, 0),  # 0 bytes, written either way
        ("0%", 0),
        ("6GiB", 6 << 30),
        (4096, 4096),  # a bare whole number from 4 KiB up: bytes (NOTE [ Bytes or a fraction ])
        ("1000B", 1000),
        (0.3, 0.3),
        ("0.3", 0.3),
        ("30%", 0.3),
        (1.0, 1.0),
        ("100%", 1.0),
        ("auto", "auto"),
        (" AUTO ", "auto"),
    ],
)
def test_activation_budget_is_bytes_or_a_fraction(value: object, parsed: object) -> None:
    got = tierstore.TierConfig(activation_budget=value).activation_budget
    assert got == parsed and type(got) is type(parsed)


def test_activation_budget_from_env_and_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    toml = tmp_path / "tierstore.toml"
    toml.write_text('activation_budget = "25%"\n')
    monkeypatch.setenv("TIERSTORE_CONFIG", str(toml))
    assert tierstore.load_config().activation_budget == 0.25
    monkeypatch.setenv("TIERSTORE_ACTIVATION_BUDGET", "2GiB")
    assert tierstore.load_config().activation_budget == 2 << 30
    with tierstore.offload(activation_budget=0.5, disk_budget=0) as store:
        assert store.config.activation_budget == 0.5


def test_activation_budget_auto_from_argument_env_and_toml(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    toml = tmp_path / "conf.toml"
    toml.write_text('activation_budget = "auto"\nmemory_margin = "512MiB"\n')
    monkeypatch.setenv("TIERSTORE_CONFIG", str(toml))
    config = tierstore.load_config()
    assert (config.activation_budget, config.memory_margin) == ("auto", 512 << 20)
    monkeypatch.setenv("TIERSTORE_ACTIVATION_BUDGET", "0.5")
    monkeypatch.setenv("TIERSTORE_MEMORY_MARGIN", "5%")
    config = tierstore.load_config()
    assert (config.activation_budget, config.memory_margin) == (0.5, 0.05)
    monkeypatch.setenv("TIERSTORE_ACTIVATION_BUDGET", "auto")
    assert tierstore.load_config().activation_budget == "auto"
    monkeypatch.delenv("TIERSTORE_MEMORY_MARGIN")
    monkeypatch.delenv("TIERSTORE_CONFIG")
    assert tierstore.TierConfig(activation_budget="auto").memory_margin == 0.1  # the default


@pytest.mark.parametrize(
    ("value", "parsed"), [(0, 0), ("1GiB", 1 << 30), (0.25, 0.25), ("0.25", 0.25), ("25%", 0.25)]
)
def test_memory_margin_is_bytes_or_a_fraction_of_the_capacity(
    value: object, parsed: object
) -> None:
    got = tierstore.TierConfig(memory_margin=value).memory_margin
    assert got == parsed and type(got) is type(parsed)


def test_a_resolved_configuration_is_reused_until_one_of_its_sources_changes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # NOTE [ Resolved configurations are cached ]: offload() resolves on every entry.
    first = tierstore.load_config(host_budget="1GiB")
    assert tierstore.load_config(host_budget="1GiB") is first
    assert tierstore.load_config(host_budget="2GiB").host_budget == 2 * 2**30
    monkeypatch.setenv("TIERSTORE_DISK_BUDGET", "3GiB")
    from_env = tierstore.load_config(host_budget="1GiB")
    assert from_env.disk_budget == 3 * 2**30
    toml = tmp_path / "tierstore.toml"
    toml.write_text("min_offload_bytes = 5\n")
    assert tierstore.load_config(host_budget="1GiB").min_offload_bytes == 5
    toml.write_text("min_offload_bytes = 77\n")  # another size, whatever the clock
    assert tierstore.load_config(host_budget="1GiB").min_offload_bytes == 77
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no tierstore.toml here; disk_path resolves here
    moved = tierstore.load_config(host_budget="1GiB", disk_path="spill")
    assert (moved.min_offload_bytes, moved.disk_path) == (64 << 10, elsewhere / "spill")
    monkeypatch.setenv("TIERSTORE_HOST_BUGDET", "3GiB")  # a resolution that raises, every time
    for _ in range(2):
        with pytest.raises(tierstore.ConfigError, match="TIERSTORE_HOST_BUGDET"):
            tierstore.load_config(host_budget="1GiB")


def test_overrides_on_a_given_configuration_are_validated_and_reused() -> None:
    base = tierstore.TierConfig(disk_budget=0)
    merged = tierstore.config.with_overrides(base, {"host_budget": "1KiB"})
    assert (merged.host_budget, merged.disk_budget) == (1024, 0)
    assert tierstore.config.with_overrides(base, {"host_budget": "1KiB"}) is merged
    assert tierstore.config.with_overrides(base, {}) is base
    for _ in range(2):
        with pytest.raises(tierstore.ConfigError, match="host_budget='lots'"):
            tierstore.config.with_overrides(base, {"host_budget": "lots"})
    # A value that cannot be hashed skips the cache, and is still validated.
    with pytest.raises(tierstore.ConfigError, match="host_budget="):
        tierstore.config.with_overrides(base, {"host_budget": ["1KiB"]})
