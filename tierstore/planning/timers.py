"""A profiled step's clock: the marks its saves and uses are timed with.

A profile's times are seconds since the step began, with the store's own
waits taken out: :class:`HostTimer` on a CPU, :class:`BusyTimer` (the
device's own work, timed with events) where a step runs on a GPU. Both
answer to :class:`Timer`. NOTE [ Timing a profile ] says why.

Example:
    >>> from tierstore.planning.timers import HostTimer
    >>> timer = HostTimer(lambda: 0.0)
    >>> start = timer.begin(); end = timer.end()
    >>> timer.elapsed(start, end) >= 0
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["BusyTimer", "HostTimer", "Timer"]

# NOTE [ Timing a profile ]
# A profile's times are when each save was made and first used, and what
# each op that could rebuild it took. On a CPU they are perf_counter seconds
# with the store's own waits taken out (HostTimer). On a GPU the host runs
# ahead of the device in a real step, and the profiled step is not a real
# step: it moves every save, waits on the link, and runs the recorder's
# Python on every op, so the device idles between kernels. A sync around
# each op makes small ops several times slower than in a real step, and
# events on the stream alone still count the idle gaps. So a GPU profile's
# clock is the device's own work (BusyTimer):
#   * forward: CUDA events around each op the recorder runs, summed. Where
#     the stream has run dry before an op (the host is slow in a profile),
#     a spin is queued first (CudaEvents.keep_busy): the op's start event
#     waits behind it while the host launches the op, so the span is the
#     op's kernels, not the launch. Ops that launch nothing (views,
#     allocations) are not timed: their span would be the host's time alone
#     (an allocation that waits on the device takes as long as the wait).
#     tierstore's own ops in its hooks (the copy off the device, a detach)
#     are not the step's: the recorder is paused while the hooks run them
#     (unrecorded() in tierstore/autograd/state.py).
#   * backward: an event at each use, less the time the compute stream
#     waited on copies back (an event pair around each wait, written down
#     by Transfers.consume while the profiled step runs).
# The seconds are read once, when the profile becomes a plan; an op's time
# not yet known travels as a function that reads it. What the step does
# outside forward and backward (the optimizer, the loader) is not seen on a
# device: the first check rescales the prediction to the measured step.


class Timer(Protocol):
    """Marks on a step's timeline, read as seconds since it began (NOTE [ Timing a profile ]).

    Example:
        >>> from tierstore.planning.timers import HostTimer, Timer
        >>> timer: Timer = HostTimer(lambda: 0.0)
        >>> timer.blocked is None  # a host's: no device waits to write down
        True
    """

    @property
    def blocked(self) -> list[tuple[Any, Any]] | None:
        """Where the compute stream's waits on copies back are written down (a device's)."""

    def mark(self, backward: bool = False) -> object:
        """Now, on the step's timeline (``backward``: a use in backward)."""

    def seconds(self, mark: object) -> float:
        """Seconds from the step's start to ``mark``."""

    def begin(self) -> Any:
        """The start of a span of the step's own work (a forward op)."""

    def end(self) -> Any:
        """The end of the span under way."""

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between a span's start and end."""


class HostTimer:
    """perf_counter marks with the store's waits taken out (NOTE [ Timing a profile ]).

    Example:
        >>> from tierstore.planning.timers import HostTimer
        >>> timer = HostTimer(lambda: 0.0)
        >>> timer.seconds(timer.mark()) >= 0
        True
    """

    blocked = None

    def __init__(self, waits: Callable[[], float]) -> None:
        self._waits = waits
        self._origin = time.perf_counter() - waits()

    def mark(self, backward: bool = False) -> float:
        """perf_counter less the waits so far."""
        return time.perf_counter() - self._waits()

    def seconds(self, mark: object) -> float:
        """Compute seconds since the timer began."""
        assert isinstance(mark, float)
        return mark - self._origin

    @staticmethod
    def begin() -> float:
        """perf_counter."""
        return time.perf_counter()

    end = begin

    @staticmethod
    def elapsed(start: Any, end: Any) -> float:
        """``end - start``."""
        return float(end - start)


class BusyTimer:
    """A profile's device time: forward's op spans summed, backward's marks less its waits.

    NOTE [ Timing a profile ]. ``event()`` records an event on the current
    stream (``torch.cuda.Event`` with ``enable_timing``, recorded; a test
    passes its own); if it has ``keep_busy()``, that is called before an op
    whose stream has run dry (the last span's end has completed). Until
    :attr:`device` is set (the step saved a CUDA tensor), it answers as a
    :class:`HostTimer` does: a CPU model on a machine whose CUDA is
    initialised.

    Example:
        >>> from tierstore.planning.timers import BusyTimer
        >>> class Event:
        ...     def __init__(self, t): self.t = t
        ...     def synchronize(self): pass
        ...     def elapsed_time(self, end): return (end.t - self.t) * 1e3
        >>> now = [0.0]
        >>> timer = BusyTimer(lambda: 0.0, lambda: Event(now[0]))
        >>> timer.device = True
        >>> _ = timer.begin(); now[0] = 0.002; _ = timer.end()  # an op: 2 ms
        >>> now[0] = 0.050                                       # idle: not counted
        >>> _ = timer.begin(); now[0] = 0.053; _ = timer.end()  # 3 ms
        >>> round(timer.seconds(timer.mark()), 6)
        0.005
        >>> first = timer.mark(backward=True)                    # backward: 10 ms, a 4 ms wait
        >>> timer.blocked.append((Event(0.055), Event(0.059))); now[0] = 0.063
        >>> round(timer.seconds(timer.mark(backward=True)), 6)
        0.011
    """

    def __init__(self, waits: Callable[[], float], event: Callable[[], Any]) -> None:
        self.host = HostTimer(waits)
        self.device = False
        #: The compute stream's waits on copies back, as event pairs (Transfers.consume).
        self.blocked: list[tuple[Any, Any]] = []
        self._event = event
        self._keep_busy: Callable[[], None] | None = getattr(event, "keep_busy", None)
        self._last: Any = None  # the last span's end event
        self._spans: list[tuple[Any, Any]] = []
        self._open: tuple[Any, float] | None = None
        self._backward: tuple[Any, int, int] | None = None  # backward's first mark
        self._busy: list[float] | None = None  # forward seconds before each span, read once
        self._waited: list[float] | None = None  # backward's waits before each, read once

    def begin(self) -> tuple[Any, float]:
        """Open a forward op's span, behind a spin if the stream has run dry."""
        if self._keep_busy is not None and (self._last is None or self._last.query()):
            self._keep_busy()
        self._open = self._event(), time.perf_counter()
        return self._open

    def end(self) -> tuple[Any, float]:
        """Close the span under way: forward's compute."""
        end = self._event(), time.perf_counter()
        self._last = end[0]
        if self._open is not None:
            self._spans.append((self._open, end))
            self._open = None
        return end

    def mark(self, backward: bool = False) -> tuple[int, Any, int, float]:
        """Forward: the spans so far. Backward: an event now, and the waits so far."""
        host = self.host.mark()
        if not backward:
            return len(self._spans), None, 0, host
        event = self._event()
        if self._backward is None:
            self._backward = (event, len(self._spans), len(self.blocked))
        return len(self._spans), event, len(self.blocked), host

    def seconds(self, mark: object) -> float:
        """Device seconds before ``mark`` (waits for its events)."""
        assert isinstance(mark, tuple)
        spans, event, blocked, host = mark
        if not self.device:
            return self.host.seconds(host)
        if self._busy is None or len(self._busy) <= len(self._spans):  # read once, at the end
            self._busy = _prefix(self.elapsed(a, b) for a, b in self._spans)
        if self._waited is None or len(self._waited) <= len(self.blocked):
            self._waited = _prefix(self._seconds(a, b) for a, b in self.blocked)
        if event is None or self._backward is None:
            return self._busy[spans]
        assert self._waited is not None
        origin, origin_spans, origin_blocked = self._backward
        waited = self._waited[blocked] - self._waited[origin_blocked]
        return self._busy[origin_spans] + max(0.0, self._seconds(origin, event) - waited)

    def elapsed(self, start: Any, end: Any) -> float:
        """A span's seconds: the events' on the device, else the host's."""
        if not self.device:
            return float(end[1] - start[1])
        return self._seconds(start[0], end[0])

    @staticmethod
    def _seconds(start: Any, end: Any) -> float:
        end.synchronize()
        return max(0.0, float(start.elapsed_time(end)) / 1e3)


def _prefix(values: Iterable[float]) -> list[float]:
    out, total = [0.0], 0.0
    for value in values:
        total += value
        out.append(total)
    return out
