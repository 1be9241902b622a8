"""Encoding: saved tensor ↔ the bytes that rest in a lower tier.

Two steps, kept apart because the host tier needs only the first:

1. **Layout** (:func:`to_span` / :func:`from_span`). A saved tensor becomes a
   1-D *span* of its elements plus the :class:`Layout` that views it back.
   See ``NOTE [ Spans ]``.
2. **Frame** (:func:`encode` / :func:`decode`). A CPU span becomes a
   safetensors-framed record: an 8-byte little-endian header length, a JSON
   header, then the payload (raw bytes, or zstd of the byte-shuffled bytes).
   The record describes itself: ``safetensors.torch.load(record)`` reads it.
   See ``NOTE [ Record integrity ]``.

Example:
    >>> import torch
    >>> from tierstore import codec
    >>> x = torch.arange(12.0).reshape(3, 4).t()       # transposed view
    >>> span, layout = codec.to_span(x)
    >>> frame = codec.encode(span, compression="zstd")
    >>> record = frame.header + bytes(frame.payload)
    >>> meta = codec.parse_header(record[: len(frame.header)])
    >>> back = codec.decode(meta, bytearray(record[len(frame.header) :]))
    >>> y = codec.from_span(back, layout)
    >>> torch.equal(x, y), y.stride() == x.stride()
    (True, True)
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import xxhash
import zstandard

from tierstore.errors import CorruptDataError

__all__ = [
    "Alloc",
    "Frame",
    "FrameMeta",
    "Layout",
    "address_align",
    "byte_view",
    "checksum",
    "decode",
    "empty_strided",
    "encode",
    "from_span",
    "parse_header",
    "payload_tensor",
    "record_bound",
    "record_view",
    "span_nbytes",
    "to_span",
]

Compression = Literal["none", "zstd"]

#: Gives ``nbytes`` of uint8 CPU memory: where a span, payload or scratch
#: buffer lands. The store passes buffers it recycles (NOTE [ Leased buffers ]
#: in ``tierstore/tiers/host_pool.py``); ``None`` means the heap (``torch.empty``).
Alloc = Callable[[int], torch.Tensor]


def _empty(nbytes: int, dtype: torch.dtype, alloc: Alloc | None) -> torch.Tensor:
    """A 1-D CPU tensor of ``nbytes`` bytes of ``dtype``, from ``alloc`` or the heap."""
    if alloc is None:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype)
    return alloc(nbytes).view(dtype)


def empty_strided(
    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, alloc: Alloc
) -> torch.Tensor:
    """An uninitialised CPU tensor of this shape and strides, in memory from ``alloc``.

    Example:
        >>> import torch
        >>> from tierstore.codec import empty_strided
        >>> heap = lambda n: torch.empty(n, dtype=torch.uint8)
        >>> empty_strided((2, 3), (1, 2), torch.float32, heap).stride()
        (1, 2)
    """
    extent = _extent(shape, stride) if all(shape) else 0
    return _empty(extent * dtype.itemsize, dtype, alloc).as_strided(shape, stride)


# NOTE [ Spans ]
# A saved tensor may be a view: transposed, sliced, expanded (stride 0), a
# gapped slice of a larger storage, or one whose elements share places
# (as_strided with steps smaller than a row, unfold, sliding windows). It
# comes back with the shape and strides it was saved with, over a fresh
# buffer whose first element is the view's first (its storage offset counts
# from the part of storage it covers): a custom autograd.Function or a
# compiled graph may rely on them, and a kernel's rounding can follow them
# (a transposed matmul operand; float32 GELU's backward on a dense input).
# We rest only what the view can reach:
#   * stride-0 dimensions are narrowed to size 1 (an expanded tensor rests at
#     its unexpanded size) and keep stride 0 in the layout;
#   * a view whose elements fill one range of storage (dense, in any
#     dimension order), or that may share places and covers at most
#     _MAX_GAP_RATIO times its elements, rests as the range of storage it
#     covers, first element to last: the span is a zero-copy 1-D view of it,
#     and restoring is one as_strided with the saved strides. Sharing views
#     rest smaller than dense (unfold's windows share their elements), and
#     can be restored no other way: a dense copy has lost which elements
#     were one;
#   * a view without shared places but with gaps (x[:, 1:], x[:, ::2])
#     rests densely (Layout.dense: its elements, in the same dimension
#     order), and is copied back into a buffer of its extent, gaps included,
#     with its own strides (Layout.stride) while that extent is at most
#     _MAX_GAP_RATIO times its elements;
#   * past that ratio (one column of a wide matrix, h[:, 0] of a long
#     sequence), restoring the strides would allocate, in backward, the
#     storage a thin view reaches across (up to the whole base eager kept
#     alive). Such a view comes back dense: equal values, other strides
#     (Layout.saved_stride holds the ones it was saved with). The tier
#     manager counts it (stats().restrided_views) and warns once: this is
#     never silent.


@dataclass(frozen=True)
class Layout:
    """How to view a span as the saved tensor: shape, strides and offset, in elements.

    ``dense``: the span holds the elements densely with these strides, to be
    copied into a buffer with ``stride``. ``saved_stride``: the strides the
    tensor was saved with, when it comes back with ``stride`` instead
    (NOTE [ Spans ]). ``align``: the address of its first element modulo
    :func:`address_align`, which it comes back with (NOTE [ Addresses ]).

    Example:
        >>> import torch
        >>> from tierstore.codec import to_span
        >>> to_span(torch.zeros(2, 3).t())[1]
        Layout(shape=(3, 2), stride=(1, 3), offset=0, dense=None, saved_stride=None, align=0)
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dense: tuple[int, ...] | None = None
    saved_stride: tuple[int, ...] | None = None
    align: int = 0


# NOTE [ Addresses ]
# A kernel's rounding can follow its operands' addresses too: CPU BLAS takes
# another vector path for an operand whose first element is not on a 16-byte
# boundary (the gradient of W in x.t()[:, 1:] @ W differs in its
# last bits between a copy 24 bytes past a 64-byte boundary, where eager's
# view starts, and one on it). Allocators hand out memory on a boundary
# (address_align: CPU 64 bytes, the CUDA caching allocator 512), so eager's
# address of a view, modulo that, is fixed by its storage offset and nothing
# else, and kernels see the same bits run after run. A saved tensor comes
# back with the same address modulo that boundary (Layout.align): a span
# that lands elsewhere (a disk read into a page-aligned buffer, a copy onto
# the device) is copied to that place, in a buffer one boundary larger.
# Only views whose storage offset is off the boundary pay that copy; a
# gapped view is copied back anyway, straight to its place.


def address_align(device: torch.device) -> int:
    """The boundary the allocator of ``device`` hands memory out on (NOTE [ Addresses ]).

    Example:
        >>> import torch
        >>> from tierstore.codec import address_align
        >>> address_align(torch.device("cpu")), address_align(torch.device("cuda", 0))
        (64, 512)
    """
    return 512 if device.type == "cuda" else 64


def _residue(t: torch.Tensor) -> int:
    """``t``'s first element's address modulo :func:`address_align` (0: none to read)."""
    try:
        return t.data_ptr() % address_align(t.device)
    except (RuntimeError, NotImplementedError):  # tensors without memory (fake, meta)
        return 0


def _placed(
    extent: int, like: torch.Tensor, align: int, alloc: Alloc | None
) -> tuple[torch.Tensor, int]:
    """A buffer for ``extent`` elements of ``like``'s dtype, and the index that sits at ``align``.

    NOTE [ Addresses ]; the memory comes from ``alloc`` for a CPU ``like``.
    """
    itemsize, boundary = like.element_size(), address_align(like.device)
    spare = boundary // itemsize
    if alloc is not None and like.device.type == "cpu":
        buffer = _empty((extent + spare) * itemsize, like.dtype, alloc)
    else:
        buffer = like.new_empty(extent + spare)
    shift, odd = divmod((align - _residue(buffer)) % boundary, itemsize)
    return buffer, 0 if odd else shift


# A view is restored with its own strides while the storage it covers is at
# most this many times its elements (NOTE [ Spans ]).
_MAX_GAP_RATIO = 4


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a view's first element to its last, inclusive (numel > 0)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))


def _nested(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether each dimension steps past everything the smaller-stride ones reach.

    Enough to prove that no two elements share a place (no overlap).
    """
    reach = 0  # the largest offset the dimensions seen so far reach
    for n, st in sorted(
        (p for p in zip(shape, stride, strict=True) if p[0] != 1), key=lambda p: p[1]
    ):
        if st <= reach:
            return False
        reach += (n - 1) * st
    return True


def _dense_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for ``shape`` that keep the dimension order of ``stride``."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], -d))
    dense = [0] * len(shape)
    expected = 1
    for d in order:
        dense[d] = expected
        expected *= shape[d]
    return tuple(dense)


def _is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, st in sorted(
        ((sz, st) for sz, st in zip(shape, stride, strict=True) if sz != 1), key=lambda p: p[1]
    ):
        if st != expected:
            return False
        expected *= size
    return True


def _core_shape(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with its broadcast (stride-0) dimensions narrowed to size 1."""
    return tuple(1 if st == 0 else n for n, st in zip(shape, stride, strict=True))


_Rest = Literal["range", "gapped", "dense"]


def _rest(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[_Rest, int]:
    """How a view with no broadcast dimension rests (NOTE [ Spans ]), and its span's elements.

    ``"range"``: the storage it covers; ``"gapped"``: its elements, restored
    with its strides; ``"dense"``: its elements, restored dense.
    """
    numel = 1
    for n in shape:
        numel *= n
    if _is_dense(shape, stride):
        return "range", numel
    extent = _extent(shape, stride)
    if extent > _MAX_GAP_RATIO * numel:
        return "dense", numel
    if _nested(shape, stride):
        return "gapped", numel
    return "range", extent


def span_nbytes(t: torch.Tensor) -> int:
    """Bytes of the span :func:`to_span` makes of ``t``: what it rests in once offloaded.

    Broadcast (stride-0) dimensions count once; a view whose elements share
    places rests as the storage it covers (NOTE [ Spans ]).

    Example:
        >>> import torch
        >>> from tierstore.codec import span_nbytes
        >>> span_nbytes(torch.zeros(1, 256).expand(1024, 256))
        1024
        >>> span_nbytes(torch.zeros(1000).unfold(0, 100, 1))  # 901 windows of 100
        4000
    """
    if t.is_contiguous():
        return t.numel() * t.element_size()
    stride = tuple(t.stride())
    shape = _core_shape(tuple(t.shape), stride)
    if 0 in shape:
        return 0
    return _rest(shape, stride)[1] * t.element_size()


def to_span(t: torch.Tensor, alloc: Alloc | None = None) -> tuple[torch.Tensor, Layout]:
    """Split a strided tensor into a 1-D span and the layout that views it back.

    The span is a view of ``t``'s storage when that is possible (no copy),
    see ``NOTE [ Spans ]``; otherwise a dense copy, in memory from ``alloc``
    when ``t`` is a CPU tensor.

    Example:
        >>> import torch
        >>> from tierstore.codec import to_span
        >>> span, layout = to_span(torch.ones(1, 4).expand(1000, 4))
        >>> span.numel(), layout.stride
        (4, (0, 1))
        >>> span, layout = to_span(torch.arange(10.0).unfold(0, 4, 2))  # windows that overlap
        >>> span.tolist(), layout.stride
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], (2, 1))
    """
    shape = tuple(t.shape)
    stride = tuple(t.stride())
    if t.numel() == 0:
        return t.new_empty((0,)), Layout(shape, stride, 0)
    core_shape = _core_shape(shape, stride)
    core = t.as_strided(core_shape, stride, t.storage_offset())
    rest, numel = _rest(core_shape, stride)
    align = _residue(t)  # See NOTE [ Addresses ]
    if rest == "range":
        span = core.as_strided((numel,), (1,), core.storage_offset())
        return span, Layout(shape, stride, 0, align=align)
    dense = _dense_strides(core_shape, stride)
    if alloc is not None and t.device.type == "cpu":
        flat = _empty(numel * t.element_size(), t.dtype, alloc)
        compact = flat.as_strided(core_shape, dense, 0)
    else:
        compact = torch.empty_strided(core_shape, dense, dtype=t.dtype, device=t.device)
    compact.copy_(core)
    span = compact.as_strided((numel,), (1,), 0)
    full_dense = tuple(0 if st == 0 else d for st, d in zip(stride, dense, strict=True))
    if rest == "gapped":
        return span, Layout(shape, stride, 0, full_dense, align=align)
    return span, Layout(shape, full_dense, 0, saved_stride=stride, align=align)


def from_span(span: torch.Tensor, layout: Layout, alloc: Alloc | None = None) -> torch.Tensor:
    """View a span as the tensor it was split from.

    A gapped view is copied into a buffer with its own strides, from
    ``alloc`` for a CPU span (``None``: the heap); see ``NOTE [ Spans ]``.

    Example:
        >>> import torch
        >>> from tierstore.codec import from_span, to_span
        >>> x = torch.randn(3, 5)[1:, 1:4]      # a view that starts mid-storage
        >>> torch.equal(from_span(*to_span(x)), x)
        True
    """
    # as_strided's offset counts from the start of the storage, not of the
    # span, and a zero-copy span of a view starts wherever the view did.
    if layout.dense is None:
        out = span.as_strided(layout.shape, layout.stride, span.storage_offset() + layout.offset)
        if span.numel() == 0 or _residue(span) == layout.align:
            return out
        # Elsewhere than eager had it: to its place (NOTE [ Addresses ]).
        buffer, at = _placed(span.numel(), span, layout.align, alloc)
        buffer[at : at + span.numel()].copy_(span)
        return buffer.as_strided(layout.shape, layout.stride, at)
    # A gapped view: back into a buffer with its own strides (NOTE [ Spans ]),
    # at its address (NOTE [ Addresses ]). Broadcast dimensions (stride 0)
    # are copied at size 1, then expanded.
    core_shape = tuple(
        1 if st == 0 else n for n, st in zip(layout.shape, layout.stride, strict=True)
    )
    dense = span.as_strided(core_shape, layout.dense, span.storage_offset())
    buffer, at = _placed(_extent(core_shape, layout.stride), span, layout.align, alloc)
    buffer.as_strided(core_shape, layout.stride, at).copy_(dense)
    return buffer.as_strided(layout.shape, layout.stride, at)


# --------------------------------------------------------------------------
# Frames

# safetensors dtype codes for the dtypes it knows; anything else rests as U8
# with the torch dtype in the metadata.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
# Every dtype this torch has, by the name str() gives it, for reading headers
# back (aliases such as torch.half map to their canonical name).
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (getattr(torch, name) for name in dir(torch))
    if isinstance(dt, torch.dtype)
}
# Byte shuffle pays off where exponent bytes repeat: 16- and 32-bit floats.
_SHUFFLE = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEADER = 1 << 16
_FORMAT = "tierstore-1"

# NOTE [ Record integrity ]
# A disk record holds the only copy of bytes a gradient depends on, so it
# carries the xxh3-64 checksum of its payload (as stored: compressed or raw)
# in its header, and decode() checks it before a byte is used: a flipped bit
# on the disk is a CorruptDataError, never a silently different gradient.
# xxh3 because it is the fastest well-kept hash for the job, about twice
# crc32c's rate and five times zlib's crc32's on one core (`tierstore bench
# storage` prints its rate beside the disk figures), and it releases the GIL.
# It guards against corruption, not against an attacker who can write the
# spill file: that is what the 0700 directory is for
# (NOTE [ Spill directory lifecycle ]).
# Lengths are checked before anything is allocated from them: the header is
# at most _MAX_HEADER bytes, an uncompressed payload must be exactly
# numel * itemsize bytes, and the store sizes every read from the header it
# wrote, which it keeps in memory and compares with what the disk returns.


def checksum(data: memoryview | bytes | bytearray) -> str:
    """The xxh3-64 checksum of ``data`` as 16 hex digits (NOTE [ Record integrity ]).

    Example:
        >>> from tierstore.codec import checksum
        >>> checksum(b"")
        '2d06800538d394c2'
    """
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class FrameMeta:
    """What a record's header says about its payload.

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> frame = codec.encode(torch.zeros(4))
        >>> codec.parse_header(frame.header)  # doctest: +NORMALIZE_WHITESPACE
        FrameMeta(dtype=torch.float32, numel=4, codec='none', shuffle=0, payload_nbytes=16,
                  checksum='d0a66a65c7528968')
    """

    dtype: torch.dtype
    numel: int
    codec: Compression
    shuffle: int
    payload_nbytes: int
    checksum: str

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the decoded span."""
        return self.numel * self.dtype.itemsize


#: Bytes left free in front of a payload in memory tierstore allocates (a
#: staged span, a compressed payload): NOTE [ Records in one buffer ].
HEADROOM = 4096

# NOTE [ Records in one buffer ]
# A record is its header then its payload. A backend that takes one buffer
# per record (LMDB: one value per put) would have to join the two, a copy of
# every byte written into a buffer as large as the largest record, resident
# for as long as the backend is open. Where tierstore allocates the payload's
# memory itself (a span staged for its write, NOTE [ Write staging ]; a zstd
# payload), it leaves HEADROOM bytes in front of it; Frame.views() writes the
# header there and hands over the whole record as one view. A header longer
# than HEADROOM (headers take a few hundred bytes) or a payload in the
# caller's memory go as two views, header and payload.
#
# A payload of ALIGNED_MIN bytes or more gets its header padded (with spaces
# inside the JSON, as safetensors pads it) to exactly HEADROOM bytes. The
# record then starts where tierstore's buffer starts, on a page, and its
# payload a page later in the file and in memory; the file backend's O_DIRECT
# path writes it, and reads it back, without a bounce copy (NOTE [ File
# backend O_DIRECT ]). Smaller payloads keep the short header: there the copy
# costs nothing and a padded header could double the record.

#: Payloads of at least this many bytes get a header of exactly HEADROOM bytes.
ALIGNED_MIN = 64 << 10
#: The longest header a record gets otherwise: its JSON has a few short
#: fields (numbers of at most 20 digits, a dtype's name), a few hundred bytes.
SHORT_HEADER_MAX = 1024


@dataclass(frozen=True)
class Frame:
    """An encoded span: ``header`` then ``payload``, written back to back.

    ``payload`` may be a view of the span's memory, so ``owner`` keeps that
    memory alive until the frame is written. ``room``, when the payload's
    memory has :data:`HEADROOM` free bytes in front of it: those bytes and
    the payload, as one uint8 tensor (NOTE [ Records in one buffer ]).

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> f = codec.encode(torch.arange(3, dtype=torch.int64))
        >>> len(f.header) % 8, len(f.payload), f.nbytes == len(f.header) + 24
        (0, 24, True)
    """

    header: bytes
    payload: memoryview
    owner: object
    room: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Length of the whole record."""
        return len(self.header) + self.payload.nbytes

    def views(self) -> list[bytes | memoryview]:
        """The record as the backend writes it: one view where the header fits in front.

        Example:
            >>> import torch
            >>> from tierstore import codec
            >>> f = codec.encode(torch.zeros(1000), "zstd")
            >>> [len(v) for v in f.views()] == [f.nbytes]
            True
        """
        n = len(self.header)
        if self.room is None or n > HEADROOM:
            return [self.header, self.payload]
        record = self.room[HEADROOM - n :]
        record[:n].copy_(torch.frombuffer(bytearray(self.header), dtype=torch.uint8))
        return [byte_view(record)]


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without a copy.

    The view keeps ``t`` alive: an I/O thread reading into it or writing from
    it never touches freed memory, even if whoever asked for the I/O has
    given up on it (a cancelled read, say).

    Example:
        >>> import torch
        >>> from tierstore.codec import byte_view
        >>> t = torch.zeros(2, dtype=torch.int16)
        >>> byte_view(t)[0] = 7
        >>> t.tolist()
        [7, 0]
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got {t.device} {t.stride()}")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    window = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    window._owner = t  # type: ignore[attr-defined]  # the memoryview holds window, window holds t
    return memoryview(window).cast("B")


def _header(meta: FrameMeta, st_dtype: str, st_shape: list[int], *, padded: bool) -> bytes:
    body = json.dumps(
        {
            "__metadata__": {
                "format": _FORMAT,
                "dtype": str(meta.dtype).removeprefix("torch."),
                "numel": str(meta.numel),
                "codec": meta.codec,
                "shuffle": str(meta.shuffle),
                "xxh3": meta.checksum,
            },
            "span": {
                "dtype": st_dtype,
                "shape": st_shape,
                "data_offsets": [0, meta.payload_nbytes],
            },
        },
        separators=(",", ":"),
    ).encode()
    # safetensors pads the JSON with spaces so that the payload starts 8-aligned;
    # a padded header fills HEADROOM (NOTE [ Records in one buffer ]).
    fill = HEADROOM - 8 - len(body) if padded and len(body) <= HEADROOM - 8 else -len(body) % 8
    body += b" " * fill
    return struct.pack("<Q", len(body)) + body


def encode(
    span: torch.Tensor,
    compression: Compression = "none",
    level: int = 1,
    alloc: Alloc | None = None,
    *,
    headroom: bool = False,
    digest: str | None = None,
) -> Frame:
    """Frame a 1-D CPU span as a self-describing record.

    Args:
        span: contiguous 1-D CPU tensor (see :func:`to_span`).
        compression: ``"none"`` or ``"zstd"`` (16/32-bit floats are
            byte-shuffled first).
        level: zstd level.
        alloc: where the shuffled bytes and the compressed payload go
            (``None``: the heap); unused without compression.
        headroom: ``span``'s storage has :data:`HEADROOM` bytes of
            tierstore's own in front of it, free for the header
            (NOTE [ Records in one buffer ]).
        digest: :func:`checksum` of ``span``'s bytes, computed beforehand
            (uncompressed only: NOTE [ Checksums beside the I/O ] in
            ``tierstore/tiers/movers.py``); ``None``: computed here.

    Example:
        >>> import torch, safetensors.torch
        >>> from tierstore import codec
        >>> f = codec.encode(torch.arange(4.0))
        >>> safetensors.torch.load(f.header + bytes(f.payload))["span"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    span = span.contiguous()
    dtype = span.dtype
    if digest is not None and compression != "none":
        raise ValueError("encode: a digest given beforehand is for uncompressed spans only")
    if compression == "zstd":
        shuffle = dtype.itemsize if dtype in _SHUFFLE and span.numel() > 1 else 0
        raw = span.view(torch.uint8)
        if shuffle:
            # Byte k of every element together: exponents repeat, so zstd finds runs.
            shuffled = _empty(raw.numel(), torch.uint8, alloc)
            shuffled.view(shuffle, -1).copy_(raw.view(-1, shuffle).t())
            raw = shuffled
        out = _empty(HEADROOM + _compress_bound(raw.numel()), torch.uint8, alloc)
        data = _compress_into(raw, out[HEADROOM:], level)
        meta = FrameMeta(dtype, span.numel(), "zstd", shuffle, data.nbytes, checksum(data))
        header = _header(meta, "U8", [data.nbytes], padded=data.nbytes >= ALIGNED_MIN)
        return Frame(header, data, out, out[: HEADROOM + data.nbytes])
    payload = byte_view(span)
    digest = checksum(payload) if digest is None else digest
    meta = FrameMeta(dtype, span.numel(), "none", 0, payload.nbytes, digest)
    room = _room(span) if headroom else None
    padded = room is not None and payload.nbytes >= ALIGNED_MIN
    st = _ST_DTYPES.get(dtype)
    st_dtype, st_shape = (st, [span.numel()]) if st is not None else ("U8", [payload.nbytes])
    return Frame(_header(meta, st_dtype, st_shape, padded=padded), payload, span, room)


def _room(span: torch.Tensor) -> torch.Tensor | None:
    """The HEADROOM bytes in front of ``span`` and ``span``'s bytes, as one uint8 tensor."""
    start = span.storage_offset() * span.element_size()
    if start < HEADROOM:
        return None
    whole = torch.empty(0, dtype=torch.uint8).set_(span.untyped_storage())
    return whole[start - HEADROOM : start + span.numel() * span.element_size()]


def record_bound(nbytes: int, compression: Compression = "none") -> int:
    """The most bytes :func:`encode` can make of a span of ``nbytes``: header and payload.

    A payload of :data:`ALIGNED_MIN` bytes or more may get a header of
    exactly :data:`HEADROOM` bytes (NOTE [ Records in one buffer ]); a
    shorter one, a header of at most :data:`SHORT_HEADER_MAX` bytes.

    Example:
        >>> from tierstore import codec
        >>> codec.record_bound(1000), codec.record_bound(1 << 16)
        (2024, 69632)
    """
    payload = _compress_bound(nbytes) if compression == "zstd" else nbytes
    return payload + (HEADROOM if payload >= ALIGNED_MIN else SHORT_HEADER_MAX)


def _compress_bound(nbytes: int) -> int:
    """The most bytes zstd can make of ``nbytes`` (ZSTD_compressBound)."""
    return nbytes + (nbytes >> 8) + 128


def _compress_into(raw: torch.Tensor, out: torch.Tensor, level: int) -> memoryview:
    """Compress ``raw`` with zstd into ``out``; the view of the bytes written."""
    view = byte_view(out)
    filled = 0
    cctx = zstandard.ZstdCompressor(level=level)
    if raw.numel() == 0:  # the stream reader never reports the end of an empty source
        empty = cctx.compress(b"")
        view[: len(empty)] = empty
        return view[: len(empty)]
    with cctx.stream_reader(byte_view(raw), size=raw.numel()) as reader:
        while True:
            got = reader.readinto(view[filled:])
            if got == 0:
                break
            filled += got
    return view[:filled]


def parse_header(header: bytes | bytearray | memoryview) -> FrameMeta:
    """Read a record's header, checking every length before trusting it.

    Raises:
        CorruptDataError: the header is truncated, too long, not ours, or its
            sizes do not agree with each other.

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> codec.parse_header(codec.encode(torch.ones(2, dtype=torch.bool)).header).dtype
        torch.bool
    """
    raw = bytes(header)
    if len(raw) < 8:
        raise CorruptDataError(f"tierstore: record header of {len(raw)} bytes is truncated")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > _MAX_HEADER or n + 8 != len(raw):
        raise CorruptDataError(
            f"tierstore: record header says {n} bytes of JSON but {len(raw) - 8} are there"
        )
    try:
        doc = json.loads(raw[8:])
        meta = doc["__metadata__"]
        if meta["format"] != _FORMAT:
            raise ValueError(f"format {meta['format']!r}")
        start, end = doc["span"]["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        codec = meta["codec"]
        if codec not in ("none", "zstd"):
            raise ValueError(f"codec {codec!r}")
        numel, shuffle, digest = int(meta["numel"]), int(meta["shuffle"]), meta["xxh3"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 == start <= end):
            raise ValueError(f"data_offsets {[start, end]}")
        if numel < 0 or shuffle not in (0, 2, 4):
            raise ValueError(f"numel {numel}, shuffle {shuffle}")
        if codec == "none" and end != numel * dtype.itemsize:
            raise ValueError(f"{end} payload bytes for {numel} elements of {dtype}")
        if not (isinstance(digest, str) and len(digest) == 16):
            raise ValueError(f"xxh3 {digest!r}")
        return FrameMeta(dtype, numel, codec, shuffle, end, digest)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"tierstore: record header is not a tierstore frame: {exc}") from exc


def decode(
    meta: FrameMeta,
    payload: torch.Tensor | bytearray | memoryview,
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """Turn a record's payload back into its 1-D CPU span.

    ``payload`` may be the tensor returned by :func:`payload_tensor`, in which
    case an uncompressed record is decoded without a copy. A compressed one
    is decoded into memory from ``alloc`` (``None``: the heap).

    The payload's checksum is checked first (NOTE [ Record integrity ]).

    Raises:
        CorruptDataError: the payload's checksum is not the one in ``meta``,
            or it does not decode to the size in ``meta``.

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> f = codec.encode(torch.arange(3))
        >>> codec.decode(codec.parse_header(f.header), bytearray(f.payload)).tolist()
        [0, 1, 2]
    """
    if isinstance(payload, torch.Tensor):
        buf = payload.view(torch.uint8)
    else:
        buf = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0)
        buf = buf.view(torch.uint8)
    if buf.numel() != meta.payload_nbytes:
        raise CorruptDataError(
            f"tierstore: payload of {buf.numel()} bytes, header says {meta.payload_nbytes}"
        )
    found = checksum(byte_view(buf))
    if found != meta.checksum:
        raise CorruptDataError(
            f"tierstore: the {buf.numel()} payload bytes have checksum xxh3={found}, "
            f"the header says {meta.checksum}"
        )
    if meta.codec == "none":
        if buf.numel() != meta.raw_nbytes:
            raise CorruptDataError(
                f"tierstore: payload of {buf.numel()} bytes, header says {meta.raw_nbytes}"
            )
        return buf.view(meta.dtype)
    out = _empty(meta.raw_nbytes, torch.uint8, alloc)
    try:
        with zstandard.ZstdDecompressor().stream_reader(byte_view(buf)) as reader:
            view = byte_view(out)
            filled = 0
            while filled < len(view):
                got = reader.readinto(view[filled:])
                if got == 0:
                    break
                filled += got
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"tierstore: zstd payload does not decode: {exc}") from exc
    if filled != meta.raw_nbytes:
        raise CorruptDataError(
            f"tierstore: zstd payload decodes to {filled} bytes, header says {meta.raw_nbytes}"
        )
    if meta.shuffle:
        shuffled, out = out, _empty(meta.raw_nbytes, torch.uint8, alloc)
        out.view(-1, meta.shuffle).copy_(shuffled.view(meta.shuffle, -1).t())
    return out.view(meta.dtype)


def payload_tensor(
    meta: FrameMeta, alloc: Alloc | None = None, *, headroom: bool = False
) -> torch.Tensor:
    """An empty CPU tensor to read a record's payload into (then :func:`decode` it).

    Uncompressed payloads are allocated with their real dtype so that
    decoding them is free; ``alloc`` gives the memory (``None``: the heap).
    ``headroom`` leaves :data:`HEADROOM` bytes in front, in the same buffer,
    for a padded header, so the whole record reads as one view
    (:func:`record_view`).

    Example:
        >>> import torch
        >>> from tierstore import codec
        >>> codec.payload_tensor(codec.parse_header(codec.encode(torch.zeros(5)).header)).shape
        torch.Size([5])
    """
    dtype = meta.dtype if meta.codec == "none" else torch.uint8
    nbytes = meta.raw_nbytes if meta.codec == "none" else meta.payload_nbytes
    if headroom:
        return _empty(HEADROOM + nbytes, torch.uint8, alloc)[HEADROOM:].view(dtype)
    return _empty(nbytes, dtype, alloc)


def record_view(payload: torch.Tensor) -> memoryview:
    """The HEADROOM bytes in front of ``payload`` and ``payload``'s bytes, as one byte view.

    For a payload from :func:`payload_tensor` with ``headroom=True``.

    Example:
        >>> from tierstore import codec
        >>> f = codec.encode(torch.zeros(1 << 16), headroom=False)
        >>> meta = codec.parse_header(f.header)
        >>> len(codec.record_view(codec.payload_tensor(meta, headroom=True)))
        266240
    """
    room = _room(payload)
    if room is None:
        raise ValueError("record_view: the payload has no HEADROOM bytes in front of it")
    return byte_view(room)
