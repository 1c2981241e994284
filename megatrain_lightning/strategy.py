"""``Trainer(strategy="megatrain")``: Lightning glue around the streaming engine and the host optimizer.

The strategy is an ordinary single-device strategy whose hooks hand the model to the engine instead of
moving it to the device, replace the optimizer with :class:`HostAdamW`, tell the engine before each
backward whether more micro-batches follow, and read/write checkpoints from the host masters.
"""

from __future__ import annotations

import logging
import pickle
import random
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from typing_extensions import override

from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.averaging import AVERAGED_STATE, AveragingViews, replaced_weights
from megatrain_lightning.checkpoint import trust
from megatrain_lightning.convert import lightning_checkpoint
from megatrain_lightning.engine.config import EngineConfig, check_options
from megatrain_lightning.engine.discover import BlocksOption
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.optimizer import HostAdamW
from megatrain_lightning.precision import MegatrainPrecision

log = logging.getLogger("megatrain_lightning")


def check_trainer_args(
    accumulate_grad_batches: Any = 1,
    gradient_clip_val: Any = None,
    gradient_clip_algorithm: Any = None,
    val_check_interval: Any = None,
) -> None:
    """Trainer options that Lightning accepts and then fails on (accumulate_grad_batches=0 divides by zero
    at the first batch) or silently misreads (a negative clip), refused naming the valid range; the megatrain
    command and the sweep driver check them before anything is built."""
    acc = accumulate_grad_batches
    if not isinstance(acc, int) or isinstance(acc, bool) or acc < 1:
        raise ValueError(f"trainer accumulate_grad_batches={acc!r} must be an integer >= 1 (1: no accumulation)")
    clip = gradient_clip_val
    if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0):
        raise ValueError(f"trainer gradient_clip_val={clip!r} must be a number >= 0 (0 or null: no clipping)")
    if gradient_clip_algorithm is not None and str(gradient_clip_algorithm) not in ("norm", "value"):
        raise ValueError(
            f"trainer gradient_clip_algorithm={str(gradient_clip_algorithm)!r} must be 'norm' (the default) or 'value'"
        )
    interval = val_check_interval
    fraction = isinstance(interval, float)  # Lightning reads a float as a share of the epoch
    if interval is not None and not (
        isinstance(interval, (int, float)) and interval > 0 and not (fraction and interval > 1)
    ):
        raise ValueError(
            f"trainer val_check_interval={interval!r} must be above 0: an integer number of batches, or a "
            "fraction of an epoch in (0, 1]"
        )


class MegatrainStrategy(SingleDeviceStrategy):
    """Train on one device with parameters, fp32 masters and Adam state in host memory.

    Gradients leave each parameter for the host as backward produces them, so they do not sit in ``.grad``.
    Hooks that read or edit them: when the LightningModule or a callback overrides ``on_after_backward`` or
    ``on_before_optimizer_step`` (:func:`gradient_hooks`), every step lands all gradients in an fp32 host
    buffer (4 bytes/param, logged at setup) and waits for them; during those hooks each parameter is a view
    of its fp32 master and ``.grad`` a view of its gradient, and what the hooks leave there is what the
    step uses, as in ordinary training (no overlap of the optimizer with backward then). Clipping
    (``gradient_clip_val``) by norm or by value is exact; by value, the optimizer still overlaps backward
    (each gradient clamped as it lands) unless ``configure_gradient_clipping`` is overridden.
    On resume the optimizer's settings come from the checkpoint, as ``torch.optim.Optimizer.load_state_dict``
    leaves them in ordinary training.

    Args:
        device: the compute device; by default the Trainer's device (the GPU when there is one).
        num_slots: device weight slots blocks stream through (>= 2: one computing, one loading). ``"auto"``
            (default): 2, then, after the first optimizer step, as many more as the device memory that step
            left free allows beyond four times what it needed (at most one per block; the CPU keeps 2).
            More slots keep more blocks resident from a forward to its backward and across the micro-batches
            of an accumulation, so fewer uploads; with one per block the backward uploads nothing.
        overlap_optimizer: step each block on the host as soon as its gradient lands, while backward goes
            on (only when nothing needs the whole gradient first: no clipping, no hook reading gradients).
        offload_inputs: where each block's input, saved for its backward, waits. ``True``: in pinned host
            memory (copied back one block ahead in backward), so device memory no longer grows with depth,
            at the cost of one more transfer of the hidden states each way (long context). ``False``: on the
            device. ``"auto"`` (default): decided at the start of each forward pass, offloading when the
            inputs would take more than half of the device memory free at that moment (on a CPU device:
            never). ``engine.stats["offloaded_passes"]`` counts the passes that offloaded.
        recompute: ``True``: every block is run again, with grad, in backward (the least device memory).
            ``False``: every block keeps its graph from the forward (its activations and its slot stay on the
            device until its backward; the slot pool grows as needed), so each block is computed once.
            ``"auto"`` (default): per forward pass, the last blocks keep their graphs while their measured
            activations fit in half of the free device memory and two slots stay free for streaming; on
            a device with no memory measure (the CPU) every block is recomputed. ``engine.stats["kept_calls"]``
            counts the calls that kept their graph.
        offload_inputs_dtype: how offloaded block inputs are stored on the host (and cross the link): ``None``
            (default) exactly; ``"bf16"`` (32-true runs) as bfloat16, half the bytes; ``"fp8"`` as
            float8_e4m3fn with one fp32 scale per token, 1 + 4/hidden_size bytes per element (a quarter of
            fp32, half of bf16). Lossy: backward recomputes each block from the rounded input (see the user
            guide for the measured cost). Encoded and decoded on the device. Does nothing to inputs kept on
            the device (``offload_inputs=False``, or "auto" deciding not to offload).
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
        storage_options: fsspec options (credentials, endpoint, ...) for this strategy's checkpoints: every
            save (unless ``trainer.save_checkpoint(..., storage_options=...)`` gives its own), the
            ``ckpt_path`` it resumes from and the old checkpoints it deletes. Passed to fsspec only: never
            written into a checkpoint or a log. None: fsspec's defaults (e.g. the ``AWS_*`` variables).
        blocks: the ``nn.ModuleList``s of blocks to stream: a dotted name (``"model.layers"``), a list of names
            (one per stack), or a callable model -> ModuleList (or a list of them). Default: the list holding
            the most parameters, if it holds at least a fifth of them (otherwise setup refuses and names the
            lists it found), and every other list outside it holding at least 4% (an encoder, a vision tower;
            see "How blocks are found" in the user guide). Setup logs the stacks, their lengths and shares.
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        device: torch.device | str | None = None,
        num_slots: int | Literal["auto"] = "auto",
        overlap_optimizer: bool = True,
        offload_inputs: bool | Literal["auto"] = "auto",
        recompute: bool | Literal["auto"] = "auto",
        offload_inputs_dtype: Literal["bf16", "fp8"] | None = None,
        host_layout: Literal["default", "lean"] = "default",
        nvme_dir: str | None = None,
        host_threads: int | None = None,
        checkpoint_format: Literal["sharded", "torch"] = "sharded",
        compile_blocks: bool = False,
        storage_options: dict[str, Any] | None = None,
        blocks: BlocksOption = None,
        **kwargs: Any,
    ) -> None:
        check_options(
            {
                "compile_blocks": compile_blocks,
                "overlap_optimizer": overlap_optimizer,
                "blocks": blocks,
                "checkpoint_format": checkpoint_format,
                "num_slots": num_slots,
                "offload_inputs": offload_inputs,
                "recompute": recompute,
                "offload_inputs_dtype": offload_inputs_dtype,
                "host_layout": host_layout,
                "host_threads": host_threads,  # ValueError for < 1 or more than the cores
            }
        )
        super().__init__(device=device or "cpu", **kwargs)
        self._device_arg = device
        self.num_slots = num_slots
        self.overlap_optimizer = overlap_optimizer
        self.offload_inputs = offload_inputs
        self.recompute = recompute
        self.offload_inputs_dtype = offload_inputs_dtype
        self.host_layout, self.nvme_dir = host_layout, nvme_dir
        self.host_threads = host_threads  # None: resolved where the worker starts (cores - 1)
        self.checkpoint_format = checkpoint_format
        self.compile_blocks = compile_blocks
        self.storage_options = storage_options
        self.blocks = blocks
        self.parallel_devices: list[torch.device] | None = None  # filled in by Lightning from Trainer(devices=...)
        self.engine: Engine | None = None
        self._averaging: AveragingViews | None = None  # set up with the engine (averaging.py)
        self.grad_hooks: list[str] = []  # overridden hooks that see gradients (set at setup): see gradient_hooks

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
        self.grad_hooks = gradient_hooks(trainer) if fitting else []
        if fitting:
            self.setup_optimizers(trainer)
        plugin = self.precision_plugin
        plugin.device_type = self.root_device.type
        if self.engine is None:
            self.engine = Engine(self.lightning_module, self.engine_config(trainer, plugin.precision, fitting))
            log.info(self.engine.layout.describe(self.engine.model))
        plugin.engine = self.engine
        plugin.gradients_visible = bool(self.grad_hooks)
        if self.grad_hooks:
            log.info(
                "%s read or edit gradients: every optimizer step lands all gradients in an fp32 host buffer that "
                "`.grad` views during those hooks (4 bytes/param, %.2f GiB) and the host optimizer steps after "
                "backward instead of overlapping it",
                ", ".join(self.grad_hooks),
                4 * self.engine.num_parameters() / 2**30,
            )
        self.precision_plugin = plugin
        if fitting:
            self.optimizers = [self.engine.optimizer(self._single_optimizer())]
        self.setup_precision_plugin()
        # Weight averaging callbacks (EMA, SWA) read and write the module through the engine's host view.
        self._averaging = AveragingViews(trainer.callbacks, self.lightning_module, lambda: self.engine)

    def engine_config(self, trainer: Any, precision: str, fitting: bool) -> EngineConfig:
        """The engine's options: this strategy's, with what the Trainer says of the run."""
        clipping = bool(fitting and trainer.gradient_clip_val)
        visible = bool(fitting and self.grad_hooks)
        return EngineConfig(
            device=self.root_device,
            precision=precision,
            num_slots=self.num_slots,
            overlap_optimizer=self.overlap_optimizer,
            offload_inputs=self.offload_inputs,
            recompute=self.recompute,
            offload_inputs_dtype=self.offload_inputs_dtype,
            host_layout=self.host_layout,
            nvme_dir=self.nvme_dir,
            host_threads=self.host_threads,
            compile_blocks=self.compile_blocks,
            blocks=self.blocks,
            training=fitting,
            # The fp32 accumulator counts too; gradients visible to hooks live in it.
            accumulating=fitting and (_accumulates(trainer) or visible),
            clipping=clipping,
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
        if self._averaging is not None:
            self._averaging.restore()
            self._averaging = None
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
        clip = bool(trainer.gradient_clip_val) and (
            "value" if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE else "norm"
        )
        if clip == "value" and not _overrides(module, LightningModule, "configure_gradient_clipping"):
            # The clip Lightning will ask for after backward, said now: units still step as they land.
            self.engine.clip_grad_value_(float(trainer.gradient_clip_val))
        with self.engine.backward(accumulate=accumulate, clip=clip, visible=bool(self.grad_hooks)):
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
        NVMe tier, too). Once the engine is released a save writes Lightning's single file: the moments go
        here then."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps it
        if self.checkpoint_format == "sharded" and self.engine is not None and isinstance(inner, HostAdamW):
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
            state["megatrain_param_groups"] = groups  # as they are (the index's JSON turns betas into a list)
        options = storage_options if storage_options is not None else self.storage_options
        # A weight average a callback put in the state dict goes to the shards as the weights (as it goes to
        # Lightning's file); the masters it replaced are in the state too, as the callback left them.
        weights = replaced_weights(self.engine, checkpoint.get("state_dict", {}))
        mt_checkpoint.save(
            self.engine,
            str(filepath),
            state,
            optimizer=with_optimizer,
            param_groups=groups,
            storage_options=options,
            weights=weights,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint: its trainer state, checksummed and read by the restricted unpickler whatever
        `weights_only` says (:mod:`megatrain_lightning.checkpoint.trust`); a damaged one is explained, never
        handed to Lightning. A single file (``checkpoint_format="torch"``): Lightning's loader, with
        ``weights_only=True`` unless the caller says False (so that no stored object runs code)."""
        path = str(checkpoint_path)
        if not mt_checkpoint.is_checkpoint(path, self.storage_options):
            return self._load_single_file(checkpoint_path, weights_only)
        state, index = mt_checkpoint.store.read_checkpoint(path, self.storage_options)
        state["megatrain_checkpoint"] = path
        state["megatrain_index"] = index  # the weights must come from the version this state came from
        state["state_dict"] = {}  # the weights stream from the shards in load_model_state_dict
        if AVERAGED_STATE in state or (self._averaging is not None and self._averaging.reads_state_dict):
            # WeightAveraging's on_load_checkpoint reads its average from the state dict (one copy, for a moment)
            state["state_dict"] = lightning_checkpoint(path, optimizer=False, storage_options=self.storage_options)[
                "state_dict"
            ]
        groups = state.pop("megatrain_param_groups", None) or index["param_groups"]
        if index["optimizer"]:
            state["optimizer_states"] = [{"param_groups": groups}]
        return state

    def _load_single_file(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        if weights_only is False:  # the user's explicit choice: they trust this file
            return super().load_checkpoint(checkpoint_path, weights_only=False)
        try:
            with trust.allowed():
                return super().load_checkpoint(checkpoint_path, weights_only=True)
        except pickle.UnpicklingError as err:
            name = trust.refused_global(err)
            if name is None:
                raise
            raise mt_checkpoint.CheckpointError(
                f"{trust.refusal(str(checkpoint_path), name, 'the checkpoint')}, or pass weights_only=False to trust the whole file"
            ) from None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if mt_checkpoint.is_checkpoint(str(filepath), self.storage_options):
            mt_checkpoint.remove(str(filepath), self.storage_options)
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if "megatrain_checkpoint" in checkpoint:
            resuming = self.engine.has_optimizer and "optimizer_states" in checkpoint
            url, pinned = checkpoint["megatrain_checkpoint"], checkpoint.get("megatrain_index")
            mt_checkpoint.restore(
                self.engine, url, optimizer=resuming, pinned=pinned, storage_options=self.storage_options
            )
            return
        self.engine.load_master_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: the Adam state already streamed in with the weights; restore group settings (as
        ``torch.optim.Optimizer.load_state_dict`` does: the checkpoint's win) and RNG."""
        if "megatrain_checkpoint" not in checkpoint:
            return super().load_optimizer_state_dict(checkpoint)
        for opt in self.optimizers:
            inner = getattr(opt, "_optimizer", opt)  # LightningOptimizer wraps it
            inner.restore_groups(checkpoint["optimizer_states"][0]["param_groups"])
        if "megatrain_rng" in checkpoint:
            _set_rng_state(checkpoint["megatrain_rng"])

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="host-resident full-precision training, streaming blocks"
            )


GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def gradient_hooks(trainer: Any) -> list[str]:
    """The hooks between backward and the optimizer step that the LightningModule or a callback overrides,
    as ``Class.hook``: they may read or edit ``.grad``, so the strategy shows them every gradient there.

    A hook counts as overridden when its class defines it anew or the instance holds its own (Lightning's
    ``LambdaCallback`` sets the hooks it is given on the instance). Lightning's own callbacks override
    neither hook."""
    owners = [(trainer.lightning_module, LightningModule), *((cb, Callback) for cb in trainer.callbacks)]
    return [
        f"{type(owner).__name__}.{hook}"
        for owner, base in owners
        for hook in GRAD_HOOKS
        if _overrides(owner, base, hook)
    ]


def _overrides(owner: Any, base: type, hook: str) -> bool:
    return hook in vars(owner) or getattr(type(owner), hook) is not getattr(base, hook)


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
