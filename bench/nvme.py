"""Throughput of the NVMe tier (engine/host/nvme.py) next to a plain sequential write and read of the same drive.

    python bench/nvme.py [--size-gib 4] [--dir /tmp] [--unit-mib 256]

The tier moves Adam moments through its own path: one file per unit, working buffers, ``os.pwrite`` +
``fdatasync`` + dropping the pages from the page cache (write-behind), ``os.preadv`` on the read-ahead
threads. Three passes over ``--size-gib`` of moments in units of ``--unit-mib``:

  write   every unit taken fresh (a working buffer as it is: random bytes) and written back
  read    every unit read, in a planned order, so reads run ahead on the IO threads
  step    read + write back per unit, the pattern of an optimizer step (bytes moved = 2 x size)

The reference is what ``dd`` measures: one file written in 64 MiB blocks then fsync'ed, its pages
dropped (``POSIX_FADV_DONTNEED``), then read back in 64 MiB blocks. Numbers are printed, not checked;
"GB/s" is 1e9 bytes per second. :func:`measure_tier` is importable (bench/host_memory.py can use it).

The tier checksums every piece it writes and checks it after every read (engine/host/nvme.py's ``checksum``):
``--checksum-cost`` also prints that function's speed on one unit's moments next to zlib's CRC32, and the
tier's passes again with the checksum replaced by a constant (what the check costs the tier).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from unittest import mock

import torch

from megatrain_lightning.engine.host import nvme
from megatrain_lightning.engine.host.nvme import BUFFERS, IO_THREADS, NvmeTier

_BLOCK = 64 << 20


@dataclass(eq=False)
class _Unit:
    """What the tier needs of a unit: a name and a parameter count (m and v take 8 bytes per parameter)."""

    name: str
    numel: int


def measure_tier(
    directory: str, size_bytes: int, unit_bytes: int = 256 << 20, buffers: int = BUFFERS, io_threads: int = IO_THREADS
) -> dict[str, float]:
    """GB/s of the tier's write, read and read+write (step) passes over `size_bytes` of moments in units
    of `unit_bytes`, in a fresh run directory under `directory` (removed afterwards)."""
    numel = max(1, unit_bytes // 8)
    units = [_Unit(f"u{i}", numel) for i in range(max(1, size_bytes // (numel * 8)))]
    total = len(units) * numel * 8
    tier = NvmeTier(directory, total // 8, numel, buffers=buffers, io_threads=io_threads)
    try:
        for u in units:
            tier.alloc(u)
        units = [p for u in units for p in tier.pieces(u)]  # one piece each: the tier's pieces are `numel`
        for u in units[:buffers]:  # every working buffer allocated before timing, holding random bytes
            with tier.resident(u, fresh=True) as (m, v):  # (zeros could be turned into discards by a drive)
                m.copy_(torch.randn(numel))
                v.copy_(torch.rand(numel))
        out = {"bytes": float(total)}
        out["write"] = total / _timed(tier, units, lambda u: tier.resident(u, fresh=True), plan=False) / 1e9
        out["read"] = total / _timed(tier, units, lambda u: tier.resident(u, write=False)) / 1e9
        out["step"] = 2 * total / _timed(tier, units, lambda u: tier.resident(u)) / 1e9
        out["wait_seconds"] = tier.stats["wait_seconds"]
        return out
    finally:
        tier.close()


def _timed(tier: NvmeTier, units: list, resident, plan: bool = True) -> float:
    """Seconds from the first use of a unit to the last write landed, starting with no unit in memory."""
    tier.drain()
    t0 = time.perf_counter()
    if plan:
        tier.plan(units)
    for u in units:
        with resident(u):
            pass
    tier.drain()
    return time.perf_counter() - t0


def measure_sequential(directory: str, size_bytes: int) -> dict[str, float]:
    """GB/s of a dd-style sequential write (64 MiB blocks, then fsync) and read (after dropping the pages)."""
    block = torch.randint(0, 256, (_BLOCK,), dtype=torch.uint8).numpy().tobytes()
    blocks = max(1, size_bytes // _BLOCK)
    fd, path = tempfile.mkstemp(prefix="megatrain-nvme-bench-", dir=directory)
    try:
        t0 = time.perf_counter()
        for _ in range(blocks):
            os.write(fd, block)
        os.fsync(fd)
        write = blocks * _BLOCK / (time.perf_counter() - t0) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(_BLOCK)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        read = blocks * _BLOCK / (time.perf_counter() - t0) / 1e9
        return {"write": write, "read": read}
    finally:
        os.close(fd)
        os.unlink(path)


def measure_checksum(unit_bytes: int, repeats: int = 5) -> dict[str, float]:
    """GB/s of the tier's checksum and of zlib.crc32 over one unit's m and v (random fp32), best of `repeats`
    (each pass reads the bytes from memory: a unit is larger than the caches)."""
    numel = max(1, unit_bytes // 8)
    views = (torch.randn(numel), torch.rand(numel))
    passes = {
        "checksum": lambda: nvme.checksum(views),
        "crc32": lambda: zlib.crc32(views[1].numpy(), zlib.crc32(views[0].numpy())),
    }
    out = {}
    for name, run in passes.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        out[name] = numel * 8 / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--unit-mib", type=int, default=256, help="moments (m and v) per unit")
    ap.add_argument("--buffers", type=int, default=BUFFERS)
    ap.add_argument("--io-threads", type=int, default=IO_THREADS)
    ap.add_argument("--checksum-cost", action="store_true", help="also time the tier's checksum (see above)")
    args = ap.parse_args()
    size = int(args.size_gib * 2**30)
    seq = measure_sequential(args.dir, size)
    tier = measure_tier(args.dir, size, args.unit_mib << 20, args.buffers, args.io_threads)
    print(
        f"{args.dir}: {tier['bytes'] / 2**30:.2f} GiB of moments, units of {args.unit_mib} MiB, "
        f"{args.buffers} buffers, {args.io_threads} IO threads"
    )
    print("| path | write GB/s | read GB/s | read+write (step) GB/s |")
    print("|---|---|---|---|")
    print(
        f"| sequential (dd-style, 64 MiB blocks, fsync; read after DONTNEED) | {seq['write']:.2f} | {seq['read']:.2f} | - |"
    )
    print(
        f"| NVMe tier (pwrite+fdatasync+DONTNEED / preadv read-ahead) | {tier['write']:.2f} | {tier['read']:.2f} | "
        f"{tier['step']:.2f} |"
    )
    if args.checksum_cost:
        with mock.patch.object(nvme, "checksum", lambda views: 0):
            bare = measure_tier(args.dir, size, args.unit_mib << 20, args.buffers, args.io_threads)
        print(f"| NVMe tier, checksum off | {bare['write']:.2f} | {bare['read']:.2f} | {bare['step']:.2f} |")
        speed = measure_checksum(args.unit_mib << 20)
        print(f"checksum of one unit's moments: {speed['checksum']:.2f} GB/s (zlib.crc32: {speed['crc32']:.2f} GB/s)")


if __name__ == "__main__":
    main()
