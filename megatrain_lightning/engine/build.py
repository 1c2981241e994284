"""Building an engine: the model taken apart into the parts the engine holds, in the order each needs.

:func:`build` runs once, from ``Engine.__init__``: discovery of the blocks, the data-parallel partition and
this rank's CPUs, the host-memory check (before anything is allocated), the NVMe tier, the streams, the
refusal of a shared block with a KV cache, the host rings, the host units (filled when the model was built
without weights), the slot pool, the keep policy, the host worker and host side, the outer parameters, the
self-checks, the block streamer (engine/device/streamer.py) and, with ``compile_blocks``, the compiled block calls.
A failure midway gives back what was pinned and the NVMe files. Only the engine calls it: the parts it sets
are the engine's own, and the engine's facade (engine.py) reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.device.block_fn import compile_block_calls
from megatrain_lightning.engine.device.grad_sums import DeviceGradSums
from megatrain_lightning.engine.device.recompute import KeepPolicy
from megatrain_lightning.engine.device.replay import refuse_compiled
from megatrain_lightning.engine.device.rows import RowChunks
from megatrain_lightning.engine.device.saved_inputs import SavedInputs
from megatrain_lightning.engine.device.streamer import BlockStreamer, ParamRefs, block_buffers, param_refs
from megatrain_lightning.engine.device.streams import SlotPool, Streams
from megatrain_lightning.engine.device.uploads import Uploader
from megatrain_lightning.engine.discover import find_blocks, unit_parameters
from megatrain_lightning.engine.host import host_memory, materialize, pinned
from megatrain_lightning.engine.host.host_memory import available_host_bytes
from megatrain_lightning.engine.host.host_steps import HostSide
from megatrain_lightning.engine.host.nvme import BUFFERS, NvmeTier
from megatrain_lightning.engine.host.pending_reads import PendingReads
from megatrain_lightning.engine.host.ring import HostRing, piece_numel, ring_counts
from megatrain_lightning.engine.host.units import HostMemoryError, HostUnit, host_bytes_by_kind, host_bytes_per_param
from megatrain_lightning.engine.host.worker import HostWorker
from megatrain_lightning.engine.outer import OuterParams
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.engine.ranks import ranks_of
from megatrain_lightning.engine.self_checks import SelfChecks
from megatrain_lightning.optim.threads import configure_host_threads, resolve_host_threads
from megatrain_lightning.planning.device_memory import free_device_bytes, step_transient_bytes


def build(engine: Any, model: nn.Module, config: EngineConfig, probes: Probes) -> None:
    """Take `model` apart into the engine's parts and set them on `engine` (an ``Engine`` being constructed:
    its own methods serve as the parts' callbacks): each step below needs the ones before it."""
    engine.config = config
    engine.model, engine.device, engine.compute_dtype = model, config.torch_device, config.compute_dtype
    engine.stats = _new_stats()
    refuse_compiled(model)  # (engine/device/replay.py)
    # The stacks, each distinct block once, the parameters blocks share (outer units); what setup logs.
    engine.layout = find_blocks(model, config.blocks)
    engine.blocks = engine.layout.blocks
    # The ranks (engine/ranks.py): with several, this rank holds one shard of every unit's host state.
    engine.ranks = ranks = ranks_of(config.group)
    engine.host_cpus: list[int] | None = ranks.host_cpus()  # this rank's share of the machine's CPUs (None: all)
    engine.host_threads = resolve_host_threads(
        config.host_threads, None if engine.host_cpus is None else len(engine.host_cpus)
    )
    pin = engine.device.type == "cuda" if config.pin_memory is None else config.pin_memory
    block_params, outer = unit_parameters(model, engine.layout)
    largest_block = max(sum(p.numel() for _, p in params) for params in block_params)
    engine.piece = config.piece or piece_numel(max([largest_block, *(p.numel() for _, p in outer)]))
    engine._host_available = probes.host_available_bytes or available_host_bytes
    engine._host_need = _check_host_memory(engine, block_params, outer, engine._host_available)
    # Checked (directory, free space) before the model is taken apart; the moments need it only to train.
    training = config.training
    engine.tier = (
        NvmeTier(config.nvme_dir, sum(_sizes(block_params, outer)), engine.piece)
        if training and config.nvme_dir
        else None
    )
    engine.streams = (probes.streams or Streams)(engine.device)
    free = probes.device_free_bytes or partial(free_device_bytes, engine.device)
    transient = probes.step_transient_bytes or partial(step_transient_bytes, engine.device)
    # What decides a collective must be decided alike on every rank: the least free memory of any.
    keep_free = ranks.least_of(free)
    engine.saved_inputs = SavedInputs(
        engine.streams,
        engine.device,
        pin,
        engine.stats,
        config.offload_inputs,
        free,
        engine._host_room,
        config.offload_inputs_dtype,
        config.keep_attention,
    )
    if training and engine.layout.repeated and _kv_cache_configs(model):
        raise ValueError(
            f"{engine.layout.repeated[0]} of {type(model).__name__} is one module, and the model's config has "
            "use_cache=True: ordinary training then lets its later calls attend to the keys its earlier calls "
            "cached (they share a layer index), which a recomputed block cannot repeat. Set "
            "model.config.use_cache = False for training, or build one module per position"
        )
    engine._caches_off = _disable_kv_caches(model) if training else []
    staging, grads = ring_counts(largest_block, engine.piece)
    lean = config.host_layout == "lean"
    # Lean layout: uploads cast the master into a staging ring (in fp32 the pinned master is the source).
    staging_ring = (
        HostRing("staging", staging, engine.piece, engine.compute_dtype, pin)
        if lean and engine.compute_dtype != torch.float32
        else None
    )
    grad_ring = HostRing("gradient", grads, engine.piece, engine.compute_dtype, pin) if lean and training else None
    engine.uploads = Uploader(engine.streams, engine.stats, engine.piece, staging_ring, ranks)
    engine.units: list[HostUnit] = []
    outer_units: list[HostUnit] = []
    empty = materialize.empty_params(model)  # built without weights: filled unit by unit below
    try:
        refs, buffers = _build_blocks(engine, block_params, pin)
        outer_units = [_unit(engine, n, [(n, p)], pin, not lean) for n, p in outer]
        materialize.fill_units(model, engine.units + outer_units, empty)
        for unit in engine.units + outer_units if training and config.speculative_step else ():
            unit.ensure_spare()  # (the speculative steps' copies: host_steps.Speculation)
    except BaseException:
        pinned.unregister(pinnable(engine.units + outer_units, [staging_ring, grad_ring]))  # the limit ran out midway
        if engine.tier is not None:
            engine.tier.close()
        raise
    slots = 2 if config.num_slots == "auto" else config.num_slots
    engine.pool = SlotPool(engine.streams, slots, max(u.slot_numel for u in engine.units), engine.compute_dtype)
    engine.pool.grow_when_pinned = config.recompute is False
    engine.keep = KeepPolicy(
        config.recompute, keep_free, engine.pool.pinned, lambda: engine.pool.num_slots, engine.stats
    )
    # Steps run in the order the next forward needs them, among those whose gradient has landed
    # (engine/host/worker.py); with the NVMe tier in the order queued, the order its read-ahead plan names.
    worker = HostWorker(
        "megatrain-host_0",
        worker_init,
        (engine.device, engine.host_threads, engine.host_cpus),
        fifo=engine.tier is not None,
    )
    engine.host = HostSide(
        engine.units,
        outer_units,
        engine.streams,
        probes.worker(worker) if probes.worker is not None else worker,
        engine.stats,
        piece=engine.piece,
        grad_ring=grad_ring,
        ring_shape=(grads, pin),
        tier=engine.tier,
        overlap_optimizer=config.overlap_optimizer,
        speculative=training and config.speculative_step,
        invalidate=engine.pool.stepped,
        ranks=ranks,
        sums=(
            DeviceGradSums(
                engine.units + outer_units,
                len(engine.units),
                engine.device,
                0 if config.device_grad_sums == "auto" else config.device_grad_sums,
            )
            if training
            else None
        ),
    )
    outer_buffers_to(model, engine.blocks, engine.device)
    engine.outer = OuterParams(outer_units, engine.device, engine.streams, engine.uploads, engine.host)
    engine.checks = SelfChecks(engine)  # (engine/self_checks.py)
    engine.reads = PendingReads(engine.host.wait)  # (engine/host/pending_reads.py)
    stack = engine.layout.stack_of
    engine.streamer = BlockStreamer(
        blocks=engine.blocks,
        units=engine.units,
        shared=engine.layout.shared,
        spans=[(stack.index(s), stack.count(s)) for s in stack],
        param_refs=refs,
        buffers=buffers,
        device=engine.device,
        preserve_rng_state=config.preserve_rng_state,
        ranks=ranks,
        pool=engine.pool,
        uploads=engine.uploads,
        host=engine.host,
        outer=engine.outer,
        keep=engine.keep,
        saved_inputs=engine.saved_inputs,
        checks=engine.checks,
        reads=engine.reads,
        rows=RowChunks(config.row_chunk, keep_free, engine.keep.estimate),
        transient=transient,
        free_device_bytes=free,
        keep_attention=config.keep_attention,
    )
    engine.runners = engine.streamer.runners
    if config.compile_blocks:
        compile_block_calls(engine.blocks, engine.runners, config.keep_attention)
    if engine.device.type == "cuda":
        engine.host.gate = engine.checks.gate  # a block's host jobs first read its recompute's comparison


def _unit(engine: Any, name: str, params: list, pin: bool, keep_copy: bool) -> HostUnit:
    """A host unit over `params`: this rank's shard of it (the whole unit with one rank)."""
    bounds, device_numel = engine.ranks.unit_shard(sum(p.numel() for _, p in params))
    return HostUnit(name, params, engine.compute_dtype, pin, keep_copy, bounds=bounds, device_numel=device_numel)


def _build_blocks(engine: Any, block_params: list, pin: bool) -> tuple[list[ParamRefs], list[list[list]]]:
    """Move each block into a host unit whose master its parameters are views of from now on; returns where
    each block's parameters sit and its buffers' device copies (engine/device/streamer.py)."""
    refs: list[ParamRefs] = []  # per block: where each parameter sits (engine/device/streamer.py)
    engine._state_hooks = []
    for i, (blk, params) in enumerate(zip(engine.blocks, block_params)):
        keep_copy = engine.config.host_layout != "lean"
        unit = _unit(engine, engine.layout.names[i], params, pin, keep_copy)
        engine.units.append(unit)
        unit.bind_host()  # frees the block's own storage right away
        refs.append(param_refs(blk, unit))
        # A block's parameters are views of its master, which the worker steps in the background after
        # optimizer_step returns: state_dict() (of the model or the block) waits for the block's step, and
        # reads the buffers the block's forward updated on their device copies.
        engine._state_hooks.append(blk.register_state_dict_pre_hook(partial(engine._block_state_read, i)))
    return refs, block_buffers(engine.blocks, engine.device)


def _check_host_memory(engine: Any, block_params, outer, available_bytes: Callable[[], int]) -> int:
    """Refuse a model whose training state does not fit the host; returns the bytes it counted."""
    c = engine.config
    numel = sum(hi - lo for lo, hi in map(engine.ranks.bounds, _sizes(block_params, outer)))  # this rank's shards
    layout, elt = c.host_layout, torch.tensor([], dtype=engine.compute_dtype).element_size()
    spec = c.speculative_step
    per_param = host_bytes_per_param(engine.compute_dtype, c.training, c.accumulating, layout, c.clipping, spec)
    largest_block = max(sum(p.numel() for _, p in params) for params in block_params)
    rings = sum(ring_counts(largest_block, engine.piece)) * engine.piece * elt if layout == "lean" else 0
    nvme = c.training and bool(c.nvme_dir)  # m, v on the drive: a few pieces' working buffers instead
    per_param -= 8 if nvme else 0
    need = numel * per_param + rings + (BUFFERS * engine.piece * 8 if nvme else 0)
    # The model's own parameters are released unit by unit as they move into flat buffers.
    reclaim = sum(p.numel() * p.element_size() for params in block_params for _, p in params if p.device.type == "cpu")
    have = available_bytes() + reclaim
    if need > have:
        labels = {
            "master": "fp32 master",
            "adam": "Adam m and v",
            "copy": "transfer copy",
            "slab": "gradient slab",
            "acc": "fp32 gradient accumulator",
            "spare": "spare copy for speculative steps",
        }
        by_kind = host_bytes_by_kind(elt, c.training, c.accumulating, layout, c.clipping, spec)
        kinds = [labels[k] for k, b in by_kind.items() if b and not (nvme and k == "adam")]
        share = engine.ranks.share_note()
        raise HostMemoryError(
            f"the model's {numel / 1e9:.2f}B parameters{share} need {need / 2**30:.1f} GiB of host memory "
            f"({per_param} bytes/param: {', '.join(kinds[:-1])} and {kinds[-1]}) but about "
            f"{have / 2**30:.1f} GiB is available{_host_limit_named(available_bytes)}. Use a machine "
            "with more host memory, a smaller model"
            + (
                ", accumulate_grad_batches=1 (drops the 4 bytes/param fp32 gradient accumulator)"
                if c.accumulating
                else ""
            )
            + ", or check the size first with the memory planner."
        )
    return need


def _host_limit_named(available_bytes: Callable[[], int]) -> str:
    """Which limit the machine's reading came from, when it is not the machine's free memory (a
    container's cgroup, ulimit -v), and how to raise it."""
    if available_bytes is not host_memory.available_host_bytes:  # a stand-in's figure (Probes)
        return ""
    limit = host_memory.tightest_host_limit()
    return "" if limit.name == "MemAvailable" else f" under {limit.name} ({limit.fix})"


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
        "kept_attention": 0,  # attention calls a recompute got from the forward instead of computing (keep_attention)
        "uploads_ahead": 0,  # blocks whose speculative step's weights went up during the backward, and were kept
        "early_input_fetches": 0,  # offloaded inputs brought back during the later block's backward, not after
        "sums_held_for_the_link": 0,  # step's last sums that waited for the link, to go down needed first
        "host_step_seconds": 0.0,  # worker: Adam steps
        "speculative_kept": 0,  # units whose speculative step the optimizer step kept (speculative_step)
        "speculative_discarded": 0,  # and those whose it discarded (clipped, or something changed since)
        "host_land_seconds": 0.0,  # worker: waiting for downloads, accumulating, norms
        "host_wait_seconds": 0.0,  # compute-issuing thread blocked on a pending host job
    }


def _sizes(block_params: list, outer: list) -> list[int]:
    """Elements of each unit, whole: the blocks', then the outer parameters'."""
    return [sum(p.numel() for _, p in params) for params in block_params] + [p.numel() for _, p in outer]


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


def pinnable(units: list[HostUnit], rings: list[HostRing | None]) -> list[torch.Tensor | None]:
    """The host buffers the engine may have page-locked: the units' and the rings'."""
    return [t for unit in units for t in (unit.master, unit.copy, unit.slab, unit.spare)] + [
        b for r in rings if r is not None for b in r.buffers
    ]


def outer_buffers_to(model: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
    """Move the buffers of the modules outside the blocks to `device` (a block's have device copies)."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    for module in model.modules():
        if id(module) in in_blocks:
            continue
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
