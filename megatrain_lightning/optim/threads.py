"""The host worker's thread budget: how many threads the CPU optimizer uses, and on which CPUs.

The engine's host worker (engine/host/host_steps.py) runs the Adam steps, gradient landing and norms on one
Python thread, beside the thread that launches the GPU's kernels. Left alone, the native kernel (csrc/)
and torch's intra-op pool each take every core, and the launching thread has to fight them for one.
:func:`configure_host_threads`, called first thing on the worker thread, gives the host work
``host_threads`` threads: by default the cores this process may run on (``os.sched_getaffinity``) minus
one, kept for the launching thread.

- The native kernel: ``native.set_num_threads(n)``, the library's own setting, read by every call.
- torch's ops on the worker (norms for clipping; the whole step when the native kernel is missing):
  ``torch.set_num_threads`` is not process-wide in an OpenMP build of torch (Linux, the usual wheels).
  It sets the OpenMP team size of the *calling* thread, and the default that threads which have not yet
  run a parallel torch op pick up at their first; threads already running (the one that built the
  model) keep theirs. So it is called on the worker itself, and the previous default is put back from a
  short-lived thread: the worker keeps ``n``, nothing else changes. Where torch has one pool for the
  process (builds without OpenMP), putting the default back also undoes the worker's setting; the
  worker then shares that pool with the other threads, which adds no threads.
  Torch and the kernel load one OpenMP runtime and run one after the other on the worker, so they share
  its ``n``-thread team instead of stacking two.
- NUMA: on a machine whose cores (of this process's affinity mask) span several nodes
  (``/sys/devices/system/node/node*/cpulist``), thread ``i`` of ``n`` is placed on CPU
  ``cpus[i * len(cpus) // n]`` of the mask's CPUs listed node by node: the threads spread evenly over
  the nodes, each node's share over its own CPUs. On one node nothing is placed.

Data parallel (engine/ranks.py): the ranks on one machine split its CPUs (:func:`rank_cpus`), each
rank's share contiguous in the node-by-node listing, so with at least as many ranks as NUMA nodes each
rank's threads stay on one node, next to the memory its shards were first touched from. A rank's budget
is then its share minus one, and its threads are placed on its share whatever the number of nodes.

Thread counts and placement never change results: the kernel splits work by team size into ranges whose
arithmetic does not depend on it, and is bitwise equal across thread counts (tests/test_native_adamw.py).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("megatrain_lightning")

SYSFS = "/sys"


@dataclass(frozen=True)
class HostThreads:
    """What :func:`configure_host_threads` set up."""

    threads: int
    """Threads of the native kernel and of torch's ops on the configuring thread."""
    cpus: tuple[int, ...] | None
    """CPU of each kernel thread (index 0: the configuring thread itself, not moved); None: not placed."""


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where the OS has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def resolve_host_threads(host_threads: int | None, cores: int | None = None) -> int:
    """The thread budget ``host_threads`` asks for: itself when it is an int from 1 to `cores` (default: the
    CPUs this process may use); None: all of them but one (at least 1). ValueError naming it otherwise."""
    cores = len(usable_cpus()) if cores is None else cores
    if host_threads is None:
        return max(1, cores - 1)
    if isinstance(host_threads, bool) or not isinstance(host_threads, int) or not 1 <= host_threads <= cores:
        raise ValueError(
            f"host_threads={host_threads!r}: give an integer from 1 to {cores} (the CPU cores this process may "
            f"use), or leave it unset for {max(1, cores - 1)}: all but one, kept for the thread that launches the "
            "GPU's kernels"
        )
    return host_threads


def parse_cpulist(text: str) -> list[int]:
    """CPU numbers of a sysfs cpulist such as ``"0-3,8,10-11"`` (empty for a node without CPUs)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes(sysfs_root: str = SYSFS) -> dict[int, list[int]]:
    """Node number -> its CPUs, from ``<sysfs_root>/devices/system/node/node*/cpulist``; {} when the tree
    is missing (no sysfs, not Linux): the machine then counts as one node."""
    nodes = {}
    for path in glob.glob(os.path.join(sysfs_root, "devices/system/node/node*/cpulist")):
        match = re.fullmatch(r"node(\d+)", os.path.basename(os.path.dirname(path)))
        if match:
            with open(path) as f:
                nodes[int(match.group(1))] = parse_cpulist(f.read())
    return nodes


def kernel_cpus(threads: int, affinity: set[int], nodes: dict[int, list[int]]) -> tuple[int, ...] | None:
    """The CPU of each of `threads` kernel threads, spread evenly over the CPUs of `affinity` listed node by
    node; None when those CPUs lie on fewer than two nodes (nothing to place). `threads` <= len(affinity)."""
    in_mask = [[c for c in sorted(cpus) if c in affinity] for _, cpus in sorted(nodes.items())]
    if sum(1 for cpus in in_mask if cpus) < 2:
        return None
    ordered = [c for cpus in in_mask for c in cpus]
    ordered += sorted(affinity - set(ordered))  # CPUs no node lists (not seen in practice) come last
    return tuple(ordered[i * len(ordered) // threads] for i in range(threads))


def rank_cpus(local_rank: int, local_world: int, affinity: set[int], nodes: dict[int, list[int]]) -> list[int]:
    """The CPUs of `affinity` that data-parallel rank `local_rank` of the `local_world` ranks on this machine
    uses: the CPUs listed node by node, cut into `local_world` contiguous parts (the first parts one CPU
    longer when they do not divide evenly); with more ranks than CPUs, one CPU each, shared round-robin."""
    listed = [c for _, cpus in sorted(nodes.items()) for c in sorted(cpus) if c in affinity]
    listed += sorted(affinity - set(listed))
    if local_world > len(listed):
        return [listed[local_rank % len(listed)]]
    base, extra = divmod(len(listed), local_world)
    start = local_rank * base + min(local_rank, extra)
    return listed[start : start + base + (local_rank < extra)]


def configure_host_threads(
    host_threads: int | None = None, *, share: list[int] | None = None, sysfs_root: str = SYSFS
) -> HostThreads:
    """Give the host work of *this* thread `host_threads` threads (see the module docstring); call it first
    thing on the engine's host worker thread. ValueError for a budget below 1 or above the usable cores.
    `share`: a data-parallel rank's CPUs (:func:`rank_cpus`): the budget counts them, and the threads are
    placed on them."""
    affinity = usable_cpus() if share is None else set(share)
    threads = resolve_host_threads(host_threads, len(affinity))
    if share is None:
        cpus = kernel_cpus(threads, affinity, numa_nodes(sysfs_root))
    else:  # spread over the rank's own CPUs, on one node or several
        cpus = tuple(share[i * len(share) // threads] for i in range(threads))
    from megatrain_lightning.optim import native

    if native.available():
        native.set_num_threads(threads)
        if not native.set_team_cpus(list(cpus or [])):
            cpus = None  # this build cannot place threads
    _limit_torch_threads_here(threads)
    log.debug("host worker: %d threads%s", threads, f" on CPUs {list(cpus)}" if cpus else "")
    return HostThreads(threads, cpus)


def _limit_torch_threads_here(threads: int) -> None:
    """torch's intra-op threads of this thread only (the module docstring says why this takes two calls)."""
    before = torch.get_num_threads()  # this thread's first torch call takes the process default
    if before == threads:
        return
    torch.set_num_threads(threads)  # this thread's team, and the default of threads that start later ...
    restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="megatrain-threads")
    restore.start()  # ... which is put back from another thread, leaving this thread's team as it is
    restore.join()
