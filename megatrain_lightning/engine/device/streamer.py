"""The per-block device work of the engine: a block's call streamed through a weight slot, both ways.

    forward_block(i)   bind block i's weights from its slot, run it (no graph unless the call keeps one),
                       record the tensors that leave it besides its output, prefetch the next blocks
    backward_block(i)  bring its weights back (or use the slot its kept graph pinned), recompute it with
                       grad, ship its parameters' gradients to the host, return its inputs' gradients
    _run / _load       bind a slot (uploading it unless resident), enqueue the call, prefetch ahead
    _bound             a block's parameters and buffers pointed at the device for the duration of a call

The streamer owns what only the block calls need: each block's runner (engine/device/block_fn.py, which asks it to
stream), the open calls of each block (whose backward has not run yet), where each parameter of a block sits
in its modules (rebound to the slot for a call) and the device copies of the blocks' buffers. The engine
(engine.py) builds it over the parts it holds (the slot pool, the host units and the host side, the keep
policy, the saved inputs, the self-checks) and asks it only to size the slot pool after the first step, to
upload the next forward's first blocks, and to give the blocks back when it closes.

Why one file of about 520 lines: the forward and the backward of a block call share the slot binding, the
prefetch ahead and the open calls' bookkeeping here; the decisions they consult live in the parts it is given.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megatrain_lightning.engine.device.ahead import UploadsAhead
from megatrain_lightning.engine.device.block_fn import BlockRunner, CallState, SideOutputs, select_side
from megatrain_lightning.engine.device.block_state import InputChain, Mutations, flatten
from megatrain_lightning.engine.device.grad_sums import auto_sum_count
from megatrain_lightning.engine.device.kept_attention import Tape
from megatrain_lightning.engine.device.recompute import KeepPolicy, KeptGraph, nothing_saved
from megatrain_lightning.engine.device.rows import RowChunks
from megatrain_lightning.engine.device.saved_inputs import SavedInputs
from megatrain_lightning.engine.device.streams import SlotPool
from megatrain_lightning.engine.device.uploads import Uploader
from megatrain_lightning.engine.host.host_steps import HostSide, graph_task
from megatrain_lightning.engine.host.pending_reads import PendingReads
from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.engine.outer import OuterParams
from megatrain_lightning.engine.ranks import Ranks
from megatrain_lightning.engine.self_checks import SelfChecks, fingerprint
from megatrain_lightning.planning.device_memory import auto_slot_count

log = logging.getLogger("megatrain_lightning")

ParamRefs = list[tuple[nn.Module, str, int]]  # per block: (module, attribute, index in the unit's layout)


class BlockStreamer:
    """Streams each block's calls through the slot pool; block `i` is host unit ``units[i]``."""

    def __init__(
        self,
        *,
        blocks: list[nn.Module],
        units: list[HostUnit],
        shared: set[int],
        spans: list[tuple[int, int]],
        param_refs: list[ParamRefs],
        buffers: list[list[list]],
        device: torch.device,
        preserve_rng_state: bool,
        ranks: Ranks,
        pool: SlotPool,
        uploads: Uploader,
        host: HostSide,
        outer: OuterParams,
        keep: KeepPolicy,
        saved_inputs: SavedInputs,
        checks: SelfChecks,
        reads: PendingReads,
        rows: RowChunks,
        transient: Callable[[], int | None],
        free_device_bytes: Callable[[], int | None],
        keep_attention: bool = False,
    ) -> None:
        self.keep_attention = keep_attention  # (engine/device/kept_attention.py)
        self.blocks, self.units, self.device, self.preserve_rng_state = blocks, units, device, preserve_rng_state
        self.ranks, self.pool, self.uploads, self.host, self.outer = ranks, pool, uploads, host, outer
        self.keep, self.saved_inputs, self.checks, self.reads, self.rows = keep, saved_inputs, checks, reads, rows
        self._transient, self._free_device_bytes = transient, free_device_bytes
        self._step_transient: int | None = None  # what the first step needed beyond the persistent buffers
        self._step_input = 0  # and the largest input it offloaded (bytes)
        self.ahead = UploadsAhead(pool, units, host, uploads, ranks)  # (speculative steps: engine/device/ahead.py)
        host.needed_first.when = self.ahead.possible  # the step's last sums go down needed first where it pays
        # Per block, (first block, number of blocks) of its stack: a stack's blocks are consecutive, and each
        # stack's forward pass is decided on anew (offloaded inputs, kept graphs).
        self._spans, self._param_refs = spans, param_refs
        self._block_buffers = buffers  # (see block_buffers)
        self.grad_anchor = torch.empty(0, requires_grad=True)
        self.input_chain = InputChain()
        self._forward_states: list[Any] = [None] * len(units)  # weakref: the latest call of each block
        # Per block, its calls whose backward has not run yet (a graph dropped unused drops its calls too).
        self.open_calls: list[weakref.WeakSet] = [weakref.WeakSet() for _ in units]
        self.runners = [
            BlockRunner(self, i, blk, [p for _, p in blk.named_parameters() if id(p) in shared])
            for i, blk in enumerate(blocks)
        ]
        for blk, runner in zip(blocks, self.runners):
            blk.forward = runner

    # -- the calls of one block ---------------------------------------------------------------------
    def offloads_call(self, idx: int, hidden: torch.Tensor) -> bool:
        """Whether this call of block `idx` (under grad) saves its input on the host (engine/device/saved_inputs.py)."""
        first, count = self._spans[idx]
        return self.saved_inputs.offloads_call(idx - first, hidden, count)

    def chunks_call(self, idx: int, hidden: torch.Tensor) -> int | None:
        """The rows each chunk of this call of block `idx` (under grad) computes, None when it is whole
        (engine/device/rows.py; 0: ``row_chunk="auto"`` measures its first chunk of one row)."""
        return self.rows.size_for(idx, hidden)

    def keeps_call(self, idx: int, hidden: torch.Tensor) -> bool:
        """Whether this whole call of block `idx` (under grad) keeps its graph instead of a recompute
        (engine/device/recompute.py; a call in chunks of rows never does: its graph is each chunk's, made again in
        backward)."""
        return self.keep.keeps(idx, *self._spans[idx], hidden)

    def attention_tape(self, idx: int) -> Tape | None:
        """Where a new recomputed call of block `idx` keeps its attention outputs (None: keep_attention is off)."""
        if not self.keep_attention:
            return None
        return Tape(
            self.units[idx].name, fingerprint, functools.partial(self.checks.agree, idx), self.saved_inputs.stats
        )

    def size_slots(self) -> None:
        """``num_slots="auto"``, after the first optimizer step: add the slots that the device memory the step
        left free allows (device_memory.auto_slot_count), up to one per block. More slots keep more of the
        last blocks of a forward resident for its backward, and with one per block the backward uploads
        nothing and the next micro-batch of an accumulation finds every block resident. Runs once; on a
        device with no memory measure (the CPU) the pool keeps its 2 slots."""
        measured = self._memory_after_step()
        if measured is None:
            return
        free, transient = measured
        have, slot = self.pool.num_slots, self.pool.slot_bytes
        want = auto_slot_count(free, transient, slot, len(self.units), have)
        want = self.ranks.least(want)  # every rank must stream alike: as many slots as the fullest device allows
        if want > have and self.device.type == "cuda":
            torch.cuda.empty_cache()  # (once) the freed activations go back, so the slots get whole segments
        try:
            self.pool.grow(want - have)
        except torch.cuda.OutOfMemoryError:
            pass  # fragmentation: keep the slots that were allocated
        # A rank whose allocation failed midway has fewer: all keep the fewest, or they would prefetch
        # different blocks and issue their all-gathers in different orders (a hang, or wrong weights).
        self.pool.truncate(self.ranks.least(self.pool.num_slots))
        log.info(
            "num_slots='auto': %d weight slots for %d blocks (%.2f GiB each); the first step needed %.2f GiB "
            "beyond the persistent buffers and %.2f GiB was free",
            self.pool.num_slots,
            len(self.units),
            slot / 2**30,
            transient / 2**30,
            free / 2**30,
        )

    def measure_step(self) -> None:
        """After the first optimizer step: keep what it needed beyond the persistent buffers, and the largest
        input it offloaded (0: none)."""
        self._step_transient = self._transient()
        self._step_input = self.saved_inputs.largest

    def _memory_after_step(self) -> tuple[int, int] | None:
        """(free device bytes, what the first step needed beyond the persistent buffers), read after that
        step; None on a device with no memory measure (the CPU)."""
        transient = self._step_transient
        free = None if transient is None else self._free_device_bytes()
        return None if free is None else (free, transient)

    def _room_beside(self, nbytes: int, input_bytes: int) -> bool:
        """Whether an offloaded input of `input_bytes` (`nbytes` with the attention outputs kept beside it) fits on
        the device during a block's backward: free memory holds it and the first step's transient (one block's
        backward with its input), scaled by how much larger this input is than that step's largest (a longer batch
        needs as much more). Not before that step is measured, nor where it offloaded nothing, nor on a device with
        no memory measure (the CPU)."""
        measured = self._memory_after_step()
        scale = max(1.0, input_bytes / self._step_input) if self._step_input else 0.0
        return measured is not None and scale > 0 and measured[0] >= nbytes + measured[1] * scale

    def size_sums(self) -> None:
        """``device_grad_sums="auto"``, after the first optimizer step (and the slots' sizing): as many blocks get
        a device gradient sum as the memory left free allows (engine/device/grad_sums.auto_sum_count); none on a device
        with no memory measure (the CPU)."""
        measured, sums = self._memory_after_step(), self.host.sums
        if measured is None or sums is None:
            return
        free, transient = measured
        outer = sum(u.device_numel for u in self.host.outer)
        sums.grow_to(auto_sum_count(free, transient, [u.device_numel for u in self.units], sums.count, outer))
        self.host.reserve_sums()  # their buffers now, between steps, not inside the next backward
        log.info(
            "device_grad_sums='auto': %d of %d blocks sum their gradients on the device", sums.count, len(self.units)
        )

    def forward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, input_requires_grad: bool, record: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run block `idx`: (hidden output, side outputs for the autograd node), without a graph unless the
        call keeps it (``state.keep``, engine/device/recompute.py: ``state.kept`` then holds it for the backward).

        When training (`record`), the input is handed over with the flag it will have in the recompute, and
        the tensors that may leave the block besides its output are recorded (see SideOutputs)."""
        blk, runner = self.blocks[idx], self.runners[idx]
        self.checks.adopted(idx)
        x = hidden.detach().requires_grad_(input_requires_grad) if record else hidden
        side = SideOutputs(blk) if record else None
        keep = record and state.keep
        chunked = record and state.row_chunk is not None
        if chunked:
            self.rows.refuse_before(self.units[idx].name, blk, state, x)

        def call() -> Any:
            if side is None:
                return state.call(runner.inner, x)
            if keep:  # nothing is replayed: the forward runs once
                with side.recording(), self._measuring(idx, x):
                    return state.call(runner.inner, x)
            # (inside the binding: a buffer's changes are seen on its device copy)
            with side.recording(), Mutations.watch(blk) as state.changed:
                if chunked:
                    measuring = functools.partial(self._measuring, idx)
                    name = self.units[idx].name
                    return self.rows.forward(idx, name, state, runner.inner, x, self.checks, state.row_chunk, measuring)
                return state.call(runner.inner, x)

        # Training: in grad mode, as ordinary training's forward and the recompute (engine/device/recompute.py).
        with (torch.enable_grad() if keep else nothing_saved()) if record else torch.no_grad():
            result, kept = self._run(idx, +1, call, keep=keep)
            out, state.unsplit, state.extra = state.split(result)
        if side is None:
            return out, []
        state.own_input = x
        if chunked:
            self.rows.refuse_after(self.units[idx].name, state, [*side.tensors, *state.sunk()], state.drew)
        side.add(state.extra)
        side.add(state.sunk())
        state.recorded = len(side.tensors)
        state.side_index = select_side(side.tensors, out, [x, *flatten((state.args, state.kwargs))[0]])
        picked = [side.tensors[i] for i in state.side_index]
        state.extra_ids = {id(t): j for j, t in enumerate(picked)}
        self._forward_states[idx] = weakref.ref(state)
        self.open_calls[idx].add(state)
        if kept is not None:
            # The node's outputs are these very tensors (a hook or an attribute may hold them, and autograd
            # re-points them at the node): their graph's own ends are taken first, as edges, which hold no
            # tensor (a view would hold the output, which holds the node, which holds this state: a cycle
            # that would keep a dropped graph's activations and slot). A tensor computed without grad has
            # none, and takes no gradient, as in ordinary training.
            kept.x = x
            kept.outputs = [get_gradient_edge(t) if t.requires_grad else None for t in [out, *picked]]
            state.kept = kept
        elif not chunked:  # (a chunked call's fingerprints are its chunks': engine/device/rows.py)
            self.checks.forward_done(state, [out, *picked])
        return out, picked

    def backward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, grads_out: list, needs: tuple[bool, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recompute block `idx` with grad (or differentiate the graph its forward kept); ship its parameters'
        gradients to the host, return the gradients of its inputs (the hidden state, then the arguments that
        require grad) where `needs` asks for them."""
        unit, blk, runner = self.units[idx], self.blocks[idx], self.runners[idx]
        self.open_calls[idx].discard(state)
        more = bool(self.open_calls[idx])  # another call of this block is still to come back
        if idx == len(self.units) - 1:
            self.host.read_ahead_backward()
        kept: KeptGraph | None = state.kept
        # Parameters the user froze get no gradient, exactly as in ordinary training (checked now: a
        # parameter may be frozen or unfrozen between steps; a kept graph has the flags of its forward).
        params = kept.leaves if kept is not None else [e.param for e in unit.layout]
        trained = [i for i, p in enumerate(params) if p.requires_grad]
        if not trained and not any(needs):
            if kept is not None:
                kept.release()
            return (None,) * len(needs)
        wanted = [t for t, need in zip(state.grad_inputs, needs[1:]) if need]  # leaves: grads taken, not kept
        # The gradients the later blocks sent each grad input through its chain link (InputChain).
        n_side = len(grads_out) - state.chained
        grads_out, seeds = grads_out[:n_side], grads_out[n_side:]
        seeded = [(t, g) for t, g, need in zip(state.grad_inputs, seeds, needs[1:]) if need and g is not None]

        def recompute() -> tuple:
            if kept is not None:
                return differentiate(kept.x, kept.outputs, [])
            x = hidden.detach().requires_grad_(needs[0])
            side = SideOutputs(blk)
            with torch.enable_grad(), state.replay(), state.changed.replayed(unit.name):
                with side.recording(), self._measuring(idx, x):
                    out, _, extra = state.split(state.call(runner.inner, x))
                side.add(extra)
                side.add(state.sunk())
                side.restore_attrs()
                # Made last, so autograd runs them first: a grad input's sum starts from the later blocks' part.
                links = [(t.view_as(t), g) for t, g in seeded]
            if len(side.tensors) != state.recorded:
                raise RuntimeError(
                    f"block {unit.name} produced {len(side.tensors)} side tensors in its recompute but "
                    f"{state.recorded} in its forward: the block must run the same code both times"
                )
            self.checks.recompute_done(idx, state, [out, *(side.tensors[i] for i in state.side_index)])
            return differentiate(x, [out, *(side.tensors[i] for i in state.side_index)], links)

        def differentiate(x: torch.Tensor, outputs: list[torch.Tensor | GradientEdge | None], links: list) -> tuple:
            if kept is not None:
                with torch.enable_grad():  # made now, and last: autograd still runs them first
                    links = [(t.view_as(t), g) for t, g in seeded]
            pairs = [(o, g) for o, g in zip(outputs, grads_out)]
            pairs = [(o, g) for o, g in pairs if g is not None and o is not None and _differentiable(o)] + links
            inputs = ([x] if needs[0] else []) + wanted + [params[i] for i in trained]
            if not pairs:
                return (None,) * len(inputs)
            outs, gouts = zip(*pairs)
            return torch.autograd.grad(outs, inputs, gouts, allow_unused=True)

        def recompute_rows() -> tuple:
            measuring = functools.partial(self._measuring, idx)
            done = functools.partial(self.checks.recompute_done, idx, state)
            weights = [params[i] for i in trained]
            return self.rows.backward(state, runner.inner, hidden, grads_out, needs[0], weights, done, measuring)

        grads = list(self._run(idx, -1, recompute_rows if state.row_spans else recompute, kept=kept)[0])
        if state.tape is not None:
            state.tape.left_over()  # (before any of its gradient leaves)
        grads_in = [grads.pop(0) if need else None for need in needs]
        by_entry: list[torch.Tensor | None] = [None] * len(unit.layout)
        for i, g in zip(trained, grads):
            by_entry[i] = g
        present = [g is not None for g in by_entry]
        # (ranks.ships_absent: every rank ships, a collective, and a parameter has a gradient if any rank's has one)
        if any(present) or (self.ranks.ships_absent and trained):
            if not self.host.sum_grads(unit, by_entry, present, idx, more):
                flat, grad_slot = self.host.pack_grads(unit, by_entry)
                self.host.ship(unit, flat, present, block_idx=idx, grad_slot=grad_slot, more=more)
        elif unit.grad.held is not None and not more:
            self.host.land_held(unit, idx, this_pass=unit.grad.held.task == graph_task())  # it was the last call
        return tuple(grads_in)

    def _run(
        self, idx: int, direction: int, fn: Callable[[], Any], keep: bool = False, kept: KeptGraph | None = None
    ) -> tuple[Any, KeptGraph | None]:
        """Bind block `idx`'s weights from a slot, enqueue `fn`, then prefetch the next blocks (those whose
        optimizer step is done: a pending one is waited for when its block runs, not before).

        `keep`: the call keeps its graph: its weights are fresh leaves over the slot, and the slot stays
        pinned until the call's backward (returned: the KeptGraph). `kept`: that backward, on its pinned slot
        (the block's parameters are bound to it too, for a checkpoint inside the block that recomputes)."""
        unit = self.units[idx]
        slot = self._load(idx, {idx}) if kept is None else kept.slot
        earlier = self._earlier_input(idx) if direction < 0 else []  # the next backward's offloaded input(s)
        if earlier and self._room_beside(sum(e.host.nbytes for e in earlier), earlier[0].host.nbytes):
            for e in earlier:
                self.saved_inputs.prefetch(e, early=True)  # (its copy runs during this backward)
        # (binding rewrites the parameters' .data, which reads nothing: outside the pending-reads mode too)
        with self.reads.suspended(), self._bound(idx, self.pool.acquire(slot, unit.slot_numel), fresh=keep) as leaves:
            out = fn()
        self.pool.release(slot)
        if kept is not None:
            kept.release()
        if keep:
            self.pool.pin(slot)
            kept = KeptGraph(slot, leaves, self.pool.unpin)
        for e in earlier:
            self.saved_inputs.prefetch(e)  # (otherwise now: after the compute whose end frees its memory)
        self.ahead.backward_call(idx) if direction < 0 else self.ahead.forward_call()
        depth = self._prefetch_depth(direction)
        ahead = [j for j in (idx + direction * k for k in range(1, depth + 1)) if 0 <= j < len(self.units)]
        for j in ahead:
            if self._load(j, {idx, *ahead}, wait=False) is None:
                break  # steps finish in forward order (or every other slot is pinned): stop here
        return out, (kept if keep else None)

    def _earlier_input(self, idx: int) -> list[Any]:
        """The offloaded input (saved_inputs.SavedInput) of the latest call of block `idx` - 1, which backward
        reaches next, and the attention outputs offloaded beside it; none when it offloaded nothing."""
        earlier = self._forward_states[idx - 1] if idx > 0 else None
        state = earlier() if earlier is not None else None
        if state is None or state.saved is None:
            return []
        return [state.saved, *(state.tape.stowed() if state.tape is not None else ())]

    def _prefetch_depth(self, direction: int) -> int:
        """How many blocks ahead of the one computing are uploaded now: as many as the other slots hold, unless
        the ranks' uploads are collectives (engine/ranks.py: ``prefetch_depth``)."""
        return self.ranks.prefetch_depth(self.pool.num_slots - 1, forward=direction > 0)

    @contextmanager
    def _bound(self, idx: int, flat: torch.Tensor, fresh: bool = False) -> Iterator[list[nn.Parameter]]:
        """Point block `idx`'s parameters at the device weights in `flat` and its buffers at their device
        copies for the duration of a call; afterwards the parameters are views of the masters again.

        `fresh`: the block's modules hold, for the call, new leaf parameters over `flat` (yielded, in the
        unit's order, with the flags of the block's own): a graph kept from the call saves those, which
        stay on the slot when the block's own parameters move back to the masters."""
        unit = self.units[idx]
        buffers = [(record, record[2].data) for record in self._block_buffers[idx]]
        unit.bind_slot(flat)
        leaves = [nn.Parameter(e.param.data, requires_grad=e.param.requires_grad) for e in unit.layout] if fresh else []
        for module, name, i in self._param_refs[idx] if fresh else []:
            module._parameters[name] = leaves[i]
        for (_, _, b, dev), _ in buffers:
            b.data = dev
        try:
            yield leaves
        finally:
            for module, name, i in self._param_refs[idx] if fresh else []:
                module._parameters[name] = unit.layout[i].param
            unit.bind_host()
            for record, host in buffers:
                module, name, b, _ = record
                now = module._buffers.get(name)
                if now is not b and now is not None:  # the forward assigned a new tensor: the copy from now on
                    record[3] = now.detach()
                    module._buffers[name] = b
                b.data = host

    def _load(self, idx: int, protect: set[int], wait: bool = True) -> int | None:
        """Block `idx`'s slot, uploading it unless resident; with `wait=False` None (and nothing issued)
        while its optimizer step is still pending."""
        unit = self.units[idx]
        slot = self.pool.slot_of(idx)
        if slot is None:
            # (ranks.late_steps: False where an upload is a collective, whose issue must not depend on timing)
            if not wait and self.ranks.late_steps and self.host.weights_pending(unit):
                return None
            self.host.wait_weights(unit)  # a pending optimizer step is still rewriting the copy
            slot = self.ahead.take(idx)  # (its next weights, if they went up ahead and are its weights now)
            if slot is None:
                slot = self.pool.load(idx, protect, lambda dst: self.uploads.upload(unit, dst), optional=not wait)
            if slot is None:
                return None
        unit.upload_done = self.pool.ready[slot]
        if unit.future is None or unit.future.done():  # (a kept speculative step: the master may still be stepping)
            self.reads.settled(unit)
        return slot

    def _measuring(self, idx: int, x: torch.Tensor, held: list[Any] = ()) -> AbstractContextManager:
        """Count what block `idx`'s call saves for backward (``recompute="auto"`` sizes kept graphs by it,
        ``row_chunk="auto"`` chunks)."""
        if self.keep.mode != "auto" and not self.rows.auto:
            return nullcontext()
        persistent = [*self.pool.buffers, *self.outer.device_copies, *(t for t in held if isinstance(t, torch.Tensor))]
        return self.keep.measuring(idx, x.numel(), persistent)

    def upload_first(self) -> None:
        """After an optimizer step: the next forward's first blocks go up now, block 0 as soon as its step is
        done, the blocks after it only if theirs are done already (the next forward's prefetch takes the
        rest), so more slots never hold this thread back."""
        first = set(range(min(self._prefetch_depth(+1), len(self.units))))
        for j in sorted(first):
            if self._load(j, first, wait=j == 0) is None:
                break  # steps finish in forward order: the blocks after it are not ready either

    def release(self) -> None:
        """Give the blocks back: their own forwards, their parameters views of the masters."""
        self.input_chain.clear()
        for blk, runner in zip(self.blocks, self.runners):
            blk.__dict__.pop("forward", None)
            if runner.own is not None:
                blk.forward = runner.own
        for unit in self.units:
            unit.bind_host()

    # -- the blocks' buffers and parameter bindings --------------------------------------------------
    def refresh_block_buffers(self) -> None:
        """Copy the blocks' host buffers to the device anew (see :func:`block_buffers`)."""
        self._block_buffers = block_buffers(self.blocks, self.device)

    def buffers_to_host(self, idx: int | None = None) -> None:
        """Write block `idx`'s (None: every block's) device buffer copies into its host buffers (before they
        are read)."""
        records = self._block_buffers[idx] if idx is not None else [r for rs in self._block_buffers for r in rs]
        for _, _, host, dev in records:
            if host.shape == dev.shape and host.dtype == dev.dtype:
                host.copy_(dev)
            else:
                host.data = dev.detach().to(host.device)

    def adopt_block_changes(self, idx: int, param_refs: list[tuple[nn.Module, str, int]]) -> None:
        """Block `idx`'s parameters sit at `param_refs` now, and its buffers may have changed (SelfChecks saw
        pruning or a parametrization after setup): bind those from now on, and copy new buffers to the device."""
        self._param_refs[idx] = param_refs
        self.buffers_to_host()
        self.refresh_block_buffers()


def param_refs(block: nn.Module, unit: HostUnit) -> ParamRefs:
    """Where each of `block`'s parameters sits among its modules (they are rebound for a call that keeps
    its graph)."""
    at = {id(e.param): j for j, e in enumerate(unit.layout)}
    return [
        (m, n, at[id(p)]) for m in block.modules() for n, p in m._parameters.items() if p is not None and id(p) in at
    ]


def block_buffers(blocks: list[nn.Module], device: torch.device) -> list[list[list]]:
    """Device copies of the blocks' host buffers, per block a list of [module, name, host buffer, device
    copy]: bound in place of the host ones while a block runs, so what its forward updates in place lands
    on the copy (and a buffer the forward replaces becomes the copy); :meth:`BlockStreamer.buffers_to_host`
    brings the copies back."""
    records: dict[tuple[int, str], list] = {}  # one per buffer: a module shared by blocks has one copy
    out = []
    for blk in blocks:
        here = [(m, n, b) for m in blk.modules() for n, b in m._buffers.items()]
        for m, n, b in here:
            if b is not None and b.device != device and (id(m), n) not in records:
                records[id(m), n] = [m, n, b, b.to(device)]  # (copied once, however many blocks hold it)
        out.append([records[id(m), n] for m, n, _ in here if (id(m), n) in records])
    return out


def _differentiable(t: torch.Tensor | GradientEdge) -> bool:
    return isinstance(t, GradientEdge) or t.requires_grad
