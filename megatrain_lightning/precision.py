"""Precision for strategy='megatrain': bf16 or fp32 compute, always fp32 master weights and optimizer."""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from megatrain_lightning.engine.config import check_precision, compute_dtype, forward_context

if TYPE_CHECKING:
    from megatrain_lightning.engine.engine import Engine


class MegatrainPrecision(Precision):
    """Maps Lightning's precision flag onto the engine's compute dtype.

    ``bf16-mixed`` and ``bf16-true`` both stream bf16 weights and compute in bf16 while the masters and
    Adam state stay fp32 on the host; ``bf16-mixed`` additionally runs the step under ``torch.autocast``
    (softmax and losses in fp32, as Lightning's AMP does). ``32-true`` streams fp32 weights.
    """

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = check_precision(precision)  # type: ignore[assignment]
        self.device_type = "cpu"  # set by the strategy to its root device's type
        self.engine: Engine | None = None
        # Set by the strategy when hooks read or edit gradients: they see them in `.grad` (gradients_visible).
        self.gradients_visible = False

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Leave dtypes alone: the engine keeps fp32 masters and makes compute copies itself."""
        return module

    @override
    def forward_context(self) -> ContextManager:
        return forward_context(self.precision, self.device_type)

    def _visible(self) -> ContextManager:
        return self.engine.gradients_visible() if self.gradients_visible and self.engine is not None else nullcontext()

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
        if self.engine is None:
            raise RuntimeError("clip_gradients was called before the megatrain strategy was set up")
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.engine.clip_grad_value_(float(clip_val))
        else:
            self.engine.clip_grad_norm_(float(clip_val))
