"""Token tiles for long context: how many tokens a decoder block processes at a time, and running a tile.

At 512k tokens, one block's recompute for an 8B model would hold ~300 KiB per token of intermediates
(MLP gate/up/product and their gradients, fp32 norm copies, projections). Everything in a block except
the attention core treats tokens independently, so it can run tile by tile; each tile is a
non-reentrant checkpoint, so under grad only the tile's inputs are saved and its intermediates exist
for one tile at a time, in forward and again in backward.

The tile size is resolved once per forward pass (``LlamaModel.forward``) and handed to every block as
an argument, so a block's recompute in backward uses the very tiles its forward used.

The attention core is tiled too when memory asks for it (``tiled_attention``, models/tiled_attention.py):
the fused kernel's backward holds, besides q, k, v, the output and their gradients, an fp32 dq accumulator
and (with grouped-query attention) dk and dv expanded to every query head: about a third more per token. The
tiled core holds nothing of the sequence's length beyond its inputs, outputs and two fp32 row statistics,
and is slower (plain torch, every score block computed three times), so "auto" keeps the fused kernel while
its backward takes at most AUTO_CORE_SHARE of the free memory. Its query blocks and key blocks are
:func:`attention_block` = 1/ATTENTION_BLOCK_DIVISOR of the token tile: a block pair's fp32 scores (heads x
(c/8)^2 x 4 bytes, two of them in backward) then stay below a tile's own intermediates wherever c x heads <
8 x (6I + 6H) (16384 x 32 heads for an 8B model: two 512 MiB score blocks beside a tile's 3.9 GiB), and the
memory "auto" gives a tile covers the core's blocks too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from megatrain_lightning.planning.device_memory import free_device_bytes

from .config import LlamaConfig

AUTO_CPU_TILE = 8192
"""Tile size "auto" picks on the CPU (where there is no separate device memory to size it from)."""
AUTO_MIN_TILE = 1024
AUTO_UNTILED_SHARE = 4
""""auto" leaves blocks untiled while their whole recompute transient takes at most 1/4 of the free memory."""
AUTO_SHARE = 16
""""auto" lets one tile's transient take at most 1/AUTO_SHARE of the free device memory: the rest is the
attention core's inputs and gradients, the saved block inputs and the weights."""


AUTO_CORE_SHARE = (3, 4)
""""auto" tiles the attention core once the fused kernel's backward would take over 3/4 of the free memory."""
ATTENTION_BLOCK_DIVISOR = 8
"""The tiled attention core's query and key blocks are 1/8 of the token tile (module docstring)."""


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


def fused_core_bytes_per_token(config: LlamaConfig, elt: int) -> int:
    """One token's share of a tiled block's memory in the fused attention kernel's backward: q, the output, its
    gradient and dq (4A); k, v, dk, dv (4K', K' = K where bf16 kernels share kv heads, A + K where fp32 repeats
    them); the block's output, its incoming gradient and the input's gradient (3H); the softmax statistics
    (4 bytes per head); and in bf16 the CUDA flash kernel's workspace: an fp32 dq accumulator (4A) and, with
    grouped-query attention, dk and dv expanded to every head (2A x elt)."""
    h, heads = config.hidden_size, config.num_attention_heads
    a, k = heads * config.head_dim, config.num_key_value_heads * config.head_dim
    grouped = heads > config.num_key_value_heads
    kv = k if elt == 2 or not grouped else a + k  # bf16 kernels share kv heads (enable_gqa); fp32 repeats them
    workspace = (4 * a + (2 * a * elt if grouped else 0)) if elt == 2 else 0
    return elt * (4 * a + 4 * kv + 3 * h) + 4 * heads + workspace


def tiled_core_bytes_per_token(config: LlamaConfig, elt: int) -> int:
    """The same with the tiled attention core: kv heads never repeated (4K), no accumulator of the sequence's
    length, and two fp32 statistics per head (the log-sum-exp and D = rowsum(dO * O)). Its blocks' workspace
    does not grow with the sequence (:func:`~megatrain_lightning.models.tiled_attention.workspace_bytes`)."""
    h, heads = config.hidden_size, config.num_attention_heads
    a, k = heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return elt * (4 * a + 4 * k + 3 * h) + 8 * heads


def attention_block(tile: int) -> int:
    """Queries (and keys) per block of the tiled attention core for tiles of `tile` tokens."""
    return max(1, tile // ATTENTION_BLOCK_DIVISOR)


def auto_core(config: LlamaConfig, tokens: int, rows: int, elt: int, free: int | None) -> bool:
    """Whether "auto" tiles the attention core of blocks tiled for `rows` x `tokens` tokens with `free` device
    bytes: once the fused kernel's backward would take over AUTO_CORE_SHARE of them (never on the CPU, where
    there is no device memory to size from)."""
    if free is None:
        return False
    share, of = AUTO_CORE_SHARE
    return rows * tokens * fused_core_bytes_per_token(config, elt) > free * share // of


def resolve_core(config: LlamaConfig, tokens: int, rows: int, device: torch.device, elt: int) -> bool:
    """Whether tiled blocks run the tiled attention core (``config.tiled_attention``; "auto": :func:`auto_core`)."""
    setting = config.tiled_attention
    if setting == "auto":
        return auto_core(config, tokens, rows, elt, free_device_bytes(device))
    return setting


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
