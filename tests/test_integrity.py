"""Record integrity (issue 6, item 1): a flipped byte on disk is an error, never a gradient.

NOTE [ Record integrity ] in tierstore/codec.py: every disk record carries the
xxh3 checksum of its payload, and the store keeps the header it wrote.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tierstore
from tierstore import codec
from tierstore.tiers.handle import Handle
from tierstore.tiers.manager import TierManager

LOST = (
    "The saved tensor it held is lost and this backward cannot finish; run the step "
    "again, and check the disk under disk_path (TIERSTORE_DISK_PATH)"
)


def _disk_only(spill_root: Path, backend: str, compression: str) -> TierManager:
    return TierManager(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="4MiB",
            disk_path=spill_root,
            disk_backend=backend,
            compression=compression,
            min_offload_bytes=0,
        )
    )


def _record(mgr: TierManager, handle: Handle) -> tuple[bytes, bytes]:
    """The header the store kept for ``handle`` and the record's bytes as they rest."""
    mgr.flush()
    entry = mgr._entries[handle.key]
    assert entry.record is not None and entry.tier == "disk"
    backend = mgr._pipeline.backend_if_open
    assert backend is not None
    header = entry.record.header
    out = bytearray(len(header) + entry.record.meta.payload_nbytes)
    backend.read_into(handle.key, [memoryview(out)])
    return header, bytes(out)


def _where(mgr: TierManager, key: int) -> str:
    backend = mgr._pipeline.backend_if_open
    assert backend is not None
    return f"entry {key} on the disk tier ({backend.name} backend, {backend.path})"


def _flip(mgr: TierManager, key: int, at: int) -> None:
    """Flip one bit of byte ``at`` of record ``key`` where it rests, behind the store's back."""
    backend = mgr._pipeline.backend_if_open
    assert backend is not None
    if backend.name == "file":
        place = backend._records[key][0]
        fd = os.open(backend.path, os.O_RDWR)
        try:
            (old,) = os.pread(fd, 1, place + at)
            os.pwrite(fd, bytes([old ^ 0x10]), place + at)
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        env = backend._env  # type: ignore[attr-defined]
        name = backend._records[key][0]
        with env.begin(write=True) as txn:
            value = bytearray(txn.get(name))
            value[at] ^= 0x10
            txn.put(name, bytes(value))


@pytest.mark.parametrize("backend", ["file", "lmdb"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_flipped_payload_byte_is_corrupt_data(
    spill_root: Path, backend: str, compression: str
) -> None:
    mgr = _disk_only(spill_root, backend, compression)
    x = torch.linspace(-3, 3, 2048)
    handle = mgr.put(x)
    header, stored = _record(mgr, handle)
    payload = stored[len(header) :]
    _flip(mgr, handle.key, len(header) + len(payload) // 2)
    broken = bytearray(payload)
    broken[len(payload) // 2] ^= 0x10
    where = _where(mgr, handle.key)
    meta = codec.parse_header(header)
    with pytest.raises(tierstore.CorruptDataError) as info:
        mgr.get(handle)
    assert str(info.value) == (
        f"tierstore: {where} is corrupt: the {len(payload)} payload bytes have checksum "
        f"xxh3={codec.checksum(broken)}, the header says {meta.checksum}. {LOST}"
    )
    # The store stays usable: other entries still come back exactly.
    y = torch.arange(1000.0)
    assert torch.equal(mgr.get(mgr.put(y)), y)
    mgr.close()


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_flipped_header_byte_is_corrupt_data(spill_root: Path, backend: str) -> None:
    mgr = _disk_only(spill_root, backend, "none")
    handle = mgr.put(torch.ones(1024))
    header, _ = _record(mgr, handle)
    _flip(mgr, handle.key, len(header) - 20)  # inside the JSON
    where = _where(mgr, handle.key)
    with pytest.raises(tierstore.CorruptDataError) as info:
        mgr.get(handle)
    assert str(info.value) == (
        f"tierstore: {where} came back with another header: its bytes were changed after "
        f"they were written. {LOST}"
    )
    mgr.close()


class _Save(torch.autograd.Function):
    """y = x * w, saving both: backward needs the offloaded x."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * w, g * x


@pytest.mark.parametrize("backend", ["file", "lmdb"])
def test_backward_raises_instead_of_a_wrong_gradient(spill_root: Path, backend: str) -> None:
    store = tierstore.TierStore(
        tierstore.TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="4MiB",
            disk_path=spill_root,
            disk_backend=backend,
            min_offload_bytes=0,
        )
    )
    x = torch.randn(4096, requires_grad=True)
    w = torch.randn(4096, requires_grad=True)
    with store.offload():
        y = _Save.apply(x.detach() * 1.0, w)  # the product is the tensor that goes to disk
    mgr = store._manager
    keys = sorted(mgr._entries)
    assert keys, "nothing was offloaded"
    for key in keys:
        header, _ = _record(mgr, Handle(key, torch.empty(0)))  # type: ignore[arg-type]
        _flip(mgr, key, len(header) + 7)
    with pytest.raises(tierstore.CorruptDataError, match=r"is corrupt: the \d+ payload bytes"):
        y.sum().backward()
    assert w.grad is None  # no gradient was written from bad bytes
    store.close()


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("mutate", ["flip", "truncate", "extend"])
def test_decode_checks_the_payload(compression: str, mutate: str) -> None:
    frame = codec.encode(torch.randn(513), compression=compression)  # type: ignore[arg-type]
    meta = codec.parse_header(frame.header)
    payload = bytearray(frame.payload)
    change: dict[str, Callable[[bytearray], bytearray]] = {
        "flip": lambda b: b[:9] + bytes([b[9] ^ 1]) + b[10:],
        "truncate": lambda b: b[:-1],
        "extend": lambda b: b + b"\0",
    }
    bad = change[mutate](payload)
    with pytest.raises(tierstore.CorruptDataError) as info:
        codec.decode(meta, bad)
    if mutate == "flip":
        expected = (
            f"tierstore: the {len(bad)} payload bytes have checksum xxh3={codec.checksum(bad)}, "
            f"the header says {meta.checksum}"
        )
    else:
        expected = f"tierstore: payload of {len(bad)} bytes, header says {meta.payload_nbytes}"
    assert str(info.value) == expected
    assert torch.equal(codec.decode(meta, payload), codec.decode(meta, bytearray(frame.payload)))


def _crafted(edit: Callable[[dict[str, object]], None]) -> bytes:
    import json
    import struct

    header = codec.encode(torch.zeros(4)).header
    doc = json.loads(header[8:])
    edit(doc)
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        # A header that asks for 2**60 elements of a 16-byte payload: refused
        # before payload_tensor() could allocate from it.
        (lambda d: d["__metadata__"].update(numel=str(2**60)), "16 payload bytes for"),
        (lambda d: d["span"].update(data_offsets=[0, -8]), "data_offsets [0, -8]"),
        (lambda d: d["span"].update(data_offsets=[8, 24]), "data_offsets [8, 24]"),
        (lambda d: d["__metadata__"].update(numel="-1"), "numel -1"),
        (lambda d: d["__metadata__"].update(shuffle="3"), "shuffle 3"),
        (lambda d: d["__metadata__"].pop("xxh3"), "'xxh3'"),
        (lambda d: d["__metadata__"].update(xxh3="00"), "xxh3 '00'"),
    ],
)
def test_crafted_header_is_refused_before_allocation(
    edit: Callable[[dict[str, object]], None], reason: str
) -> None:
    with pytest.raises(tierstore.CorruptDataError, match="is not a tierstore frame") as info:
        codec.parse_header(_crafted(edit))
    assert reason in str(info.value)


def test_header_of_a_huge_length_is_refused() -> None:
    import struct

    with pytest.raises(tierstore.CorruptDataError) as info:
        codec.parse_header(struct.pack("<Q", 2**62) + b"{}")
    assert str(info.value) == (
        f"tierstore: record header says {2**62} bytes of JSON but 2 are there"
    )
