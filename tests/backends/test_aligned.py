"""The aligned bounce-buffer pool and its copy: alignment, reuse, bounds, threads, closing."""

from __future__ import annotations

import ctypes
import doctest
import mmap
import os
import re
import sys
import threading
import time
from typing import Any

import pytest
from backend_helpers import run_in_threads

from tierstore.backends import _aligned
from tierstore.backends._aligned import AlignedBuffer, AlignedBufferPool, copy

PAGE = mmap.PAGESIZE


def test_docstring_examples() -> None:
    # tests/test_docs.py lists the public modules; this private one is run here.
    result = doctest.testmod(_aligned, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3
    assert result.failed == 0


def test_buffers_are_page_aligned_and_sized() -> None:
    pool = AlignedBufferPool(4 * PAGE, max_buffers=3)
    with pool.buffer() as a, pool.buffer() as b, pool.buffer() as c:
        for buf in (a, b, c):
            assert buf.address % PAGE == 0
            assert buf.view.nbytes == 4 * PAGE
            assert not buf.view.readonly
        assert len({a.address, b.address, c.address}) == 3  # one buffer per holder
    pool.close()


def test_a_returned_buffer_is_reused() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=4)
    for _ in range(10):
        with pool.buffer() as buf:
            address = buf.address
    assert pool.created == 1
    with pool.buffer() as buf:
        assert buf.address == address
    pool.close()


def test_invalid_sizes() -> None:
    for size, count in [(0, 1), (PAGE + 1, 1), (PAGE, 0)]:
        with pytest.raises(ValueError, match="must be a positive multiple"):
            AlignedBufferPool(size, max_buffers=count)


def test_past_the_cap_a_caller_waits_for_a_returned_buffer() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=2)
    got: list[int] = []
    with pool.buffer(), pool.buffer():

        def third() -> None:
            with pool.buffer() as c:
                got.append(c.address)

        waiter = threading.Thread(target=third)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # blocked: two buffers exist, both lent out
        assert (pool.created, got) == (2, [])
    # Leaving the with statement returned both; the waiter took one of them.
    waiter.join(10)
    assert not waiter.is_alive()
    assert pool.created == 2
    assert got[0] in {b.address for b in pool.buffers}
    pool.close()


def test_many_threads_never_share_a_buffer() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=3)
    holders: dict[int, int] = {}  # address -> thread id
    lock = threading.Lock()
    errors: list[str] = []

    def worker(tid: int) -> None:
        for _ in range(200):
            with pool.buffer() as buf:
                with lock:
                    if buf.address in holders:
                        errors.append(f"{tid} got the buffer {holders[buf.address]} holds")
                    holders[buf.address] = tid
                buf.view[:8] = tid.to_bytes(8, "little")
                time.sleep(0)
                if buf.view[:8] != tid.to_bytes(8, "little"):
                    errors.append(f"{tid}'s bytes were overwritten")
                with lock:
                    del holders[buf.address]

    assert run_in_threads(worker) == []
    assert errors == []
    assert 1 <= pool.created <= 3
    pool.close()


def test_close_unmaps_every_buffer_and_is_idempotent() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=3)
    with pool.buffer(), pool.buffer():
        pass
    buffers = pool.buffers
    assert len(buffers) == 2 and not any(b.closed for b in buffers)
    pool.close()
    assert all(b.closed for b in buffers)
    pool.close()
    closed = re.escape("tierstore: the aligned buffer pool is closed")
    with pytest.raises(RuntimeError, match=closed), pool.buffer():
        pass


def test_a_buffer_lent_out_at_close_is_unmapped_when_it_returns() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=1)
    with pool.buffer() as buf:
        pool.close()
        assert not buf.closed  # still in use: close() must not pull it away
        buf.view[:1] = b"x"
    assert buf.closed


def test_a_waiter_is_woken_by_close() -> None:
    pool = AlignedBufferPool(PAGE, max_buffers=1)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            with pool.buffer():
                pass
        except RuntimeError as e:
            errors.append(e)

    with pool.buffer():
        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(0.1)
        assert waiter.is_alive()
        pool.close()
        waiter.join(10)
        assert not waiter.is_alive()
    assert len(errors) == 1


def test_buffer_close_with_a_slice_still_alive() -> None:
    buf = AlignedBuffer(PAGE)
    piece = buf.view[:10]  # as a traceback might keep one
    buf.close()  # no BufferError: the memory goes with the last slice
    assert not buf.closed
    piece[:1] = b"y"  # still mapped, still safe to touch
    del piece


# -- copy -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 64 * 1024 - 1, 64 * 1024, 1 << 20])
@pytest.mark.parametrize("readonly", [False, True])
def test_copy_any_size_and_alignment(size: int, readonly: bool) -> None:
    data = bytes((i * 7 + 3) % 256 for i in range(min(size, 4096))) * (size // 4096 + 1)
    data = data[:size]
    src_backing = bytearray(5) + bytearray(data)
    src = memoryview(bytes(src_backing) if readonly else src_backing)[5:]
    dst_backing = bytearray(size + 6)
    copy(memoryview(dst_backing)[3 : 3 + size], src)
    assert bytes(dst_backing[3 : 3 + size]) == data
    assert bytes(dst_backing[:3]) == bytes(3)
    assert bytes(dst_backing[3 + size :]) == bytes(3)


def test_copy_refuses_lengths_that_differ() -> None:
    with pytest.raises(ValueError, match=re.escape("copy: 3 bytes into a buffer of 2")):
        copy(memoryview(bytearray(2)), memoryview(b"abc"))


def test_large_writable_copies_run_without_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    # ctypes.memmove is a foreign call: ctypes releases the GIL around it.
    calls: list[int] = []
    real = ctypes.memmove

    def memmove(dst: Any, src: Any, n: int) -> Any:
        calls.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", memmove)
    big = 1 << 20
    copy(memoryview(bytearray(big)), memoryview(bytearray(b"z" * big)))
    copy(memoryview(bytearray(big)), memoryview(b"z" * big))  # read-only: slice assignment
    copy(memoryview(bytearray(100)), memoryview(bytearray(100)))  # small: slice assignment
    assert calls == [big]


def _vm_flags(address: int) -> list[str]:
    # The VmFlags of the mapping that holds ``address`` (Linux /proc/self/smaps).
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"),
    reason="transparent huge pages are a Linux feature",
)
def test_large_buffers_ask_for_huge_pages_small_ones_do_not() -> None:
    # NOTE [ Huge pages for I/O buffers ]: "hg" is VM_HUGEPAGE, set by madvise.
    probe = mmap.mmap(-1, _aligned._HUGE_MIN, flags=_aligned.PRIVATE)
    try:
        probe.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    finally:
        probe.close()
    large, small = AlignedBuffer(_aligned._HUGE_MIN), AlignedBuffer(_aligned._HUGE_MIN // 2)
    try:
        assert "hg" in _vm_flags(large.address)
        assert "hg" not in _vm_flags(small.address)
    finally:
        large.close()
        small.close()


def _resident_pages(buf: AlignedBuffer) -> int:
    # mincore(2): one byte per page of the range, bit 0 set where the page is resident.
    libc = ctypes.CDLL(None, use_errno=True)
    pages = len(buf.view) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(buf.address), ctypes.c_size_t(len(buf.view)), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore(2) as Linux has it")
def test_trim_hands_back_the_pages_of_idle_buffers_and_leaves_lent_ones() -> None:
    # NOTE [ Idle I/O buffers ]: the pages go, the buffers stay in the pool.
    pool = AlignedBufferPool(_aligned._HUGE_MIN, max_buffers=2)
    pages = _aligned._HUGE_MIN // mmap.PAGESIZE
    with pool.buffer() as first, pool.buffer() as second:
        first.view[:] = b"\1" * len(first.view)
        second.view[:] = b"\1" * len(second.view)
    with pool.buffer() as lent:  # lent while the pool trims
        assert pool.trim() == _aligned._HUGE_MIN  # only the idle one
        assert _resident_pages(lent) == pages and lent.view[0] == 1
    (idle,) = (b for b in pool.buffers if b is not lent)
    assert _resident_pages(idle) == 0
    assert pool.trim() == _aligned._HUGE_MIN  # the one lent during the last trim
    assert pool.trim() == 0  # nothing resident is left to hand back
    assert pool.created == 2
    with pool.buffer() as again:  # zeroed pages where its bytes were
        assert again.view[0] == 0
    pool.close()
