"""Finding the repeated decoder blocks of a model."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: the nn.ModuleList of >= 2 same-class modules holding the most parameters.

    That is ``model.layers`` for this project's Llama and ``model.model.layers`` for any Hugging Face
    ``*ForCausalLM``. Lists nested inside a layer (experts, heads) hold fewer parameters than the layer
    list itself, so they are never chosen.
    """
    best: tuple[str, nn.ModuleList, int] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel > 0 and (best is None or numel > best[2]):
            best = (name, module, numel)
    if best is None:
        raise ValueError(
            f"strategy='megatrain' streams a model's repeated decoder blocks, and {type(model).__name__} has none: "
            "it looks for an nn.ModuleList of at least 2 modules of one class that hold parameters (the decoder "
            "layers, e.g. `model.layers` of a Hugging Face *ForCausalLM). Keep the layers in an nn.ModuleList, "
            "or train this model with an ordinary strategy."
        )
    return best[0], best[1]
