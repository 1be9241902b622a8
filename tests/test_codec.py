"""Encoding: layouts round-trip bitwise, frames describe themselves, corruption is caught."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import CorruptDataError, codec

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def _round_trip(t: torch.Tensor, compression: codec.Compression) -> torch.Tensor:
    span, layout = codec.to_span(t)
    frame = codec.encode(span, compression)
    meta = codec.parse_header(frame.header)
    payload = codec.payload_tensor(meta)
    codec.byte_view(payload)[:] = frame.payload
    return codec.from_span(codec.decode(meta, payload), layout)


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.itemsize == 1 and dtype.is_floating_point:  # float8: no randn kernel
        return torch.randint(0, 256, shape, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):  # no randint kernel either
        return torch.randint(0, 30000, shape, dtype=torch.int64).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_dtypes_round_trip_bitwise(dtype: torch.dtype, compression: codec.Compression) -> None:
    t = _random(dtype, (13, 7))
    back = _round_trip(t, compression)
    assert back.dtype == dtype and back.shape == t.shape and back.stride() == t.stride()
    # Compare bits, not values: NaN payloads and -0.0 must survive too.
    assert torch.equal(
        back.view(torch.uint8) if dtype != torch.bool else back,
        t.view(torch.uint8) if dtype != torch.bool else t,
    )


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    data=st.data(),
    compression=st.sampled_from(["none", "zstd"]),
)
def test_any_view_round_trips(
    shape: list[int], data: st.DataObject, compression: codec.Compression
) -> None:
    base = torch.randn(*[s + 3 for s in shape]) if shape else torch.randn(())
    view = base
    for d in range(len(shape)):
        op = data.draw(st.sampled_from(["slice", "step", "expand", "window", "none"]))
        if op == "slice":
            view = view.narrow(d, 1, shape[d])
        elif op == "step" and view.shape[d] > 1:
            view = view[(slice(None),) * d + (slice(None, None, 2),)]
        elif op == "expand":
            view = view.narrow(d, 0, 1).expand(*view.shape[:d], 4, *view.shape[d + 1 :])
        elif op == "window" and view.shape[d] > 1:  # windows that share elements
            view = view.unfold(d, 2, 1)
    if view.dim() >= 2 and data.draw(st.booleans()):
        view = view.transpose(0, -1)
    back = _round_trip(view, compression)
    assert torch.equal(back, view) and back.shape == view.shape
    # NOTE [ Spans ]: the saved strides, except a thin view's, which says so.
    saved_stride = codec.to_span(view)[1].saved_stride
    assert back.stride() == view.stride() or saved_stride == view.stride()


def test_views_keep_their_strides_thin_ones_say_they_do_not() -> None:
    # NOTE [ Spans ]: dense, gapped and overlapping views come back with their
    # own strides; a view thinner than 1/4 of the storage it reaches comes
    # back dense and its layout says so.
    t = torch.randn(8, 6)
    for view in (t.t(), t[2:5], t[3:4], t[:1].expand(5, 6), t.unsqueeze(1).expand(8, 3, 6)):
        assert _round_trip(view, "none").stride() == view.stride()
    for gapped, dense_stride in (
        (t[:, ::2], (3, 1)),
        (t[1:3, 1:4].t(), (1, 3)),
        (t[:, 1:4:2].unsqueeze(1).expand(8, 5, 2), (2, 0, 1)),
    ):
        span, layout = codec.to_span(gapped)
        assert span.numel() == gapped[..., :1, :].numel() if gapped.dim() == 3 else gapped.numel()
        assert layout.stride == gapped.stride() and layout.dense == dense_stride
        back = codec.from_span(span.clone(), layout)
        assert torch.equal(back, gapped) and back.stride() == gapped.stride()
    x = torch.randn(64)
    for overlapping, covers in (
        (x.unfold(0, 4, 2), 64),  # 31 windows of 4
        (x[3:].as_strided((10, 8), (1, 1), 5), 17),  # a sliding window, mid-storage
        (x.as_strided((4, 3, 8), (4, 0, 1), 1).transpose(0, 2), 20),  # broadcast too
        (x.unfold(0, 8, 4).unfold(1, 4, 2), 64),  # windows of windows
    ):
        span, layout = codec.to_span(overlapping)
        assert span.numel() == covers and layout.saved_stride is None
        assert span.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # no copy
        for compression in ("none", "zstd"):
            back = _round_trip(overlapping, compression)
            assert back.stride() == overlapping.stride() and torch.equal(back, overlapping)
    wide = torch.randn(100, 100)[:, :3]  # extent 33x its elements: not worth a buffer
    column = t[:, 1:2]  # 43 elements of extent for 8
    for view, dense_stride in ((wide, (3, 1)), (column, (1, 1))):
        span, layout = codec.to_span(view)
        assert layout.stride == dense_stride and layout.dense is None
        assert layout.saved_stride == view.stride()
        assert torch.equal(codec.from_span(span.clone(), layout), view)


def test_span_nbytes_is_the_span_to_span_makes() -> None:
    x = torch.randn(40, 30)
    for view in (
        x,
        x.t(),
        x[:, ::2],
        x[:, :3],
        x[:1].expand(9, 30),
        x.view(-1).unfold(0, 10, 3),
        x.view(-1)[5:].as_strided((100, 12), (1, 1)),
        x[:0],
    ):
        assert codec.span_nbytes(view) == codec.to_span(view)[0].nbytes, view.shape


def test_expanded_rests_at_unexpanded_size() -> None:
    t = torch.randn(1, 1024).expand(4096, 1024)
    span, _ = codec.to_span(t)
    assert span.numel() == 1024
    assert codec.encode(span).payload.nbytes == 4096


def test_span_of_dense_view_is_zero_copy() -> None:
    t = torch.randn(10, 10)
    span, _ = codec.to_span(t[3:7].t())
    assert span.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _landed(span: torch.Tensor) -> torch.Tensor:
    """``span`` copied to the start of a page, as a disk read lands it."""
    page = torch.empty(span.numel() * span.element_size() + 8192, dtype=torch.uint8)
    start = -page.data_ptr() % 4096
    out = page[start : start + span.numel() * span.element_size()].view(span.dtype)
    return out.copy_(span)


@pytest.mark.parametrize("view", ["rows", "gapped"])
def test_a_view_comes_back_at_its_address_modulo_the_boundary(view: str) -> None:
    # NOTE [ Addresses ]: x[1:] starts 24 bytes past a 64-byte boundary, and
    # a span read back lands on a page: it goes back 24 bytes past one.
    base = torch.randn(5, 6)
    x = base[1:] if view == "rows" else base[1:, ::2]
    assert x.data_ptr() % 64 == 24
    span, layout = codec.to_span(x)
    assert layout.align == 24
    back = codec.from_span(_landed(span), layout)
    assert back.data_ptr() % 64 == 24
    assert back.stride() == x.stride() and torch.equal(back, x)


def test_a_span_on_its_boundary_is_not_copied_back() -> None:
    x = torch.randn(8, 16)[2:]  # 128 bytes in: on a 64-byte boundary
    span, layout = codec.to_span(x)
    landed = _landed(span)
    back = codec.from_span(landed, layout)
    assert back.data_ptr() == landed.data_ptr()


def test_frames_are_safetensors() -> None:
    t = torch.arange(6, dtype=torch.float32)
    frame = codec.encode(t)
    loaded = safetensors.torch.load(frame.header + bytes(frame.payload))
    assert torch.equal(loaded["span"], t)
    zframe = codec.encode(t, "zstd")
    loaded = safetensors.torch.load(zframe.header + bytes(zframe.payload))
    assert loaded["span"].dtype == torch.uint8  # compressed bytes, described as U8


def test_zstd_shuffle_compresses_smooth_floats() -> None:
    t = torch.linspace(0, 1, 1 << 16)
    assert codec.encode(t, "zstd").payload.nbytes < codec.encode(t).payload.nbytes // 2


def test_corrupt_headers_and_payloads_raise() -> None:
    frame = codec.encode(torch.ones(64), "zstd")
    with pytest.raises(CorruptDataError, match="truncated"):
        codec.parse_header(frame.header[:5])
    bad = bytearray(frame.header)
    bad[0] ^= 0x40
    with pytest.raises(CorruptDataError, match="bytes of JSON"):
        codec.parse_header(bad)
    meta = codec.parse_header(frame.header)
    payload = bytearray(frame.payload)
    payload[len(payload) // 2] ^= 0xFF
    with pytest.raises(CorruptDataError):
        codec.decode(meta, payload[: len(payload) // 2])
    raw = codec.parse_header(codec.encode(torch.ones(4)).header)
    with pytest.raises(CorruptDataError, match="payload of 15 bytes, header says 16"):
        codec.decode(raw, bytearray(15))


def test_byte_view_rejects_what_it_cannot_view() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        codec.byte_view(torch.randn(4, 4).t())
    assert len(codec.byte_view(torch.empty(0))) == 0


def test_byte_view_keeps_its_tensor_alive() -> None:
    import gc
    import weakref

    t = torch.arange(16, dtype=torch.int32)
    alive = weakref.ref(t)
    view = codec.byte_view(t)
    del t
    gc.collect()
    assert alive() is not None  # an I/O thread holding the view holds the memory
    assert bytes(view[:4]) == (0).to_bytes(4, "little")
    del view
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_large_record_in_our_own_buffer_starts_on_a_page(compression: str) -> None:
    # NOTE [ Records in one buffer ]: the header fills the page in front of the
    # payload, so O_DIRECT moves the record without a bounce copy.
    numel = codec.ALIGNED_MIN // 2  # 2x the bound: zstd leaves random floats above it
    buf = torch.empty(codec.HEADROOM + 4 * numel, dtype=torch.uint8)
    span = buf[codec.HEADROOM :].view(torch.float32)
    span.copy_(torch.randn(numel))
    frame = codec.encode(span, compression, headroom=True)  # type: ignore[arg-type]
    assert len(frame.header) == codec.HEADROOM
    (record,) = frame.views()
    assert len(record) == frame.nbytes
    if compression == "none":
        assert bytes(record[: codec.HEADROOM]) == frame.header
        assert torch.frombuffer(record, dtype=torch.uint8).data_ptr() == buf.data_ptr()
    loaded = safetensors.torch.load(bytes(record))["span"]  # still a safetensors file
    meta = codec.parse_header(frame.header)
    if compression == "none":
        assert torch.equal(loaded, span)
    assert torch.equal(codec.decode(meta, bytearray(frame.payload)), span)


def test_small_records_and_records_in_the_callers_memory_keep_a_short_header() -> None:
    small = torch.empty(codec.HEADROOM + 100, dtype=torch.uint8)[codec.HEADROOM :]
    assert len(codec.encode(small, headroom=True).header) < 512
    large = torch.zeros(codec.ALIGNED_MIN)  # the caller's: no room in front
    assert len(codec.encode(large, headroom=True).header) < 512
    assert len(codec.encode(large).header) < 512


def test_a_padded_record_reads_back_as_one_view() -> None:
    span = torch.randn(codec.ALIGNED_MIN // 4)
    meta = codec.parse_header(codec.encode(span).header)
    payload = codec.payload_tensor(meta, headroom=True)
    whole = codec.record_view(payload)
    assert len(whole) == codec.HEADROOM + 4 * span.numel()
    whole[codec.HEADROOM :] = codec.byte_view(span)
    assert torch.equal(codec.decode(meta, payload), span)
    with pytest.raises(ValueError, match="no HEADROOM bytes in front"):
        codec.record_view(codec.payload_tensor(meta))


def test_the_longest_short_header_is_within_its_bound() -> None:
    # record_bound reserves SHORT_HEADER_MAX for the header of a payload under
    # ALIGNED_MIN: the longest dtype name and 20-digit sizes still fit.
    longest = max(codec._DTYPES.values(), key=lambda dt: len(str(dt)))
    big = 10**19
    meta = codec.FrameMeta(longest, big, "zstd", 4, big, "f" * 16)
    assert len(codec._header(meta, "U8", [big], padded=False)) <= codec.SHORT_HEADER_MAX
    for nbytes in (0, 1000, codec.ALIGNED_MIN - 1, codec.ALIGNED_MIN, 1 << 20):
        for compression in ("none", "zstd"):
            span = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)  # incompressible
            room = torch.empty(codec.HEADROOM + nbytes, dtype=torch.uint8)
            room[codec.HEADROOM :] = span
            for s in (span, room[codec.HEADROOM :]):
                frame = codec.encode(s, compression, headroom=s is not span)
                assert frame.nbytes <= codec.record_bound(nbytes, compression)


def test_a_digest_given_beforehand_frames_the_same_record() -> None:
    """NOTE [ Checksums beside the I/O ]: the hasher's digest is the one encode computes."""
    span = torch.arange(1000.0)
    framed = codec.encode(span)
    given = codec.encode(span, digest=codec.checksum(codec.byte_view(span)))
    assert given.header == framed.header
    assert torch.equal(
        codec.decode(codec.parse_header(given.header), bytearray(given.payload)), span
    )
    with pytest.raises(ValueError, match="for uncompressed spans only"):
        codec.encode(span, "zstd", digest=framed.header.decode("latin-1")[-16:])
