"""Saves counted by where they went, under a lock of their own.

The tier manager counts the saves that take its full path as they land; the
saves that stay where autograd made them (NOTE [ Saves that stay ] in
tiers/manager.py: the filters', ``keep()``'s, a plan's and device_budget's)
and the saves rebuilt in backward take no entry and never its lock, so they
are counted here, under :attr:`SaveCounts.lock`, which the manager's lock
may hold but never waits for the other way round.

Example:
    >>> from tierstore.tiers.counts import SaveCounts
    >>> from tierstore.tiers.entry import TierState
    >>> counts = SaveCounts(TierState(4096, {}, []), 4096)
    >>> counts.stays(1024)  # the first step takes the full path: nothing known yet
    False
    >>> counts.step_ended()  # it saved 1024 bytes, which fit the 4096 free
    >>> counts.stays(1024), counts.pack_tally().counts["device_budget"]
    (True, (1, 1024))
"""

from __future__ import annotations

import threading

from tierstore.stats import PackTally, Placement, Tier
from tierstore.tiers.entry import TierState
from tierstore.tiers.limits import Limits

__all__ = ["QUIET_ROOM", "SaveCounts"]

# NOTE [ Where kept saves count ]
# A save kept as it is stays in the memory of the device that made it: on a
# CPU, in RAM. It has no entry, so the device tier's own table never sees it,
# and a device peak of entries alone would read 0 B beside the bytes a step
# kept. So the device tier's peak counts them: each step's kept saves
# together with the most its entries held in that step (an upper bound:
# autograd frees a kept save at its use, an entry as its node runs), taken as
# the step ends, and for the step under way as stats() is read. A parameter
# (or a buffer, or a view of one) is no activation: the model holds it
# whether or not anything saves it, so it counts in neither; stats() gives
# its count and bytes apart. Counted per step from the totals the hooks keep
# anyway, so a save that stays pays nothing more.

#: NOTE [ Quiet blocks ] in autograd/quiet.py: a block repeats the one before only
#: where that one's bytes fit this many times in the room device_budget leaves.
QUIET_ROOM = 8


class SaveCounts:
    """Saves by where they went: kept as they are (by why), stayed, rebuilt, tallied.

    ``device`` is the manager's device tier: a step's end gives it back its
    budget and reads the room it left for the next step's saves to stay in.
    Under a plan (:attr:`limits` set), the plan's kept saves are counted by
    its runner, not here, and device_budget keeps no save without an entry.
    """

    def __init__(self, device: TierState, device_budget: int) -> None:
        #: NOTE [ Saves that stay ] in tiers/manager.py: never the manager's lock.
        self.lock = threading.Lock()
        self._device = device
        self._device_budget = device_budget
        #: What the manager follows (TierManager.follow); ``None``: no plan.
        self.limits: Limits | None = None
        # Saves kept as they are, by why: [count, bytes] (device_budget: by the
        # budget or the plan, without an entry).
        self.kept_by: dict[Placement, list[int]] = {"device_budget": [0, 0]}
        # What the device tier had free of device_budget as the step began; -1:
        # this step's saves may not stay (its predecessor did not fit, or one
        # of its own saves did not).
        self._room = -1
        self._step_bytes = 0  # offloadable bytes saved this step (the hooks ask stays())
        self._stayed_n = 0  # of them, saves that stayed by device_budget without an entry
        self._stayed = 0  # and their bytes, once one did not: till then, all of _step_bytes
        self.recomputed = 0  # saves rebuilt in backward, and their bytes
        self.recomputed_bytes = 0
        # Saves by where they went (NOTE [ Is it working? ] in tierstore/stats.py).
        self.tally = PackTally()
        # NOTE [ Where kept saves count ]: the kept activations' bytes as the last
        # step ended, and the device tier's peak with them, over the steps ended.
        self._kept_mark = 0
        self._device_peak = 0

    def stays(self, nbytes: int) -> bool:
        """Whether a save of ``nbytes`` stays on the device by device_budget, counted if so.

        NOTE [ Saves that stay ] in tiers/manager.py: only in a step whose
        predecessor fitted, and only while this step's saves so far fit too;
        once one does not, the device tier holds the budget less what stayed.
        """
        # `with`, never acquire() then try: NOTE [ Finalizers and interrupts ] in
        # tiers/release.py.
        with self.lock:
            total = self._step_bytes = self._step_bytes + nbytes
            if total <= self._room:
                self._stayed_n += 1
                return True
            if self._room >= 0:  # the first that does not fit: the rest take the full path
                self._room = -1
                self._stayed = total - nbytes
            return False

    def count_kept(self, nbytes: int, why: Placement = "keep", n: int = 1) -> None:
        """Count ``n`` saves of ``nbytes`` in all the caller left on the device, and why.

        NOTE [ Saves that stay ] in tiers/manager.py.
        """
        with self.lock:  # add_kept's body, inline: every save a filter keeps comes here
            counts = self.kept_by.get(why)
            if counts is None:
                counts = self.kept_by[why] = [0, 0]
            counts[0] += n
            counts[1] += nbytes

    def add_kept(self, why: Placement, n: int, nbytes: int) -> None:
        """Count ``n`` kept saves of ``nbytes`` in all; under :attr:`lock`."""
        counts = self.kept_by.get(why)
        if counts is None:
            counts = self.kept_by[why] = [0, 0]
        counts[0] += n
        counts[1] += nbytes

    def stayed_as_before(self, tally: PackTally) -> bool:
        """A quiet block's saves, counted as those of the block it repeats (``tally``).

        NOTE [ Quiet blocks ] in autograd/quiet.py: only where device_budget's saves may
        stay this step (NOTE [ Saves that stay ] in tiers/manager.py) and the
        repeated block's fit :data:`QUIET_ROOM` times over in the room left;
        else ``False``, and nothing is counted.
        """
        n, nbytes = tally.counts.get("device_budget", (0, 0))
        with self.lock:
            if self.limits is not None or self._step_bytes + QUIET_ROOM * nbytes > self._room:
                return False  # a room of -1: this step's saves may not stay
            self._step_bytes += nbytes
            self._stayed_n += n
            for why, (k, b) in tally.counts.items():
                if why != "device_budget":
                    counts = self.kept_by.setdefault(why, [0, 0])  # type: ignore[arg-type]
                    counts[0] += k
                    counts[1] += b
            return True

    def stayed_now(self) -> tuple[int, int]:
        """The saves that stayed by device_budget this step, and their bytes; under :attr:`lock`."""
        return self._stayed_n, self._step_bytes if self._room >= 0 else self._stayed

    def kept_now(self) -> tuple[int, int]:
        """Saves kept this step without an entry (not yet in :attr:`kept_by`); under the lock."""
        if self.limits is not None:
            return self.limits.kept()
        return self.stayed_now()

    def step_ended(self) -> None:
        """A backward ran and the next step begins.

        NOTE [ Saves that stay ] in tiers/manager.py: the room its saves may stay in.
        """
        with self.lock:
            if self.limits is not None:
                return
            n, nbytes = self.stayed_now()
            self.add_kept("device_budget", n, nbytes)
            device = self._device
            device.budget = self._device_budget
            room = device.budget - device.bytes  # a graph kept across steps holds some
            self._room = room if 0 < self._step_bytes <= room else -1
            self._step_bytes = self._stayed_n = self._stayed = 0
            self.device_step_ended()

    def _kept_activations(self) -> int:
        """Bytes of saves kept as they are, but parameters, so far; under :attr:`lock`."""
        kept = sum(b for why, (_, b) in self.kept_by.items() if why != "parameter")
        return kept + self.kept_now()[1]

    def device_step_ended(self) -> None:
        """The step's kept saves in the device's peak; under :attr:`lock`.

        NOTE [ Where kept saves count ].

        Called once the step's own counts are in :attr:`kept_by`.
        """
        device = self._device
        kept = self._kept_activations()
        self._device_peak = max(self._device_peak, device.step_peak + kept - self._kept_mark)
        self._kept_mark = kept
        device.step_peak = device.bytes

    def device_peak(self) -> int:
        """The device tier's peak, kept saves counted (NOTE [ Where kept saves count ])."""
        with self.lock:
            device = self._device
            now = device.step_peak + self._kept_activations() - self._kept_mark
            return max(device.peak, self._device_peak, now)

    def parameters(self) -> tuple[int, int]:
        """Saves that were parameters (or buffers, or views of them), and their bytes."""
        with self.lock:
            n, nbytes = self.kept_by.get("parameter", (0, 0))
            return n, nbytes

    def step_failed(self) -> None:
        """The step under way raised: its saves counted; none of the next stays without an entry.

        NOTE [ A step that raised ] in tierstore/tier_store.py: the next step
        takes the full path, as one after a step that did not fit does.
        """
        with self.lock:
            if self.limits is None:
                n, nbytes = self.stayed_now()
                self.add_kept("device_budget", n, nbytes)
                self._device.budget = self._device_budget
            self._room = -1
            self._step_bytes = self._stayed_n = self._stayed = 0
            if self.limits is None:
                self.device_step_ended()

    def count_recomputed(self, nbytes: int, n: int = 1) -> None:
        """Count ``n`` saved tensors, ``nbytes`` in all, the caller will rebuild in backward."""
        with self.lock:
            self.recomputed += n
            self.recomputed_bytes += nbytes
            self.tally.add("recomputed", nbytes, n)

    def tallied(self, tier: Tier | None, nbytes: int) -> None:
        """Count a save by where it landed: within device_budget, or below the device."""
        with self.lock:
            self.tally.add("device_budget" if tier == "device" else "offloaded", nbytes)

    def pack_tally(self) -> PackTally:
        """A snapshot of the saves by where they went (NOTE [ Is it working? ])."""
        with self.lock:
            tally = self.tally.copy()
            now = self.kept_now()
            for why, (n, nbytes) in self.kept_by.items():
                live = now if why == "device_budget" else (0, 0)
                if n + live[0]:
                    had_n, had_bytes = tally.counts.get(why, (0, 0))
                    tally.counts[why] = (had_n + n + live[0], had_bytes + nbytes + live[1])
            return tally

    def kept_totals(self) -> tuple[int, int]:
        """Saves kept as they are, whatever the reason, and their bytes."""
        with self.lock:
            n, nbytes = self.kept_now()
            return (
                n + sum(n for n, _ in self.kept_by.values()),
                nbytes + sum(b for _, b in self.kept_by.values()),
            )
