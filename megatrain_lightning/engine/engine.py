"""The streaming engine: the one public API every client drives.

    engine = Engine(model, EngineConfig(precision="bf16-mixed"))   # the model's blocks now stream
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    with engine.autocast():
        loss = model(batch)
    with engine.backward(accumulate=False, clip=True):            # what this backward is for
        loss.backward()
    engine.clip_grad_norm_(1.0)                                    # or clip_grad_value_(0.5)
    opt.step(); opt.zero_grad()
    engine.save("s3://bucket/run/step-100")                        # engine.load(url) resumes
    engine.close()                                                 # an ordinary fp32 host model again

The Lightning Trainer strategy, the Fabric strategy, a plain loop, the planner's fake-tensor measurement
and the schedule model all go through these calls. The engine holds its parts and passes each what it
needs (it imports no Lightning):

    Engine
     |- HostUnit per block and per outer parameter (engine/host.py): flat fp32 master, Adam moments,
     |  compute copy, gradient slab; the block's parameters stay registered as views of the master
     |- SlotPool (engine/streams.py): device slots blocks stream through; Uploader (engine/uploads.py)
     |- BlockRunner per block (engine/block_fn.py): the block's forward, recomputed in backward
     |  (engine/block_state.py: what a block call takes, returns and changes)
     |- SavedInputs (engine/saved_inputs.py): block inputs kept for backward, on the device or the host
     |- KeepPolicy (engine/recompute.py): which block calls keep their graph instead of a recompute
     |- HostSide (engine/host_steps.py): gradients to the host, accumulation, norms, Adam, the worker
     |- OuterParams (engine/outer.py): embedding, final norm, head: device copies rewritten after a step
 |- Partition (engine/partition.py), data parallel only: this rank's shard of every unit, the collectives

One host worker thread (engine/worker.py) does all host-side arithmetic, a unit's jobs in the order
submitted and steps in the order the next forward needs them. A unit's ``future`` is its last job;
nothing reads or overwrites a unit's buffers before that future and the copy events it waits on.

Why one file of about 950 lines: it is the public API (each call a few lines) and the per-block streaming
(forward_block, backward_block, the slot loads they issue), which share the slot pool and the open calls of
each block; the parts with state of their own live in the files named above.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from megatrain_lightning.device_memory import auto_slot_count, free_device_bytes, step_transient_bytes
from megatrain_lightning.engine import host_memory, materialize, pinned
from megatrain_lightning.engine.block_fn import BlockRunner, CallState, SideOutputs, compile_block_calls, select_side
from megatrain_lightning.engine.block_state import InputChain, Mutations, flatten
from megatrain_lightning.engine.config import EngineConfig, forward_context
from megatrain_lightning.engine.discover import find_blocks, unit_parameters
from megatrain_lightning.engine.generic_optim import GenericHostOptimizer, GenericSteps
from megatrain_lightning.engine.host import (
    HostMemoryError,
    HostUnit,
    host_bytes_by_kind,
    host_bytes_per_param,
)
from megatrain_lightning.engine.host_memory import available_host_bytes
from megatrain_lightning.engine.host_steps import HostSide, graph_task
from megatrain_lightning.engine.nvme import BUFFERS, NvmeTier
from megatrain_lightning.engine.optimizer import HostAdamW, check_optimizer, native_ok
from megatrain_lightning.engine.outer import OuterParams
from megatrain_lightning.engine.partition import Partition, partition_of
from megatrain_lightning.engine.pending_reads import PendingReads
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.engine.recompute import KeepPolicy, KeptGraph, nothing_saved
from megatrain_lightning.engine.replay import refuse_compiled
from megatrain_lightning.engine.ring import HostRing, piece_numel, ring_counts
from megatrain_lightning.engine.saved_inputs import SavedInputs
from megatrain_lightning.engine.self_checks import SelfChecks
from megatrain_lightning.engine.streams import SlotPool, Streams
from megatrain_lightning.engine.uploads import Uploader
from megatrain_lightning.engine.worker import HostWorker
from megatrain_lightning.optim.threads import (
    configure_host_threads,
    numa_nodes,
    rank_cpus,
    resolve_host_threads,
    usable_cpus,
)

log = logging.getLogger("megatrain_lightning")


class Engine:
    """Streams a model's blocks through device slots; all persistent state stays on the host."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, probes: Probes | None = None) -> None:
        self.config = config = EngineConfig() if config is None else config
        probes = Probes() if probes is None else probes
        self.model, self.device, self.compute_dtype = model, config.torch_device, config.compute_dtype
        self.preserve_rng_state = config.preserve_rng_state
        self.stats = _new_stats()
        self.host_cpus: list[int] | None = None  # data parallel: this rank's share of the machine's CPUs
        self.host_threads = resolve_host_threads(config.host_threads)
        refuse_compiled(model)  # (engine/replay.py)
        # The stacks, each distinct block once, the parameters blocks share (outer units); what setup logs.
        self.layout = find_blocks(model, config.blocks)
        self.blocks = self.layout.blocks
        # Data parallel (engine/partition.py): this rank holds one shard of every unit's host state.
        self.partition = partition = partition_of(config.group)
        if partition is not None:
            self.host_cpus = (
                rank_cpus(partition.local_rank, partition.local_world, usable_cpus(), numa_nodes())
                if partition.split_cpus
                else sorted(usable_cpus())  # (bound apart already: each rank's own CPUs)
            )
            self.host_threads = resolve_host_threads(config.host_threads, len(self.host_cpus))
        # Per block, (first block, number of blocks) of its stack: a stack's blocks are consecutive, and each
        # stack's forward pass is decided on anew (offloaded inputs, kept graphs).
        stack = self.layout.stack_of
        self._spans = [(stack.index(s), stack.count(s)) for s in stack]
        pin = self.device.type == "cuda" if config.pin_memory is None else config.pin_memory
        block_params, outer = unit_parameters(model, self.layout)
        largest_block = max(sum(p.numel() for _, p in params) for params in block_params)
        self.piece = config.piece or piece_numel(max([largest_block, *(p.numel() for _, p in outer)]))
        self._host_available = probes.host_available_bytes or available_host_bytes
        self._host_need = self._check_host_memory(block_params, outer, self._host_available)
        # Checked (directory, free space) before the model is taken apart; the moments need it only to train.
        training = config.training
        self.tier = (
            NvmeTier(config.nvme_dir, _numel(block_params, outer), self.piece) if training and config.nvme_dir else None
        )
        self.streams = (probes.streams or Streams)(self.device)
        free = probes.device_free_bytes or partial(free_device_bytes, self.device)
        self._transient = probes.step_transient_bytes or partial(step_transient_bytes, self.device)
        self._free_device_bytes = free
        # With several ranks, what decides a collective must be decided alike on every rank: the least free memory.
        keep_free = free if partition is None else partial(_least_free, free, partition)
        self.saved_inputs = SavedInputs(
            self.streams,
            self.device,
            pin,
            self.stats,
            config.offload_inputs,
            free,
            self._host_room,
            config.offload_inputs_dtype,
        )
        if training and self.layout.repeated and _kv_cache_configs(model):
            raise ValueError(
                f"{self.layout.repeated[0]} of {type(model).__name__} is one module, and the model's config has "
                "use_cache=True: ordinary training then lets its later calls attend to the keys its earlier calls "
                "cached (they share a layer index), which a recomputed block cannot repeat. Set "
                "model.config.use_cache = False for training, or build one module per position"
            )
        self._caches_off = _disable_kv_caches(model) if training else []
        staging, grads = ring_counts(largest_block, self.piece)
        lean = config.host_layout == "lean"
        # Lean layout: uploads cast the master into a staging ring (in fp32 the pinned master is the source).
        staging_ring = (
            HostRing("staging", staging, self.piece, self.compute_dtype, pin)
            if lean and self.compute_dtype != torch.float32
            else None
        )
        grad_ring = HostRing("gradient", grads, self.piece, self.compute_dtype, pin) if lean and training else None
        self.uploads = Uploader(self.streams, self.stats, self.piece, staging_ring, partition)
        self.units: list[HostUnit] = []
        outer_units: list[HostUnit] = []
        empty = materialize.empty_params(model)  # built without weights: filled unit by unit below
        try:
            self._build_blocks(block_params, pin)
            outer_units = [self._unit(n, [(n, p)], pin, not lean) for n, p in outer]
            materialize.fill_units(model, self.units + outer_units, empty)
        except BaseException:
            pinned.unregister(
                self._pinnable(self.units + outer_units, [staging_ring, grad_ring])
            )  # the limit ran out midway
            if self.tier is not None:
                self.tier.close()
            raise
        self._forward_states: list[Any] = [None] * len(self.units)  # weakref: the latest call of each block
        # Per block, its calls whose backward has not run yet (a graph dropped unused drops its calls too).
        self._open_calls: list[weakref.WeakSet] = [weakref.WeakSet() for _ in self.units]
        slots = 2 if config.num_slots == "auto" else config.num_slots
        self.pool = SlotPool(self.streams, slots, max(u.slot_numel for u in self.units), self.compute_dtype)
        self.pool.grow_when_pinned = config.recompute is False
        self.keep = KeepPolicy(config.recompute, keep_free, self.pool.pinned, lambda: self.pool.num_slots, self.stats)
        self.grad_anchor = torch.empty(0, requires_grad=True)
        self.input_chain = InputChain()
        # Steps run in the order the next forward needs them, among those whose gradient has landed
        # (engine/worker.py); with the NVMe tier in the order queued, the order its read-ahead plan names.
        worker = HostWorker(
            "megatrain-host_0",
            worker_init,
            (self.device, self.host_threads, self.host_cpus),
            fifo=self.tier is not None,
        )
        self.host = HostSide(
            self.units,
            outer_units,
            self.streams,
            probes.worker(worker) if probes.worker is not None else worker,
            self.stats,
            piece=self.piece,
            grad_ring=grad_ring,
            ring_shape=(grads, pin),
            tier=self.tier,
            overlap_optimizer=config.overlap_optimizer,
            invalidate=self.pool.invalidate,
            partition=partition,
        )
        self._outer_buffers_to(self.device)
        self.outer = OuterParams(outer_units, self.device, self.streams, self.uploads, self.host)
        self.optimizer_steps = 0
        self._host_views = self._host_view_writes = 0  # host_view(): depth, and how many of them write
        self._optimizer: HostAdamW | GenericHostOptimizer | None = None  # engine.optimizer()'s (its groups: save())
        self.generic: GenericSteps | None = None  # torch optimizers stepping themselves (engine/generic_optim.py)
        if config.compile_blocks:
            compile_block_calls(self.blocks, self.runners)
        self.checks = SelfChecks(self)  # (engine/self_checks.py)
        self.reads = PendingReads(self.host.wait)  # (engine/pending_reads.py)
        if self.device.type == "cuda":
            self.host.gate = self.checks.gate  # a block's host jobs first read its recompute's comparison

    # -- construction helpers -------------------------------------------------------------------
    def _unit(self, name: str, params: list, pin: bool, keep_copy: bool) -> HostUnit:
        """A host unit over `params`: whole, or partitioned, this rank's shard of it."""
        if self.partition is None:
            return HostUnit(name, params, self.compute_dtype, pin, keep_copy)
        numel = sum(p.numel() for _, p in params)
        bounds, padded = self.partition.bounds(numel), self.partition.padded(numel)
        return HostUnit(name, params, self.compute_dtype, pin, keep_copy, bounds=bounds, device_numel=padded)

    def _build_blocks(self, block_params: list, pin: bool) -> None:
        """Move each block into a host unit, bind its parameters to the master, route its forward here."""
        self.runners: list[BlockRunner] = []
        self._param_refs: list[list[tuple[nn.Module, str, int]]] = []  # per block: where each parameter sits
        self._state_hooks = []
        for i, (blk, params) in enumerate(zip(self.blocks, block_params)):
            keep_copy = self.config.host_layout != "lean"
            unit = self._unit(self.layout.names[i], params, pin, keep_copy)
            self.units.append(unit)
            unit.bind_host()  # frees the block's own storage right away
            foreign = [p for _, p in blk.named_parameters() if id(p) in self.layout.shared]
            self.runners.append(BlockRunner(self, i, blk, foreign))
            at = {id(e.param): j for j, e in enumerate(unit.layout)}
            self._param_refs.append(
                [
                    (m, n, at[id(p)])
                    for m in blk.modules()
                    for n, p in m._parameters.items()
                    if p is not None and id(p) in at
                ]
            )
            blk.forward = self.runners[-1]
            # A block's parameters are views of its master, which the worker steps in the background after
            # optimizer_step returns: state_dict() (of the model or the block) waits for the block's step, and
            # reads the buffers the block's forward updated on their device copies.
            self._state_hooks.append(blk.register_state_dict_pre_hook(partial(self._block_state_read, i)))
        self._refresh_block_buffers()

    def _check_host_memory(self, block_params, outer, available_bytes: Callable[[], int]) -> int:
        """Refuse a model whose training state does not fit the host; returns the bytes it counted."""
        c = self.config
        numel = _numel(block_params, outer, self.partition)
        layout, elt = c.host_layout, torch.tensor([], dtype=self.compute_dtype).element_size()
        per_param = host_bytes_per_param(self.compute_dtype, c.training, c.accumulating, layout, c.clipping)
        largest_block = max(sum(p.numel() for _, p in params) for params in block_params)
        rings = sum(ring_counts(largest_block, self.piece)) * self.piece * elt if layout == "lean" else 0
        nvme = c.training and bool(c.nvme_dir)  # m, v on the drive: a few pieces' working buffers instead
        per_param -= 8 if nvme else 0
        need = numel * per_param + rings + (BUFFERS * self.piece * 8 if nvme else 0)
        # The model's own parameters are released unit by unit as they move into flat buffers.
        reclaim = sum(
            p.numel() * p.element_size() for params in block_params for _, p in params if p.device.type == "cpu"
        )
        have = available_bytes() + reclaim
        if need > have:
            labels = {
                "master": "fp32 master",
                "adam": "Adam m and v",
                "copy": "transfer copy",
                "slab": "gradient slab",
                "acc": "fp32 gradient accumulator",
            }
            by_kind = host_bytes_by_kind(elt, c.training, c.accumulating, layout, c.clipping)
            kinds = [labels[k] for k, b in by_kind.items() if b and not (nvme and k == "adam")]
            share = "" if self.partition is None else f" (this rank's 1/{self.partition.world} share of them)"
            raise HostMemoryError(
                f"the model's {numel / 1e9:.2f}B parameters{share} need {need / 2**30:.1f} GiB of host memory "
                f"({per_param} bytes/param: {', '.join(kinds[:-1])} and {kinds[-1]}) but about "
                f"{have / 2**30:.1f} GiB is available{self._host_limit_named(available_bytes)}. Use a machine "
                "with more host memory, a smaller model"
                + (
                    ", accumulate_grad_batches=1 (drops the 4 bytes/param fp32 gradient accumulator)"
                    if c.accumulating
                    else ""
                )
                + ", or check the size first with the memory planner."
            )
        return need

    @staticmethod
    def _host_limit_named(available_bytes: Callable[[], int]) -> str:
        """Which limit the machine's reading came from, when it is not the machine's free memory (a
        container's cgroup, ulimit -v), and how to raise it."""
        if available_bytes is not host_memory.available_host_bytes:  # a stand-in's figure (Probes)
            return ""
        limit = host_memory.tightest_host_limit()
        return "" if limit.name == "MemAvailable" else f" under {limit.name} ({limit.fix})"

    def _host_room(self) -> int:
        """Host memory left for new buffers (the offloaded inputs'): what the OS can still hand out, less what
        the check at construction counted but the engine has not allocated yet (the gradient slabs come with
        the first backward, the Adam moments with the optimizer)."""
        pending = self._host_need - sum(self.host_bytes().values())
        return self._host_available() - max(0, pending)

    def _refresh_block_buffers(self) -> None:
        """Device copies of the blocks' host buffers, per block a list of [module, name, host buffer, device
        copy]: bound in place of the host ones while a block runs, so what its forward updates in place lands
        on the copy (and a buffer the forward replaces becomes the copy); :meth:`_buffers_to_host` brings the
        copies back."""
        records: dict[tuple[int, str], list] = {}  # one per buffer: a module shared by blocks has one copy
        self._block_buffers = []
        for blk in self.blocks:
            here = [(m, n, b) for m in blk.modules() for n, b in m._buffers.items()]
            for m, n, b in here:
                if b is not None and b.device != self.device and (id(m), n) not in records:
                    records[id(m), n] = [m, n, b, b.to(self.device)]  # (copied once, however many blocks hold it)
            self._block_buffers.append([records[id(m), n] for m, n, _ in here if (id(m), n) in records])

    def _buffers_to_host(self, idx: int | None = None) -> None:
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
        self._buffers_to_host()
        self._refresh_block_buffers()

    def _block_state_read(self, idx: int, *_: Any) -> None:
        self._whole("a block's state_dict()")
        self.units[idx].wait()
        self._buffers_to_host(idx)

    def _whole(self, what: str) -> None:
        """Refuse `what` when partitioned: it needs every parameter whole in this process."""
        if self.partition is not None:
            raise RuntimeError(
                f"{what} needs every parameter whole in this process, but each of the {self.partition.world} "
                "data-parallel ranks holds 1/W of them; save a checkpoint (engine.save) and read it instead"
            )

    def _outer_buffers_to(self, device: torch.device) -> None:
        in_blocks = {id(m) for b in self.blocks for m in b.modules()}
        for module in self.model.modules():
            if id(module) in in_blocks:
                continue
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)

    # -- the phases of a step ----------------------------------------------------------------------
    def optimizer(self, optimizer: torch.optim.Optimizer) -> HostAdamW | GenericHostOptimizer:
        """Take over a torch optimizer built on the model's parameters: the returned optimizer shares its
        param groups (schedulers keep working) and steps the host masters. A plain AdamW or Adam steps on the
        native kernel, overlapping backward; any other steps itself (engine/generic_optim.py)."""
        return self.optimizers([optimizer])[0]

    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[HostAdamW | GenericHostOptimizer]:
        """Take over several torch optimizers at once (over disjoint parameters; each steps itself, see
        engine/generic_optim.py); replaces those taken over before."""
        optimizers = [check_optimizer(o) for o in optimizers]
        self.generic = None
        if not optimizers:  # (Lightning's configure_optimizers may return none)
            return []
        if len(optimizers) == 1 and native_ok(optimizers[0]):
            self._optimizer = HostAdamW(optimizers[0], self)
            return [self._optimizer]
        self.generic = GenericSteps(self, optimizers)
        self._optimizer = self.generic.optimizers[0]
        return list(self.generic.optimizers)

    def attach_optimizer(self, groups: dict[int, int], hyper: Callable[[], list[Any]], param_order: list[int]) -> None:
        """Map parameters (by id) to param groups and allocate Adam moments (first time only); called by
        :class:`HostAdamW`."""
        self.flush()
        for unit in self.all_units():
            unit.set_groups(groups)
            unit.tier = self.tier
            unit.alloc_optimizer_state()
        self.host.attach(hyper, param_order)

    @property
    def has_optimizer(self) -> bool:
        return self.host.hyper is not None

    @property
    def param_order(self) -> list[int]:
        """Ids of the optimizer's parameters in group order (how ``clip_grad_norm_`` walks them)."""
        return self.host.param_order

    def autocast(self) -> AbstractContextManager:
        """The context the forward runs under for this precision (autocast to bf16 for ``bf16-mixed``)."""
        return forward_context(self.config.precision, self.device.type)

    @contextmanager
    def backward(
        self, accumulate: bool = False, clip: bool | Literal["norm", "value"] = False, visible: bool = False
    ) -> Iterator[None]:
        """What the backward passes run inside are for.

        ``accumulate=True``: more micro-batches follow before the optimizer step, so their gradients are
        summed in fp32 on the host. Otherwise the backward completes the step's gradient: with
        ``overlap_optimizer`` each unit is stepped on the host as soon as its gradient lands, while the
        backward goes on, unless ``clip=True`` says :meth:`clip_grad_norm_` comes first (the norms are then
        taken on the device as the gradients go down; ``clip="value"``: :meth:`clip_grad_value_` comes first:
        called before this backward, the units still step as they land, clamped first; otherwise they wait).
        ``visible=True``: :meth:`gradients_visible` shows the gradients to hooks before the step, so every
        gradient lands and waits for it (and clipping norms are taken at the step, from what the hooks left).
        A backward outside this context (nothing known of what follows, e.g. Lightning's manual
        optimization) lands its gradients to wait for the step."""
        host = self.host
        before = host.mode, host.want_norms, host.hold
        host.mode = "accumulate" if accumulate else "step"
        host.want_norms = clip in (True, "norm") and not visible
        host.hold = visible or (clip == "value" and not host.clamp_known)
        try:
            yield
            self.checks.fold_strays()
        finally:
            host.mode, host.want_norms, host.hold = before

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip the global gradient norm to `max_norm` in the next optimizer step, exactly as
        ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters (gradients never sit in ``.grad``)."""
        self.host.clip_to(max_norm)

    def grad_norm(self) -> torch.Tensor:
        """The total 2-norm of the gradients the next optimizer step uses (fp32, on the host), bit for bit what
        ``torch.nn.utils.clip_grad_norm_`` returns over the optimizer's parameters. It waits for every
        gradient to land; the norms it takes serve the step's clipping too. Partitioned, every rank calls it
        (the ranks' squares are summed)."""
        return self.host.grad_norm()

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] in the next optimizer step, exactly as
        ``torch.nn.utils.clip_grad_value_`` on the step's (summed) gradient. Called before the step's last
        backward, with ``backward(clip="value")``, the optimizer still overlaps that backward (the clamp is
        done on the device, or by the landing job for a sum); called again after it with the same value, it
        does nothing more."""
        self.host.clip_value_to(clip_value)

    @contextmanager
    def gradients_visible(self) -> Iterator[None]:
        """Show every parameter's gradient in ``.grad`` for the duration (hooks between backward and the step).

        Every gradient lands first; ``.grad`` is then an fp32 host view of the landed gradient (the fp32
        accumulator, 4 bytes/param) and each parameter a view of its fp32 master, so devices and shapes
        agree. What the caller leaves in ``.grad`` (edited in place, assigned, or set to None) is the
        gradient the next step (and a later micro-batch's sum) uses; afterwards ``.grad`` is None again and
        the outer parameters are their device copies."""
        self._whole("engine.gradients_visible()")
        self.checks.fold_strays()
        self.host.expose()
        self.outer.bind_masters()
        units = self.all_units()
        for unit in units:
            views = unit.views(unit.acc) if unit.acc is not None else {}
            for e, has in zip(unit.entries, unit.has_grad):
                e.param.grad = views[e.name] if has else None
        try:
            yield
        finally:
            for unit in units:
                self.host.take_back(unit, [e.param.grad for e in unit.entries])
                for e in unit.entries:
                    e.param.grad = None
            self.outer.bind_device()

    def optimizer_step(self) -> None:
        """Step every unit holding gradients; blocks step in the background in forward order."""
        self.checks.fold_strays()
        stepped = self.host.step()
        self.outer.mark_stale(stepped)
        self.optimizer_steps += 1
        if self.optimizer_steps == 1 and self.config.num_slots == "auto":
            self.size_slots()  # the step's device memory is known now, its activations freed
        # What the next forward reads first goes up now, each as soon as its own step is done: the outer
        # parameters (every device copy is current when this returns), then its first blocks. (Always, not
        # only when the steps happen to be done: the uploads a step makes do not depend on timing.)
        self.outer.refresh()
        # Block 0 waits for its step; the blocks after it go up now only if theirs are done already (the
        # next forward's prefetch takes the rest), so more slots never hold this thread back.
        first = set(range(min(self._prefetch_depth(+1), len(self.units))))
        for j in sorted(first):
            if self._load(j, first, wait=j == 0) is None:
                break  # steps finish in forward order: the blocks after it are not ready either
        self.reads.watch(self.units)  # what reads a block's weights before its load waits for its step

    def zero_grad(self) -> None:
        """Drop the gradients not stepped yet (nothing blocks)."""
        self.checks.drop_strays()
        self.host.zero_grad()

    def flush(self) -> None:
        """Wait for every host job and every upload reading a host buffer: the host buffers may then be read
        or rewritten (checkpoints, loading weights, teardown)."""
        self.host.flush()
        self.reads.clear()  # every step is done

    def all_units(self) -> list[HostUnit]:
        # Outer units first: the embedding is the first thing the next forward needs.
        return self.host.all_units()

    @property
    def outer_units(self) -> list[HostUnit]:
        return self.outer.units

    def offloads_call(self, idx: int, hidden: torch.Tensor) -> bool:
        """Whether this call of block `idx` (under grad) saves its input on the host (engine/saved_inputs.py)."""
        first, count = self._spans[idx]
        return self.saved_inputs.offloads_call(idx - first, hidden, count)

    def keeps_call(self, idx: int, hidden: torch.Tensor) -> bool:
        """Whether this call of block `idx` (under grad) keeps its graph instead of a recompute (engine/recompute.py)."""
        return self.keep.keeps(idx, *self._spans[idx], hidden)

    # -- how many weight slots ("auto") -----------------------------------------------------------------
    def size_slots(self) -> None:
        """``num_slots="auto"``, after the first optimizer step: add the slots that the device memory the step
        left free allows (device_memory.auto_slot_count), up to one per block. More slots keep more of the
        last blocks of a forward resident for its backward, and with one per block the backward uploads
        nothing and the next micro-batch of an accumulation finds every block resident. Runs once; on a
        device with no memory measure (the CPU) the pool keeps its 2 slots."""
        transient = self._transient()
        free = None if transient is None else self._free_device_bytes()
        if free is None:
            return
        have, slot = self.pool.num_slots, self.pool.slot_bytes
        want = auto_slot_count(free, transient, slot, len(self.units), have)
        if self.partition is not None:  # every rank must stream alike: as many slots as the fullest device allows
            want = self.partition.least(want)
        if want > have and self.device.type == "cuda":
            torch.cuda.empty_cache()  # (once) the freed activations go back, so the slots get whole segments
        try:
            self.pool.grow(want - have)
        except torch.cuda.OutOfMemoryError:
            pass  # fragmentation: keep the slots that were allocated
        if self.partition is not None:
            # A rank whose allocation failed midway has fewer: all keep the fewest, or they would prefetch
            # different blocks and issue their all-gathers in different orders (a hang, or wrong weights).
            self.pool.truncate(self.partition.least(self.pool.num_slots))
        log.info(
            "num_slots='auto': %d weight slots for %d blocks (%.2f GiB each); the first step needed %.2f GiB "
            "beyond the persistent buffers and %.2f GiB was free",
            self.pool.num_slots,
            len(self.units),
            slot / 2**30,
            transient / 2**30,
            free / 2**30,
        )

    # -- forward / backward of one block ---------------------------------------------------------
    def forward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, input_requires_grad: bool, record: bool = True
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run block `idx`: (hidden output, side outputs for the autograd node), without a graph unless the
        call keeps it (``state.keep``, engine/recompute.py: ``state.kept`` then holds it for the backward).

        When training (`record`), the input is handed over with the flag it will have in the recompute, and
        the tensors that may leave the block besides its output are recorded (see SideOutputs)."""
        blk, runner = self.blocks[idx], self.runners[idx]
        self.checks.adopted(idx)
        x = hidden.detach().requires_grad_(input_requires_grad) if record else hidden
        side = SideOutputs(blk) if record else None
        keep = record and state.keep

        def call() -> Any:
            if side is None:
                return state.call(runner.inner, x)
            if keep:  # nothing is replayed: the forward runs once
                with side.recording(), self._measuring(idx, x):
                    return state.call(runner.inner, x)
            # (inside the binding: a buffer's changes are seen on its device copy)
            with side.recording(), Mutations.watch(blk) as state.changed:
                return state.call(runner.inner, x)

        # Training: in grad mode, as ordinary training's forward and the recompute (engine/recompute.py).
        with (torch.enable_grad() if keep else nothing_saved()) if record else torch.no_grad():
            result, kept = self._run(idx, +1, call, keep=keep)
            out, state.unsplit, state.extra = state.split(result)
        if side is None:
            return out, []
        state.own_input = x
        side.add(state.extra)
        side.add(state.sunk())
        state.recorded = len(side.tensors)
        state.side_index = select_side(side.tensors, out, [x, *flatten((state.args, state.kwargs))[0]])
        picked = [side.tensors[i] for i in state.side_index]
        state.extra_ids = {id(t): j for j, t in enumerate(picked)}
        self._forward_states[idx] = weakref.ref(state)
        self._open_calls[idx].add(state)
        if kept is not None:
            # The node's outputs are these very tensors (a hook or an attribute may hold them, and autograd
            # re-points them at the node): their graph's own ends are taken first, as edges, which hold no
            # tensor (a view would hold the output, which holds the node, which holds this state: a cycle
            # that would keep a dropped graph's activations and slot). A tensor computed without grad has
            # none, and takes no gradient, as in ordinary training.
            kept.x = x
            kept.outputs = [get_gradient_edge(t) if t.requires_grad else None for t in [out, *picked]]
            state.kept = kept
        else:
            self.checks.forward_done(state, [out, *picked])
        return out, picked

    def backward_block(
        self, idx: int, state: CallState, hidden: torch.Tensor, grads_out: list, needs: tuple[bool, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """Recompute block `idx` with grad (or differentiate the graph its forward kept); ship its parameters'
        gradients to the host, return the gradients of its inputs (the hidden state, then the arguments that
        require grad) where `needs` asks for them."""
        unit, blk, runner = self.units[idx], self.blocks[idx], self.runners[idx]
        self._open_calls[idx].discard(state)
        more = bool(self._open_calls[idx])  # another call of this block is still to come back
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

        grads = list(self._run(idx, -1, recompute, kept=kept)[0])
        grads_in = [grads.pop(0) if need else None for need in needs]
        by_entry: list[torch.Tensor | None] = [None] * len(unit.layout)
        for i, g in zip(trained, grads):
            by_entry[i] = g
        present = [g is not None for g in by_entry]
        # Partitioned, every rank ships (a collective) and a parameter has a gradient if any rank's has one.
        if any(present) or (self.partition is not None and trained):
            flat, grad_slot = self.host.pack_grads(unit, by_entry)
            self.host.ship(unit, flat, present, block_idx=idx, grad_slot=grad_slot, more=more)
        elif unit.held is not None and not more:
            self.host.land_held(unit, idx, this_pass=unit.held.task == graph_task())  # it was the last call
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
        with self._bound(idx, self.pool.acquire(slot, unit.slot_numel), fresh=keep) as leaves:
            out = fn()
        self.pool.release(slot)
        if kept is not None:
            kept.release()
        if keep:
            self.pool.pin(slot)
            kept = KeptGraph(slot, leaves, self.pool.unpin)
        # Prefetch after enqueueing the compute, so waiting for a pending host step never delays it.
        if direction < 0 and idx > 0:
            earlier = self._forward_states[idx - 1]
            state = earlier() if earlier is not None else None
            # The next block's input, if its call offloaded it (prefetch(None) does nothing).
            self.saved_inputs.prefetch(state.saved if state is not None else None)
        depth = self._prefetch_depth(direction)
        ahead = [j for j in (idx + direction * k for k in range(1, depth + 1)) if 0 <= j < len(self.units)]
        for j in ahead:
            if self._load(j, {idx, *ahead}, wait=False) is None:
                break  # steps finish in forward order (or every other slot is pinned): stop here
        return out, (kept if keep else None)

    def _prefetch_depth(self, direction: int) -> int:
        """How many blocks ahead of the one computing are uploaded now: as many as the other slots hold.

        Partitioned, an upload is a collective, so a prefetch cannot be skipped when its block's optimizer
        step is still running (whether it is would differ between ranks): it waits for that step. In the
        forward, which follows the host steps, one block ahead then keeps the steps overlapping the compute;
        a deeper prefetch (up to one slot per block with ``num_slots="auto"``) would make the first block
        wait for nearly every step. The backward finds every step done and prefetches as deep as one rank."""
        others = self.pool.num_slots - 1
        return min(others, 1) if self.partition is not None and direction > 0 else others

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
            # (Partitioned, an upload is a collective: whether it is issued must not depend on timing.)
            if not wait and self.partition is None and unit.future is not None and not unit.future.done():
                return None
            self.host.wait(unit)  # a pending optimizer step is still rewriting the master (and copy)
            slot = self.pool.load(idx, protect, lambda dst: self.uploads.upload(unit, dst), optional=not wait)
            if slot is None:
                return None
        unit.upload_done = self.pool.ready[slot]
        self.reads.settled(unit)
        return slot

    def _measuring(self, idx: int, x: torch.Tensor) -> AbstractContextManager:
        """Count what block `idx`'s call saves for backward (``recompute="auto"`` sizes kept graphs by it)."""
        if self.keep.mode != "auto":
            return nullcontext()
        return self.keep.measuring(idx, x.numel(), [*self.pool.buffers, *self.outer.device_copies])

    # -- state ---------------------------------------------------------------------------------------
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every parameter as its fp32 host master (views, no copies)."""
        with self.host_view(write=False):
            return self.model.state_dict()

    @contextmanager
    def host_view(self, write: bool = True) -> Iterator[None]:
        """Inside, the model's parameters are what ordinary training shows between steps: every one its fp32
        host master, every host step done (an outer parameter is otherwise a view of its device copy in the
        compute dtype, and a block's master may still be being stepped). With `write`, what was written into
        them is the training state from then on: the compute copies, the device copies and the slots are
        rewritten from the masters on the way out. Re-entrant: only the outermost view binds and refreshes."""
        self._whole("engine.host_view()")
        self._host_views += 1
        self._host_view_writes += int(write)
        if self._host_views == 1:
            self.flush()
            self.outer.bind_masters()
            if write:  # a buffer the writer leaves alone keeps its value from training (refresh re-copies them)
                self._buffers_to_host()
        try:
            yield
        finally:
            self._host_views -= 1
            if self._host_views == 0:
                writes, self._host_view_writes = self._host_view_writes, 0
                if writes:
                    self.refresh_from_masters()  # (binds the outer parameters to their device copies again)
                else:
                    self.outer.bind_device()

    def load_master_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights into the fp32 masters and refresh every compute copy."""
        with self.host_view(write=True):
            self.model.load_state_dict(state_dict, strict=strict)

    def state_dict(self, optimizer: HostAdamW | None = None) -> dict[str, Any]:
        """``{"model": fp32 masters, "optimizer": torch.optim's layout}`` (the latter with `optimizer`): the
        training state in memory, as ordinary training's model and AdamW state dicts hold it. For models too
        large to hold twice use :meth:`save`, which streams it unit by unit."""
        state: dict[str, Any] = {"model": self.master_state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], optimizer: HostAdamW | None = None) -> None:
        self.load_master_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])

    def save(self, url: str, state: dict[str, Any] | None = None, optimizer: bool = True) -> None:
        """Write a sharded checkpoint to any fsspec URL, streamed unit by unit and committed atomically
        (megatrain_lightning/checkpoint/store.py): the masters and, with `optimizer`, the Adam state and the
        optimizer's param group settings (lr, betas, ...); `state`: extras saved beside them (tensors,
        numbers, strings, and lists and dicts of them)."""
        from megatrain_lightning.checkpoint import store  # (store reads the engine; the engine needs it only here)

        with_optimizer = optimizer and self._optimizer is not None
        groups = None
        if with_optimizer:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups]
        store.save(self, url, dict(state or {}), optimizer=with_optimizer, param_groups=groups)

    def load(self, url: str, optimizer: bool = True) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` (weights, and with an attached optimizer its state);
        returns the extras saved with it."""
        from megatrain_lightning.checkpoint import store

        extras, index = store.read_checkpoint(url)
        with_optimizer = optimizer and self._optimizer is not None and index["optimizer"]
        store.restore(self, url, optimizer=with_optimizer, pinned=index)  # the version `extras` came from
        if with_optimizer and index["param_groups"]:
            self._optimizer.restore_groups(index["param_groups"])  # as torch's load_state_dict leaves them
        return extras

    def refresh_from_masters(self) -> None:
        """After the masters (or buffers) were written from outside: rewrite every compute copy, rebind and
        re-upload the outer parameters, and forget what the slots hold."""
        self.flush()
        for unit in self.all_units():
            unit.refresh_copy()
        self._refresh_block_buffers()
        self.outer.reupload()
        self.pool.invalidate()

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers under their state-dict names, as they stand (the blocks' device
        copies brought back first): what a checkpoint saves beside the masters, read without the model's
        ``state_dict()``, which a partitioned engine refuses."""
        self.flush()
        self._buffers_to_host()
        out: dict[str, torch.Tensor] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    out[f"{name}.{key}" if name else key] = buf
        return out

    def qualified_names(self, unit: HostUnit) -> list[str]:
        """The model's own names (``state_dict`` keys) of a unit's parameters, in layout order."""
        prefix = f"{unit.name}." if unit in self.units else ""
        return [prefix + e.name for e in unit.layout]

    # -- accounting and teardown -------------------------------------------------------------------
    def device_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on the device: they do not grow with the number of blocks."""
        grad_slots = sum(g.numel() * g.element_size() for g in self.host.grad_slots)
        return {"weight_slots": self.pool.nbytes(), "grad_slots": grad_slots, "outer": self.outer.nbytes()}

    def host_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for unit in self.all_units():
            for kind, n in unit.nbytes().items():
                total[kind] = total.get(kind, 0) + n
        if self.config.host_layout == "lean" or self.host.sum_ring is not None:
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
        return pinned.registered_bytes(self._pinnable(self.all_units(), self._rings()) + self.saved_inputs.buffers)

    def _rings(self) -> list[HostRing]:
        return [r for r in {id(r): r for r in self.uploads.rings() + self.host.rings()}.values()]

    @staticmethod
    def _pinnable(units: list[HostUnit], rings: list[HostRing | None]) -> list[torch.Tensor | None]:
        return [t for unit in units for t in (unit.master, unit.copy, unit.slab)] + [
            b for r in rings if r is not None for b in r.buffers
        ]

    def num_parameters(self) -> int:
        return sum(u.full_numel for u in self.all_units())

    def close(self, gather: bool = True) -> None:
        """Give the model back as an ordinary fp32 host model (parameters are views of the masters).
        `gather=False`: a partitioned engine whose peer rank exited runs no collective; its parameters stay
        NaN placeholders."""
        self.flush()
        self.checks.adopt_all()  # (e.g. pruning made permanent at the end of training: its values are kept)
        self.checks.close()
        self.uploads.close()  # (its uploads were waited for by the flush)
        self.streams.synchronize()  # no copy may still read or write a device buffer freed below
        self.host.close()
        if self.tier is not None:
            self.tier.close()  # the moments are scratch: the run directory goes with them
        for handle in self._state_hooks:
            handle.remove()
        self._buffers_to_host()
        if self.partition is not None and gather:  # each rank gets the whole trained model back, as after DDP
            # The shards are unregistered before the gathered masters replace them (in fp32 the master is a
            # pinned buffer): afterwards nothing would name them, and they would stay locked for good.
            pinned.unregister(self._pinnable(self.all_units(), []))
            for unit in self.all_units():
                unit.unpartition(self.partition.gather_host(unit.master, unit.full_numel))
        for config in self._caches_off:
            config.use_cache = True
        self.input_chain.clear()
        for blk, runner in zip(self.blocks, self.runners):
            blk.__dict__.pop("forward", None)
            if runner.own is not None:
                blk.forward = runner.own
        for unit in self.units:
            unit.bind_host()
        self.outer.close()
        self._outer_buffers_to(torch.device("cpu"))
        self.pool.buffers.clear()
        # They stay allocated (the masters as the model's parameters).
        pinned.unregister(self._pinnable(self.all_units(), self._rings()) + self.saved_inputs.buffers)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _differentiable(t: torch.Tensor | GradientEdge) -> bool:
    return isinstance(t, GradientEdge) or t.requires_grad


def _new_stats() -> dict[str, float]:
    """Cumulative counters for progress bars and benchmarks (seconds are wall time of the thread named)."""
    return {
        "h2d_bytes": 0,  # weights uploaded (blocks and outer parameters)
        "d2h_bytes": 0,  # gradients downloaded
        "allgather_bytes": 0,  # data parallel: weights all-gathered into device slots (the whole unit each time)
        "reduce_scatter_bytes": 0,  # data parallel: gradients reduce-scattered on the device (the whole unit)
        "input_offload_bytes": 0,  # saved block inputs to the host and back, as stored (offload_inputs[_dtype])
        "kept_calls": 0,  # block calls that kept their graph for backward instead of a recompute (recompute)
        "offloaded_passes": 0,  # forward passes whose saved block inputs went to the host
        "host_step_seconds": 0.0,  # worker: Adam steps
        "host_land_seconds": 0.0,  # worker: waiting for downloads, accumulating, norms
        "host_wait_seconds": 0.0,  # compute-issuing thread blocked on a pending host job
    }


def _numel(block_params: list, outer: list, partition: Partition | None = None) -> int:
    """Elements of the units' host buffers: of every unit whole, or of this rank's shards."""
    sizes = [sum(p.numel() for _, p in params) for params in block_params] + [p.numel() for _, p in outer]
    if partition is not None:
        sizes = [hi - lo for lo, hi in map(partition.bounds, sizes)]
    return sum(sizes)


def _least_free(free: Callable[[], int | None], partition: Partition) -> int | None:
    """The least free device memory of any rank (None on a device with no measure: every rank alike)."""
    have = free()
    return None if have is None else partition.least(have)


def _kv_cache_configs(model: nn.Module) -> list[Any]:
    """Every Hugging Face config in `model` with ``use_cache=True``, once each."""
    found: list[Any] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True and not any(c is config for c in found):
            found.append(config)
    return found


def _disable_kv_caches(model: nn.Module) -> list[Any]:
    """Set ``use_cache=False`` on every Hugging Face config in `model` (returns those changed, to restore).

    A cache filled during the forward would be filled again by each block's recompute. Training never
    reads it when each layer index runs once (a module at several positions is refused with a cache on), so
    turning it off changes no result; a cache passed explicitly is refused by the block."""
    changed = _kv_cache_configs(model)
    for config in changed:
        config.use_cache = False
    return changed


def worker_init(device: torch.device, host_threads: int | None = None, cpus: list[int] | None = None) -> None:
    """The host worker waits on CUDA events: it must use the engine's GPU, not create a context on GPU 0. It
    takes its thread budget (optim/threads.py) before its first torch op."""
    if device.type == "cuda":
        # (an index-less "cuda" would make set_device raise: EngineConfig resolves it; this is the last guard)
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    configure_host_threads(host_threads, share=cpus)
