"""Release: an entry let go when its last handle dies, deferred while the manager's lock is held.

The tier manager (:mod:`tierstore.tiers.manager`) takes its lock through
:meth:`Releases.locked`, which drains the releases queued meanwhile, and
gives every handle a finalizer that releases its entry here
(:meth:`Releases.handle`): a weak reference whose callback queues it, drained
by the next call that takes the lock. Releasing is bookkeeping on the manager's tables:
the entry leaves its tier, its dedupe key, the read-ahead window and its host
block; a disk record is deleted on the I/O thread.

Example:
    >>> import gc, torch
    >>> from tierstore import TierConfig
    >>> from tierstore.tiers.manager import TierManager
    >>> mgr = TierManager(TierConfig(device_budget=0, host_budget="1MiB", disk_budget=0))
    >>> h = mgr.put(torch.zeros(256))
    >>> del h; _ = gc.collect()  # the handle's death queues its entry
    >>> len(mgr._releases.pending)
    1
    >>> mgr.stats().tiers["host"].entries  # drained by the next call that takes the lock
    0
    >>> mgr.close()
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from tierstore.stats import Tier
from tierstore.tiers.entry import Entry, TierState
from tierstore.tiers.handle import Handle
from tierstore.tiers.interrupts import held
from tierstore.tiers.movers import Pipeline
from tierstore.tiers.readahead import ReadAhead
from tierstore.tiers.transfers import Transfers
from tierstore.tiers.writebehind import WriteBehind

__all__ = ["Releases", "close_collected", "close_now", "close_when_collected", "retake"]

# NOTE [ Deferred release ]
# A Handle's death can come at any moment: in another thread, or in this
# one while put() holds the lock (a garbage collection triggered inside put).
# Releasing then would mutate the tier tables mid-update. So its death only
# queues the entry (NOTE [ Finalizers and interrupts ]), and whoever next
# takes the lock drains the queue, as it takes it and again on the way out:
# the next put or get, stats(), a step's end, close().
# Releasing is bookkeeping only: a disk record is deleted on the I/O thread
# (NOTE [ Deletes on the I/O thread ] in tiers/movers.py), never under this lock.
# What the movers finished (D2H copies that ended: Transfers.settle; writes
# that landed: WriteBehind.harvest) is settled once, as the lock is taken,
# not at every drain: on CUDA each settle queries the events of the copies
# under way, and four drains a save (the lock's entry and exit in put and
# get) would make several event queries in a row after a moved save's copy,
# microseconds each with the Python around them. A drain on the way out
# only releases.

# NOTE [ Finalizers and interrupts ]
# Ctrl-C raises KeyboardInterrupt in the main thread at the next bytecode
# it runs, whatever that is. If that bytecode is in a finalizer (a
# weakref.finalize, a __del__), Python prints "Exception ignored" and drops
# the interrupt: training goes on, and the finalizer's work is half done (a
# pool block never returned, a lock never released, a request to the I/O
# thread half sent). So no finalizer of tierstore's runs Python code: each
# is a weak reference (a subclass of weakref.ref that carries what to let
# go of) whose callback is a queue's deque.append, a C call in which no
# interrupt can land and which takes no lock. The reference itself is kept
# alive in a dict by its id until it is drained (a weak reference that dies
# first never calls back). The thread that next takes the owner's lock
# drains the queue, where an interrupt reaches the user as it should. Each
# item leaves the queue before its work is done: an interrupt in between
# would lose that one release (a leak), never do it twice (a corruption),
# and the drain holds interrupts off until it ends (NOTE [ Interrupts held ]
# in tiers/interrupts.py), so none lands in between where Python's own
# SIGINT handler is in place.
# Locks are taken with `with`, never acquire() then try: in CPython an
# interrupt can land between the two, and the lock stays held. A lock let
# go around a wait is taken back by retake(), which holds on to an
# interrupt until it has the lock again. A store collected unclosed is
# closed by the next store made or closed, or at exit (close_when_collected).
# One window is CPython's own: threading.Condition.__enter__ is Python, so
# an interrupt right after its acquire leaves that condition held; the
# training thread enters a Future's condition only to queue a request (NOTE
# [ Requests that an interrupt cannot split ] in tiers/movers.py) or wait.


class _Release(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a handle that carries its entry's key.

    NOTE [ Finalizers and interrupts ]: its callback is ``deque.append``.
    """

    __slots__ = ("key",)
    key: int


def retake(lock: threading.Lock) -> None:
    """Take ``lock`` back after a wait, even through an interrupt, then raise it.

    NOTE [ Finalizers and interrupts ]: a ``KeyboardInterrupt`` may stop a
    blocked ``acquire()`` before it has the lock; the caller's ``with``
    would then let go of a lock it does not hold.
    """
    interrupted: BaseException | None = None
    while True:
        try:
            lock.acquire()
        except BaseException as exc:  # kept, raised once the lock is held
            interrupted = exc
            continue
        break
    if interrupted is not None:
        raise interrupted


class Owned(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an owner of threads, carrying what closes them.

    NOTE [ Finalizers and interrupts ]: its callback is ``deque.append``.
    """

    __slots__ = ("close",)
    close: Callable[[], None]


_collected: deque[Owned] = deque()  # owners collected unclosed, not yet closed
_owned: dict[int, Owned] = {}  # every owner not closed yet, by its reference's id


def close_when_collected(owner: object, close: Callable[[], None]) -> Owned:
    """Have ``close`` run once ``owner`` is collected unclosed, or at exit.

    Collection only queues it (NOTE [ Finalizers and interrupts ]): the next
    owner made, or closed, runs it (:func:`close_collected`), and so does
    interpreter exit. :func:`close_now` runs it at once.

    Example:
        >>> from tierstore.tiers.release import close_collected, close_when_collected
        >>> class Owner: ...
        >>> owner, done = Owner(), []
        >>> _ = close_when_collected(owner, lambda: done.append(1))
        >>> del owner; close_collected(); done
        [1]
    """
    ref = Owned(owner, _collected.append)
    ref.close = close
    _owned[id(ref)] = ref
    return ref


def close_now(ref: Owned) -> None:
    """Run ``ref``'s close now, unless it ran already. Idempotent."""
    if _owned.pop(id(ref), None) is not None:
        ref.close()


def close_collected() -> None:
    """Close the owners collected unclosed since the last call."""
    while _collected:
        close_now(_collected.popleft())


@atexit.register
def _close_all() -> None:
    for ref in list(_owned.values()):
        close_now(ref)


class Releases:
    """The manager's lock, and the releases of entries deferred while it is held.

    The tables are the manager's own (its entries, dedupe keys and tiers),
    shared, not copied. :attr:`closed` is set by the manager as it closes (or
    in a forked child): from then on queued keys are dropped, not released.
    """

    def __init__(
        self,
        entries: dict[int, Entry],
        dedupe: dict[tuple[object, ...], tuple[weakref.ref[object], int]],
        tiers: dict[Tier, TierState],
        *,
        pipeline: Pipeline,
        transfers: Transfers,
        reads: ReadAhead,
        writes: WriteBehind,
    ) -> None:
        self.lock = threading.Lock()
        # Handles that died, not yet released, and those alive, by id:
        # NOTE [ Finalizers and interrupts ].
        self.pending: deque[_Release] = deque()
        self._live: dict[int, _Release] = {}
        self.closed = False
        self._entries = entries
        self._dedupe = dedupe
        self._tiers = tiers
        self._pipeline = pipeline
        self._transfers = transfers
        self._reads = reads
        self._writes = writes

    def forked(self) -> None:
        """In a forked child: closed, with a lock of its own.

        NOTE [ Forked children ] in tiers/forks.py.
        """
        self.lock = threading.Lock()
        self.closed = True

    def handle(self, entry: Entry, t: torch.Tensor) -> Handle:
        """A handle on ``entry`` whose death releases one reference to it.

        The death only queues the entry: NOTE [ Deferred release ].
        """
        with held:  # NOTE [ Interrupts held ] in tiers/interrupts.py
            handle = Handle(entry.key, t)
            ref = _Release(handle, self.pending.append)
            ref.key = entry.key
            self._live[id(ref)] = ref
        return handle

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The lock, settling what the movers finished as it is taken, draining releases."""
        with self.lock:
            self._drain(settle=True)
            yield
            self._drain()

    def unlocked(self, wait: Callable[[], object]) -> None:
        """Run ``wait`` with the lock released (forward waiting on copies or writes)."""
        try:
            self.lock.release()  # inside the try: NOTE [ Finalizers and interrupts ]
            with torch.profiler.record_function("tierstore::pack_wait"):
                wait()
        finally:
            retake(self.lock)

    def drop_all(self) -> None:
        """Drop every entry at once, as the manager closes (its I/O has ended)."""
        self._entries.clear()
        self._dedupe.clear()
        self.pending.clear()
        self._live.clear()
        self._writes.clear()
        for state in self._tiers.values():
            state.entries.clear()
            state.heap.clear()
            state.bytes = 0

    def _drain(self, *, settle: bool = False) -> None:
        """Release the queued keys; with ``settle``, first what the movers finished.

        NOTE [ Deferred release ]: copies and writes are settled once per
        lock, as it is taken, not at each drain.
        """
        if self.closed:
            self.pending.clear()
            self._live.clear()
            return
        with held:  # NOTE [ Interrupts held ] in tiers/interrupts.py
            if settle:
                self._transfers.settle()
                self._writes.harvest()
            pending, live = self.pending, self._live
            while pending:
                ref = pending.popleft()
                del live[id(ref)]
                self.release_locked(ref.key)

    def release_locked(self, key: int) -> None:
        """Let go of one reference to entry ``key`` (under the lock); the last frees it."""
        entry = self._entries.get(key)
        if entry is None:  # closed, or never landed
            return
        entry.refs -= 1
        if entry.refs:
            return
        del self._entries[key]
        key_of = entry.dedupe_key
        if key_of is not None and self._dedupe.get(key_of, (None, None))[1] == key:
            # only its own: NOTE [ Deduplication under threads ] in tiers/dedupe.py
            del self._dedupe[key_of]
        self._reads.released(entry)
        if key in self._writes:
            return  # harvest() frees it once the write has ended
        if entry.tier is not None:
            state = self._tiers[entry.tier]
            state.remove(entry, state.size_of(entry))
            if entry.tier == "disk":
                self._pipeline.delete(key)
        self._transfers.free_host(entry.block)
        entry.tensor = entry.held = entry.block = None
        if entry.ready is None:  # else settle() lets go once the copy has read it
            entry.probe = None
