"""Which block calls keep their autograd graph from the forward instead of being recomputed in backward.

Every block is recomputed in backward by default on a device that cannot spare the memory: its forward
runs without a graph and its backward runs it again with one. A call that *keeps* its graph runs its
forward with grad instead; its backward only differentiates that graph, so the block's forward is computed
once. The graph holds the block's activations (the saved tensors of its ops) on the device until its
backward, and the weights it computed with: those are the slot the block was streamed into, so the slot is
pinned (engine/device/streams.py ``SlotPool.pin``) until the call's backward has run, and no upload may overwrite
it. The graph's weights are fresh leaves over the slot (engine/device/streamer.py, ``BlockStreamer._bound``), not
the block's own parameters, whose storage moves back to the host masters after every call.

``recompute`` (EngineConfig, MegatrainStrategy):

- ``True``: every call is recomputed (no graph kept; the least device memory).
- ``False``: every call under grad keeps its graph; the slot pool grows as calls pin its slots.
- ``"auto"`` (default): decided per forward pass of each stack, at its first block, from the device memory
  free then: the last blocks of the pass keep their graphs (backward reaches them first, and the slots
  keep their weights resident anyway) while their activations fit in :data:`KEEP_SHARE` of the free memory
  and :data:`STREAMING_SLOTS` slots stay unpinned for the blocks that still stream. A block's activation
  bytes are measured, not modelled: the bytes its ops save for backward (saved-tensor hooks, the weights
  excluded), from its last recompute or kept forward, scaled by the hidden state's size. A block not yet
  measured is recomputed; so is every block on a device with no memory measure (the CPU).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensor

Recompute = Literal["auto"] | bool

# "auto" lets kept activations take at most this share of the device memory free at a pass's first block:
# the rest is the pass's other activations (block inputs, the loss's chunks) and the backward's transients.
KEEP_SHARE = 0.5
# Slots left unpinned: one the block in use computes from, one the next block is uploaded into.
STREAMING_SLOTS = 2


def check_recompute(value: Any) -> Recompute:
    """`value` if it is True, False or "auto", else a ValueError naming it and the choices."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError(
        f"recompute={value!r}: choose True (recompute every block in backward), False (keep every block's "
        "graph from the forward) or 'auto' (keep the last blocks' graphs while they fit)"
    )


class KeepPolicy:
    """Decides, per block call under grad, whether it keeps its graph; measures blocks' activation bytes."""

    def __init__(
        self,
        mode: Recompute,
        free_bytes: Callable[[], int | None],
        pinned_slots: Callable[[], int],
        num_slots: Callable[[], int],
        stats: dict,
    ) -> None:
        self.mode = check_recompute(mode)
        self.free_bytes, self.pinned_slots, self.num_slots, self.stats = free_bytes, pinned_slots, num_slots, stats
        self._measured: dict[int, tuple[int, int]] = {}  # block -> (bytes saved for backward, hidden numel)
        self._keep_from: dict[int, int] = {}  # a stack's first block -> its first block that keeps its graph

    def keeps(self, idx: int, first: int, count: int, hidden: torch.Tensor) -> bool:
        """Whether this call of block `idx` (the stack's blocks are first .. first+count-1) keeps its graph."""
        if self.mode is not True and (idx == first or first not in self._keep_from):
            self._keep_from[first] = first if self.mode is False else self._decide(first, count, hidden)
        kept = self.mode is not True and idx >= self._keep_from[first]
        self.stats["kept_calls"] += int(kept)
        return kept

    def _decide(self, first: int, count: int, hidden: torch.Tensor) -> int:
        keep_from = first + count
        room = self.num_slots() - STREAMING_SLOTS - self.pinned_slots()
        if room <= 0 or self.estimate(keep_from - 1, hidden.numel()) is None:
            return keep_from  # (without reading the device memory: nothing could be kept)
        free = self.free_bytes()
        if free is None:
            return keep_from
        needs = (self.estimate(j, hidden.numel()) for j in range(first + count - 1, first - 1, -1))
        return keep_from - kept_count(needs, free, room)

    def estimate(self, idx: int, numel: int) -> int | None:
        """Bytes block `idx` saves for backward on a hidden state of `numel` elements (None: not measured)."""
        if idx not in self._measured:
            return None
        nbytes, at = self._measured[idx]
        return nbytes * numel // max(at, 1)

    @contextmanager
    def measuring(self, idx: int, numel: int, persistent: list[torch.Tensor]) -> Iterator[None]:
        """Count the bytes the ops inside save for backward, each storage once; not those of `persistent`
        (the weight slots, the outer parameters' device copies), which a kept graph does not add."""
        skip = {_storage_key(t) for t in persistent}
        seen: set[Any] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            key = _storage_key(t)
            if key not in skip and key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._measured[idx] = (total, numel)


def kept_count(needs: Iterable[int | None], free: int, room: int) -> int:
    """The rule "auto" keeps graphs by (the engine at each pass, the planner ahead of a run): how many blocks,
    from the last one back, keep their graph while the bytes each saves for backward (`needs`, the last
    block's first; None: not measured) fit :data:`KEEP_SHARE` of `free` together and at most `room` slots
    are pinned."""
    budget, used, kept = KEEP_SHARE * free, 0, 0
    for need in needs:
        if kept >= room or need is None or used + need > budget:
            break
        used, kept = used + need, kept + 1
    return kept


def _storage_key(t: torch.Tensor) -> Any:
    """What identifies `t`'s storage. A fake tensor (the planner's measurement and the schedule model run
    the engine on them) has no data pointer (torch answers 0, with a warning); its storage object's address
    tells storages apart, views of one storage (RoPE's cos and sin, saved by each rotation) counting once."""
    if isinstance(t, FakeTensor):
        return ("fake", t.untyped_storage()._cdata)
    return t.untyped_storage().data_ptr()


@contextmanager
def nothing_saved() -> Iterator[None]:
    """Grad mode that keeps nothing for backward: the forward of a call the recompute will differentiate runs
    as ordinary training's forward does, in grad mode (some kernels pick their algorithm by whether an input
    requires grad: CPU attention with a mask that does, a T5 position bias, computes differently), while each
    tensor an op saves for backward is dropped at once (the recompute saves its own)."""

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("a streamed block's forward keeps no graph: its backward runs the recompute's")

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: None, unpack):
        yield


class KeptGraph:
    """A block call's graph kept from its forward: the input leaf, the outputs' gradient edges (the hidden
    state's, then the side outputs'), the weight leaves, and the slot they live in, pinned until :meth:`release` (its backward
    ran) or until the graph is dropped unused (then when this object is collected)."""

    def __init__(self, slot: int, leaves: list[torch.Tensor], unpin: Callable[[int], None]) -> None:
        self.slot, self.leaves = slot, leaves
        self.x: torch.Tensor | None = None
        self.outputs: list[Any] = []  # the outputs' gradient edges (None: computed without grad)
        self._unpin = weakref.finalize(self, unpin, slot)

    def release(self) -> None:
        """Unpin the slot (once)."""
        self._unpin()
