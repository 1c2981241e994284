"""The NVMe tier: Adam moments in files on a local drive, in host memory only while a piece steps.

With ``nvme_dir`` the 8 bytes/param of fp32 ``m`` and ``v`` leave host memory. Each unit gets one file
(``m`` then ``v``, ``numel`` fp32 each) in a run directory made for this engine inside ``nvme_dir``
(``megatrain-adam-moments-scratch-*``), removed by ``engine.close()`` (and at interpreter exit if
release never ran). The files are scratch: a checkpoint holds everything a resume needs, and a resume
writes the checkpoint's moments back into fresh files.

The tier works in *pieces* (engine/host/ring.py): a unit's elements lo..hi, at most ``piece_numel`` of them,
stored in its file at byte ``lo * 8`` as m then v of the piece. Host memory holds at most ``buffers``
working buffers (default 4), each one piece (both moments), however large the largest unit is. A buffer
is bound to at most one piece and moves through::

    (unbound) -> READING -> CLEAN -> BUSY (a `resident` block) -> WRITING -> CLEAN -> ... -> (unbound)

- read-ahead: :meth:`NvmeTier.plan` names the pieces the next steps touch, in order (blocks L-1..0 in an
  overlapped backward, the ``todo`` list of ``optimizer_step``); the first ``buffers - 1`` of them not yet
  bound are read on the IO threads while the worker steps earlier pieces. In steady state one buffer
  steps, one writes behind and two hold the next pieces, read ahead;
- write-behind: leaving a ``resident`` block hands the buffer to an IO thread that writes it back
  (``fdatasync`` then drops the file's pages from the page cache, so the moments do not come back into
  host memory as cache); the buffer stays bound to the unit, CLEAN, and is reused from there when the
  piece comes back before the buffer is taken for another one;
- a buffer is only rebound once CLEAN (its write finished), so a piece is never read from its file while
  its newest moments are still on their way there, and only one buffer ever holds a piece: every read
  sees the last write. A piece asked for out of plan takes a free buffer, else a CLEAN one (the one needed
  last), else waits for an IO to finish; IO jobs never wait on anything, so that wait always ends.

The worker thread runs the steps; the IO threads (``io_threads``, default 2: one read and one write at
once) only move bytes, with ``os.preadv``/``os.pwrite``, which release the GIL.

Checked: each piece written gets a checksum (:func:`checksum`: the sum of its bytes as 64-bit words, modulo
2^64, about 3x as fast as zlib's CRC32 here; docs/benchmarks.md), kept in memory and compared after every read
of the piece, before the buffer is handed to a step; a piece never written must read back as the zeros it was
reserved as (sum 0). A file changed under the run (another writer, a failing drive) stops the run with one
line naming the file and the piece, instead of stepping from moments nobody wrote.
"""

from __future__ import annotations

import enum
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from megatrain_lightning.engine.host.pinned import host_empty

BUFFERS = 4  # one stepping, one writing behind, two read ahead
IO_THREADS = 2
_CHUNK = 256 << 20  # bytes per system call: Linux moves at most ~2 GiB in one read or write
_ALIGN = 16  # fp32 elements: `v` starts on a 64-byte boundary inside a working buffer, as a fresh tensor does
PREFIX = "megatrain-adam-moments-scratch-"


class NvmeTierError(ValueError):
    """nvme_dir cannot hold the Adam moments (missing, not writable, too small), or its IO failed."""


class _State(enum.Enum):
    READING = "reading"
    CLEAN = "clean"  # equals the unit's file
    BUSY = "busy"  # inside a `resident` block
    WRITING = "writing"


class Piece:
    """Elements lo..hi of a unit: what the tier reads, writes and holds in a working buffer."""

    __slots__ = ("unit", "lo", "hi")

    def __init__(self, unit: Any, lo: int, hi: int) -> None:
        self.unit, self.lo, self.hi = unit, lo, hi

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def name(self) -> str:
        return f"{self.unit.name}[{self.lo}:{self.hi}]"


class _Buffer:
    """One working buffer: room for the m and v of one piece."""

    def __init__(self, max_numel: int) -> None:
        self.v_at = -(-max_numel // _ALIGN) * _ALIGN
        # Touched now, once: faulting its pages in during the first reads into it halves their speed.
        self.flat = host_empty(self.v_at + max_numel, torch.float32, pin=False).zero_()
        self.piece: Any = None
        self.state: _State | None = None

    def views(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flat[:numel], self.flat[self.v_at : self.v_at + numel]


def check_directory(directory: str, numel: int) -> int:
    """The bytes the moments of `numel` parameters need in `directory`; NvmeTierError naming the
    directory, the bytes and the fix when it does not exist or has too little free space."""
    need = numel * 8
    size = f"{need / 2**30:.2f} GiB ({need} bytes, 8 per parameter for {numel / 1e9:.3f}B parameters)"
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise NvmeTierError(
            f"nvme_dir={directory!r} {what}; the Adam moments need {size} there. Create it on a local drive "
            f"(mkdir -p {directory}), or leave nvme_dir unset to keep the moments in host memory"
        )
    free = shutil.disk_usage(directory).free
    if free < need:
        raise NvmeTierError(
            f"nvme_dir={directory!r} has {free / 2**30:.2f} GiB free, but the Adam moments need {size}. "
            "Free space there, point nvme_dir at a larger drive, or leave it unset to keep them in host memory"
        )
    return need


class NvmeTier:
    """The Adam moments of every unit in files under a fresh run directory inside `directory`."""

    def __init__(
        self,
        directory: str,
        numel: int,
        max_numel: int,  # elements per piece (engine/host/ring.py: piece_numel)
        *,
        buffers: int = BUFFERS,
        io_threads: int = IO_THREADS,
        drop_cache: bool = True,
    ) -> None:
        if buffers < 2:
            raise ValueError(f"buffers={buffers}: the tier needs at least 2 (one stepping, one reading ahead)")
        self.need_bytes = check_directory(directory, numel)
        try:
            self.path = tempfile.mkdtemp(prefix=PREFIX, dir=directory)
        except OSError as err:
            raise NvmeTierError(
                f"nvme_dir={directory!r} is not writable ({err.strerror}); the Adam moments need "
                f"{self.need_bytes / 2**30:.2f} GiB there. Give this process write access, choose another "
                "directory, or leave nvme_dir unset"
            ) from None
        self._remove = weakref.finalize(self, shutil.rmtree, self.path, True)  # also at interpreter exit
        self.max_numel, self.buffers, self.drop_cache = max_numel, buffers, drop_cache
        self._fds: dict[Any, int] = {}
        self._files: dict[Any, str] = {}
        self._pieces: dict[Any, list[Piece]] = {}
        self._sums: dict[Piece, int] = {}  # checksum of each piece's last write (none yet: its zeros, 0)
        self._pool: list[_Buffer] = []  # allocated on demand, at most `buffers`
        self._bound: dict[Any, _Buffer] = {}
        self._plan: list[Any] = []
        self._wanted: list[Any] = []  # units a thread waits for in `resident`: their buffers are not taken
        self._cv = threading.Condition()
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="megatrain-nvme")
        self._failed: BaseException | None = None
        self._closed = False
        self.stats = {"read_bytes": 0, "write_bytes": 0, "read_seconds": 0.0, "write_seconds": 0.0, "wait_seconds": 0.0}

    # -- files ----------------------------------------------------------------------------------
    def alloc(self, unit: Any) -> None:
        """Create `unit`'s file, reserving its space now (so a full drive fails here, not hours later);
        reserved blocks read as zeros, the fresh Adam state."""
        if unit in self._fds:
            return
        file = os.path.join(self.path, f"{len(self._fds):05d}.adam")
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, unit.numel * 8)
        except OSError as err:
            os.close(fd)
            raise NvmeTierError(
                f"reserving {unit.numel * 8} bytes for the Adam moments of {unit.name} in {self.path} failed "
                f"({err.strerror}); free space there or point nvme_dir at another drive"
            ) from err
        self._fds[unit], self._files[unit] = fd, file
        self._pieces[unit] = [
            Piece(unit, lo, min(lo + self.max_numel, unit.numel)) for lo in range(0, unit.numel, self.max_numel)
        ]

    def holds(self, unit: Any) -> bool:
        return unit in self._fds

    def pieces(self, unit: Any) -> list[Piece]:
        """`unit`'s pieces in element order (its moments in files: see :meth:`alloc`)."""
        self._check(unit)
        return self._pieces[unit]

    def file_bytes(self) -> int:
        return sum(u.numel * 8 for u in self._fds)

    def buffer_bytes(self) -> int:
        """Host bytes of the working buffers allocated so far (the tier's whole host footprint)."""
        return sum(b.flat.numel() * 4 for b in self._pool)

    # -- the plan -------------------------------------------------------------------------------
    def plan(self, pieces: list[Piece]) -> None:
        """The pieces the next steps will touch, in order: reads start for the first `buffers - 1`."""
        with self._cv:
            self._plan = [p for p in pieces if p.unit in self._fds]
            self._fill()

    def _window(self) -> list:
        return self._plan[: self.buffers - 1]

    def _fill(self) -> None:
        """Start reads for planned pieces without a buffer while buffers are free (lock held)."""
        window = self._window()
        for piece in window:
            if piece in self._bound:
                continue
            buf = self._take(keep=window)
            if buf is None:
                return
            self._start_read(buf, piece)

    def _take(self, keep: list) -> _Buffer | None:
        """A buffer to bind: unbound, else a new one, else the CLEAN one whose piece is needed last and
        not in `keep` (lock held)."""
        for buf in self._pool:
            if buf.piece is None:
                return buf
        if len(self._pool) < self.buffers:
            self._pool.append(_Buffer(self.max_numel))
            return self._pool[-1]
        rank = {id(u): i for i, u in enumerate(self._plan)}
        clean = [
            b for b in self._pool if b.state is _State.CLEAN and b.piece not in keep and b.piece not in self._wanted
        ]
        if not clean:
            return None
        buf = max(clean, key=lambda b: rank.get(id(b.piece), len(rank)))
        del self._bound[buf.piece]
        buf.piece, buf.state = None, None
        return buf

    # -- one piece in host memory ------------------------------------------------------------------
    @contextmanager
    def resident(
        self, piece: Piece, write: bool = True, fresh: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A piece's (m, v) in a working buffer for the block; written back afterwards when `write` (on an
        error inside the block the buffer is dropped and the file keeps the moments from before).
        `fresh`: the caller overwrites every element, so the file is not read (and the buffer is written)."""
        write = write or fresh  # a fresh buffer matches no file until it is written
        buf = self._acquire(piece, fresh)
        ok = False
        try:
            yield buf.views(piece.numel)
            ok = True
        finally:
            self._release(buf, write and ok, dropped=not ok)

    def _acquire(self, piece: Any, fresh: bool) -> _Buffer:
        t0 = time.perf_counter()
        with self._cv:
            self._check(piece.unit)
            if piece in self._plan:
                self._plan.remove(piece)
            self._wanted.append(piece)
            try:
                while True:
                    buf = self._bound.get(piece) or self._bind(piece, fresh)
                    self._fill()
                    if buf is not None and buf.state is _State.CLEAN:
                        buf.state = _State.BUSY
                        self.stats["wait_seconds"] += time.perf_counter() - t0
                        return buf
                    self._cv.wait()  # for its read, its write, or any IO to free a buffer
                    self._check(piece.unit)
            finally:
                self._wanted.remove(piece)

    def _bind(self, piece: Any, fresh: bool) -> _Buffer | None:
        """Bind a buffer to `piece` out of plan: read its file into it, or (`fresh`) take it as it is."""
        buf = self._take(keep=[])
        if buf is None:
            return None
        if fresh:
            buf.piece, buf.state = piece, _State.CLEAN
            self._bound[piece] = buf
        else:
            self._start_read(buf, piece)
        return buf

    def _release(self, buf: _Buffer, write: bool, dropped: bool) -> None:
        with self._cv:
            if dropped:  # an error mid-block: what the buffer holds is no longer known
                del self._bound[buf.piece]
                buf.piece, buf.state = None, None
            elif write:
                buf.state = _State.WRITING
                self._io.submit(self._write, buf, buf.piece)
            else:
                buf.state = _State.CLEAN
            self._fill()
            self._cv.notify_all()

    def _check(self, unit: Any) -> None:
        if self._closed:
            raise RuntimeError("the NVMe tier was closed by engine.close(); its moments are gone")
        if isinstance(self._failed, NvmeTierError):  # (it names the file already)
            raise NvmeTierError(str(self._failed)) from None
        if self._failed is not None:
            raise NvmeTierError(f"IO on the Adam moments in {self.path} failed: {self._failed}") from self._failed
        if unit not in self._fds:
            raise RuntimeError(f"{unit.name} has no Adam moments: no optimizer is attached")

    # -- IO threads -------------------------------------------------------------------------------
    def _start_read(self, buf: _Buffer, piece: Any) -> None:
        buf.piece, buf.state = piece, _State.READING
        self._bound[piece] = buf
        self._io.submit(self._read, buf, piece)

    def _read(self, buf: _Buffer, piece: Piece) -> None:
        def read(fd: int, n: int) -> None:
            _transfer(os.preadv, fd, buf.views(n), piece.lo * 8)
            if checksum(buf.views(n)) != self._sums.get(piece, 0):
                raise NvmeTierError(
                    f"{self._files[piece.unit]}: the Adam moments of {piece.name} (bytes {piece.lo * 8} to "
                    f"{piece.hi * 8}) are not what this run wrote there (checksum mismatch): the file was changed "
                    "by another writer or the drive; the run stops before a step uses them. Make sure nothing "
                    "else writes under nvme_dir, and resume from the last checkpoint"
                )

        self._io_job(buf, piece, "read", read)

    def _write(self, buf: _Buffer, piece: Piece) -> None:
        def write(fd: int, n: int) -> None:
            self._sums[piece] = checksum(buf.views(n))  # (read back only once this write is done)
            _transfer(os.pwrite, fd, buf.views(n), piece.lo * 8)
            if self.drop_cache:
                os.fdatasync(fd)  # dirty pages cannot be dropped: write them out first

        self._io_job(buf, piece, "write", write)

    def _io_job(self, buf: _Buffer, piece: Piece, kind: str, move: Any) -> None:
        t0 = time.perf_counter()
        fd, n = self._fds[piece.unit], piece.numel
        try:
            move(fd, n)
            if self.drop_cache:  # the moments are in the buffer (or the file): no second copy as page cache
                os.posix_fadvise(fd, piece.lo * 8, n * 8, os.POSIX_FADV_DONTNEED)
        except BaseException as err:
            with self._cv:
                self._failed = err
                self._cv.notify_all()
            raise
        with self._cv:
            try:
                self.stats[f"{kind}_bytes"] += n * 8
                self.stats[f"{kind}_seconds"] += time.perf_counter() - t0
                buf.state = _State.CLEAN
                self._fill()  # may allocate a buffer or submit a read: its failure must not strand a waiter
            except BaseException as err:
                self._failed = err
                raise
            finally:
                self._cv.notify_all()

    # -- teardown ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every read and write in flight, then unbind every buffer (the next use of any unit
        reads its file)."""
        with self._cv:
            self._plan = []
            while any(b.state in (_State.READING, _State.WRITING) for b in self._pool) and self._failed is None:
                self._cv.wait()
            for buf in self._pool:
                if buf.state is not _State.BUSY:
                    self._bound.pop(buf.piece, None)
                    buf.piece, buf.state = None, None

    def close(self) -> None:
        """Finish the IO in flight, free the buffers, close and delete the files and the run directory."""
        if self._closed:
            return
        with self._cv:
            self._plan = []  # the IO threads start no more reads
        self._io.shutdown(wait=True)
        with self._cv:
            self._closed = True
            self._pool.clear()
            self._bound.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._files.clear()
        self._pieces.clear()
        self._sums.clear()
        self._remove()


def checksum(views: tuple[torch.Tensor, ...]) -> int:
    """The sum of the views' bytes as little 64-bit words, modulo 2^64 (a view of an odd number of fp32
    elements adds its last one as a 32-bit word). NumPy's integer sum: one pass at memory speed, without the
    GIL and without torch's thread pool, whose threads the host optimizer uses meanwhile. Not a CRC: any one
    changed byte changes it (several may cancel out, about once in 2^64 for random damage), and a reordering of
    whole words does not, which is not how files get overwritten."""
    total = 0
    for view in views:
        a = view.numpy()
        even = a.size & ~1
        total += int(a[:even].view(np.uint64).sum()) + int(a[even:].view(np.uint32).sum())
    return total & 0xFFFF_FFFF_FFFF_FFFF


def _transfer(call: Any, fd: int, views: tuple[torch.Tensor, torch.Tensor], base: int) -> None:
    """Move a piece's m (file offset `base`) and v (right after it) between the file and their views, in
    chunks."""
    for i, view in enumerate(views):
        mem, done = memoryview(view.numpy()).cast("B"), 0
        offset = base + i * view.numel() * 4
        while done < mem.nbytes:
            part = mem[done : done + _CHUNK]
            n = call(fd, [part], offset + done) if call is os.preadv else call(fd, part, offset + done)
            if n == 0:
                raise OSError(f"the moments file ends early at byte {offset + done}")
            done += n
