"""The streaming engine: host-resident units, device slots, gradient shipping and the host worker.

The engine is applied to an ordinary, built model (it imports no Lightning):

- every decoder block's parameters move into one :class:`HostUnit` (flat fp32 master, Adam moments,
  pinned compute copy and gradient slab) and the block's ``forward`` becomes a :class:`BlockRunner`;
  the block's parameters stay registered, as fp32 views of the master, so names and ``state_dict``
  keys do not change;
- every parameter outside the blocks (embedding, final norm, head) gets a unit of its own. Its compute
  copy lives on the device for the whole run (it does not grow with depth) and is rewritten after each
  optimizer step; a post-accumulate-grad hook ships its gradient to host as soon as autograd has it;
- one host worker thread (engine/worker.py) does all host-side arithmetic: landing gradients
  (accumulating in fp32), norms for clipping, and optimizer steps, a unit's jobs in the order submitted
  and steps in the order the next forward needs them. A unit's ``future`` is its last job;
  nothing reads or overwrites a unit's buffers before that future and the copy events it waits on.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from megatrain_lightning.device_memory import auto_slot_count, free_device_bytes, step_transient_bytes
from megatrain_lightning.engine import pinned
from megatrain_lightning.engine.block_fn import BlockRunner, CallState, SideOutputs, select_side
from megatrain_lightning.engine.config import (
    NumSlots,
    OffloadInputs,
    check_host_layout,
    check_num_slots,
    check_offload_inputs,
)
from megatrain_lightning.engine.discover import find_blocks
from megatrain_lightning.engine.host import HostUnit, available_host_bytes, host_bytes_by_kind, host_bytes_per_param
from megatrain_lightning.engine.host_steps import HostSteps, graph_task
from megatrain_lightning.engine.nvme import BUFFERS, NvmeTier
from megatrain_lightning.engine.outer import OuterParams, _bind
from megatrain_lightning.engine.ring import HostRing, piece_numel, pieces, ring_counts
from megatrain_lightning.engine.saved_inputs import (
    SavedInputs,
    offload_needed,
)
from megatrain_lightning.engine.streams import SlotPool, Streams
from megatrain_lightning.engine.worker import HostWorker
from megatrain_lightning.optim.kernels import AdamHyper
from megatrain_lightning.optim.threads import configure_host_threads, resolve_host_threads

log = logging.getLogger("megatrain_lightning")


class HostMemoryError(MemoryError):
    """The model's host-resident training state does not fit in this machine's memory."""


class StreamingEngine(HostSteps, OuterParams):
    """Streams a model's decoder blocks through device slots; all persistent state stays on the host."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device | str,
        compute_dtype: torch.dtype = torch.bfloat16,
        num_slots: NumSlots = "auto",  # "auto": 2, then after the first step what its device memory allows
        training: bool = True,
        accumulating: bool = False,  # gradients summed over micro-batches: count the fp32 accumulator
        clipping: bool = False,  # gradients wait for a global norm: the lean layout keeps a slab per unit
        pin_memory: bool | None = None,
        preserve_rng_state: bool = True,
        available_bytes: Callable[[], int] | None = None,
        offload_inputs: OffloadInputs = "auto",
        free_device_bytes: Callable[[], int] | None = None,
        step_transient_bytes: Callable[[], int | None] | None = None,  # None: measured (device_memory.py)
        host_layout: str = "default",  # "lean": no persistent compute copy, gradients through a ring
        nvme_dir: str | None = None,  # Adam moments in files there (engine/nvme.py)
        piece: int | None = None,  # elements per piece of the rings and the NVMe tier (engine/ring.py)
        host_threads: int | None = None,  # the host worker's thread budget (optim/threads.py); None: cores - 1
    ) -> None:
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute_dtype={compute_dtype}: the engine computes in torch.float32 or torch.bfloat16")
        # Cumulative counters for progress bars and benchmarks (seconds are wall time of the thread named).
        self.stats = {
            "h2d_bytes": 0,  # weights uploaded (blocks and outer parameters)
            "d2h_bytes": 0,  # gradients downloaded
            "input_offload_bytes": 0,  # saved block inputs to the host and back (offload_inputs)
            "offloaded_passes": 0,  # forward passes whose saved block inputs went to the host
            "host_step_seconds": 0.0,  # worker: Adam steps
            "host_land_seconds": 0.0,  # worker: waiting for downloads, accumulating, norms
            "host_wait_seconds": 0.0,  # compute-issuing thread blocked on a pending host job
        }
        check_host_layout(host_layout)
        self.host_layout, self.nvme_dir = host_layout, nvme_dir
        self.host_threads = resolve_host_threads(host_threads)  # ValueError before anything is allocated
        self.num_slots = check_num_slots(num_slots)
        self.model = model
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.preserve_rng_state = preserve_rng_state
        self.blocks_name, self.blocks = find_blocks(model)
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        block_params = [list(b.named_parameters()) for b in self.blocks]
        in_blocks = {id(p) for params in block_params for _, p in params}
        outer = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
        largest_block = max(sum(p.numel() for _, p in params) for params in block_params)
        largest = max(largest_block, *(p.numel() for _, p in outer))
        self.piece = piece_numel(largest) if piece is None else piece
        if self.piece < 1:
            raise ValueError(f"piece={piece}: elements per piece must be at least 1 (None picks a size)")
        self._check_host_memory(block_params, outer, training, available_bytes, accumulating, clipping, largest_block)
        # Checked (directory, free space) before the model is taken apart; the moments need it only to train.
        self.tier = NvmeTier(nvme_dir, _numel(block_params, outer), self.piece) if training and nvme_dir else None

        self.streams = Streams(self.device)
        # Block inputs saved for backward: on the device, or (offload_inputs) in pinned host buffers.
        self.offload_inputs = offload_inputs
        # Device memory free for saved inputs ("auto"); None measures the device (see _free_device_bytes).
        self.free_device_bytes = free_device_bytes
        self.step_transient_bytes = step_transient_bytes
        self._pass_offloads: bool | None = None  # the decision of the forward pass under way
        self._auto_announced = False
        self.saved_inputs = SavedInputs(self.streams, self.device, pin, self.stats)
        self._caches_off = _disable_kv_caches(model) if training else []
        self.units: list[HostUnit] = []
        self.outer_units: list[HostUnit] = []
        self._staging: HostRing | None = None  # lean layout: uploads cast the master into these
        self._uploaded: Any = None  # event: the end of the upload issued last (holds its staging buffer)
        self._grad_ring: HostRing | None = None  # lean layout: gradients landed at once go through these
        # A block called more than once before a backward: its later calls' gradients come down through this
        # ring (the lean layout's gradient ring, else one made at the first such call) to add to the first.
        self._sum_ring: HostRing | None = None
        self._ring_shape = (ring_counts(largest_block, self.piece)[1], pin)
        try:
            if host_layout == "lean":
                staging, grads = ring_counts(largest_block, self.piece)
                if compute_dtype != torch.float32:  # in fp32 the pinned master is the upload source
                    self._staging = HostRing("staging", staging, self.piece, compute_dtype, pin)
                if training:
                    self._grad_ring = HostRing("gradient", grads, self.piece, compute_dtype, pin)
            self._build_blocks(block_params, pin)
            self._build_outer(outer, pin)
        except BaseException:
            pinned.unregister(self._pinnable())  # what was already page-locked (e.g. the limit ran out midway)
            if self.tier is not None:
                self.tier.close()
            raise
        self._forward_states: list[Any] = [None] * len(self.units)  # weakref: the latest call of each block
        # Per block, its calls whose backward has not run yet (a graph dropped unused drops its calls too).
        self._open_calls: list[weakref.WeakSet] = [weakref.WeakSet() for _ in self.units]
        self._block_index = {id(u): i for i, u in enumerate(self.units)}
        max_numel = max(u.numel for u in self.units)
        self.pool = SlotPool(self.streams, 2 if num_slots == "auto" else num_slots, max_numel, compute_dtype)
        self._grad_slots = [torch.empty(max_numel, dtype=compute_dtype, device=self.device) for _ in range(2)]
        self._grad_slot_free: list[object | None] = [None, None]
        self._next_grad_slot = 0
        self.grad_anchor = torch.empty(0, requires_grad=True)
        # Steps run in the order the next forward needs them, among those whose gradient has landed
        # (engine/worker.py); with the NVMe tier in the order queued, the order its read-ahead plan names.
        self._worker = HostWorker(
            "megatrain-host_0", worker_init, (self.device, self.host_threads), fifo=self.tier is not None
        )
        self.backward_mode: str | None = None  # None | "accumulate" | "step": set by the trainer glue
        self.hyper: Callable[[], list[AdamHyper]] | None = None  # the attached optimizer's groups, now
        self.param_order: list[int] = []  # ids of the optimizer's parameters in group order
        self.overlap_optimizer = True
        self.want_norms = False
        self._pending: set[HostUnit] = set()  # units with gradients not yet stepped
        self._eager: set[HostUnit] = set()  # units stepped during this backward already
        self._clip: float | None = None  # global-norm clipping requested for the next step
        self.optimizer_steps = 0

    # -- construction helpers -------------------------------------------------------------------
    def _build_blocks(self, block_params: list, pin: bool) -> None:
        """Move each block into a host unit, bind its parameters to the master, route its forward here."""
        self.runners: list[BlockRunner] = []
        self._state_hooks = []
        for i, (blk, params) in enumerate(zip(self.blocks, block_params)):
            unit = HostUnit(f"{self.blocks_name}.{i}", params, self.compute_dtype, pin, self._keep_copy)
            self.units.append(unit)
            _bind(unit, unit.master)  # frees the block's own storage right away
            self.runners.append(BlockRunner(self, i, blk))
            blk.forward = self.runners[-1]
            # A block's parameters are views of its master, which the worker steps in the background after
            # optimizer_step returns: state_dict() (of the model or the block) waits for the block's step.
            self._state_hooks.append(blk.register_state_dict_pre_hook(lambda *_, unit=unit: unit.wait()))
        self._refresh_block_buffers()

    @property
    def _keep_copy(self) -> bool:
        return self.host_layout != "lean"

    def _check_host_memory(
        self,
        block_params,
        outer,
        training: bool,
        available_bytes,
        accumulating: bool,
        clipping: bool,
        largest_block: int,
    ) -> None:
        numel = _numel(block_params, outer)
        layout, elt = self.host_layout, torch.tensor([], dtype=self.compute_dtype).element_size()
        per_param = host_bytes_per_param(self.compute_dtype, training, accumulating, layout, clipping)
        rings = sum(ring_counts(largest_block, self.piece)) * self.piece * elt if layout == "lean" else 0
        nvme = training and bool(self.nvme_dir)  # m, v on the drive: a few pieces' working buffers instead
        per_param -= 8 if nvme else 0
        need = numel * per_param + rings + (BUFFERS * self.piece * 8 if nvme else 0)
        # The model's own parameters are released unit by unit as they move into flat buffers.
        reclaim = sum(
            p.numel() * p.element_size() for params in block_params for _, p in params if p.device.type == "cpu"
        )
        have = (available_bytes or available_host_bytes)() + reclaim
        if need > have:
            labels = {
                "master": "fp32 master",
                "adam": "Adam m and v",
                "copy": "transfer copy",
                "slab": "gradient slab",
                "acc": "fp32 gradient accumulator",
            }
            kinds = [
                labels[k]
                for k, b in host_bytes_by_kind(elt, training, accumulating, layout, clipping).items()
                if b and not (nvme and k == "adam")
            ]
            raise HostMemoryError(
                f"the model's {numel / 1e9:.2f}B parameters need {need / 2**30:.1f} GiB of host memory "
                f"({per_param} bytes/param: {', '.join(kinds[:-1])} and {kinds[-1]}) but about "
                f"{have / 2**30:.1f} GiB is available. Use a machine with more host memory, a smaller model"
                + (
                    ", accumulate_grad_batches=1 (drops the 4 bytes/param fp32 gradient accumulator)"
                    if accumulating
                    else ""
                )
                + ", or check the size first with the memory planner."
            )

    def _refresh_block_buffers(self) -> None:
        """Device copies of the blocks' buffers (bound in place of the host ones while a block runs)."""
        self._block_buffers = [
            [(b, b.to(self.device)) for b in blk.buffers() if b.device != self.device] for blk in self.blocks
        ]

    def _outer_buffers_to(self, device: torch.device) -> None:
        in_blocks = {id(m) for b in self.blocks for m in b.modules()}
        for module in self.model.modules():
            if id(module) in in_blocks:
                continue
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)

    # -- optimizer attachment -------------------------------------------------------------------
    def attach_optimizer(
        self, groups: dict[int, int], hyper: Callable[[], list[AdamHyper]], param_order: list[int]
    ) -> None:
        """Map parameters (by id) to param groups and allocate Adam moments (first time only)."""
        self.flush()
        self.param_order = param_order
        for unit in self.all_units():
            unit.set_groups(groups)
            unit.tier = self.tier
            unit.alloc_optimizer_state()
        self.hyper = hyper

    def all_units(self) -> list[HostUnit]:
        # Outer units first: the embedding is the first thing the next forward needs.
        return self.outer_units + self.units

    # -- where saved block inputs go ----------------------------------------------------------------
    @property
    def offload_inputs(self) -> OffloadInputs:
        """True: saved block inputs go to pinned host memory; False: they stay on the device; "auto":
        decided per forward pass from the device memory free for them (:func:`offload_needed`)."""
        return self._offload_inputs

    @offload_inputs.setter
    def offload_inputs(self, value: OffloadInputs) -> None:
        self._offload_inputs = check_offload_inputs(value)

    def offloads_call(self, idx: int, hidden: torch.Tensor) -> bool:
        """Whether this call of block `idx` (under grad) saves its input on the host.

        Decided when block 0 starts a forward pass and then followed by every block of the pass, so a
        setting or free memory that changes midway cannot split a pass. Each call keeps its answer
        (CallState.offload, CallState.saved): its backward looks where its forward put the input."""
        if idx == 0 or self._pass_offloads is None:
            self._pass_offloads = self._decide_offload(hidden)
            self.stats["offloaded_passes"] += int(self._pass_offloads)
        return self._pass_offloads

    def _decide_offload(self, hidden: torch.Tensor) -> bool:
        if self.offload_inputs != "auto":
            return self.offload_inputs
        free = self._free_device_bytes()
        if free is None:
            return False
        saved = len(self.blocks) * hidden.numel() * hidden.element_size()
        offload = offload_needed(saved, free)
        if offload and not self._auto_announced:
            self._auto_announced = True  # once per run: the decision may flip with every step
            log.info(
                "offload_inputs='auto': saving block inputs in host memory: %d blocks x %s need %.2f GiB, "
                "%.2f GiB of device memory free",
                len(self.blocks),
                tuple(hidden.shape),
                saved / 2**30,
                free / 2**30,
            )
        return offload

    def _free_device_bytes(self) -> int | None:
        """Device memory free for saved inputs, or None where "auto" keeps them on the device: on a CPU
        device the inputs already are in host memory (a copy would only duplicate them), and other
        devices have no measure of free memory here."""
        if self.free_device_bytes is not None:
            return self.free_device_bytes()
        return free_device_bytes(self.device)

    # -- how many weight slots ("auto") -----------------------------------------------------------------
    def size_slots(self) -> None:
        """``num_slots="auto"``, after the first optimizer step: add the slots that the device memory the step
        left free allows (device_memory.auto_slot_count), up to one per block. More slots keep more of the
        last blocks of a forward resident for its backward, and with one per block the backward uploads
        nothing and the next micro-batch of an accumulation finds every block resident. Runs once; on a
        device with no memory measure (the CPU) the pool keeps its 2 slots."""
        transient = self._step_transient_bytes()
        free = None if transient is None else self._free_device_bytes()
        if free is None:
            return
        have, slot = self.pool.num_slots, self.pool.slot_bytes
        want = auto_slot_count(free, transient, slot, len(self.units), have)
        if want > have and self.device.type == "cuda":
            torch.cuda.empty_cache()  # (once) the freed activations go back, so the slots get whole segments
        try:
            self.pool.grow(want - have)
        except torch.cuda.OutOfMemoryError:
            pass  # fragmentation: keep the slots that were allocated
        log.info(
            "num_slots='auto': %d weight slots for %d blocks (%.2f GiB each); the first step needed %.2f GiB "
            "beyond the persistent buffers and %.2f GiB was free",
            self.pool.num_slots,
            len(self.units),
            slot / 2**30,
            transient / 2**30,
            free / 2**30,
        )

    def _step_transient_bytes(self) -> int | None:
        if self.step_transient_bytes is not None:
            return self.step_transient_bytes()
        return step_transient_bytes(self.device)

    # -- forward / backward of one block ---------------------------------------------------------
    def forward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, input_requires_grad: bool, record: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run block `idx` without a graph: (hidden output, side outputs for the autograd node).

        When training (`record`), the input is handed over with the flag it will have in the recompute, and
        the tensors that may leave the block besides its output are recorded (see SideOutputs)."""
        blk, runner = self.blocks[idx], self.runners[idx]
        x = hidden.detach().requires_grad_(input_requires_grad) if record else hidden
        side = SideOutputs(blk) if record else None

        def call() -> Any:
            with side.recording() if side is not None else nullcontext():
                return state.call(runner.inner, x)

        with torch.no_grad():
            out, state.kind, state.extra = state.split(self._run(idx, +1, call))
        if side is None:
            return out, []
        side.add(state.extra)
        state.recorded = len(side.tensors)
        state.side_index = select_side(
            side.tensors, out, [x, *torch.utils._pytree.tree_leaves((state.args, state.kwargs))]
        )
        picked = [side.tensors[i] for i in state.side_index]
        state.extra_ids = {id(t): j for j, t in enumerate(picked)}
        self._forward_states[idx] = weakref.ref(state)
        self._open_calls[idx].add(state)
        return out, picked

    def backward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, grads_out: list, need_input_grad: bool
    ) -> torch.Tensor | None:
        """Recompute block `idx` with grad; ship its parameters' gradients to the host, return the input's."""
        unit, blk, runner = self.units[idx], self.blocks[idx], self.runners[idx]
        self._open_calls[idx].discard(state)
        more = bool(self._open_calls[idx])  # another call of this block is still to come back
        if idx == len(self.units) - 1:
            self._read_ahead_backward()
        # Parameters the user froze get no gradient, exactly as in ordinary training (checked now: a
        # parameter may be frozen or unfrozen between steps).
        trained = [i for i, e in enumerate(unit.entries) if e.param.requires_grad]
        if not trained and not need_input_grad:
            return None

        def recompute() -> tuple:
            x = hidden.detach().requires_grad_(need_input_grad)
            side = SideOutputs(blk)
            with torch.enable_grad(), state.replay():
                with side.recording():
                    out, _, extra = state.split(state.call(runner.inner, x))
                side.add(extra)
            side.restore_attrs()
            if len(side.tensors) != state.recorded:
                raise RuntimeError(
                    f"decoder block {idx} produced {len(side.tensors)} side tensors in its recompute but "
                    f"{state.recorded} in its forward: the block must run the same code both times"
                )
            pairs = [(o, g) for o, g in zip([out, *(side.tensors[i] for i in state.side_index)], grads_out)]
            pairs = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
            inputs = ([x] if need_input_grad else []) + [unit.entries[i].param for i in trained]
            if not pairs:
                return (None,) * len(inputs)
            outs, gouts = zip(*pairs)
            return torch.autograd.grad(outs, inputs, gouts, allow_unused=True)

        grads = self._run(idx, -1, recompute)
        by_entry: list[torch.Tensor | None] = [None] * len(unit.entries)
        for i, g in zip(trained, grads[1:] if need_input_grad else grads):
            by_entry[i] = g
        present = [g is not None for g in by_entry]
        if any(present):
            flat, grad_slot = self._pack_grads(unit, by_entry)
            self._ship(unit, flat, present, block_idx=idx, grad_slot=grad_slot, more=more)
        elif unit.held is not None and not more:
            self._land_held(unit, idx, this_pass=unit.held.task == graph_task())  # it was the last call
        return grads[0] if need_input_grad else None

    def _run(self, idx: int, direction: int, fn: Callable[[], Any]) -> Any:
        """Bind block `idx`'s weights from a slot, enqueue `fn`, then prefetch the next blocks (those whose
        optimizer step is done: a pending one is waited for when its block runs, not before)."""
        unit = self.units[idx]
        slot = self._load(idx, {idx})
        with self._bound(idx, self.pool.acquire(slot, unit.numel)):
            out = fn()
        self.pool.release(slot)
        # Prefetch after enqueueing the compute, so waiting for a pending host step never delays it.
        if direction < 0 and idx > 0:
            earlier = self._forward_states[idx - 1]
            state = earlier() if earlier is not None else None
            # The next block's input, if its call offloaded it (prefetch(None) does nothing).
            self.saved_inputs.prefetch(state.saved if state is not None else None)
        ahead = [j for j in (idx + direction * k for k in range(1, self.pool.num_slots)) if 0 <= j < len(self.units)]
        for j in ahead:
            if self._load(j, {idx, *ahead}, wait=False) is None:
                break  # steps finish in forward order: the blocks after it are not ready either
        return out

    @contextmanager
    def _bound(self, idx: int, flat: torch.Tensor) -> Iterator[None]:
        """Point block `idx`'s parameters at the device weights in `flat` and its buffers at their device
        copies for the duration of a call; afterwards the parameters are views of the masters again."""
        unit = self.units[idx]
        buffers = [(b, b.data, dev) for b, dev in self._block_buffers[idx]]
        _bind(unit, flat)
        for b, _, dev in buffers:
            b.data = dev
        try:
            yield
        finally:
            _bind(unit, unit.master)
            for b, host, _ in buffers:
                b.data = host

    def _load(self, idx: int, protect: set[int], wait: bool = True) -> int | None:
        """Block `idx`'s slot, uploading it unless resident; with `wait=False` None (and nothing issued)
        while its optimizer step is still pending."""
        unit = self.units[idx]
        slot = self.pool.slot_of(idx)
        if slot is None:
            if not wait and unit.future is not None and not unit.future.done():
                return None
            self._wait(unit)  # a pending optimizer step is still rewriting the master (and copy)
            self.stats["h2d_bytes"] += unit.numel * self.pool.buffers[0].element_size()
            slot = self.pool.load(idx, protect, lambda dst: self._upload(unit, dst))
        unit.upload_done = self.pool.ready[slot]
        return slot

    def _upload(self, unit: HostUnit, dst: torch.Tensor) -> object:
        """Issue the H2D copies of `unit`'s weights into `dst` (the caller made the H2D stream wait until
        `dst` may be overwritten): whole from its compute copy, or piece by piece through the staging
        ring. Returns the event of the last copy, which ends them all (one stream, in order)."""
        for lo, hi in self._pieces(unit):
            with self._upload_source(unit, lo, hi) as source:
                self.streams.copy(self.streams.h2d, dst[lo:hi], source)
                self._uploaded = self.streams.event(self.streams.h2d)
        return self._uploaded

    @contextmanager
    def _upload_source(self, unit: HostUnit, lo: int = 0, hi: int | None = None) -> Iterator[torch.Tensor]:
        """The host buffer an upload of `unit`'s elements lo..hi reads: its compute copy, or (lean layout)
        the next staging buffer with the master just cast into it, held until the upload issued meanwhile
        (whose end `self._uploaded` names) has read it."""
        hi = unit.numel if hi is None else hi
        if unit.copy is not None:
            yield unit.copy[lo:hi]
            return
        i, staged = self._staging.take(hi - lo)
        staged.copy_(unit.master[lo:hi])  # the rounding the step's fused cast would do: the same bits go up
        yield staged
        self._staging.hold(i, self._uploaded)

    def _pieces(self, unit: HostUnit) -> list[tuple[int, int]]:
        """Element ranges an upload of `unit` goes in: one, unless staging buffers are smaller than it."""
        return pieces(unit.numel, unit.numel if unit.copy is not None else self.piece)

    # -- state exchange ----------------------------------------------------------------------------
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter as its fp32 host master (views, no copies)."""
        self.flush()
        for unit in self.outer_units:
            _bind(unit, unit.master)
        try:
            return self.model.state_dict()
        finally:
            for unit, dev in zip(self.outer_units, self._outer_device):
                _bind(unit, dev)

    def load_master_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights into the fp32 masters and refresh every compute copy."""
        self.flush()
        for unit in self.outer_units:
            _bind(unit, unit.master)
        self.model.load_state_dict(state_dict, strict=strict)
        self.refresh_from_masters()

    def refresh_from_masters(self) -> None:
        """After the masters (or buffers) were written from outside: rewrite every compute copy, rebind and
        re-upload the outer parameters, and forget what the slots hold."""
        self.flush()
        for unit in self.all_units():
            unit.refresh_copy()
        self._refresh_block_buffers()
        for unit, dev in zip(self.outer_units, self._outer_device):
            self._upload_outer(unit, dev)
        self._stale.clear()
        self.pool.invalidate()

    def qualified_names(self, unit: HostUnit) -> list[str]:
        """The model's own names (``state_dict`` keys) of a unit's parameters, in layout order."""
        prefix = f"{unit.name}." if unit in self.units else ""
        return [prefix + e.name for e in unit.entries]

    # -- accounting and teardown -------------------------------------------------------------------
    def device_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on the device: they do not grow with the number of blocks."""
        grad_slots = sum(g.numel() * g.element_size() for g in self._grad_slots)
        outer = sum(d.numel() * d.element_size() for d in self._outer_device)
        return {"weight_slots": self.pool.nbytes(), "grad_slots": grad_slots, "outer": outer}

    def host_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for unit in self.all_units():
            for kind, n in unit.nbytes().items():
                total[kind] = total.get(kind, 0) + n
        if self.host_layout == "lean" or self._sum_ring is not None:
            total["ring"] = sum(r.nbytes() for r in self._rings())
        if self.tier is not None:  # the moments in host memory: the NVMe tier's working buffers only
            total["adam"] = total.get("adam", 0) + self.tier.buffer_bytes()
        return total

    def nvme_bytes(self) -> int:
        """Bytes of Adam moments in files under nvme_dir (0 without the NVMe tier)."""
        return 0 if self.tier is None else self.tier.file_bytes()

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the engine holds: exactly its pinned buffers' sizes, no rounding (the
        compute copy and the gradient slab; in fp32 the master, which is the copy, and the slab)."""
        return pinned.registered_bytes(self._pinnable())

    def _rings(self) -> list[HostRing]:
        return [r for r in {id(r): r for r in (self._staging, self._grad_ring, self._sum_ring) if r}.values()]

    def _pinnable(self) -> list[torch.Tensor | None]:
        rings = [b for r in self._rings() for b in r.buffers]
        return (
            [t for unit in self.all_units() for t in (unit.master, unit.copy, unit.slab)]
            + self.saved_inputs.buffers
            + rings
        )

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.all_units())

    def release(self) -> None:
        """Give the model back as an ordinary fp32 host model (parameters are views of the masters)."""
        self.flush()
        self.streams.synchronize()  # no copy may still read or write a device buffer freed below
        self._worker.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()  # the moments are scratch: the run directory goes with them
        for handle in self._hooks + self._state_hooks:
            handle.remove()
        for config in self._caches_off:
            config.use_cache = True
        for blk, runner in zip(self.blocks, self.runners):
            blk.__dict__.pop("forward", None)
            if runner.own is not None:
                blk.forward = runner.own
        for unit in self.all_units():
            _bind(unit, unit.master)
        self._outer_buffers_to(torch.device("cpu"))
        self._outer_device.clear()
        self.pool.buffers.clear()
        self._grad_slots.clear()
        pinned.unregister(self._pinnable())  # they stay allocated (the masters as the model's parameters)


def _numel(block_params: list, outer: list) -> int:
    return sum(p.numel() for params in block_params for _, p in params) + sum(p.numel() for _, p in outer)


def _disable_kv_caches(model: nn.Module) -> list[Any]:
    """Set ``use_cache=False`` on every Hugging Face config in `model` (returns those changed, to restore).

    A cache filled during the forward would be filled again by each block's recompute. Training never
    reads it, so turning it off changes no result; a cache passed explicitly is refused by the block."""
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True and not any(c is config for c in changed):
            config.use_cache = False
            changed.append(config)
    return changed


def worker_init(device: torch.device, host_threads: int | None = None) -> None:
    """The host worker waits on CUDA events: it must use the engine's GPU, not create a context on GPU 0. It
    takes its thread budget (optim/threads.py) before its first torch op."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    configure_host_threads(host_threads)
