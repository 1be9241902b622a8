"""The memory probe: how much memory there is, and how much of it is in use.

``activation_budget="auto"`` asks, at each step's start, what the memory
can still give the step (NOTE [ The room a step has ] in
tierstore/planning/room.py). A :class:`MemoryProbe` answers in bytes:
:class:`HostMemory` for saves in RAM (the process's cgroup, else what the
kernel says is available), :class:`CudaMemory` for saves on a GPU. Tests
pass their own probe: any object with these members will do.

Nothing here runs at import: the files are read, and CUDA asked, only when
a probe is read.

Example:
    >>> from tierstore.tiers.memory import HostMemory
    >>> reading = HostMemory().read()
    >>> reading.capacity > reading.in_use > 0
    True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

__all__ = [
    "UNLIMITED",
    "CudaMemory",
    "HostMemory",
    "MemoryProbe",
    "MemoryReading",
    "filesystem_type",
]

# NOTE [ Reading a cgroup ]
# A container's memory limit is its cgroup's, found through /proc/self/cgroup:
# on cgroup v2 the line "0::<path>" under the unified mount (memory.max,
# memory.current); on v1 the line naming the memory controller under its own
# mount (memory.limit_in_bytes, memory.usage_in_bytes). Inside a cgroup
# namespace the path is "/" and the mount is the container's own cgroup; a
# path that does not exist under the mount (the host's name for it) is read
# as the mount's root. A limit may sit on any ancestor (a pod's limit above
# its container's), so every level from the process's up to the mount is
# read, and the level with the least room (limit less usage) is the one the
# process lives under. Usage leaves out the clean page cache (memory.stat's
# active_file and inactive_file less file_dirty and file_writeback; v1's
# total_ keys), which the kernel reclaims at the limit before it kills
# anything. The kubelet's working set leaves out only the inactive part,
# but a disk tier's spill file read back every step keeps its pages active:
# counted, they would grow with the file and shrink the budget each step.
# Dirty pages and a tmpfs spill (shared memory, not file cache) are counted:
# neither can be dropped. A v1 limit of UNLIMITED or more (the kernel's "no limit",
# 9223372036854771712 once rounded to pages) and v2's "max" mean no limit.
# With none, the kernel's MemAvailable is the room: capacity is MemAvailable
# plus what the process holds (its resident set), and in use is that
# resident set. Whichever of the two leaves less room is the one read.

# NOTE [ Ranks in one container ]
# torchrun starts LOCAL_WORLD_SIZE ranks on a machine, and in a container
# they share one cgroup, whose usage holds every rank's steps. Each rank
# claims only its share: capacity is the limit divided by LOCAL_WORLD_SIZE,
# and in use is the rank's own resident set, not the cgroup's usage (which
# counts the other ranks' shares again). Without a limit each rank's capacity
# is its resident set plus MemAvailable divided by LOCAL_WORLD_SIZE. What
# the cgroup holds beside the ranks (page cache, the planning processes) is
# left to memory_margin.

#: A v1 limit at or above this is the kernel's "no limit".
UNLIMITED = 1 << 62


class MemoryReading(NamedTuple):
    """One reading of the memory a step's saves live in.

    Attributes:
        capacity: the bytes this process may use in all (its share, under
            ``LOCAL_WORLD_SIZE``; NOTE [ Ranks in one container ]).
        in_use: the bytes in use now that the step cannot reuse.
        source: where the capacity came from, for messages.
        share: how many ranks share the capacity (1: none).
    """

    capacity: int
    in_use: int
    source: str
    share: int = 1


class MemoryProbe(Protocol):
    """What ``activation_budget="auto"`` reads the memory through.

    Example:
        >>> from tierstore.tiers.memory import HostMemory, MemoryProbe
        >>> probe: MemoryProbe = HostMemory()
        >>> probe.usage() > 0
        True
    """

    def read(self) -> MemoryReading:
        """The capacity and what is in use now."""

    def usage(self) -> int:
        """This process's own usage now: the figure a step's working memory is measured by."""

    def close(self) -> None:
        """Release what reading took; idempotent."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    """A cgroup's memory.stat; empty where the file is missing."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[name] = int(value)
    except OSError:
        pass
    return out


#: memory.stat's keys for the clean page cache: (file pages, dirty, under writeback).
_V1_CACHE = (("total_active_file", "total_inactive_file"), "total_dirty", "total_writeback")
_V2_CACHE = (("active_file", "inactive_file"), "file_dirty", "file_writeback")


def _reclaimable(stat: dict[str, int], version: str) -> int:
    """The clean page cache of a cgroup: what its memory.stat says the kernel can drop."""
    files, dirty, writeback = _V2_CACHE if version == "v2" else _V1_CACHE
    cache = sum(stat.get(key, 0) for key in files)
    return max(0, cache - stat.get(dirty, 0) - stat.get(writeback, 0))


class _Level(NamedTuple):
    """One cgroup level with a limit."""

    path: Path
    limit: int
    usage: int


class HostMemory:
    """The RAM a CPU process may use: its cgroup's limit, else what is available.

    NOTE [ Reading a cgroup ]; NOTE [ Ranks in one container ].

    Args:
        root: the filesystem root the ``/proc`` and ``/sys`` files are read
            under (tests point it at a tree of their own).
        local_world_size: ranks sharing the machine; ``None`` reads
            ``LOCAL_WORLD_SIZE`` (1 when unset).

    Example:
        >>> from tierstore.tiers.memory import HostMemory
        >>> HostMemory(local_world_size=2).read().share
        2
    """

    def __init__(self, root: str | os.PathLike[str] = "/", local_world_size: int | None = None):
        self._root = Path(root)
        if local_world_size is None:
            try:
                local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            except ValueError:
                local_world_size = 1
        self._share = max(1, local_world_size)
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._cgroup: tuple[str, list[Path]] | None = None  # found on first read

    def usage(self) -> int:
        """This process's resident set, bytes (``/proc/self/statm``)."""
        try:
            fields = (self._root / "proc/self/statm").read_text().split()
            return int(fields[1]) * self._page
        except (OSError, ValueError, IndexError):
            return 0

    def available(self) -> int | None:
        """``MemAvailable`` from ``/proc/meminfo``, bytes."""
        try:
            for line in (self._root / "proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def read(self) -> MemoryReading:
        """The tighter of the cgroup's room and the kernel's (NOTE [ Reading a cgroup ])."""
        rss = self.usage()
        share = self._share
        available = self.available()
        best: MemoryReading | None = None
        if available is not None:
            best = MemoryReading(rss + available // share, rss, "MemAvailable", share)
        level = self.tightest()
        if level is not None:
            if share > 1:  # NOTE [ Ranks in one container ]
                cgroup = MemoryReading(level.limit // share, rss, f"cgroup {level.path}", share)
            else:
                cgroup = MemoryReading(level.limit, level.usage, f"cgroup {level.path}", share)
            if best is None or cgroup.capacity - cgroup.in_use <= best.capacity - best.in_use:
                best = cgroup
        if best is None:  # nothing readable: what the process holds, and no more
            best = MemoryReading(rss, rss, "nothing readable", share)
        return best

    def tightest(self) -> _Level | None:
        """The cgroup level with a limit and the least room over it; ``None``: no limit."""
        found = self._find()
        if found is None:
            return None
        version, levels = found
        tightest: _Level | None = None
        for path in levels:
            if version == "v2":
                limit = _read_int(path / "memory.max")
                usage = _read_int(path / "memory.current")
            else:
                limit = _read_int(path / "memory.limit_in_bytes")
                usage = _read_int(path / "memory.usage_in_bytes")
            if limit is None or limit >= UNLIMITED or usage is None:
                continue
            cache = _reclaimable(_stat(path / "memory.stat"), version)
            level = _Level(path, limit, max(0, usage - cache))
            if tightest is None or level.limit - level.usage < tightest.limit - tightest.usage:
                tightest = level
        return tightest

    def _find(self) -> tuple[str, list[Path]] | None:
        """The cgroup version and its levels, the process's first, up to the mount."""
        if self._cgroup is not None:
            return self._cgroup
        try:
            lines = (self._root / "proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        v1 = v2 = None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                v1 = path
            elif controllers == "":
                v2 = path
        sys_cgroup = self._root / "sys/fs/cgroup"
        if v1 is not None and (sys_cgroup / "memory").is_dir():
            found = ("v1", _levels(sys_cgroup / "memory", v1))
        elif v2 is not None:
            mount = sys_cgroup if (sys_cgroup / "cgroup.controllers").exists() else None
            if mount is None and (sys_cgroup / "unified/cgroup.controllers").exists():
                mount = sys_cgroup / "unified"
            if mount is None:
                return None
            found = ("v2", _levels(mount, v2))
        else:
            return None
        self._cgroup = found
        return found

    def close(self) -> None:
        """Nothing held between reads. Idempotent."""


def _levels(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each parent up to ``mount``; ``mount`` alone if it is not there."""
    leaf = mount / path.strip("/") if path.strip("/") else mount
    if not leaf.is_dir():
        return [mount]
    levels = [leaf]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


class CudaMemory:
    """A GPU's memory as this process may use it.

    Capacity is the driver's free memory plus what this process's caching
    allocator holds already (``torch.cuda.mem_get_info`` and
    ``memory_reserved``), capped by ``set_per_process_memory_fraction``
    of the total. In use is what is allocated: the allocator's cached free
    blocks are the step's to reuse.

    Args:
        device: the CUDA device index.
        runtime: what the figures are read from: ``torch.cuda`` (``None``), or
            an object with its ``mem_get_info``, ``memory_reserved``,
            ``memory_allocated`` and, where the torch has it,
            ``get_per_process_memory_fraction`` (a test's fake device).

    Example:
        >>> from tierstore.tiers.memory import CudaMemory
        >>> probe = CudaMemory(0)  # nothing asked of CUDA until read
        >>> probe.close()
    """

    def __init__(self, device: int = 0, runtime: Any = None) -> None:
        self._device = device
        self._runtime = runtime

    def read(self) -> MemoryReading:
        """Capacity and allocated bytes of the device, now."""
        device, cuda = self._device, self._cuda()
        free, total = cuda.mem_get_info(device)
        reserved = cuda.memory_reserved(device)
        fraction_of = getattr(cuda, "get_per_process_memory_fraction", None)
        fraction = float(fraction_of(device)) if fraction_of is not None else 1.0
        capacity = min(free + reserved, int(fraction * total))
        source = f"cuda:{device}" + (f" (fraction {fraction:g})" if fraction < 1.0 else "")
        return MemoryReading(capacity, int(cuda.memory_allocated(device)), source)

    def usage(self) -> int:
        """Bytes allocated on the device now."""
        return int(self._cuda().memory_allocated(self._device))

    def _cuda(self) -> Any:
        return torch.cuda if self._runtime is None else self._runtime

    def close(self) -> None:
        """Nothing held between reads. Idempotent."""


def filesystem_type(path: str | os.PathLike[str], root: str | os.PathLike[str] = "/") -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mounts``); ``""`` unknown.

    Example:
        >>> from tierstore.tiers.memory import filesystem_type
        >>> filesystem_type("/proc")
        'proc'
    """
    target = Path(os.path.realpath(path))
    best, kind = -1, ""
    try:
        lines = (Path(root) / "proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = Path(fields[1].replace("\\040", " "))
        if (mount == target or mount in target.parents) and len(mount.parts) >= best:
            best, kind = len(mount.parts), fields[2]
    return kind
