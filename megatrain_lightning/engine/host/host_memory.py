"""How much host memory this process may still allocate: the tightest of the limits that apply to it.

``MemAvailable`` (/proc/meminfo) is the machine's figure. A container or a job scheduler caps a process
lower, and going past that cap is an OOM kill without a word (cgroups) or an allocator error in the middle of
a step (``ulimit -v``), so the engine's host-memory check reads every cap and takes the least room:

- cgroup v2: ``memory.max`` less what the cgroup uses, for the process's cgroup and each one above it (a
  container sees its own cgroup at the root of /sys/fs/cgroup; a systemd unit sits in a tree of them);
- cgroup v1: ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` in the memory hierarchy, likewise;
- ``RLIMIT_AS`` (``ulimit -v``): the soft limit less the address space the process maps now (VmSize).

What a cgroup uses counts its page cache too; the inactive file pages are left out (the kernel drops them
before it kills for memory, and the working set that container runtimes watch leaves them out as well):
a run that has just read a large data file would otherwise be refused for memory it can have. Every path
and reader is a field of :class:`Sources`, so tests point them at files of their own.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# A cgroup v1 memory.limit_in_bytes at or above this is "no limit" (the kernel's is 2^63 less a page).
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Sources:
    """Where the limits are read from: the real machine's files by default."""

    proc: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit


SOURCES = Sources()


class HostLimit(NamedTuple):
    room: int
    """Bytes the process may still allocate under this limit."""
    name: str
    """The limit, as a user would look it up (a file, or a ulimit)."""
    fix: str
    """How to raise it."""


def host_limits(sources: Sources | None = None) -> list[HostLimit]:
    """Every limit on this process's host memory that can be read here (MemAvailable first)."""
    s = sources or SOURCES
    limits = []
    available = _meminfo_available(s.proc)
    if available is not None:
        limits.append(HostLimit(available, "MemAvailable", "free memory on the machine"))
    cgroups = _cgroup_paths(s.proc)
    for room, where in _v2_rooms(s.cgroup_root, cgroups.get("")):
        limits.append(HostLimit(room, f"the cgroup limit {where}/memory.max", "raise the container's memory limit"))
    for room, where in _v1_rooms(s.cgroup_root / "memory", cgroups.get("memory")):
        limits.append(
            HostLimit(room, f"the cgroup limit {where}/memory.limit_in_bytes", "raise the container's memory limit")
        )
    soft = s.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        mapped = _status_bytes(s.proc, "VmSize") or 0
        limits.append(HostLimit(max(0, soft - mapped), "ulimit -v (RLIMIT_AS)", "raise ulimit -v"))
    return limits


def tightest_host_limit(sources: Sources | None = None) -> HostLimit:
    """The limit that leaves the least room (physical memory when nothing else can be read)."""
    limits = host_limits(sources)
    if not limits:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return HostLimit(physical, "physical memory", "use a machine with more memory")
    return min(limits, key=lambda limit: limit.room)


def available_host_bytes() -> int:
    """Host memory this process can still allocate: the least room of MemAvailable, its cgroups' limits and
    ulimit -v."""
    return tightest_host_limit().room


# -- readers ------------------------------------------------------------------------------------------
def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo_available(proc: Path) -> int | None:
    for line in (_read(proc / "meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _status_bytes(proc: Path, field: str) -> int | None:
    for line in (_read(proc / "self" / "status") or "").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_paths(proc: Path) -> dict[str, str]:
    """This process's cgroup per controller ("" is the v2 hierarchy), from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _levels(root: Path, cgroup: str | None) -> list[Path]:
    """The cgroup's directory and each above it up to `root` (those that exist here). A container usually
    mounts its own cgroup as the root, where the path /proc names (the host's view) does not exist."""
    if cgroup is None:
        return [root] if root.is_dir() else []
    here = root / cgroup.strip("/")
    levels = [here, *here.parents]
    return [p for p in levels[: levels.index(root) + 1] if p.is_dir()] if root in levels else [root]


def _number(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _v2_rooms(root: Path, cgroup: str | None) -> list[tuple[int, Path]]:
    rooms = []
    for level in _levels(root, cgroup):
        limit, used = _number(level / "memory.max"), _number(level / "memory.current")
        if limit is not None and used is not None:  # "max": no limit at this level
            rooms.append((max(0, limit - used + _stat(level / "memory.stat", "inactive_file")), level))
    return rooms


def _v1_rooms(root: Path, cgroup: str | None) -> list[tuple[int, Path]]:
    rooms = []
    for level in _levels(root, cgroup):
        limit, used = _number(level / "memory.limit_in_bytes"), _number(level / "memory.usage_in_bytes")
        if limit is not None and used is not None and limit < _V1_UNLIMITED:
            rooms.append((max(0, limit - used + _stat(level / "memory.stat", "total_inactive_file")), level))
    return rooms
