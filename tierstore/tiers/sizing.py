"""How many bytes may be in flight: a limit that grows after stalls and shrinks while idle.

Read-ahead and write-behind each hold one (NOTE [ In-flight sizing ]).

Example:
    >>> from tierstore.tiers.sizing import InFlightLimit
    >>> limit = InFlightLimit(cap_bytes=100, start_bytes=10, min_bytes=4)
    >>> limit.stalled(); limit.bytes
    20
    >>> limit.step_started(); limit.step_started(); limit.bytes  # one step stalled, one did not
    15
"""

from __future__ import annotations

__all__ = ["InFlightLimit"]

# NOTE [ In-flight sizing ]
# Bytes in flight are memory: a read-ahead window and a write queue of a
# fixed size (256 MiB each) can keep a large share of a model's activations
# resident, whatever the disk's speed. Each is sized instead by what the
# step needs, learnt as
# the store runs, with the setting (prefetch_bytes, write_queue_bytes) as its
# upper bound:
#   * it starts small (start_bytes);
#   * a stall (backward waiting for a read, forward waiting for the queue)
#     doubles it at once, up to the bound: the next bytes go out earlier;
#   * a step with no stall shrinks it by a quarter for the next step, down
#     to min_bytes: a limit grown for a slow phase gives the memory back once
#     the disk keeps up.
# So it settles where the step just stops waiting: growing within a step,
# shrinking between steps, at the cost of an occasional stall while it
# probes downwards. Counted in stats() (prefetch_window_bytes,
# write_queue_limit_bytes, prefetch_stalls, pack_waits).
# Except a planned step's reads ahead: the plan sized its window (its search
# tries several) and counted it in its peak, and reads issued later than it
# assumed come back late, which it did not predict; on a GPU each probe
# downwards is a wait of the compute stream. So backward in a planned step
# reads ahead by its plan's window exactly (hold_to(..., exact=True)), and
# the learnt limit goes on learning underneath, for the steps that follow no
# plan. A plan's backward held to a learnt limit below its window would
# read ahead in small steps, doubling only at each late read, far short of
# the window it was priced with, and run over its prediction.


class InFlightLimit:
    """A byte limit sized by stalls (NOTE [ In-flight sizing ]).

    Example:
        >>> from tierstore.tiers.sizing import InFlightLimit
        >>> InFlightLimit(cap_bytes=0, start_bytes=16, min_bytes=4).bytes  # a bound of 0 wins
        0
    """

    __slots__ = ("_exact", "_held_to", "_min_bytes", "_stalled", "bytes", "cap_bytes", "stalls")

    def __init__(self, cap_bytes: int, start_bytes: int, min_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._min_bytes = min_bytes
        self.bytes = min(start_bytes, cap_bytes)
        self.stalls = 0
        self._stalled = False
        self._held_to: int | None = None
        self._exact = False

    @property
    def _floor(self) -> int:
        """The least the limit shrinks to: ``min_bytes``, or the bound when below it."""
        return min(self._min_bytes, self.cap_bytes)

    @property
    def allowed(self) -> int:
        """The bytes that may be in flight now: the learnt limit, or a hold below it (or at it)."""
        held = self._held_to
        if held is None:
            return self.bytes
        return min(held, self.cap_bytes) if self._exact else min(self.bytes, held)

    def hold_to(self, nbytes: int | None, *, exact: bool = False) -> None:
        """Hold the limit at ``nbytes`` for now (``None``: let go), learning nothing from it.

        A bound of the moment, such as a fractional activation_budget's share
        of the bytes a step has saved so far: unlike :meth:`bound` it leaves
        the learnt limit and its floor as they are. ``exact``: the limit is
        ``nbytes`` (within the bound) even where the learnt one is lower: a
        plan's window, which the plan sized and counted in its peak (NOTE [
        In-flight sizing ]).

        Example:
            >>> from tierstore.tiers.sizing import InFlightLimit
            >>> limit = InFlightLimit(cap_bytes=100, start_bytes=40, min_bytes=4)
            >>> limit.hold_to(10); limit.allowed, limit.bytes
            (10, 40)
            >>> limit.hold_to(60, exact=True); limit.allowed, limit.bytes
            (60, 40)
            >>> limit.hold_to(None); limit.allowed
            40
        """
        self._held_to = nbytes
        self._exact = exact

    def stalled(self) -> None:
        """Something waited for bytes in flight: double the limit, up to its bound."""
        self.stalls += 1
        self._stalled = True
        self.bytes = min(self.cap_bytes, max(2 * self.bytes, self._floor))

    def bound(self, cap_bytes: int) -> None:
        """A new upper bound (a plan's window); the limit follows it down, its floor both ways.

        A bound of 0 (a synchronous plan) leaves the limit at 0 until a
        larger bound: the next step then starts it at the floor again.

        Example:
            >>> from tierstore.tiers.sizing import InFlightLimit
            >>> limit = InFlightLimit(cap_bytes=100, start_bytes=40, min_bytes=4)
            >>> limit.bound(0); limit.bytes
            0
            >>> limit.bound(100); limit.step_started(); limit.bytes
            4
        """
        self.cap_bytes = cap_bytes
        self.bytes = min(self.bytes, cap_bytes)

    def step_started(self) -> None:
        """A new step: shrink by a quarter if the last one never stalled."""
        if not self._stalled:
            self.bytes = max(self._floor, self.bytes * 3 // 4)
        self._stalled = False
