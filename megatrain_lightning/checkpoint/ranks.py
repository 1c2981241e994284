"""The ranks' part in a checkpoint (engine/ranks.py): every rank writes and reads its part of the same
files, and the files do not depend on the number of ranks W.

With one rank (the ordinary case) every agreement here is this rank's own and every unit is its to write
and read whole: no collective runs, no tensor is swapped or passed through a scratch buffer, and a save or a
restore does the work of one process (store.py: one path for any W).

Saving, unit i is written by rank i % W, in rounds of W units (one per rank). For each tensor of a unit
file (master, exp_avg, exp_avg_sq, in that order) the ranks swap shards in one all-to-all: every rank sends
its shard of each unit of the round to that unit's writer, and each writer receives the W shards of its own
unit, streams the whole tensor to the URL and drops it. So a rank holds one tensor of one unit whole at a
time, and no process ever holds the model; nothing is gathered to rank 0.

    round k:    unit kW+0 -> rank 0    unit kW+1 -> rank 1    ...    (all writing at once)
    per tensor: all-to-all (shards to writers)  ->  each writer streams its unit's tensor

The collectives never depend on what the writes do: a rank whose write fails goes on sending its shards
(receiving and dropping what it no longer writes), so no rank waits on it; the failure is told at the
end, by the one all-reduce (a max) that also brings rank 0 the index's share of every rank: each unit
file's byte count and checksum from its writer, and each parameter's optimizer step (every rank holding a
piece of a parameter has stepped it alike; a rank without one adds 0). Rank 0 alone keeps the books
(lease, versions, buffers, trainer.pt, the index, the commit marker: store.py).

Restoring, every rank reads each unit file through, keeping the bytes of its own shard and passing the
rest through a small scratch buffer: the checksum covers the whole file, so every byte is read, but no rank
holds a whole unit.

Every agreement here is a tensor collective on the partition's gloo group: nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatrain_lightning.checkpoint.stream import Chunked
from megatrain_lightning.checkpoint.verify import CheckpointError

TENSORS = ("master", "exp_avg", "exp_avg_sq")  # a unit file's tensors, in file order
TEXT_BYTES = 1024  # the longest text rank 0 hands the others (a version directory's name)
SCRATCH_ELEMENTS = 1 << 22  # 16 MiB of fp32: what a restore reads the other ranks' bytes through


# -- agreements -------------------------------------------------------------------------------------
def _alone(part: Any) -> bool:
    """One rank: every agreement is its own, every unit its own to write and read whole."""
    return part.world == 1


def may_reread(part: Any) -> bool:
    """Whether a restore may start over on a newer checkpoint by itself (rereads.py): with one rank; of
    several, one alone might see the newer checkpoint, and the ranks would read different versions."""
    return _alone(part)


def share_text(part: Any, text: str | None) -> str | None:
    """Rank 0's `text` on every rank (None where rank 0 has none: it could not produce it)."""
    if _alone(part):
        return text
    buf = torch.zeros(TEXT_BYTES + 1, dtype=torch.uint8)
    if part.rank == 0 and text is not None:
        raw = text.encode()
        if len(raw) > TEXT_BYTES:
            raise ValueError(f"{text!r} is longer than the {TEXT_BYTES} bytes a rank hands the others")
        buf[0] = 1
        buf[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=dist.get_global_rank(part.cpu_group, 0), group=part.cpu_group)
    if not buf[0]:
        return None
    return bytes(buf[1:].tolist()).rstrip(b"\0").decode()


def settle(part: Any, error: BaseException | None, doing: str, consequence: str, tag: int = 0) -> None:
    """Every rank raises when any did: its own `error` where it failed, elsewhere one line naming the
    failed rank; and when the ranks' `tag`s differ (they read different things). Returns on every rank
    otherwise."""
    if _alone(part):
        _raise_failure(error, 0, doing, consequence)
        return
    t = torch.tensor([part.rank + 1 if error is not None else 0, tag, -tag], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=part.cpu_group)
    _raise_failure(error, int(t[0]), doing, consequence)
    most, least = int(t[1]), -int(t[2])
    if most != least:
        raise CheckpointError(f"{doing}: the ranks read different versions (a save committed meanwhile); {consequence}")


def _raise_failure(error: BaseException | None, failed: int, doing: str, consequence: str) -> None:
    """After an all-reduced failure flag (`failed`: 1 + the highest failed rank, 0 for none): this rank's own
    `error` where it failed, elsewhere one line naming the failed rank."""
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{doing}: rank {failed - 1} failed (its own error says why); {consequence}")


# -- steps per parameter ----------------------------------------------------------------------------
def layout_steps(unit: Any) -> list[int]:
    """The optimizer step of each parameter of the whole unit (``layout``'s order) as this rank knows it:
    its piece's, or 0 for a parameter it holds no piece of (a max over ranks then gives every one's)."""
    by_param = {id(e.param): step for e, step in zip(unit.entries, unit.steps)}
    return [by_param.get(id(e.param), 0) for e in unit.layout]


def piece_steps(unit: Any, steps: list[int]) -> list[int]:
    """Per-parameter `steps` (``layout``'s order) as this shard's pieces (``entries``) list them (a whole
    unit's: `steps` itself)."""
    if not unit.partitioned:
        return steps
    by_param = {id(e.param): step for e, step in zip(unit.layout, steps)}
    return [by_param[id(e.param)] for e in unit.entries]


# -- writing ----------------------------------------------------------------------------------------
class _Round:
    """One round's units (unit first + j is rank j's to write) and their shards, swapped a tensor at a time."""

    def __init__(self, part: Any, units: list[Any], shards: list[dict[str, torch.Tensor]]) -> None:
        self.part, self.units, self.shards = part, units, shards
        self.names = [n for n in TENSORS if any(n in s for s in shards)]
        self.done = 0  # tensors of `names` swapped so far

    def swap(self) -> torch.Tensor | None:
        """The next tensor's all-to-all: this rank's whole unit tensor (None: it writes none this round)."""
        name, part = self.names[self.done], self.part
        self.done += 1
        sends, splits = [], []
        for j in range(part.world):
            has = j < len(self.units) and name in self.shards[j]
            chunk = part.chunk(self.units[j].full_numel) if has else 0
            if has:
                shard = self.shards[j][name]
                sends += [shard, shard.new_zeros(chunk - shard.numel())]  # the last ranks' shards are short
            splits.append(chunk)
        mine = self.units[part.rank] if part.rank < len(self.units) else None
        receives = mine is not None and name in self.shards[part.rank]
        chunk = part.chunk(mine.full_numel) if receives else 0
        whole = torch.empty(chunk * part.world, dtype=torch.float32)
        send = torch.cat(sends) if sends else torch.empty(0, dtype=torch.float32)
        dist.all_to_all_single(whole, send, [chunk] * part.world, splits, group=part.cpu_group)
        return whole[: mine.full_numel] if receives else None

    def take(self, name: str) -> torch.Tensor:
        """This rank's unit's tensor `name`, whole (swapping the tensors before it in file order on the way)."""
        while True:
            whole = self.swap()
            if self.names[self.done - 1] == name:
                return whole

    def tensors(self) -> list[tuple[str, Chunked]]:
        """This rank's unit file's tensors, each swapped when the file writer comes to it."""
        mine = self.units[self.part.rank]
        return [
            (name, Chunked(mine.full_numel, torch.float32, lambda name=name: iter((self.take(name),))))
            for name in TENSORS
            if name in self.shards[self.part.rank]
        ]

    def finish(self) -> None:
        """The swaps a failed (or absent) write left out: the other writers still need this rank's shards."""
        while self.done < len(self.names):
            self.swap()


def write_units(
    part: Any,
    units: list[Any],
    shards: list[dict[str, torch.Tensor]],
    write: Callable[[int, list[tuple[str, Chunked]]], dict],
) -> tuple[dict[int, dict], Exception | None]:
    """Write this rank's units (rank, rank + W, ...): `shards[i]` names this rank's shard of each tensor of
    unit i's file (the same names on every rank), `write(i, tensors)` writes unit i's file and returns its record ({"bytes",
    "crc32"}). Every rank calls this with the same units. Returns the records of what this rank wrote and its
    error (after the first one it writes nothing more, but takes part in every swap)."""
    written: dict[int, dict] = {}
    error: Exception | None = None
    if _alone(part):  # every unit this rank's, its tensors straight from `shards`, each taken as it is written
        for i, tensors in enumerate(shards):
            try:
                written[i] = write(i, list(tensors.items()))
            except Exception as err:  # (raised by settle_books)
                return written, err
        return written, error
    for first in range(0, len(units), part.world):
        batch = units[first : first + part.world]
        work = _Round(part, batch, shards[first : first + part.world])
        if part.rank < len(batch) and error is None:
            try:
                written[first + part.rank] = write(first + part.rank, work.tensors())
            except Exception as err:  # (told to every rank at the end: see settle_books)
                error = err
        work.finish()
    return written, error


def settle_books(
    part: Any, units: list[Any], written: dict[int, dict], error: Exception | None, doing: str, consequence: str
) -> tuple[list[list[int]], list[dict]]:
    """One all-reduce (a max): whether every rank wrote its units (raising on every rank, as :func:`settle`,
    when one did not), each unit's per-parameter steps and each unit file's record from its writer (with one
    rank, its own)."""
    if _alone(part):
        _raise_failure(error, 0, doing, consequence)
        return [layout_steps(u) for u in units], [written[i] for i in range(len(units))]
    sizes = [len(u.layout) for u in units]
    t = torch.zeros(1 + sum(sizes) + 2 * len(units), dtype=torch.int64)
    t[0] = part.rank + 1 if error is not None else 0
    t[1 : 1 + sum(sizes)] = torch.tensor([s for u in units for s in layout_steps(u)], dtype=torch.int64)
    files = t[1 + sum(sizes) :].view(-1, 2)
    for i, info in written.items():
        files[i] = torch.tensor([info["bytes"], info["crc32"]])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=part.cpu_group)
    _raise_failure(error, int(t[0]), doing, consequence)
    steps, at = [], 1
    for n in sizes:
        steps.append(t[at : at + n].tolist())
        at += n
    return steps, [{"bytes": int(b), "crc32": int(c)} for b, c in files.tolist()]


# -- reading ----------------------------------------------------------------------------------------
def shard_targets(
    unit: Any, names: list[str], mine: dict[str, torch.Tensor], scratch: torch.Tensor
) -> dict[str, Chunked]:
    """Targets to read a unit file's tensors `names` into (stream.read_into): the elements lo..hi of each
    land in `mine`'s tensor of that name, every other byte (all of a tensor not in `mine`) passes through
    `scratch`."""

    def parts(own: torch.Tensor | None) -> Iterator[torch.Tensor]:
        for a, b, into in ((0, unit.lo, None), (unit.lo, unit.hi, own), (unit.hi, unit.full_numel, None)):
            if into is not None:
                yield into
                continue
            for at in range(a, b, scratch.numel()):
                yield scratch[: min(scratch.numel(), b - at)]

    return {n: Chunked(unit.full_numel, torch.float32, lambda own=mine.get(n): parts(own)) for n in names}


def scratch_for(units: list[Any]) -> torch.Tensor | None:
    """The buffer a restore reads the other ranks' bytes through (None: every unit is whole here)."""
    if not any(u.partitioned for u in units):
        return None
    return torch.empty(min(SCRATCH_ELEMENTS, max([u.full_numel for u in units], default=1)), dtype=torch.float32)
