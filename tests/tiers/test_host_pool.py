"""The host pool: blocks carved from a few chunks, grown in steps, reused, bounded."""

from __future__ import annotations

import pytest
import torch

from tierstore.bench.memory import AnonRss
from tierstore.errors import StoreClosedError, TierstoreWarning
from tierstore.tiers import host_pool as host
from tierstore.tiers.host_pool import BLOCK_ALIGN, HostPool


def test_blocks_are_aligned_views_of_one_chunk_and_reused() -> None:
    pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
    a, b = pool.take(10), pool.take(BLOCK_ALIGN + 1)
    assert a is not None and b is not None
    assert (a.chunk, a.offset, a.length) == (0, 0, BLOCK_ALIGN)
    assert (b.chunk, b.offset, b.length) == (0, BLOCK_ALIGN, 2 * BLOCK_ALIGN)
    assert a.tensor.numel() == 10 and b.nbytes == BLOCK_ALIGN + 1
    # Both are windows on the same allocation, so no new memory per entry.
    base = a.tensor.untyped_storage().data_ptr()
    assert b.tensor.untyped_storage().data_ptr() == base
    assert b.tensor.data_ptr() - base == BLOCK_ALIGN
    a.tensor.fill_(1)
    b.tensor.fill_(2)
    assert int(a.tensor.sum()) == 10  # b's bytes did not spill into a's
    pool.give(b)
    c = pool.take(100)
    assert c is not None and (c.chunk, c.offset) == (0, BLOCK_ALIGN)  # b's place, again
    assert pool.used_bytes == 2 * BLOCK_ALIGN
    assert pool.reserved_bytes == 1 << 20
    pool.close()


def test_grows_by_step_up_to_capacity_then_declines() -> None:
    step = 4 * BLOCK_ALIGN
    pool = HostPool(capacity=10 * BLOCK_ALIGN, step=step, pin=False)
    blocks = [pool.take(BLOCK_ALIGN) for _ in range(10)]
    assert all(b is not None for b in blocks)
    # Chunks of 4, 4 and the 2 pages the capacity leaves.
    assert [b.chunk for b in blocks if b is not None] == [0] * 4 + [1] * 4 + [2] * 2
    assert pool.reserved_bytes == 10 * BLOCK_ALIGN
    assert pool.take(1) is None
    assert pool.allocations_outside == 1
    for b in blocks:
        assert b is not None
        pool.give(b)
    assert pool.used_bytes == 0
    assert pool.reserved_bytes == 10 * BLOCK_ALIGN  # chunks stay for the next step
    again = pool.take(BLOCK_ALIGN)
    assert again is not None and again.chunk == 0
    pool.close()


def test_trim_frees_the_pages_instead_of_only_unmapping_them() -> None:
    # Private anonymous memory: MADV_DONTNEED frees the pages and the next
    # touch gets zeroed ones. A shared mapping (Python's mmap default) would
    # keep the bytes in shmem, resident but not counted as anonymous memory.
    pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
    block = pool.take(1 << 20)
    assert block is not None
    block.tensor.fill_(7)
    pool.give(block)
    assert pool.trim() == 1 << 20
    again = pool.take(1 << 20)
    assert again is not None and again.offset == block.offset
    assert int(again.tensor.max()) == 0
    pool.close()


@pytest.mark.skipif(host._malloc_trim() is None, reason="not glibc: no malloc_trim")
def test_release_free_heap_hands_back_free_pages_between_live_ones() -> None:
    # NOTE [ Handing the heap back ]: 64 KiB tensors come from the heap
    # (below glibc's mmap threshold), and a freed one between two live ones
    # can neither merge nor leave with the heap's top: it stays resident.
    rss = AnonRss()
    try:
        chunks = [torch.ones(16 * 1024) for _ in range(1024)]  # 64 MiB, touched
        del chunks[::2]  # 32 MiB free, every piece between live ones
        before = rss()
        assert host.release_free_heap()
        assert before - rss() >= 24 << 20, (before, rss())
        assert all(int(c[0]) == 1 for c in chunks)  # what is in use is untouched
    finally:
        rss.close()


@pytest.mark.skipif(host._malloc_trim() is None, reason="not glibc: no malloc_trim")
def test_a_page_handed_back_costs_a_fault_measured_once() -> None:
    # NOTE [ Handing the heap back ]: what the planner prices a hand-back at.
    per_page = host.page_fault_s()
    assert 0.0 < per_page < 1e-3  # a fault and a zeroed page: microseconds, not milliseconds
    assert host.page_fault_s() == per_page  # once a process


def test_idle_chunks_make_way_for_a_block_no_chunk_can_hold() -> None:
    # NOTE [ Host pool ]: a first step's chunks, all free again, must not turn
    # away a later step's larger block; chunks with a block out stay put.
    step = 4 * BLOCK_ALIGN
    pool = HostPool(capacity=12 * BLOCK_ALIGN, step=step, pin=False)
    first = [pool.take(step) for _ in range(3)]
    assert all(b is not None for b in first) and pool.reserved_bytes == 12 * BLOCK_ALIGN
    kept = first[1]
    assert kept is not None
    kept.tensor.fill_(7)
    for b in (first[0], first[2]):
        assert b is not None
        pool.give(b)
    big = pool.take(8 * BLOCK_ALIGN)  # no chunk holds it, and the pool is at capacity
    assert big is not None and big.chunk == 0  # the first dropped chunk's place
    assert pool.reserved_bytes == 12 * BLOCK_ALIGN and pool.allocations_outside == 0
    assert int(kept.tensor.sum()) == 7 * step  # the busy chunk was left alone
    assert pool.take(8 * BLOCK_ALIGN) is None  # busy chunks are never dropped
    assert pool.allocations_outside == 1
    pool.give(big)
    pool.give(kept)
    assert pool.used_bytes == 0
    pool.close()


def test_a_block_larger_than_a_step_gets_its_own_chunk() -> None:
    pool = HostPool(capacity=1 << 20, step=BLOCK_ALIGN, pin=False)
    big = pool.take(3 * BLOCK_ALIGN - 5)
    assert big is not None and big.length == 3 * BLOCK_ALIGN
    assert pool.reserved_bytes == 3 * BLOCK_ALIGN
    assert pool.take(2 << 20) is None  # larger than the whole capacity
    pool.close()


def test_close_is_idempotent_and_refuses_new_blocks() -> None:
    pool = HostPool(capacity=1 << 20, step=1 << 16, pin=False)
    block = pool.take(8)
    assert block is not None
    block.tensor.copy_(torch.arange(8, dtype=torch.uint8))
    pool.close()
    pool.close()
    assert pool.reserved_bytes == 0
    assert block.tensor.tolist() == list(range(8))  # a block handed out keeps its memory
    pool.give(block)  # no-op once closed
    with pytest.raises(StoreClosedError, match="the host pool is closed"):
        pool.take(1)


def test_double_give_is_refused() -> None:
    pool = HostPool(capacity=1 << 20, step=1 << 16, pin=False)
    a, b = pool.take(8), pool.take(8)
    assert a is not None and b is not None
    pool.give(a)
    twice = r"block \[0, 4096\) of chunk 0 is not out: given back twice"
    with pytest.raises(ValueError, match=twice):
        pool.give(a)
    pool.close()


def test_a_pool_that_cannot_pin_warns_once_and_goes_on_pageable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU on the test machine: make the one function that pins fail as
    # cudaHostAlloc does past the locked-memory limit.
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA`")

    monkeypatch.setattr(host, "_pinned", refuse)
    step = 4 * BLOCK_ALIGN
    pool = HostPool(capacity=3 * step, step=step, pin=True)
    with pytest.warns(TierstoreWarning) as caught:
        a = pool.take(step)
        b = pool.take(step)  # a second chunk: no second warning
    assert [str(w.message) for w in caught] == [
        "tierstore: pinning 16.0 KiB of host memory for the host pool failed (CUDA error: "
        "out of memory); the pool goes on in pageable memory, where copies to and from the "
        "GPU are slower. The locked-memory limit (ulimit -l) or the free memory is below the "
        "48.0 KiB the pool may pin: lower host_budget (TIERSTORE_HOST_BUDGET), or set "
        "pin_memory=False (TIERSTORE_PIN_MEMORY) to pin nothing"
    ]
    assert a is not None and b is not None and not pool.pinned
    a.tensor.fill_(7)
    assert int(a.tensor.sum()) == 7 * step and pool.reserved_bytes == 2 * step
    pool.close()
