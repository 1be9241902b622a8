"""Ctrl-C held off for the few microseconds of bookkeeping that one must not split.

NOTE [ Interrupts held ]

Python raises ``KeyboardInterrupt`` in the main thread at the next bytecode
it runs, wherever that is. Most of the store survives that: a lock is
taken with ``with``, a request to an I/O thread goes in one call, a save
interrupted inside ``put`` is let go of by its ``except`` (NOTE
[ Finalizers and interrupts ] in tierstore/tiers/release.py). A few short
runs of bookkeeping cannot: releasing an entry whose handle died (its
tier's bytes, its read ahead, its disk record) and putting a leased host
buffer back. An interrupt in the middle leaves a table that no longer
matches the memory: an entry on disk or a host buffer that no one would
ever let go of.

So, where SIGINT has Python's own handler (``signal.default_int_handler``,
what every script starts with), the first store opened on the main thread
puts :func:`_interrupted` in its place, and the last one closed puts the
default back if it is still there. It raises ``KeyboardInterrupt`` exactly
as the default does, except while the main thread is inside :data:`held`:
then it notes the interrupt, and the hold raises it as it ends, a few
microseconds later, with the bookkeeping whole. Holding costs a thread-id
compare and an integer add; it never spans a wait, so Ctrl-C still reaches
a step stuck on a copy or a write at once. A handler of the user's (a
trainer's, a notebook's) is left alone: tierstore then holds nothing, and
the host pool still finds a block an interrupt mislaid when nothing is out
(NOTE [ Pool blocks and interrupts ] in tierstore/tiers/host_pool.py).
Signal handlers run only in the main thread, so a hold in any other thread
does nothing and needs nothing.

One window is CPython's own (before 3.13): ``Thread.is_alive()`` tries the
thread's state lock without blocking, and an interrupt right after that try
finds the lock "locked" (the living thread holds it), releases it for the
thread and marks the thread stopped for good (the repair of bpo-45274 taken
where it does not apply): a store asking whether its I/O thread lives would
think it dead and refuse every save after. So tierstore asks through
:func:`alive`, in a hold; the I/O thread's own liveness is a flag the
thread clears as it ends (NOTE [ A dead I/O thread ] in tiers/movers.py),
which no interrupt touches.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

__all__ = ["alive", "held", "hold_interrupts", "let_go_of_interrupts"]

# The main thread's id once installed (0: not installed), how deep its holds
# are, the interrupts noted meanwhile, and the stores that asked.
_main = [0]
_depth = [0]
_noted: list[int] = []
_users = [0]


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """SIGINT: ``KeyboardInterrupt`` now, or as the hold under way ends."""
    if _depth[0]:
        _noted.append(signum)
        return
    signal.default_int_handler(signum, frame)


class _Held:
    """``with held:`` holds Ctrl-C off in the main thread until the block ends."""

    __slots__ = ()

    def __enter__(self) -> None:
        if threading.get_ident() == _main[0]:
            _depth[0] += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if threading.get_ident() != _main[0]:
            return
        _depth[0] -= 1
        if not _depth[0] and _noted:
            _noted.clear()
            if kind is None or not issubclass(kind, KeyboardInterrupt):
                raise KeyboardInterrupt  # an error of the block's own is its context


#: The hold: ``with held:`` around bookkeeping an interrupt must not split.
held = _Held()


def alive(thread: threading.Thread) -> bool:
    """``thread.is_alive()``, with Ctrl-C held off: NOTE [ Interrupts held ].

    Example:
        >>> import threading
        >>> from tierstore.tiers.interrupts import alive
        >>> alive(threading.main_thread())
        True
    """
    with held:
        return thread.is_alive()


def hold_interrupts() -> None:
    """A store opened: put :func:`_interrupted` in front of Python's SIGINT handler.

    Only from the main thread, and only where the handler is Python's own.

    Example:
        >>> import signal
        >>> from tierstore.tiers.interrupts import hold_interrupts, let_go_of_interrupts
        >>> was = signal.signal(signal.SIGINT, signal.default_int_handler)  # a script's
        >>> hold_interrupts(); signal.getsignal(signal.SIGINT).__name__
        '_interrupted'
        >>> let_go_of_interrupts(); signal.getsignal(signal.SIGINT) is signal.default_int_handler
        True
        >>> _ = signal.signal(signal.SIGINT, was)
    """
    _users[0] += 1
    if _main[0] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # the user's: NOTE [ Interrupts held ]
    _main[0] = threading.get_ident()
    signal.signal(signal.SIGINT, _interrupted)


def let_go_of_interrupts() -> None:
    """A store closed: the last one puts Python's SIGINT handler back, if ours is in place."""
    _users[0] = max(0, _users[0] - 1)
    if _users[0] or not _main[0]:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # stays; the next store closed on the main thread puts it back
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _main[0] = 0
    _noted.clear()
