"""``Trainer(strategy="megatrain")``: Lightning glue around the streaming engine and the host optimizer.

The strategy is an ordinary single-device strategy whose hooks hand the model to the engine instead of
moving it to the device, replace the optimizer with :class:`HostAdamW`, tell the engine before each
backward whether more micro-batches follow, and read/write checkpoints from the host masters.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.engine.config import (
    EngineConfig,
    check_checkpoint_format,
    check_flag,
    check_host_layout,
    check_host_threads,
    check_num_slots,
    check_offload_inputs,
)
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.optimizer import HostAdamW
from megatrain_lightning.precision import MegatrainPrecision


class MegatrainStrategy(SingleDeviceStrategy):
    """Train on one device with parameters, fp32 masters and Adam state in host memory.

    Args:
        device: the compute device; by default the Trainer's device (the GPU when there is one).
        num_slots: device weight slots blocks stream through (>= 2: one computing, one loading). ``"auto"``
            (default): 2, then, after the first optimizer step, as many more as the device memory that step
            left free allows beyond four times what it needed (at most one per block; the CPU keeps 2).
            More slots keep more blocks resident from a forward to its backward and across the micro-batches
            of an accumulation, so fewer uploads; with one per block the backward uploads nothing.
        overlap_optimizer: step each block on the host as soon as its gradient lands, while backward goes
            on (only when nothing needs the whole gradient first, i.e. no clipping).
        offload_inputs: where each block's input, saved for its backward, waits. ``True``: in pinned host
            memory (copied back one block ahead in backward), so device memory no longer grows with depth,
            at the cost of one more transfer of the hidden states each way (long context). ``False``: on the
            device. ``"auto"`` (default): decided at the start of each forward pass, offloading when the
            inputs would take more than half of the device memory free at that moment (on a CPU device:
            never). ``engine.stats["offloaded_passes"]`` counts the passes that offloaded.
        host_layout: ``"default"`` keeps a pinned compute-dtype copy of every weight and a gradient slab per
            unit (16 B/param in bf16); ``"lean"`` casts weights into a small ring of pinned staging buffers
            just before each upload and lands gradients through a ring where the step consumes them at once
            (12 B/param plus buffers in flight; with clipping a per-unit gradient stays, 2 B/param in bf16).
        nvme_dir: a local directory for the Adam moments (8 B/param off host memory), read ahead and
            written behind per unit by the host worker; scratch only (checkpoints stay the durable copy).
        host_threads: threads of the host optimizer (the native Adam kernel and torch's ops on the host
            worker thread); default: the cores this process may use minus one, kept for the thread that
            launches the GPU's kernels. Spread over the NUMA nodes when there are several
            (:mod:`megatrain_lightning.optim.threads`). Results do not depend on it.
        checkpoint_format: ``"sharded"`` streams per-block shards to any fsspec URL and commits atomically
            (see :mod:`megatrain_lightning.checkpoint`); ``"torch"`` writes Lightning's usual single file,
            which ordinary strategies can also resume from (small models only: it is built in memory).
        compile_blocks: run each decoder block's forward, and its recompute in backward, through
            ``torch.compile`` (one compiled function per block class, shared by all its blocks; see
            :class:`~megatrain_lightning.engine.block_fn.CompiledBlock`): twice per run (without and with
            grad), more for other sequence lengths. Equal to eager training within round-off, not bit for bit.
            A block that cannot compile as one graph raises at its first call, naming its class.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        device: torch.device | str | None = None,
        num_slots: int | Literal["auto"] = "auto",
        overlap_optimizer: bool = True,
        offload_inputs: bool | Literal["auto"] = "auto",
        host_layout: Literal["default", "lean"] = "default",
        nvme_dir: str | None = None,
        host_threads: int | None = None,
        checkpoint_format: Literal["sharded", "torch"] = "sharded",
        compile_blocks: bool = False,
        **kwargs: Any,
    ) -> None:
        check_flag("compile_blocks", compile_blocks)
        check_checkpoint_format(checkpoint_format)
        check_num_slots(num_slots)
        check_offload_inputs(offload_inputs)
        check_host_layout(host_layout)
        check_host_threads(host_threads)  # ValueError for < 1 or more than the cores
        super().__init__(device=device or "cpu", **kwargs)
        self._device_arg = device
        self.num_slots = num_slots
        self.overlap_optimizer = overlap_optimizer
        self.offload_inputs = offload_inputs
        self.host_layout, self.nvme_dir = host_layout, nvme_dir
        self.host_threads = host_threads  # None: resolved where the worker starts (cores - 1)
        self.checkpoint_format = checkpoint_format
        self.compile_blocks = compile_blocks
        self.parallel_devices: list[torch.device] | None = None  # filled in by Lightning from Trainer(devices=...)
        self.engine: Engine | None = None

    # -- device and precision ----------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_arg is not None:
            return torch.device(self._device_arg)
        if self.parallel_devices:
            return self.parallel_devices[0]
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    @override
    def precision_plugin(self) -> MegatrainPrecision:
        return self._precision_plugin if self._precision_plugin is not None else MegatrainPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning builds a plugin from Trainer(precision=...); keep its flag, use our semantics.
        if plugin is not None and not isinstance(plugin, MegatrainPrecision):
            plugin = MegatrainPrecision(str(getattr(plugin, "precision", "32-true")))
        self._precision_plugin = plugin

    # -- setup / teardown -----------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        """Build the engine over the module (no ``model.to(device)``) and take the optimizer over."""
        assert self.accelerator is not None and self.lightning_module is not None
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ValueError(
                f"strategy='megatrain' trains on one device, got devices={self.parallel_devices}; "
                "use Trainer(devices=1) (run several trainers for several GPUs, e.g. with ray_jobs)"
            )
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_clipping(trainer)
            self.setup_optimizers(trainer)
        plugin = self.precision_plugin
        plugin.device_type = self.root_device.type
        if self.engine is None:
            self.engine = Engine(self.lightning_module, self.engine_config(trainer, plugin.precision, fitting))
        plugin.engine = self.engine
        self.precision_plugin = plugin
        if fitting:
            self.optimizers = [self.engine.optimizer(self._single_optimizer())]
        self.setup_precision_plugin()

    def engine_config(self, trainer: Any, precision: str, fitting: bool) -> EngineConfig:
        """The engine's options: this strategy's, with what the Trainer says of the run."""
        clipping = bool(fitting and trainer.gradient_clip_val)
        return EngineConfig(
            device=self.root_device,
            precision=precision,
            num_slots=self.num_slots,
            overlap_optimizer=self.overlap_optimizer,
            offload_inputs=self.offload_inputs,
            host_layout=self.host_layout,
            nvme_dir=self.nvme_dir,
            host_threads=self.host_threads,
            compile_blocks=self.compile_blocks,
            training=fitting,
            accumulating=fitting and _accumulates(trainer),  # the fp32 accumulator counts too
            clipping=clipping,
        )

    def _check_clipping(self, trainer: Any) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                f"gradient_clip_algorithm='value' (gradient_clip_val={trainer.gradient_clip_val}) is not supported "
                "by strategy='megatrain'; use gradient_clip_algorithm='norm'"
            )

    def _single_optimizer(self) -> torch.optim.Optimizer:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy='megatrain' steps exactly one optimizer on the host; configure_optimizers returned "
                f"{len(self.optimizers)}. Return a single torch.optim.AdamW (use param groups for different settings)."
            )
        opt = self.optimizers[0]
        return opt._optimizer if isinstance(opt, LightningOptimizer) else opt

    @override
    def model_to_device(self) -> None:
        """Nothing to move: the engine decides what lives on the device."""

    @override
    def teardown(self) -> None:
        """Hand back an ordinary fp32 host model (its parameters are the trained masters)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        super().teardown()

    # -- training hooks -------------------------------------------------------------------------
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Tell the engine whether this gradient completes an optimizer step, then run backward."""
        assert self.engine is not None
        module = self.lightning_module
        if module is None or not module.automatic_optimization or module._trainer is None:
            # Manual optimization: nothing is known about what follows; the gradients wait for the step.
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = module.trainer
        accumulate = trainer.fit_loop._should_accumulate()
        with self.engine.backward(accumulate=accumulate, clip=bool(trainer.gradient_clip_val)):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights load into the host masters, which exist only after setup

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        return self.engine.master_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """For a sharded checkpoint only the param groups: the moments go to the checkpoint's own shards, and
        gathering them here as well would hold every moment in host memory at once (read back from the
        NVMe tier, too)."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps it
        if self.checkpoint_format == "sharded" and isinstance(inner, HostAdamW):
            return inner.state_dict(with_moments=False)
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Sharded: stream the host buffers unit by unit; Lightning's tensors in `checkpoint` are not used."""
        if self.checkpoint_format == "torch":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if self.engine is None:
            warnings.warn(
                f"saving {filepath} outside fit/validate/predict: the host buffers are released, so this writes "
                "Lightning's single-file format from the ordinary model (it resumes all the same)",
                stacklevel=2,
            )
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state["megatrain_rng"] = _rng_state()
        with_optimizer = "optimizer_states" in checkpoint
        groups = None
        if with_optimizer:
            groups = [
                {k: v for k, v in g.items() if k != "params"} for g in checkpoint["optimizer_states"][0]["param_groups"]
            ]
        mt_checkpoint.save(self.engine, str(filepath), state, optimizer=with_optimizer, param_groups=groups)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not mt_checkpoint.is_checkpoint(str(checkpoint_path)):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state, index = mt_checkpoint.store.read_checkpoint(str(checkpoint_path))
        state["megatrain_checkpoint"] = str(checkpoint_path)
        state["megatrain_index"] = index  # the weights must come from the version this state came from
        state["state_dict"] = {}  # the weights stream from the shards in load_model_state_dict
        if index["optimizer"]:
            state["optimizer_states"] = [{"param_groups": index["param_groups"]}]
        return state

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if mt_checkpoint.is_checkpoint(str(filepath)):
            mt_checkpoint.remove(str(filepath))
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if "megatrain_checkpoint" in checkpoint:
            resuming = self.engine.has_optimizer and "optimizer_states" in checkpoint
            url, pinned = checkpoint["megatrain_checkpoint"], checkpoint.get("megatrain_index")
            mt_checkpoint.restore(self.engine, url, optimizer=resuming, pinned=pinned)
            return
        self.engine.load_master_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: the Adam state already streamed in with the weights; restore group settings and RNG."""
        if "megatrain_checkpoint" not in checkpoint:
            return super().load_optimizer_state_dict(checkpoint)
        for opt in self.optimizers:
            for group, saved in zip(opt.param_groups, checkpoint["optimizer_states"][0]["param_groups"]):
                group.update(saved)
        if "megatrain_rng" in checkpoint:
            _set_rng_state(checkpoint["megatrain_rng"])

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="host-resident full-precision training, streaming blocks"
            )


def _accumulates(trainer: Any) -> bool:
    """Whether gradients will be summed over micro-batches (the engine then allocates fp32 accumulators),
    now or in a later epoch of a GradientAccumulationScheduler."""
    factors = [trainer.accumulate_grad_batches]
    for cb in trainer.callbacks:
        if isinstance(cb, GradientAccumulationScheduler):
            factors.extend(cb.scheduling.values())
    return max(factors) > 1


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
