"""``Fabric(strategy="megatrain")``: Lightning Fabric glue over the streaming engine's public API.

    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed", strategy="megatrain")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    with fabric.no_backward_sync(model, enabled=not last_micro_batch):   # accumulation micro-batches
        fabric.backward(model(batch).loss)
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)        # the total norm; or clip_val=0.5
    optimizer.step(); optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer})         # torch layouts, as ordinary Fabric
    fabric.strategy.teardown()                         # the model is an ordinary fp32 host model again

What Fabric calls maps onto the engine one to one: ``setup`` builds :class:`Engine` over the module and swaps
the optimizer for the host one (:class:`HostAdamW`, or any torch optimizer stepping itself on the host);
``no_backward_sync(enabled=True)`` is ``engine.backward(accumulate=True)``; ``clip_gradients`` is
``engine.clip_grad_norm_`` (returning ``engine.grad_norm()``) or ``engine.clip_grad_value_``;
``save``/``load`` read and write the fp32 masters and the
optimizer in ``torch.optim`` layout, so checkpoints move between this strategy and ordinary Fabric.

Why ``Strategy`` and not ``SingleDeviceStrategy``: ``Fabric.no_backward_sync`` returns a null context for any
``SingleDeviceStrategy`` without asking it, and that context is how a Fabric loop says a micro-batch is not
the last. Fabric asks ``fabric.launch()`` of every strategy but the two that run in the calling process
(``SingleDeviceStrategy``, ``DataParallelStrategy``); this one runs there too, on one device, so it is registered
as a virtual ``DataParallelStrategy`` (an ``isinstance`` answer only: nothing is inherited) and, as with ordinary
single-device Fabric, ``launch()`` may be called or not.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator, CUDAAccelerator
from lightning.fabric.plugins import CheckpointIO, Precision
from lightning.fabric.strategies import DataParallelStrategy, Strategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.types import _PATH
from torch import nn
from typing_extensions import override

from megatrain_lightning.engine import (
    Engine,
    EngineConfig,
    GenericHostOptimizer,
    HostAdamW,
    check_device,
    check_optimizer,
    check_options,
    declared,
    materialize,
    options_doc,
    parameters,
)
from megatrain_lightning.lightning.precision import MegatrainFabricPrecision, for_strategy

__all__ = ["MegatrainFabricPrecision", "MegatrainFabricStrategy"]


class _MicroBatches(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=True)``: the backward inside is not the step's last micro-batch."""

    def __init__(self, strategy: MegatrainFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """Gradients are summed in fp32 on the host when enabled; a null context otherwise."""
        engine = self.strategy.engine
        if not enabled or engine is None or module is not engine.model:
            return nullcontext()
        return self.strategy._accumulating_backward()


class MegatrainFabricStrategy(Strategy):
    """Train with Fabric on one device with parameters, fp32 masters and Adam state in host memory.

        ``overlap_optimizer`` (default True, as under the Trainer) declares that every ``fabric.backward`` outside
        ``no_backward_sync`` completes the step's gradient: each block is then stepped on the host as soon as its
        gradient lands, while backward goes on, unless ``clipping``, with the learning rate the param groups hold
        then. A loop that calls ``fabric.clip_gradients`` passes ``clipping=True`` too (the step then waits for the
        clip); a loop that does not keep the promise passes ``overlap_optimizer=False``: its gradients land and wait
        for ``optimizer.step()``, exact whatever the loop does next.

        Args:
            **engine options**: every option :class:`~megatrain_lightning.engine.config.EngineConfig` declares, under
                its name and with its default, as for :class:`~megatrain_lightning.lightning.strategy.MegatrainStrategy`, and
                the two a Fabric loop declares, since Fabric cannot see them (the lines below are generated from the
                declarations; the precision comes from ``Fabric(precision=...)``):
    {engine_options}
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - {d.name for d in declared("option", "loop")})
        if unknown:
            raise TypeError(f"MegatrainFabricStrategy got unexpected keyword arguments {unknown}")
        options = {d.name: options.get(d.name, d.default) for d in declared("option", "loop")}
        check_options(options)  # each option by its check; against the precision when the engine is built
        device = options.pop("device")
        self._device_arg = None if device is None else check_device(device)
        self._parallel_devices: list[torch.device] | None = None
        self.engine: Engine | None = None
        self.optimizer: HostAdamW | GenericHostOptimizer | None = None
        self._accumulating = False  # inside no_backward_sync(enabled=True)
        self.options: dict[str, Any] = options
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self._backward_sync_control = _MicroBatches(self)
        self.global_rank, self.local_rank, self.world_size = 0, 0, 1

    @property
    def overlap_optimizer(self) -> bool:
        return self.options["overlap_optimizer"]

    @property
    def clipping(self) -> bool:
        return self.options["clipping"]

    # -- device and precision ----------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_arg is not None:
            return self._device_arg
        if self._parallel_devices:
            return self._parallel_devices[0]
        if isinstance(self._accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Set by Fabric from ``devices=...``: one device only."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"strategy='megatrain' trains on one device, got devices={devices}; use Fabric(devices=1) "
                "(run several processes for several GPUs, each with its own device)"
            )
        self._parallel_devices = devices

    @property
    @override
    def is_global_zero(self) -> bool:
        return True

    @property
    @override
    def precision(self) -> MegatrainFabricPrecision:
        return self._precision if self._precision is not None else MegatrainFabricPrecision(strategy=self)

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        # Fabric builds a plugin from Fabric(precision=...) (bf16-true's would cast the module to bf16): keep
        # its flag, use the engine's semantics. A flag the engine cannot train with is refused here, in Fabric().
        self._precision = for_strategy(precision, MegatrainFabricPrecision, self)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()`` builds the model on the host in fp32: the engine decides what goes to the
        device, and a model too large for it must never be materialized there. ``empty_init=True`` builds it
        without weights (parameters on the meta device, buffers on the host): ``fabric.setup`` fills the
        engine's fp32 masters unit by unit, from the checkpoint ``load_hf_weights`` named, else by each
        module's own init (engine/host/materialize.py)."""
        return materialize.empty_init() if empty_init else _EmptyInit(enabled=False)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to move: the engine decides what lives on the device."""

    # -- setup / teardown ----------------------------------------------------------------------------
    def engine_config(self) -> EngineConfig:
        """The engine's options: this strategy's, with Fabric's device and precision."""
        return EngineConfig(**self.options, device=self.root_device, precision=self.precision.precision, training=True)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """Build the engine over `module` and hand back the host optimizer for the one optimizer (a plain
        AdamW/Adam on the native kernel, any other torch optimizer stepping itself: engine/generic_optim.py).

        The optimizer is checked before the engine takes the model apart, and the engine is closed again if
        taking the optimizer over fails, so an error leaves the model as it was."""
        if len(optimizers) != 1:
            raise ValueError(
                f"strategy='megatrain' steps exactly one optimizer on the host; fabric.setup got {len(optimizers)}. "
                "Pass a single optimizer (use param groups for different settings)."
            )
        check_optimizer(optimizers[0])
        module = self.setup_module(module)
        try:
            optimizer = self.setup_optimizer(optimizers[0])
        except BaseException:
            self.teardown_engine()
            raise
        return module, [optimizer], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Build the engine over `module` (its blocks now stream; its parameters stay registered, so an
        optimizer built on them afterwards and passed to ``fabric.setup_optimizers`` works too)."""
        if self.engine is not None:
            raise ValueError(
                "strategy='megatrain' streams one model per Fabric and one was set up already; "
                "use a Fabric (and a strategy) per model"
            )
        self.engine = Engine(module, self.engine_config())
        return module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> HostAdamW | GenericHostOptimizer:
        """Take the optimizer over: it shares the user's param groups (schedulers keep working)."""
        if self.engine is None:
            raise RuntimeError(
                "strategy='megatrain' takes the optimizer over for the model it streams: set the model up first, "
                "fabric.setup(model, optimizer) or fabric.setup_module(model) then fabric.setup_optimizers(optimizer)"
            )
        if self.optimizer is not None:
            raise ValueError(
                "strategy='megatrain' steps exactly one optimizer on the host and one was set up already; "
                "use param groups for different settings"
            )
        self.optimizer = self.engine.optimizer(optimizer)
        return self.optimizer

    def teardown_engine(self) -> None:
        """Close the engine: the model is an ordinary fp32 host model again, holding the trained weights."""
        if self.engine is not None:
            self.engine.close()
        self.engine, self.optimizer = None, None

    @override
    def teardown(self) -> None:
        """Hand back an ordinary fp32 host model (Fabric never calls this itself: call
        ``fabric.strategy.teardown()`` when training is done). The optimizer cannot step afterwards."""
        self.teardown_engine()
        super().teardown()

    # -- training hooks --------------------------------------------------------------------------------
    @contextmanager
    def _accumulating_backward(self) -> Iterator[None]:
        assert self.engine is not None
        before, self._accumulating = self._accumulating, True
        try:
            with self.engine.backward(accumulate=True):
                yield
        finally:
            self._accumulating = before

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Under ``no_backward_sync``: a micro-batch that is not the last (the context says so already).
        Otherwise, with ``overlap_optimizer``, this backward completes the step's gradient; without it, nothing
        is known of what follows, so the gradients land and wait for ``optimizer.step()``."""
        if self.engine is None or self._accumulating or not self.overlap_optimizer:
            return super().backward(tensor, module, *args, **kwargs)
        with self.engine.backward(clip=self.clipping):
            return super().backward(tensor, module, *args, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the global 2-norm of the gradients to `max_norm` in the next ``optimizer.step()``, exactly as
        ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, and return the total norm before
        clipping as it does (an fp32 scalar on the host, where the gradients are; this waits for them to land)."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"norm_type={norm_type}: strategy='megatrain' clips the global 2-norm only; pass norm_type=2"
            )
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm}: give a positive norm to clip to")
        self._check_clip_call(optimizer)
        total = self.engine.grad_norm()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total gradient norm is {float(total)}, so it cannot be clipped (nothing was clipped); "
                "pass error_if_nonfinite=False to scale the gradients by it anyway"
            )
        self.engine.clip_grad_norm_(float(max_norm))
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element to [-clip_val, clip_val] in the next ``optimizer.step()``, exactly as
        ``torch.nn.utils.clip_grad_value_`` on the step's gradient (the sum of its micro-batches)."""
        if not clip_val > 0:
            raise ValueError(f"clip_val={clip_val}: give a positive value to clamp the gradients to")
        self._check_clip_call(optimizer)
        self.engine.clip_grad_value_(float(clip_val))

    def _check_clip_call(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is None or not any(optimizer is o for o in (self.optimizer, self.optimizer.optimizer)):
            raise ValueError("clip_gradients: pass the model and the optimizer set up with this Fabric")
        if self.overlap_optimizer and not self.clipping:
            raise RuntimeError(
                "clip_gradients with MegatrainFabricStrategy(overlap_optimizer=True): the optimizer already stepped "
                "during backward. Pass clipping=True as well, so the step waits for the clip"
            )

    # -- checkpoints -----------------------------------------------------------------------------------
    def _streams(self, module: nn.Module) -> bool:
        return self.engine is not None and module is self.engine.model

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The streamed model's fp32 masters (views, no copies: ``fabric.save`` writes them at once)."""
        if self._streams(module):
            return self.engine.master_state_dict()
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Into the fp32 masters, refreshing every compute copy."""
        if self._streams(module):
            return self.engine.load_master_state_dict(state_dict, strict=strict)
        return super().load_module_state_dict(module, state_dict, strict=strict)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Fabric's loading with ``weights_only=True`` unless the caller says otherwise: tensors and plain
        containers only, never arbitrary pickled objects (the checkpoint's optimizer state is torch.optim's)."""
        weights_only = True if weights_only is None else weights_only
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    # -- one process: collectives are identities ----------------------------------------------------------
    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return obj


MegatrainFabricStrategy.__init__.__signature__ = inspect.signature(MegatrainFabricStrategy.__init__).replace(
    parameters=[
        *list(inspect.signature(MegatrainFabricStrategy.__init__).parameters.values())[:-1],
        *parameters("option", "loop"),
    ]
)
MegatrainFabricStrategy.__doc__ = MegatrainFabricStrategy.__doc__.replace(
    "{engine_options}", options_doc("option", "loop")
)

# Fabric asks no launch() of strategies that run in the calling process; see the module docstring.
DataParallelStrategy.register(MegatrainFabricStrategy)
