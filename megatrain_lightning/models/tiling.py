"""Token tiles for long context: how many tokens a decoder block processes at a time, and running a tile.

At 512k tokens, one block's recompute for an 8B model would hold ~300 KiB per token of intermediates
(MLP gate/up/product and their gradients, fp32 norm copies, projections). Everything in a block except
the attention core treats tokens independently, so it can run tile by tile; each tile is a
non-reentrant checkpoint, so under grad only the tile's inputs are saved and its intermediates exist
for one tile at a time, in forward and again in backward.

The tile size is resolved once per forward pass (``LlamaModel.forward``) and handed to every block as
an argument, so a block's recompute in backward uses the very tiles its forward used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megatrain_lightning.device_memory import free_device_bytes

from .config import LlamaConfig

AUTO_CPU_TILE = 8192
"""Tile size "auto" picks on the CPU (where there is no separate device memory to size it from)."""
AUTO_MIN_TILE = 1024
AUTO_UNTILED_SHARE = 4
""""auto" leaves blocks untiled while their whole recompute transient takes at most 1/4 of the free memory."""
AUTO_SHARE = 16
""""auto" lets one tile's transient take at most 1/AUTO_SHARE of the free device memory: the rest is the
attention core's inputs and gradients, the saved block inputs and the weights."""


def tile_bytes_per_token(config: LlamaConfig, elt: int) -> int:
    """Intermediates of one token inside a tile's recompute with grad: the MLP's gate, up, silu and product
    plus two gradients of that width (6I), normed input, projections and residuals (6H) in the compute
    dtype, and the two RMSNorms' fp32 copies (8H bytes)."""
    h, i = config.hidden_size, config.intermediate_size
    return elt * (6 * i + 6 * h) + 8 * h


def untiled_bytes_per_token(config: LlamaConfig, elt: int) -> int:
    """One token's share of an untiled block's recompute with grad: the tile's intermediates plus the
    attention's q, k, v, their rotations and repeats and its output (7A + 4K)."""
    a, k = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return tile_bytes_per_token(config, elt) + elt * (7 * a + 4 * k)


def resolve_tile(config: LlamaConfig, tokens: int, rows: int, device: torch.device, elt: int) -> int | None:
    """Tokens per tile for a pass over `rows` x `tokens` tokens computed on `device` in a dtype of `elt`
    bytes, or None when the blocks run untiled (no tiling asked, or one tile would hold the whole row)."""
    setting = config.token_chunk_size
    if setting == "auto":
        setting = auto_tile(config, tokens, rows, elt, free_device_bytes(device))
    return setting if setting is not None and setting < tokens else None


def auto_tile(config: LlamaConfig, tokens: int, rows: int, elt: int, free: int | None) -> int | None:
    """What "auto" picks for `rows` x `tokens` tokens with `free` device bytes: None (untiled) while the
    untiled block transient fits in 1/AUTO_UNTILED_SHARE of them, else the largest power of two (at least
    AUTO_MIN_TILE tokens) whose tile transient fits in 1/AUTO_SHARE; AUTO_CPU_TILE when there is no
    device memory to size from. Tiling costs one more forward of everything but attention, so it is only
    used where memory asks for it."""
    if free is None:
        return AUTO_CPU_TILE
    if rows * tokens * untiled_bytes_per_token(config, elt) <= free // AUTO_UNTILED_SHARE:
        return None
    per_token = tile_bytes_per_token(config, elt) * rows
    tile = AUTO_MIN_TILE
    while tile * 2 * per_token <= free // AUTO_SHARE:
        tile *= 2
    return tile


def run_tile(fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """`fn(*args)`; under grad as a checkpoint that saves only `args` and recomputes `fn` in backward.
    Nothing inside draws random numbers, so no RNG state is kept for the recompute."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)
