"""Transfers: the host memory a copy off the device may take (issue 22, item 6).

The copies themselves need a GPU (tests/test_cuda.py); the pool they take
their blocks from is the same on a CPU, unpinned.
"""

from __future__ import annotations

import pytest

import tierstore
from tierstore.tiers.transfers import Transfers


def test_a_copy_off_the_device_is_refused_past_host_budget_not_allocated_outside() -> None:
    transfers = Transfers(
        tierstore.TierConfig(
            host_budget="16KiB", write_queue_bytes="8KiB", host_pool_step="8KiB", pin_memory=False
        )
    )
    blocks = [transfers.host_block(5000) for _ in range(3)]  # a page each, rounded up
    with pytest.raises(tierstore.TierFullError) as caught:
        transfers.host_block(5000)
    assert str(caught.value) == (
        "tierstore: the host pool has no room for a copy of 4.9 KiB off the device: "
        "24.0 KiB of its 24.0 KiB (host_budget=16.0 KiB plus write_queue_bytes=8.0 KiB) are "
        "in use; raise host_budget (TIERSTORE_HOST_BUDGET), or write_queue_bytes "
        "(TIERSTORE_WRITE_QUEUE_BYTES) for copies on their way to disk"
    )
    pool = transfers.pinned_pool_if_open
    assert pool is not None
    assert (pool.reserved_bytes, pool.allocations_outside) == (24 << 10, 1)
    pool.give(blocks.pop())
    assert transfers.host_block(5000).nbytes == 5000  # room again, in the pool
    transfers.close()


class _LateEvent:
    """A copy's event the device has not reached yet; synchronize() waits for it."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_a_full_pool_waits_for_blocks_given_back_behind_copies_rather_than_refuse() -> None:
    # NOTE [ Copies on CUDA ]: a block given back returns to the pool once the
    # copies issued before its release have ended. With the host ahead of the
    # device, such blocks can fill the pool: the next copy off the device waits
    # for them (an H200 step under a budget raised TierFullError here).
    transfers = Transfers(
        tierstore.TierConfig(
            host_budget="16KiB", write_queue_bytes="8KiB", host_pool_step="8KiB", pin_memory=False
        )
    )
    blocks = [transfers.host_block(5000) for _ in range(3)]
    late = _LateEvent()
    transfers._returns.append(([late], blocks.pop()))  # as free_host() queues it on CUDA
    transfers.reclaim()
    assert transfers._returns  # still behind its copy
    assert transfers.host_block(5000).nbytes == 5000
    assert late.waits == 1 and not transfers._returns
    with pytest.raises(tierstore.TierFullError):  # nothing left to wait for: refused
        transfers.host_block(5000)
    transfers.close()
