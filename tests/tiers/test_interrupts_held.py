"""Ctrl-C held off through bookkeeping (NOTE [ Interrupts held ] in tierstore/tiers/interrupts.py).

Real SIGINTs, raised in this process with ``signal.raise_signal`` at the
worst moment: in the middle of releasing an entry, of putting a leased host
buffer back. The interrupt must still reach the caller, and the tables must
still match the memory afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore import TierConfig
from tierstore.tiers import interrupts
from tierstore.tiers.entry import TierState
from tierstore.tiers.host_pool import BLOCK_ALIGN, HostPool
from tierstore.tiers.interrupts import held, hold_interrupts, let_go_of_interrupts
from tierstore.tiers.manager import TierManager
from tierstore.tiers.movers import Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.release import Releases


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as a script has it, and nothing of tierstore's after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        while interrupts._users[0]:
            let_go_of_interrupts()
        signal.signal(signal.SIGINT, before)


def _disk_store(tmp_path: Path) -> TierManager:
    """A store whose every save goes to disk."""
    return TierManager(
        TierConfig(
            device_budget=0,
            host_budget=0,
            disk_budget="1MiB",
            disk_path=str(tmp_path),
            min_offload_bytes=0,
        )
    )


def test_an_interrupt_in_a_hold_is_raised_as_the_hold_ends(default_sigint: None) -> None:
    hold_interrupts()
    ran = []
    with pytest.raises(KeyboardInterrupt), held:
        signal.raise_signal(signal.SIGINT)
        ran.append("after the signal")  # the bookkeeping ends whole
    assert ran == ["after the signal"]
    with pytest.raises(KeyboardInterrupt):  # outside a hold: at once, as Python's own
        signal.raise_signal(signal.SIGINT)
        ran.append("never")
    assert ran == ["after the signal"]
    let_go_of_interrupts()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_in_the_hold_does_not_swallow_the_interrupt(default_sigint: None) -> None:
    hold_interrupts()
    with pytest.raises(KeyboardInterrupt) as caught, held:
        signal.raise_signal(signal.SIGINT)
        raise ValueError("the block's own")
    assert isinstance(caught.value.__context__, ValueError)


def test_the_handler_goes_back_as_the_last_store_closes(
    default_sigint: None, tmp_path: Path
) -> None:
    first = TierManager(TierConfig(disk_path=str(tmp_path)))
    second = TierManager(TierConfig(disk_path=str(tmp_path)))
    assert signal.getsignal(signal.SIGINT) is interrupts._interrupted
    first.close()
    assert signal.getsignal(signal.SIGINT) is interrupts._interrupted
    second.close()
    second.close()  # idempotent: lets go once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_the_users_is_left_alone(default_sigint: None, tmp_path: Path) -> None:
    def mine(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, mine)
    store = TierManager(TierConfig(disk_path=str(tmp_path)))
    assert signal.getsignal(signal.SIGINT) is mine
    store.close()
    assert signal.getsignal(signal.SIGINT) is mine


def test_ctrl_c_while_releasing_an_entry_loses_no_release(
    default_sigint: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _disk_store(tmp_path)
    handles = [store.put(torch.full((256,), float(i))) for i in range(3)]
    assert store.stats().tiers["disk"].entries == 3
    release = Releases.release_locked
    signalled = []

    def interrupted(self: Releases, key: int) -> None:
        if not signalled:  # Ctrl-C as the first release begins
            signalled.append(key)
            signal.raise_signal(signal.SIGINT)
        release(self, key)

    monkeypatch.setattr(Releases, "release_locked", interrupted)
    del handles
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        store.stats()  # takes the lock, and drains the three releases
    assert signalled
    stats = store.stats()
    assert {t: s.entries for t, s in stats.tiers.items()} == {"device": 0, "host": 0, "disk": 0}
    assert stats.tiers["disk"].bytes == 0
    store.close()


def test_a_put_back_cut_short_is_found_when_nothing_is_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A handler of the user's that raises: no hold, so the interrupt splits
    # the put-back; the pool starts afresh once nothing is out.
    pool = HostPool(capacity=1 << 20, step=1 << 20, pin=False)
    kept, lost = pool.lease(100), pool.lease(5000)
    assert pool.used_bytes == 3 * BLOCK_ALIGN
    free = pool._free

    def cut_short(block: object) -> None:
        monkeypatch.setattr(pool, "_free", free)
        raise KeyboardInterrupt  # before any of the free list changed

    monkeypatch.setattr(pool, "_free", cut_short)
    del lost
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        _ = pool.used_bytes
    assert pool.used_bytes == 3 * BLOCK_ALIGN  # mislaid while `kept` is out
    del kept
    gc.collect()
    assert pool.used_bytes == 0  # nothing out: found
    block = pool.take(3 * BLOCK_ALIGN)
    assert block is not None and block.offset == 0
    pool.give(block)
    pool.close()


def test_ctrl_c_before_the_wait_for_a_read_gives_its_bytes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ A read handed to backward ] in tierstore/tiers/readahead.py: the
    # interrupt lands after the read was handed out, before its wait began.
    store = _disk_store(tmp_path)
    handle = store.put(torch.arange(8192.0))
    store.flush()  # on disk, not still in memory: the unpack reads it back
    finish = ReadAhead.finish

    def interrupted(self: ReadAhead, *args: object) -> torch.Tensor:
        monkeypatch.setattr(ReadAhead, "finish", finish)
        raise KeyboardInterrupt

    monkeypatch.setattr(ReadAhead, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.get(handle)
    reads = store._reads
    assert reads.held_bytes == 32768  # handed out, not yet let go of
    del handle  # the graph an interrupted backward drops
    gc.collect()
    stats = store.stats()
    assert stats.tiers["disk"].entries == 0
    assert (reads.held_bytes, reads.in_flight()) == (0, [])
    for _ in range(100):  # a read too far along to cancel lands, and lets go of its buffer
        if not stats.buffer_bytes_in_use:
            break
        time.sleep(0.05)
        stats = store.stats()
    assert stats.buffer_bytes_in_use == 0
    store.close()


def test_ctrl_c_as_a_write_is_handed_over_still_queues_it(
    default_sigint: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE [ Requests that an interrupt cannot split ] in tierstore/tiers/movers.py:
    # the write's future is the store's before the request is queued; a
    # request never queued would leave flush() waiting on it for good.
    store = _disk_store(tmp_path)
    submit = Pipeline.submit_write

    def interrupted(self: Pipeline, *args: object, **kwargs: object) -> object:
        monkeypatch.setattr(Pipeline, "submit_write", submit)
        signal.raise_signal(signal.SIGINT)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "submit_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(torch.arange(8192.0))
    flushing = threading.Thread(target=store.flush, daemon=True)
    flushing.start()
    flushing.join(60)
    assert not flushing.is_alive(), "a write was never queued: flush() waits for good"
    stats = store.stats()
    assert (stats.tiers["disk"].entries, stats.tiers["disk"].bytes) == (0, 0)
    store.close()


def test_ctrl_c_as_a_save_rests_in_its_tier_leaves_the_tables_whole(
    default_sigint: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An entry's tier and that tier's table change in one step (TierPlacement._rest):
    # put()'s `except` then finds it where it looks.
    store = _disk_store(tmp_path)
    add = TierState.add

    def interrupted(self: TierState, *args: object, **kwargs: object) -> None:
        monkeypatch.setattr(TierState, "add", add)
        signal.raise_signal(signal.SIGINT)
        add(self, *args, **kwargs)

    monkeypatch.setattr(TierState, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(torch.arange(8192.0))
    store.flush()
    stats = store.stats()
    assert (stats.tiers["disk"].entries, stats.tiers["disk"].bytes) == (0, 0)
    store.close()


def test_the_io_tasks_die_on_the_io_thread(tmp_path: Path) -> None:
    # NOTE [ Tasks die on the loop ] in tierstore/tiers/movers.py: a future the
    # training thread still holds keeps no asyncio task alive.
    pipe = Pipeline(TierConfig(disk_path=str(tmp_path)))
    record = pipe.submit_write(1, torch.arange(10.0)).result()
    read = pipe.submit_read(1, record)
    assert read.result().tolist()[:3] == [0.0, 1.0, 2.0]
    for _ in range(100):  # the loop lets go of a task once its callbacks ran
        gc.collect()
        tasks = [t for t in gc.get_objects() if type(t) is asyncio.Task]
        if not tasks:
            break
        time.sleep(0.01)
    assert tasks == [] and read.done()
    pipe.close()
