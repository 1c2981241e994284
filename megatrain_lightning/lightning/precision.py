"""Precision for strategy='megatrain' under the Trainer and under Fabric: bf16 or fp32 compute, always fp32 master
weights and optimizer.

Both plugins are thin adapters over one :class:`PrecisionCore` (the flag checked once, the compute dtype, the
forward context, the module left alone). Each receives at construction the strategy it serves, as a
:class:`Streaming`, and reads the device, the engine and whether hooks see gradients from it when Lightning
calls: nothing is assigned to a plugin after it is built.
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from megatrain_lightning.engine import check_precision, compute_dtype, forward_context

if TYPE_CHECKING:
    from megatrain_lightning.engine import Engine


class Streaming(Protocol):
    """What a plugin reads of the strategy it serves, when it is called."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def engine(self) -> Engine | None: ...

    @property
    def gradients_visible(self) -> bool:
        """Whether hooks read or edit gradients, which then see them in ``.grad`` (the Trainer's strategy)."""
        ...


class PrecisionCore:
    """The precision flag mapped onto the engine: ``bf16-mixed`` and ``bf16-true`` stream bf16 copies of the fp32
    masters (``bf16-mixed`` runs the forward under ``torch.autocast``: softmax and losses in fp32, as Lightning's
    AMP does); ``32-true`` streams fp32. Unlike Lightning's own plugins it never casts the module (the engine
    needs its fp32 parameters as masters) nor the inputs and outputs."""

    def __init__(self, precision: str, strategy: Streaming | None) -> None:
        self.precision = check_precision(precision)
        self.strategy = strategy

    @property
    def device_type(self) -> str:
        """The strategy's root device's type ("cpu" for a plugin that serves no strategy yet)."""
        return "cpu" if self.strategy is None else self.strategy.root_device.type

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    def forward_context(self) -> ContextManager:
        """The engine's forward context: autocast to bf16 for ``bf16-mixed``, nothing otherwise."""
        return forward_context(self.precision, self.device_type)

    @property
    def engine(self) -> Engine | None:
        return None if self.strategy is None else self.strategy.engine


class _OnCore:
    """What both plugins are: their :class:`PrecisionCore`'s flag, strategy, device type, compute dtype and
    forward context, and the module left alone (listed first in each plugin's bases, so these win)."""

    def __init__(self, precision: str = "32-true", strategy: Streaming | None = None) -> None:
        self.core = PrecisionCore(precision, strategy)
        self.precision = self.core.precision

    @property
    def strategy(self) -> Streaming | None:
        return self.core.strategy

    @property
    def device_type(self) -> str:
        return self.core.device_type

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.core.compute_dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Leave dtypes alone: the engine keeps fp32 masters and makes the compute copies itself."""
        return module

    def forward_context(self) -> ContextManager:
        return self.core.forward_context()


class MegatrainPrecision(_OnCore, Precision):
    """``Trainer(strategy="megatrain", precision=...)``: :class:`PrecisionCore` for the Trainer, which also shows
    hooks every gradient in ``.grad`` when they ask for it and hands clipping to the engine."""

    def _visible(self) -> ContextManager:
        engine = self.core.engine
        visible = engine is not None and self.strategy is not None and self.strategy.gradients_visible
        return engine.gradients_visible() if visible else nullcontext()

    @override
    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """``on_after_backward`` runs with every gradient in ``.grad`` when a hook asks for it."""
        with self._visible():
            return super().post_backward(tensor, module)

    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        """``on_before_optimizer_step`` and clipping, with every gradient in ``.grad`` when a hook asks for it."""
        with self._visible():
            super()._after_closure(model, optimizer)

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """The engine clips inside the step, exactly as torch's ``clip_grad_norm_`` / ``clip_grad_value_`` on
        ``.grad`` would (the gradients, or what the hooks left of them, are on the host by then)."""
        if clip_val is None or clip_val <= 0:
            return
        engine = self.core.engine
        if engine is None:
            raise RuntimeError("clip_gradients was called before the megatrain strategy was set up")
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            engine.clip_grad_value_(float(clip_val))
        else:
            engine.clip_grad_norm_(float(clip_val))


class MegatrainFabricPrecision(_OnCore, FabricPrecision):
    """``Fabric(strategy="megatrain", precision=...)``: :class:`PrecisionCore` for Fabric (Fabric clips through
    the strategy, so there is nothing more)."""


def for_strategy(plugin: Any, cls: type, strategy: Streaming) -> Any:
    """The plugin a megatrain strategy keeps for what Lightning or Fabric built from the precision flag (or the
    user passed): `cls` over `plugin`'s flag, serving `strategy`. Lightning's own plugin for ``bf16-true``
    would cast the module to bf16; only its flag is kept. A flag the engine cannot train with is refused here."""
    if plugin is None or (isinstance(plugin, cls) and plugin.strategy is strategy):
        return plugin
    return cls(str(getattr(plugin, "precision", "32-true")), strategy)
