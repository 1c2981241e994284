"""The weights a callback put in a checkpoint's ``state_dict`` in place of the masters (WeightAveraging's
average): a sharded checkpoint writes them as its weights, as Lightning's single file would hold them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatrain_lightning.engine import Engine, HostUnit


def replaced_weights(engine: Engine, state_dict: dict[str, Any]) -> Callable[[HostUnit], torch.Tensor] | None:
    """For a sharded checkpoint whose ``state_dict`` a callback replaced (WeightAveraging's average): per unit,
    the flat fp32 weights the state dict holds. None when every parameter in it is still its master's view."""

    def own(unit: HostUnit) -> bool:
        names = engine.qualified_names(unit)
        return all(_is_master(_entry(state_dict, n), unit, e) for n, e in zip(names, unit.entries))

    def weights(unit: HostUnit) -> torch.Tensor:
        if own(unit):
            return unit.master
        tensors = [_entry(state_dict, n) for n in engine.qualified_names(unit)]
        return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])

    return None if all(own(u) for u in engine.all_units()) else weights


def _entry(state_dict: dict[str, Any], name: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(
            f"the checkpoint's state_dict lacks {name!r} (a callback's on_save_checkpoint replaced it); a "
            "sharded checkpoint needs every parameter: keep them all, or use checkpoint_format='torch'"
        )
    return state_dict[name]


def _is_master(t: torch.Tensor, unit: HostUnit, e: Any) -> bool:
    """Whether `t` is parameter `e`'s view of the unit's fp32 master (what the strategy put in the state dict)."""
    own = unit.master[e.offset : e.offset + e.numel]
    return t.dtype == torch.float32 and t.device == own.device and t.data_ptr() == own.data_ptr()
