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
and the schedule model all go through these calls. This module is that facade: each call a few lines over
the parts the engine holds, which engine/build.py constructs (it imports no Lightning):

    Engine
     |- Ranks (engine/ranks.py): this rank's shard of every unit (the whole with one rank), the collectives
     |- OuterParams (engine/outer.py): embedding, final norm, head: device copies rewritten after a step
     |- engine/device/: the per-block device work
     |   |- BlockStreamer (streamer.py): each block's call streamed through a slot, forward and backward
     |   |- SlotPool (streams.py): device slots blocks stream through; Uploader (uploads.py)
     |   |- BlockRunner per block (block_fn.py): the block's forward, recomputed in backward
     |   |  (block_state.py: what a block call takes, returns and changes)
     |   |- SavedInputs (saved_inputs.py): block inputs kept for backward, on the device or the host
     |   |- KeepPolicy (recompute.py): which block calls keep their graph instead of a recompute
     |- engine/host/: the host half
         |- HostUnit per block and per outer parameter (units.py): flat fp32 master, Adam moments, compute
         |  copy, gradient slab; the block's parameters stay registered as views of the master
         |- HostSide (host_steps.py): gradients to the host, accumulation, norms, Adam, the worker

One host worker thread (engine/host/worker.py) does all host-side arithmetic, a unit's jobs in the order
submitted and steps in the order the next forward needs them. A unit's ``future`` is its last job;
nothing reads or overwrites a unit's buffers before that future and the copy events it waits on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from torch import nn

from megatrain_lightning.checkpoint import store
from megatrain_lightning.engine.build import build, outer_buffers_to, pinnable
from megatrain_lightning.engine.config import EngineConfig, forward_context
from megatrain_lightning.engine.generic_optim import GenericHostOptimizer, GenericSteps
from megatrain_lightning.engine.host import pinned
from megatrain_lightning.engine.host.ring import HostRing
from megatrain_lightning.engine.host.units import HostMemoryError, HostUnit
from megatrain_lightning.engine.optimizer import HostAdamW, check_optimizer, native_ok
from megatrain_lightning.engine.probes import Probes

__all__ = ["Engine", "EngineConfig", "HostMemoryError"]


class Engine:
    """Streams a model's blocks through device slots; all persistent state stays on the host."""

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, probes: Probes | None = None) -> None:
        build(self, model, EngineConfig() if config is None else config, Probes() if probes is None else probes)
        self.optimizer_steps = 0
        self._host_views = self._host_view_writes = 0  # host_view(): depth, and how many of them write
        self._optimizer: HostAdamW | GenericHostOptimizer | None = None  # engine.optimizer()'s (its groups: save())
        self.generic: GenericSteps | None = None  # torch optimizers stepping themselves (engine/generic_optim.py)

    def _host_room(self) -> int:
        """Host memory left for new buffers (the offloaded inputs'): what the OS can still hand out, less what
        the check at construction counted but the engine has not allocated yet (the gradient slabs come with
        the first backward, the Adam moments with the optimizer)."""
        pending = self._host_need - sum(self.host_bytes().values())
        return self._host_available() - max(0, pending)

    def _block_state_read(self, idx: int, *_: Any) -> None:
        self._whole("a block's state_dict()")
        self.units[idx].wait()
        self.streamer.buffers_to_host(idx)

    def _whole(self, what: str) -> None:
        """Refuse `what` where the parameters are not whole here (the ranks' ``whole_here``)."""
        if not self.ranks.whole_here:
            raise RuntimeError(
                f"{what} needs every parameter whole in this process, but each of the {self.ranks.world} "
                "data-parallel ranks holds 1/W of them; save a checkpoint (engine.save) and read it instead"
            )

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
            for e, has in zip(unit.entries, unit.grad.present):
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
        if self.optimizer_steps == 1:
            self.streamer.measure_step()  # (its activations freed: what it needed beyond what stays)
        if self.optimizer_steps == 1 and self.config.num_slots == "auto":
            self.streamer.size_slots()  # the step's device memory is known now, its activations freed
        if self.optimizer_steps == 1 and self.config.device_grad_sums == "auto":
            self.streamer.size_sums()  # (with what the slots left)
        # What the next forward reads first goes up now, each as soon as its own step is done: the outer
        # parameters (every device copy is current when this returns), then its first blocks. (Always, not
        # only when the steps happen to be done: the uploads a step makes do not depend on timing.)
        self.outer.refresh()
        self.streamer.upload_first()
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
                self.streamer.buffers_to_host()
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
        with_optimizer = optimizer and self._optimizer is not None
        groups = None
        if with_optimizer:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups]
        store.save(self, url, dict(state or {}), optimizer=with_optimizer, param_groups=groups)

    def load(self, url: str, optimizer: bool = True) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` (weights, and with an attached optimizer its state);
        returns the extras saved with it."""
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
        self.host.forget_speculation()
        for unit in self.all_units():
            unit.refresh_copy()
        self.streamer.refresh_block_buffers()
        self.outer.reupload()
        self.pool.invalidate()

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers under their state-dict names, as they stand (the blocks' device
        copies brought back first): what a checkpoint saves beside the masters, read without the model's
        ``state_dict()``, which a partitioned engine refuses."""
        self.flush()
        self.streamer.buffers_to_host()
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
        """Bytes the engine holds on the device: they do not grow with the number of blocks, except the gradient
        sums of the blocks given one (``device_grad_sums``)."""
        host = self.host
        grad_slots = sum(g.numel() * g.element_size() for g in host.grad_slots)
        sums = 0 if host.sums is None else host.sums.nbytes()
        return {
            "weight_slots": self.pool.nbytes(),
            "grad_slots": grad_slots,
            "outer": self.outer.nbytes(),
            "grad_sums": sums,
        }

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
        return pinned.registered_bytes(pinnable(self.all_units(), self._rings()) + self.saved_inputs.buffers)

    def _rings(self) -> list[HostRing]:
        return [r for r in {id(r): r for r in self.uploads.rings() + self.host.rings()}.values()]

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
        self.streamer.buffers_to_host()
        if gather and not self.ranks.whole_here:  # each rank gets the whole trained model back, as after DDP
            # The shards are unregistered before the gathered masters replace them (in fp32 the master is a
            # pinned buffer): afterwards nothing would name them, and they would stay locked for good.
            pinned.unregister(pinnable(self.all_units(), []))
            for unit in self.all_units():
                unit.unpartition(self.ranks.gather_host(unit.master, unit.full_numel))
        for config in self._caches_off:
            config.use_cache = True
        self.streamer.release()
        self.outer.close()
        outer_buffers_to(self.model, self.blocks, torch.device("cpu"))
        self.pool.buffers.clear()
        # They stay allocated (the masters as the model's parameters).
        pinned.unregister(pinnable(self.all_units(), self._rings()) + self.saved_inputs.buffers)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
