"""What a store reports: bytes per tier now and at peak, and what moved.

Example:
    >>> import tierstore
    >>> with tierstore.TierStore(tierstore.TierConfig(disk_budget=0)) as store:
    ...     s = store.stats()
    >>> s.tiers["host"].bytes, s.packed
    (0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tierstore.config import human_bytes

__all__ = ["TIERS", "PackTally", "Placement", "Stats", "Tier", "TierStats", "step_summary"]

Tier = Literal["device", "host", "disk"]
#: The tiers, fastest first.
TIERS: tuple[Tier, ...] = ("device", "host", "disk")


@dataclass(frozen=True)
class TierStats:
    """One tier's counters.

    ``bytes`` and ``peak_bytes`` count what the tier holds now and at most
    since the store opened: span bytes on the device and host, footprint
    bytes (after compression and alignment) on disk. ``bytes_written`` and
    ``bytes_read`` are totals since the store opened (subtract two snapshots
    for one step), and mean on each tier:

    * ``device``: ``bytes_written`` is the bytes of saved tensors placed on
      the tier (within ``device_budget``): left where autograd made them,
      nothing copied. ``bytes_read`` stays 0: backward gets them as they are.
    * ``host``: bytes copied into host memory (off the accelerator, or into
      the pool), and copied back out for backward.
    * ``disk``: footprint bytes written to disk, and read back.

    ``str(stats)`` words them so (NOTE [ Counter names ]).

    Example:
        >>> TierStats(bytes=0, peak_bytes=4096, entries=0, bytes_written=4096, bytes_read=4096)
        TierStats(bytes=0, peak_bytes=4096, entries=0, bytes_written=4096, bytes_read=4096)
    """

    bytes: int
    peak_bytes: int
    entries: int
    bytes_written: int
    bytes_read: int


@dataclass(frozen=True)
class Stats:
    """A snapshot of a store's counters (see :meth:`tierstore.TierStore.stats`).

    Counts, seconds and moved bytes are totals since the store opened:
    subtract an earlier snapshot for one step, as :func:`step_summary` does.
    The attributes that end in "now" below are the state at the snapshot.

    Attributes:
        tiers: per tier ``"device"``, ``"host"``, ``"disk"``.
        packed: saved tensors handed to the store (offloaded or not).
        deduplicated: saves that reused an entry already held.
        kept: saves left on the device as they were (parameters, small
            tensors, ``tierstore.keep()``, ...).
        kept_bytes: bytes of those kept saves.
        parameters: of the kept saves, those that were parameters or buffers
            (or views of them, as ``nn.Linear`` saves ``weight.t()``): the
            model holds them anyway, so they count in no tier.
        parameter_bytes: bytes of those. The rest of ``kept_bytes`` are
            activations kept where they were made: they count in the device
            tier's peak (on a CPU, in RAM; NOTE [ Where kept saves count ] in
            ``tierstore/tiers/counts.py``).
        prefetch_hits: entries whose bytes were there when backward asked:
            read ahead from disk and landed (or still in memory, their write
            not yet done), and on CUDA, host entries whose copy back to the
            device had completed (NOTE [ Hits ] in ``tierstore/tiers/readahead.py``).
        prefetch_misses: entries backward had to read or copy on demand, or
            that were read or copied ahead but had not landed yet.
        bytes_prefetched: bytes read or copied ahead of use.
        unpack_wait_s: seconds backward waited for disk reads, in all the
            backward passes since the store opened (a CUDA copy is waited
            for by the stream, not the host: not counted).
        pack_wait_s: seconds forward waited for the write queue
            (``write_queue_bytes``) to drain, or on CUDA for the oldest copy
            off the device, in all forwards since the store opened.
        host_pool_bytes: host memory the pool holds now (pinned on CUDA; 0
            on CPU, where the host tier needs no copy).
        host_pool_misses: copies off the device that found no room in the
            pool, each refused with a TierFullError that names host_budget
            (memory outside the pool would count against no budget).
        disk_io: how the disk tier moves bytes: ``"file: O_DIRECT"``,
            ``"file: buffered"`` (the filesystem refused O_DIRECT) or
            ``"lmdb"``; ``None`` until the disk tier is first used. Bytes to
            and from a GPU pass through pinned host memory (GPUDirect
            Storage is not used).
        failed_writes: disk writes that failed. None loses data: a live
            entry stays in host memory, and one released before its write
            ended needs nothing (NOTE [ Failed writes ] in
            ``tierstore/tiers/writebehind.py``).
        prefetch_window_bytes: bytes backward may read ahead now: the
            window learnt from stalls, at most ``prefetch_bytes``
            (NOTE [ In-flight sizing ] in ``tierstore/tiers/sizing.py``).
        prefetch_stalls: unpacks whose read or copy back had not landed
            (other than the first of a backward and the reads it sent out),
            each of which grew the window.
        write_queue_limit_bytes: bytes forward may queue for the disk now,
            learnt the same way, at most ``write_queue_bytes``.
        pack_waits: saves that found the queue over its limit and waited,
            each of which grew it.
        buffer_bytes_in_use: on a CPU, bytes of tierstore's own buffers
            (disk reads not yet dropped by autograd, write staging) out of
            its pool now.
        buffer_misses: buffers that found the pool full and came from the
            heap.
        recomputed: saves backward rebuilds instead of reading back
            (``recompute="cheap"`` or a policy; NOTE [ Recompute ] in
            ``tierstore/autograd/recompute.py``): never stored, never moved.
        recomputed_bytes: the bytes those saves would have been stored in.
        restrided_views: saved views that come back with dense strides,
            not their own: thin views whose own strides reach across more
            than 4 times their elements' storage (NOTE [ Spans ] in
            ``tierstore/codec.py``); the first is warned of. Every other
            saved tensor comes back with the shape and strides it was
            saved with.
        steps: training steps the store has run (NOTE [ Step log ] says where
            one ends).
        planned_steps: of those, the steps that ran under an
            ``activation_budget`` plan: made for their shape, or carried over
            to it from another (NOTE [ Plans across shapes ] in
            ``tierstore/planning/carry.py``).

    Example:
        >>> import torch, tierstore
        >>> store = tierstore.TierStore(tierstore.TierConfig(
        ...     device_budget=0, host_budget="1GiB", disk_budget=0, min_offload_bytes=0))
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with store.offload():
        ...     y = x.exp()
        >>> store.stats().tiers["host"].bytes
        262144
        >>> y.sum().backward(); store.close()
    """

    tiers: Mapping[Tier, TierStats]
    packed: int
    deduplicated: int
    kept: int
    kept_bytes: int
    parameters: int = 0
    parameter_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    bytes_prefetched: int = 0
    unpack_wait_s: float = 0.0
    pack_wait_s: float = 0.0
    host_pool_bytes: int = 0
    host_pool_misses: int = 0
    disk_io: str | None = None
    failed_writes: int = 0
    prefetch_window_bytes: int = 0
    prefetch_stalls: int = 0
    write_queue_limit_bytes: int = 0
    pack_waits: int = 0
    buffer_bytes_in_use: int = 0
    buffer_misses: int = 0
    recomputed: int = 0
    recomputed_bytes: int = 0
    restrided_views: int = 0
    steps: int = 0
    planned_steps: int = 0

    @property
    def prefetch_hit_rate(self) -> float | None:
        """Hits over unpacks that needed a read or copy, or ``None`` before any."""
        total = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / total if total else None

    def __str__(self) -> str:
        """Per tier, then the totals; each figure says whether it is now, peak or since open.

        NOTE [ Counter names ]: the fields keep one name on every tier, the
        text says what moved: nothing is copied to the device tier, so its
        bytes are "placed", the host's "copied in" and "copied back", the
        disk's "written" and "read back".
        """
        rows = [
            f"{name:>6}: {human_bytes(t.bytes):>10} now, {human_bytes(t.peak_bytes):>10} peak, "
            f"{t.entries} entries; since the store opened: {_moved(name, t)}"
            for name, t in self.tiers.items()
        ]
        rows.append(
            f"since the store opened: packed {self.packed}, deduplicated {self.deduplicated}, "
            f"kept {self.kept} ({human_bytes(self.kept_bytes)}; "
            f"{self.parameters} of them parameters, {human_bytes(self.parameter_bytes)})"
            + (
                f", recomputed {self.recomputed} ({human_bytes(self.recomputed_bytes)})"
                if self.recomputed
                else ""
            )
        )
        rate = self.prefetch_hit_rate
        rows.append(
            f"since the store opened: prefetch {self.prefetch_hits} hits, "
            f"{self.prefetch_misses} misses"
            + (f" ({rate:.0%})" if rate is not None else "")
            + f"; backward waited {self.unpack_wait_s:.3f} s for reads"
            + f", forward {self.pack_wait_s:.3f} s for the write queue"
        )
        if self.disk_io is not None:
            rows.append(f"disk I/O: {self.disk_io}")
        if self.host_pool_bytes or self.host_pool_misses:
            rows.append(
                f"host pool {human_bytes(self.host_pool_bytes)} now, "
                f"{self.host_pool_misses} copies it had no room for since the store opened"
            )
        if self.failed_writes:
            rows.append(f"{self.failed_writes} disk writes failed (no saved tensor lost)")
        if self.restrided_views:
            rows.append(
                f"{self.restrided_views} saved views came back with dense strides, not their own"
            )
        return "\n".join(rows)


def _moved(tier: str, t: TierStats) -> str:
    """What ``bytes_written`` and ``bytes_read`` mean on ``tier`` (NOTE [ Counter names ])."""
    written, read = human_bytes(t.bytes_written), human_bytes(t.bytes_read)
    if tier == "device":
        return f"{written} placed (left where autograd made them, not copied)"
    if tier == "host":
        return f"{written} copied in, {read} copied back"
    return f"{written} written, {read} read back"


#: Where a saved tensor went: ``"offloaded"`` (below the device, at once or
#: by demotion), or why it stayed on the device.
Placement = Literal[
    "offloaded",
    "recomputed",
    "device_budget",
    "min_offload_bytes",
    "parameter",
    "keep",
    "layout",
]

# NOTE [ Is it working? ]
# A user who wraps a forward in offload() and sees no memory go down needs to
# know why without reading the code. The tier manager tallies every save by
# where it went (PackTally); when a block saved tensors and nothing has left
# the device since the store opened, the store warns once, in numbers, with
# the setting that would change it. Once per store: a loop that runs the same
# block every step would otherwise say the same thing every step.
# Per placement: what it was (one tensor, several), and the setting that would move it.
_WHY: dict[str, tuple[str, str, str | None]] = {
    "device_budget": (
        "within device_budget={device_budget}",
        "within device_budget={device_budget}",
        "lower device_budget",
    ),
    "min_offload_bytes": (
        "under min_offload_bytes={min_offload_bytes}",
        "under min_offload_bytes={min_offload_bytes}",
        "lower min_offload_bytes",
    ),
    "keep": (
        "saved inside tierstore.keep() or keep_module() (tier='device')",
        "saved inside tierstore.keep() or keep_module() (tier='device')",
        "take keep() or keep_module() off them",
    ),
    "parameter": (
        "a parameter or buffer (or a view of one)",
        "parameters or buffers (or views of them)",
        None,
    ),
    "layout": (
        "not a plain strided tensor (sparse, nested, a subclass, meta)",
        "not plain strided tensors (sparse, nested, subclasses, meta)",
        None,
    ),
}
_ENV = {"lower device_budget": "DEVICE_BUDGET", "lower min_offload_bytes": "MIN_OFFLOAD_BYTES"}


class PackTally:
    """Saved tensors counted by where they went (:data:`Placement`): how many, how many bytes.

    See NOTE [ Is it working? ].

    Example:
        >>> tally = PackTally()
        >>> tally.add("min_offload_bytes", 1024); tally.add("min_offload_bytes", 2048)
        >>> tally.counts["min_offload_bytes"], tally.moved
        ((2, 3072), False)
        >>> print(tally.nothing_moved("this offload() block", 0, 64 << 10))
        tierstore: nothing left the device in this offload() block: all 2 saved tensors \
(3.0 KiB) were under min_offload_bytes=64.0 KiB; to offload them, lower min_offload_bytes \
(TIERSTORE_MIN_OFFLOAD_BYTES)
    """

    def __init__(self, counts: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.counts: dict[str, tuple[int, int]] = dict(counts or {})

    def add(self, placement: Placement, nbytes: int, n: int = 1) -> None:
        """Count ``n`` saves of ``nbytes`` bytes in all."""
        had, b = self.counts.get(placement, (0, 0))
        self.counts[placement] = (had + n, b + nbytes)

    @property
    def moved(self) -> bool:
        """Whether any save left the device."""
        return "offloaded" in self.counts or "recomputed" in self.counts

    def copy(self) -> PackTally:
        """An independent snapshot."""
        return PackTally(self.counts)

    def since(self, earlier: PackTally) -> PackTally:
        """The saves counted after ``earlier`` was taken."""
        return PackTally(
            {
                k: (n - earlier.counts.get(k, (0, 0))[0], b - earlier.counts.get(k, (0, 0))[1])
                for k, (n, b) in self.counts.items()
                if n != earlier.counts.get(k, (0, 0))[0]
            }
        )

    def nothing_moved(self, where: str, device_budget: int, min_offload_bytes: int) -> str | None:
        """The warning for saves none of which left the device, or ``None``.

        ``None`` when nothing was saved or something moved.
        """
        if self.moved or not self.counts:
            return None
        values = {
            "device_budget": human_bytes(device_budget),
            "min_offload_bytes": human_bytes(min_offload_bytes),
        }
        rows = sorted(self.counts.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
        total_n = sum(n for n, _ in self.counts.values())
        total_b = sum(b for _, b in self.counts.values())

        def what(placement: str, n: int) -> str:
            one, several, _ = _WHY[placement]
            return (one if n == 1 else several).format(**values)

        them = "them" if total_n > 1 else "it"
        if total_n == 1:
            why = f"the saved tensor ({human_bytes(total_b)}) was {what(rows[0][0], 1)}"
        elif len(rows) == 1:
            why = (
                f"all {total_n} saved tensors ({human_bytes(total_b)}) were "
                f"{what(rows[0][0], total_n)}"
            )
        else:
            parts = [
                f"{n} ({human_bytes(b)}) {'was' if n == 1 else 'were'} {what(k, n)}"
                for k, (n, b) in rows
            ]
            why = (
                f"of {total_n} saved tensors ({human_bytes(total_b)}), "
                + ", ".join(parts[:-1])
                + f" and {parts[-1]}"
            )
        fixes = [fix for k, _ in rows if (fix := _WHY[k][2]) is not None]
        if fixes:
            hint = " or ".join(
                f"{fix} (TIERSTORE_{_ENV[fix]})" if fix in _ENV else fix for fix in fixes
            )
            hint = f"to offload {them}, {hint}"
        else:
            hint = (
                "tierstore never offloads these; run the layers whose activations should "
                "leave the device inside the block"
            )
        return f"tierstore: nothing left the device in {where}: {why}; {hint}"


def step_summary(step: int, now: Stats, before: Stats | None, kind: str = "") -> str:
    """One line on a training step: bytes per tier, what moved, prefetch hits and waits.

    ``before`` is the snapshot at the end of the previous step (``None``: the
    first step); moved bytes, hits and waits are this step's, peaks are the
    store's. ``kind``: what the step was under ``activation_budget``
    (``"profiled"``, ``"planned"``, ``"planned, carried over"``, ``"safe
    placement"``), after its number. The saves it kept on the device are activations, which the
    device's peak counts; the parameters it saved, which the model holds
    anyway, are counted apart (NOTE [ Where kept saves count ] in
    ``tierstore/tiers/counts.py``).

    Example:
        >>> tier = TierStats(bytes=0, peak_bytes=4096, entries=0, bytes_written=4096,
        ...                  bytes_read=4096)
        >>> empty = TierStats(0, 0, 0, 0, 0)
        >>> now = Stats(tiers={"device": empty, "host": empty, "disk": tier}, packed=3,
        ...             deduplicated=0, kept=2, kept_bytes=64, parameters=2, parameter_bytes=64,
        ...             prefetch_hits=1)
        >>> print(step_summary(1, now, None))
        tierstore: step 1: saved 3 (0 kept on the device, 0 B; 2 parameters); peak device 0 B, \
host 0 B, disk 4.0 KiB; moved to host 0 B, to disk 4.0 KiB, back 4.0 KiB; prefetch 1 hits, \
0 misses (100%); waited 0.000 s in backward, 0.000 s in forward
    """
    zero = Stats(tiers={}, packed=0, deduplicated=0, kept=0, kept_bytes=0)
    b = before or zero

    def moved(tier: Tier, attr: str) -> int:
        was = b.tiers.get(tier)
        return int(getattr(now.tiers[tier], attr) - (getattr(was, attr) if was else 0))

    hits = now.prefetch_hits - b.prefetch_hits
    misses = now.prefetch_misses - b.prefetch_misses
    rate = f" ({hits / (hits + misses):.0%})" if hits + misses else ""
    back = sum(moved(t, "bytes_read") for t in ("host", "disk"))
    peaks = ", ".join(f"{t} {human_bytes(now.tiers[t].peak_bytes)}" for t in TIERS)
    kept = now.kept - now.parameters - b.kept + b.parameters
    kept_bytes = now.kept_bytes - now.parameter_bytes - b.kept_bytes + b.parameter_bytes
    parameters = now.parameters - b.parameters
    return (
        f"tierstore: step {step}{f' ({kind})' if kind else ''}: saved {now.packed - b.packed} "
        f"({kept} kept on the device, {human_bytes(kept_bytes)}; "
        f"{parameters} {'parameter' if parameters == 1 else 'parameters'}); "
        f"peak {peaks}; moved to host {human_bytes(moved('host', 'bytes_written'))}, "
        f"to disk {human_bytes(moved('disk', 'bytes_written'))}, back {human_bytes(back)}; "
        f"prefetch {hits} hits, {misses} misses{rate}; "
        f"waited {now.unpack_wait_s - b.unpack_wait_s:.3f} s in backward, "
        f"{now.pack_wait_s - b.pack_wait_s:.3f} s in forward"
    )
