"""The peers megatrain is compared with: Lightning's DeepSpeed ZeRO-3 offload and FSDP CPU offload.

bench/throughput.py trains each at megatrain's comparison point: the same model (shape, layers, init),
micro-batch, sequence length, accumulation and gradient clipping; every decoder layer is recomputed in
backward, as megatrain recomputes every block, so all three do the same math. What differs is the
system: where the optimizer runs and how parameters and gradients move.

- DeepSpeed: ``deepspeed_stage_3_offload`` with pinned buffers, ``deepspeed.checkpointing`` around each
  layer, DeepSpeedCPUAdam (ZeRO-Offload's optimizer, a C++ op compiled on first use). The row fails,
  naming the reason, unless that compiled op really loaded: a DeepSpeed row stepping torch's AdamW
  would compare megatrain with a slower peer than the one users run. Clipping: DeepSpeed's own
  ``gradient_clipping``, which Lightning sets from ``Trainer(gradient_clip_val=)``.
- FSDP: ``FSDPStrategy(cpu_offload=True)`` with decoder layers as the wrap and checkpointing policy,
  ``torch.optim.AdamW(fused=True)`` on the CPU. Clipping: the root FSDP module's ``clip_grad_norm_``
  (Lightning's FSDP precision refuses to clip by norm itself).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatrain_lightning.models.llama import DecoderLayer

COMPETITORS = {"deepspeed": "DeepSpeed ZeRO-3 offload", "fsdp": "FSDP CPU offload"}
NOTE = (
    f"{COMPETITORS['deepspeed']}: Lightning's deepspeed_stage_3_offload with pin_memory=True, "
    "deepspeed.checkpointing per layer, DeepSpeedCPUAdam (its compiled op checked); "
    f"{COMPETITORS['fsdp']}: FSDPStrategy(cpu_offload=True), decoder layers as auto_wrap_policy and "
    "activation_checkpointing_policy, fused CPU AdamW; both at megatrain's point, clipping included"
)


def blocker(kind: str, device: torch.device) -> str | None:
    """Why a peer cannot run here (None: it can)."""
    if device.type != "cuda":
        return "skipped: needs CUDA"
    if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return (
            "missing: DeepSpeed is not installed (bench-only: pip install deepspeed; without network, "
            "carry the wheel: docs/benchmarks.md, GPU)"
        )
    return None


class _Checkpointed(nn.Module):
    """A decoder layer whose activations are recomputed in backward. It is called through the module, so
    DeepSpeed's parameter-fetching hooks run for the recompute too."""

    def __init__(self, layer: nn.Module, checkpoint: Callable) -> None:
        super().__init__()
        self.layer, self._checkpoint = layer, checkpoint

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self._checkpoint(self.layer, *args)


def prepare(kind: str, model: nn.Module) -> None:
    """DeepSpeed: every decoder layer recomputed through deepspeed.checkpointing (FSDP's strategy does it)."""
    if kind == "deepspeed":
        import deepspeed

        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = _Checkpointed(layer, deepspeed.checkpointing.checkpoint)


def optimizer(kind: str, groups: list[dict], hp: dict) -> tuple[torch.optim.Optimizer, str]:
    """The peer's optimizer and what the table says about it."""
    if kind == "deepspeed":
        return deepspeed_cpu_adam(groups, hp)
    return torch.optim.AdamW(groups, fused=True, **hp), "torch.optim.AdamW(fused=True) on the CPU"


def deepspeed_cpu_adam(groups: list[dict], hp: dict) -> tuple[torch.optim.Optimizer, str]:
    """DeepSpeedCPUAdam with its compiled op loaded, or a RuntimeError saying why not (the row fails)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    try:
        opt = DeepSpeedCPUAdam(groups, adamw_mode=True, **hp)
    except (ImportError, OSError, RuntimeError) as err:  # the JIT build needs a compiler, ninja and CUDA headers
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1][:80]
        raise RuntimeError(
            f"DeepSpeedCPUAdam did not build its C++ op ({reason}); the DeepSpeed row needs it: "
            "check nvcc and ninja (DS_BUILD_CPU_ADAM=1 prebuilds it)"
        ) from err
    origin = compiled_origin(getattr(opt, "ds_opt_adam", None))
    if origin is None:
        raise RuntimeError(
            f"DeepSpeedCPUAdam's op {getattr(opt, 'ds_opt_adam', None)!r} is not a compiled "
            "extension; the DeepSpeed row needs the C++ op, not a stand-in"
        )
    return opt, f"DeepSpeedCPUAdam, compiled op {Path(origin).name}"


def compiled_origin(op: Any) -> str | None:
    """The shared library `op` was loaded from, or None when it is no compiled Adam extension."""
    path = getattr(op, "__file__", None)
    if path and Path(path).suffix in (".so", ".pyd") and callable(getattr(op, "adam_update", None)):
        return str(path)
    return None


def make_strategy(kind: str) -> Any:
    if kind == "deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

        # Lightning's registered "deepspeed_stage_3_offload", with the pinned buffers DeepSpeed recommends.
        return DeepSpeedStrategy(**StrategyRegistry["deepspeed_stage_3_offload"]["init_params"], pin_memory=True)
    if kind == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        layers = {DecoderLayer}
        return FSDPStrategy(cpu_offload=True, auto_wrap_policy=layers, activation_checkpointing_policy=layers)
    raise ValueError(f"no peer named {kind!r}; peers: {', '.join(COMPETITORS)}")
