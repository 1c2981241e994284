"""Memory planner: how many bytes of host and GPU memory a run with ``strategy="megatrain"`` needs.

``plan(config, seq_len, micro_batch, ...)`` is a pure function of the model's shapes and the run's
settings, so ``megatrain plan`` and resource requests (a Ray trial asks for ``{"memory": host bytes}``)
can size a run before anything is allocated.

Host bytes follow the engine's own buffers one for one (``engine/host/units.py``, ``engine/host/ring.py``), for the
host layout planned (``MegatrainStrategy(host_layout=..., nvme_dir=...)``), per parameter:

    default   fp32 master 4 + Adam m, v 8 + pinned compute copy (2 in bf16; 0 in fp32, where the master is
              the copy) + gradient slab (2 in bf16, 4 in fp32) + fp32 accumulator 4 (only when accumulate > 1)
    lean      fp32 master 4 + Adam m, v 8 + fp32 accumulator 4 (only when accumulate > 1)
              + gradient slab (2 in bf16, 4 in fp32) only with clipping and accumulate = 1, where each
                gradient waits for the global norm
              + two rings of pieces (``engine/host/ring.py``: a piece is 1/32 of the largest unit, at least 2^22
                elements), not per parameter, in the compute dtype: 4 pieces that uploads cast the master
                into (none in fp32), and a block's pieces + 1 that gradients land in
    nvme_dir  Adam m, v (8) in files on that directory instead of host memory; the host keeps them for
              4 pieces in flight (4 x piece x 8 bytes). Each optimizer step reads and writes all
              of them: 16 bytes/param of drive traffic, timed at ``nvme_gbps`` GB/s read and as much write

The largest unit is the larger of a decoder block and the vocab x hidden embedding or head (each parameter
outside the blocks is a unit of its own). ``host_layout="auto"`` plans the first that fits ``host_mem``:
default, lean, then (given ``nvme_dir``) lean with Adam on NVMe; each step down saves host memory and costs
time (the lean casts on the host; the drive traffic).

The copy and slab (in fp32 the master and slab) are page-locked at exactly these sizes (``engine/host/pinned.py``;
no power-of-two rounding), and the engine's own host-memory check uses the same per-parameter figure.

GPU bytes are the engine's fixed buffers plus what a step computes with; each item is a fixed part plus a
part per token of the micro-batch (``elt`` = compute dtype bytes, ``n`` = micro_batch x seq_len tokens,
``A`` = heads x head_dim, ``K`` = kv_heads x head_dim, ``I`` = MLP width, ``H`` = hidden, ``V`` = vocabulary,
``c`` = tokens per tile):

    weight slots      num_slots x largest block x elt; num_slots="auto": 2 plus as many more as the GPU
                      memory left beyond 4 x the step's transient (saved inputs, RoPE, the larger of
                      recompute and loss) and 1 GiB allows, at most one per block (what the engine settles
                      on after its first step, device_memory.auto_slot_count, from the same figures measured)
    gradient slots    2 x largest block x elt
    gradient sums     (accumulate > 1) (sums x block + outer) x 4 / W: the blocks whose fp32 gradient sum stays
                      on the device across micro-batches, and with them the outer parameters'
                      (``device_grad_sums``: a count, or "auto": after the slots, as many as the memory beyond
                      4 x the transient and 1 GiB allows, the outer ones first; engine/device/grad_sums.py)
    outer parameters  (embedding + final norm + head, a tied head counted once) x elt
    saved inputs      layers x n x H x elt                      (the only activations kept for backward)
                      with offloaded inputs: n x H x elt (the block in use; the next one is fetched
                      after its recompute is issued); the layers x n x H x elt move to pinned host
                      memory ("activations"), or layers x n x H x 2 with offload_inputs_dtype="bf16",
                      layers x n x (H + 4) with "fp8" (a byte per element, a 4-byte scale per token)
    RoPE              cos and sin, n x head_dim x elt each (computed once per pass, shared by all blocks)
    block recompute   untiled: n x (elt x (7A + 4K + 6I + 6H) + 8H) + block x elt      (transient, one block)
                      tiled:   the larger of
                               n x (elt x (4A + 4K' + 3H) + 4 heads) + attention workspace  (attention backward)
                               n x elt x (3A + 2K' + 3H) + c x (elt x (6I + 6H) + 8H)       (a tile's backward)
                               plus block x elt
                      tiled core (``tiled_attention``): the attention backward's term is
                               n x (elt x (4A + 4K + 3H) + 8 heads) + one block pair of the core
                      row chunks (``row_chunk`` R below the micro-batch's rows; engine/device/rows.py): the term above
                               for one chunk's R x seq_len tokens (tiles planned for them), + block x 4 (the
                               fp32 gradient sum over chunks) + n x 4 H elt (the block's input, its output's and
                               its input's gradients, the next input prefetched); no kept graphs
    chunked loss      min(loss_chunk_size, n) x V x 4 x 3 + V x H x (4 + elt) + 2 n H elt  (transient)
    kept graphs       kept x n x (elt x (4H + 2A + 2K" + 4I + 2 head_dim) + 8H + 4 heads + 8)   untiled
                      kept x n x (elt x (H + 2A + 2K" + 2 head_dim) + 4 heads)                   tiled
                      (recompute: the blocks whose graph stays from the forward to their backward)
    CUDA context      1 GiB fixed allowance for the context and allocator slack

Untiled, the recompute term counts what autograd keeps while one block is recomputed with grad: attention
q, rotated q, repeated k and v, attention output and its reshaped copy (7A); k, v and their rotations
(4K); the MLP's gate, up, silu and product plus two gradients of that width in flight (6I); normed inputs,
projections and residuals (6H); the two RMSNorms' fp32 copies (8H bytes); and the block's weight
gradients before they are packed into a gradient slot.

Tiled (``token_chunk_size``, models/tiling.py), only the attention core sees the whole sequence, and the
peak is one of two moments. In the attention's backward: q, the attention output, its gradient and dq
(4A); k, v, dk and dv (4K', K' = K when bf16 kernels share kv heads, A + K when fp32 repeats them); the
block's output, the gradient coming into the block and the input's gradient gathered tile by tile (3H); the softmax
statistics (4 bytes per head); and the attention workspace, what the CUDA flash kernel allocates inside
its backward (bf16): an fp32 dq accumulator (4A) and, with grouped-query attention, dk and dv expanded
to all heads (2A x elt); the fp32 memory-efficient kernel needs none. Or earlier, in a tile's backward:
q, k, v and the output (3A + 2K' with the output's gradient gathering), the 3H above, and one tile's
intermediates. These terms were read off the live tensors at the measured peak (``measure.py``). With the
tiled attention core (models/tiled_attention.py, chosen by "auto" once the fused kernel's backward would take
over 3/4 of ``gpu_mem``) the attention backward holds the same tensors without the flash workspace, kv heads
never repeated (4K), and two fp32 statistics per head (its log-sum-exp and D = rowsum(dO * O)); its block
pair (``tiled_attention.workspace_bytes``: fp32 blocks of 1/8 of a tile) does not grow with the sequence.

A kept graph (``recompute``, engine/device/recompute.py) holds what the block's ops save for backward (read off
saved-tensor hooks on the model): untiled, each RMSNorm's fp32 input (8H bytes for the two), inverse norm
(4 bytes, 8) and, in the compute dtype, its output and that output cast for the projections (4H); q and
the attention output (2A), k and v (2K": K where bf16 kernels share kv heads, A where fp32 repeats them),
the softmax statistics (4 bytes per head); gate, up, silu and their product (4I); RoPE's cos and sin
(2 head_dim). Tiled, each tile is recomputed inside the block's backward, so the graph keeps only the
block's input (H), the concatenated q, k, v, the attention output, the statistics, and cos and sin.
``kept`` (:func:`kept_blocks`) follows the engine's "auto" rule on the plan's figures: from the last block
back, while kept x that fits
:data:`~megatrain_lightning.engine.device.recompute.KEEP_SHARE` of the memory free at the pass's first block
(``gpu_mem`` less the persistent items, the context, RoPE and the first block's input) and
:data:`~megatrain_lightning.engine.device.recompute.STREAMING_SLOTS` slots stay unpinned; ``False`` keeps every
block (one slot per block), ``True`` none.

Attention uses the fused SDPA kernels (no T x T scores). The loss term is the chunk's fp32 logits, their
gradient and a compute-dtype copy, plus the head's fp32 gradient sum and its cast, and the last hidden
states with their gradient. The two transients never coexist, so the peak takes the larger.

``megatrain plan`` prints beside these formulas the peak measured by running one training step of the
engine and the model on fake tensors (``measure.py``): the formulas are checked, not only stated.

Data parallel (``devices`` GPUs on each of ``nodes`` nodes, W = devices x nodes ranks; planned ahead of a
mode built on the CPU, not yet run on GPUs): every unit's flat host buffers that scale with the parameters (master,
Adam m and v, compute copy, gradient slab, accumulator) are cut into W contiguous shards, one per rank, so
the W ranks together hold one copy of them and a node 1/nodes of it (``per_node``, rounded up; padding each
unit to a multiple of W adds at most W elements per unit, not counted). What does not scale with the
parameters is each rank's own: staging and gradient rings, Adam pieces in flight from NVMe, offloaded
block inputs of its micro-batch (``PER_RANK_KINDS``): devices times a rank's on a node. GPU memory is per GPU:
a slot holds a whole block once its shards are all-gathered (in place: the rank uploads its shard into its
own part of the slot), so every single-GPU item stays. A unit's gradient is exchanged all-to-all into a
buffer of the unit's size and each rank sums its chunk's W parts in fp32 (engine/ranks.py): the
largest unit (the embedding or head, or a block) adds that buffer and the chunk's sum
(:func:`collective_bytes`), beside an allowance for the collective library's own channel buffers
(``COLLECTIVE_BYTES``, ranks.py; not measured); everything sized from the GPU limit (micro-batch, sequence, slots)
leaves them free.

Why one file of about 1,200 lines: every figure here (host per buffer kind, drive, GPU per item and per
token, the tiers "auto" tries, the longest sequence that fits) is read by the one ``plan`` and printed by
the one table, and each is short; the engine-side facts it counts with (buffer kinds, ring and piece sizes,
slot counts, option checks) are imported from the engine, so they cannot drift.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatrain_lightning.engine.config import HOST_LAYOUTS as ENGINE_HOST_LAYOUTS
from megatrain_lightning.engine.config import EngineConfig, OffloadInputsDtype, check_host_layout, check_precision
from megatrain_lightning.engine.device.grad_sums import auto_sum_count
from megatrain_lightning.engine.device.recompute import (
    KEEP_SHARE,
    STREAMING_SLOTS,
    Recompute,
    check_recompute,
    kept_count,
)
from megatrain_lightning.engine.host.nvme import BUFFERS as NVME_BUFFERS
from megatrain_lightning.engine.host.ring import piece_numel, ring_counts
from megatrain_lightning.engine.host.units import host_bytes_by_kind
from megatrain_lightning.models.config import LlamaConfig
from megatrain_lightning.models.tiled_attention import workspace_bytes as tiled_core_workspace
from megatrain_lightning.models.tiling import (
    attention_block,
    auto_core,
    auto_tile,
    fused_core_bytes_per_token,
    tile_bytes_per_token,
    tiled_core_bytes_per_token,
    untiled_bytes_per_token,
)
from megatrain_lightning.planning.device_memory import auto_slot_count
from megatrain_lightning.planning.ranks import data_parallel_text, exchange_bytes

GiB = 2**30
CUDA_CONTEXT_BYTES = GiB
"""Allowance for the CUDA context and allocator fragmentation; not visible to ``max_memory_allocated``."""
HOST_LAYOUTS: tuple[str, ...] = (*ENGINE_HOST_LAYOUTS, "auto")
"""The engine's layouts and "auto", which the planner resolves (:func:`choose_tiers`)."""
NVME_PIECES_IN_FLIGHT = NVME_BUFFERS
"""Pieces whose Adam m, v the host holds while the drive reads ahead and writes behind (the tier's buffers)."""
NVME_GBPS = 6.0
"""Drive bandwidth assumed by default, GB/s (10^9 bytes) read and as much write: a PCIe 4.0 x4 NVMe drive."""
PER_RANK_KINDS = ("staging", "grad_ring", "nvme_buffers", "activations")
"""Host buffers each rank keeps for itself (a node holds devices of each); every other kind is sharded."""
TIERS: tuple[tuple[str, bool], ...] = (("default", False), ("lean", False), ("lean", True))
"""(host layout, Adam on NVMe) in the order ``host_layout="auto"`` tries them: less host memory each."""

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``"512GiB"``, ``"80GB"``, ``"1.5TiB"`` or a plain integer number of bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"size {text!r} is not a number with a unit; write e.g. 512GiB, 80GB or 1.5TiB")
    number, unit = float(match.group(1)), match.group(2).lower() or "b"
    if unit in ("k", "m", "g", "t"):
        u = unit.upper()
        raise ValueError(
            f"size {text!r}: unit {match.group(2)!r} is ambiguous; write {match.group(1)}{u}B "
            f"(powers of 10) or {match.group(1)}{u}iB (powers of 2)"
        )
    if unit not in _UNITS:
        raise ValueError(
            f"size {text!r} has unknown unit {match.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    return int(number * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """``"119.7 GiB"`` (one decimal; MiB below 1 GiB): the form ``megatrain plan`` and the configs use."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def block_numel(config: LlamaConfig) -> int:
    """Parameters of one decoder block (all blocks are alike)."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if config.attention_bias else 0)
    return attn + 3 * h * config.intermediate_size + 2 * h


def outer_numel(config: LlamaConfig) -> int:
    """Parameters outside the blocks: embedding, final norm and (unless tied) the head."""
    return config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2) + config.hidden_size


def collective_bytes(config: LlamaConfig, precision: str, ranks: int) -> int:
    """GPU bytes a data-parallel rank sets aside for collectives (none with one rank): the library's allowance,
    and the gradient exchange of the largest unit: its parts (the unit, padded to W chunks) and its chunk's
    fp32 sum and compute-dtype result."""
    largest = max(block_numel(config), config.vocab_size * config.hidden_size)
    return exchange_bytes(largest, compute_bytes(precision), ranks)


def compute_bytes(precision: str) -> int:
    """Bytes per element of the dtype weights stream and blocks compute in."""
    return 4 if check_precision(precision) == "32-true" else 2


def saved_input_bytes(config: LlamaConfig, tokens: int, precision: str, stored: OffloadInputsDtype = None) -> int:
    """One block's input hidden state for a micro-batch of `tokens` tokens; `stored`: as offload_inputs_dtype
    stores it on the host (bf16: 2 bytes per element; fp8: 1, plus a 4-byte scale per token)."""
    if stored == "fp8":
        return tokens * (config.hidden_size + 4)
    return tokens * config.hidden_size * (2 if stored == "bf16" else compute_bytes(precision))


def kept_attention_bytes(config: LlamaConfig, tokens: int, precision: str) -> int:
    """One block call's attention outputs kept for its recompute (keep_attention) for `tokens` tokens: the output, in
    the compute dtype, and an fp32 log-sum-exp per head (engine/device/kept_attention.py)."""
    heads = config.num_attention_heads
    return tokens * heads * (config.head_dim * compute_bytes(precision) + 4)


def largest_unit(config: LlamaConfig) -> int:
    """Parameters of the largest streamed unit: a decoder block, or the vocab x hidden embedding or head."""
    return max(block_numel(config), config.vocab_size * config.hidden_size)


def host_breakdown(
    config: LlamaConfig,
    precision: str,
    accumulate: int,
    tokens: int = 0,
    offload_inputs: bool = False,
    *,
    layout: str = "default",
    nvme: bool = False,
    clipping: bool = False,
    num_slots: int = 2,
    inputs_dtype: OffloadInputsDtype = None,
    speculative: bool = False,
    kept_attention: bool = False,
) -> dict[str, int]:
    """Host bytes per buffer kind, as the engine allocates them after the first training step, for host
    `layout` "default" or "lean" (with `clipping`: gradient clipping on); `nvme`: Adam m, v in files, the
    host holding only the units in flight. With `offload_inputs`, the pinned buffers holding every
    block's input for a micro-batch of `tokens` tokens, stored as `inputs_dtype` (offload_inputs_dtype), and with
    `kept_attention` each block's attention outputs beside it (keep_attention)."""
    if layout not in ("default", "lean"):
        raise ValueError(f"layout={layout!r}: host_breakdown takes 'default' or 'lean' (plan() resolves 'auto')")
    elt, n = compute_bytes(precision), config.num_parameters()
    if layout == "default":
        per_param = host_bytes_by_kind(elt, training=True, accumulating=accumulate > 1, speculative=speculative)
        out = {kind: b * n for kind, b in per_param.items()}
    else:
        out = lean_breakdown(config, elt, accumulate, clipping, num_slots)
    if nvme:  # in the Adam line's place, so the table keeps its order
        held = NVME_PIECES_IN_FLIGHT * piece_numel(largest_unit(config)) * 8
        out = {("nvme_buffers" if k == "adam" else k): (held if k == "adam" else v) for k, v in out.items()}
    one = saved_input_bytes(config, tokens, precision, inputs_dtype)
    one += kept_attention_bytes(config, tokens, precision) if kept_attention else 0
    return {**out, "activations": config.num_hidden_layers * one if offload_inputs else 0}


def lean_breakdown(
    config: LlamaConfig, elt: int, accumulate: int, clipping: bool, num_slots: int = 2
) -> dict[str, int]:
    """The lean layout's host bytes (engine/host/ring.py): no persistent copy, but a staging ring of pieces that
    uploads cast the master into (none in fp32, where the pinned master is the upload source) and a gradient
    ring of pieces; a gradient slab only where a gradient must wait for the step (clipping needs the global
    norm first; an accumulated one waits in the fp32 accumulator). `num_slots` does not change them."""
    n = config.num_parameters()
    per_param = host_bytes_by_kind(elt, training=True, accumulating=accumulate > 1, layout="lean", clipping=clipping)
    piece = piece_numel(largest_unit(config))
    staging, grads = ring_counts(block_numel(config), piece)
    return {
        "master": per_param["master"] * n,
        "adam": per_param["adam"] * n,
        "staging": staging * piece * elt if elt == 2 else 0,
        "grad_ring": grads * piece * elt,
        "slab": per_param["slab"] * n,
        "acc": per_param["acc"] * n,
    }


def nvme_bytes(config: LlamaConfig) -> int:
    """Bytes of the Adam m, v files on the NVMe directory."""
    return 8 * config.num_parameters()


def per_node(host: dict[str, int], devices: int = 1, nodes: int = 1) -> dict[str, int]:
    """A node's host bytes per kind with the run data parallel over `devices` GPUs x `nodes` nodes (module
    docstring): the sharded kinds 1/nodes of the single-GPU figure (rounded up), the per-rank kinds
    `devices` times it."""
    return {k: v * devices if k in PER_RANK_KINDS else -(-v // nodes) for k, v in host.items()}


def check_ranks(devices: int, nodes: int) -> None:
    """One-line ValueErrors for a bad data-parallel shape."""
    for key, value in (("devices", devices), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1 (1: no data parallelism)")


def choose_tiers(
    host_total: Callable[[str, bool], int], host_layout: str, nvme_dir: str | None, host_mem: int | None
) -> tuple[str, bool]:
    """(layout, Adam on NVMe) to plan. An explicit layout is planned as given (on NVMe when `nvme_dir` is);
    "auto" takes the first of :data:`TIERS` whose `host_total` fits `host_mem` (NVMe only given `nvme_dir`),
    or, when none fits, the last tried: the one that comes closest."""
    if host_layout != "auto":
        return host_layout, nvme_dir is not None
    tried = [t for t in TIERS if nvme_dir is not None or not t[1]]
    return next((t for t in tried if host_mem is None or host_total(*t) <= host_mem), tried[-1])


def gpu_items(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    num_slots: int,
    offload_inputs: bool = False,
    gpu_mem: int | None = None,
    kept: int = 0,
    row_chunk: int | None = None,
) -> dict[str, tuple[int, int]]:
    """GPU memory per item as (fixed bytes, bytes per token of the micro-batch), with `kept` blocks keeping
    their graph (:func:`kept_blocks`); see the module docstring. With `row_chunk` rows a call (engine/device/rows.py)
    a block's recompute holds one chunk's activations and an fp32 sum of its weights' gradients."""
    elt, block, h, v = compute_bytes(precision), block_numel(config), config.hidden_size, config.vocab_size
    tokens = micro_batch * seq_len
    inputs = 1 if offload_inputs else config.num_hidden_layers  # offloaded: at the peak, the input of the block in use
    rows = call_rows(micro_batch, row_chunk)
    tile = planned_tile(config, seq_len, rows, elt, gpu_mem)
    core = planned_core(config, seq_len, rows, elt, gpu_mem, tile)
    per_token, fixed = recompute_terms(config, elt, tile, rows * seq_len, core, rows)
    recompute = (fixed + block * elt, per_token)
    if rows < micro_batch:
        # One chunk's activations and an fp32 sum of the block's gradients, whatever the rows of the micro-batch;
        # per token of it, the block's input, its output's gradient, its input's and the next input prefetched.
        recompute = (fixed + block * elt + per_token * rows * seq_len + 4 * block, 4 * h * elt)
    return {
        "weight_slots": (num_slots * block * elt, 0),
        "grad_slots": (2 * block * elt, 0),
        "outer": (outer_numel(config) * elt, 0),
        "saved_inputs": (0, inputs * h * elt),
        "rope": (0, 2 * config.head_dim * elt),
        "recompute": recompute,
        "loss": (min(config.loss_chunk_size, tokens) * v * 4 * 3 + v * h * (4 + elt), 2 * h * elt),
        "kept_graphs": (0, kept * kept_bytes_per_token(config, elt, tile, core)),
        "cuda_context": (CUDA_CONTEXT_BYTES, 0),
    }


def call_rows(micro_batch: int, row_chunk: int | None) -> int:
    """Rows a block call computes at a time: the micro-batch's, or with ``row_chunk`` at most that many."""
    return micro_batch if row_chunk is None else min(micro_batch, row_chunk)


def kept_bytes_per_token(config: LlamaConfig, elt: int, tile: int | None, tiled_core: bool = False) -> int:
    """What one block's kept graph holds per token (module docstring): the bytes its ops save for backward."""
    h, hd, heads = config.hidden_size, config.head_dim, config.num_attention_heads
    a, k = heads * hd, config.num_key_value_heads * hd
    repeats = elt == 4 and heads > config.num_key_value_heads and not tiled_core
    kv = a if repeats else k  # the fused fp32 kernel repeats kv heads; bf16 and the tiled core share them
    if tile is not None:
        return elt * (h + 2 * a + 2 * kv + 2 * hd) + 4 * heads
    return elt * (4 * h + 2 * a + 2 * kv + 4 * config.intermediate_size + 2 * hd) + 8 * h + 4 * heads + 8


def kept_blocks(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    num_slots: int,
    offload_inputs: bool,
    gpu_mem: int | None,
    recompute: Recompute = "auto",
    row_chunk: int | None = None,
) -> int:
    """Blocks per forward pass that keep their graph instead of a recompute (engine/device/recompute.py): none with
    True, all with False; "auto" the engine's rule on the plan's figures, from the last block back, while
    their activations fit :data:`KEEP_SHARE` of the memory free at the pass's first block and
    :data:`STREAMING_SLOTS` of the `num_slots` stay unpinned (none without `gpu_mem`: no memory measure).
    None either when calls run in chunks of rows (`row_chunk`): a chunked call keeps no graph."""
    layers, mode = config.num_hidden_layers, check_recompute(recompute)
    if call_rows(micro_batch, row_chunk) < micro_batch:
        return 0
    if mode is True or mode is False:
        return layers if mode is False else 0
    room = num_slots - STREAMING_SLOTS
    if gpu_mem is None or room <= 0:
        return 0
    gpu = gpu_breakdown(config, seq_len, micro_batch, precision, num_slots, offload_inputs, gpu_mem)
    first_input = saved_input_bytes(config, seq_len * micro_batch, precision)  # the embedding's output
    live = sum(gpu[k] for k in ("weight_slots", "grad_slots", "outer", "rope", "cuda_context")) + first_input
    elt = compute_bytes(precision)
    tile = planned_tile(config, seq_len, micro_batch, elt, gpu_mem)
    core = planned_core(config, seq_len, micro_batch, elt, gpu_mem, tile)
    per_block = seq_len * micro_batch * kept_bytes_per_token(config, elt, tile, core)
    return kept_count([per_block] * layers, gpu_mem - live, room)


def gpu_breakdown(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    num_slots: int,
    offload_inputs: bool = False,
    gpu_mem: int | None = None,
    kept: int = 0,
    row_chunk: int | None = None,
) -> dict[str, int]:
    """GPU bytes per item for a micro-batch of `micro_batch` x `seq_len` tokens."""
    tokens = micro_batch * seq_len
    items = gpu_items(config, seq_len, micro_batch, precision, num_slots, offload_inputs, gpu_mem, kept, row_chunk)
    return {key: fixed + per_token * tokens for key, (fixed, per_token) in items.items()}


def planned_tile(config: LlamaConfig, seq_len: int, micro_batch: int, elt: int, gpu_mem: int | None) -> int | None:
    """Tokens per tile the model would use (None: untiled). "auto" is sized from the whole `gpu_mem` (or 80 GiB),
    an upper bound of the memory free at run time, so the planned tile is never smaller than the real one."""
    setting = config.token_chunk_size
    if setting == "auto":
        setting = auto_tile(config, seq_len, micro_batch, elt, gpu_mem or 80 * GiB)
    return setting if setting is not None and setting < seq_len else None


def planned_core(
    config: LlamaConfig, seq_len: int, micro_batch: int, elt: int, gpu_mem: int | None, tile: int | None
) -> bool:
    """Whether tiled blocks run the tiled attention core; "auto" is decided on the whole `gpu_mem` (or 80 GiB),
    as the tile is: where the run finds less free, it may tile the core where the plan counts the fused one's
    larger bytes."""
    if tile is None:
        return False
    setting = config.tiled_attention
    if setting == "auto":
        return auto_core(config, seq_len, micro_batch, elt, gpu_mem or 80 * GiB)
    return setting


def recompute_terms(
    config: LlamaConfig, elt: int, tile: int | None, tokens: int, tiled_core: bool = False, rows: int = 1
) -> tuple[int, int]:
    """One block's recompute with grad for `tokens` tokens in `rows` rows: (bytes per token, fixed bytes)."""
    if tile is None:
        return untiled_bytes_per_token(config, elt), 0  # the figure "auto" sizes tiles by, too
    h, heads = config.hidden_size, config.num_attention_heads
    a, k = heads * config.head_dim, config.num_key_value_heads * config.head_dim
    grouped = heads > config.num_key_value_heads
    kv = k if elt == 2 or not grouped or tiled_core else a + k  # fp32's fused kernel repeats kv heads
    core_fixed = 0
    if tiled_core:
        in_attention = tiled_core_bytes_per_token(config, elt)
        core_fixed = _core_blocks(config, tokens // rows, rows, attention_block(tile))
    else:
        in_attention = fused_core_bytes_per_token(config, elt)
    in_tile = elt * (3 * a + 2 * kv + 3 * h)
    tile_fixed = tile * tile_bytes_per_token(config, elt)
    if tokens * in_attention + core_fixed >= tokens * in_tile + tile_fixed:
        return in_attention, core_fixed
    return in_tile, tile_fixed


def _core_blocks(config: LlamaConfig, seq_len: int, rows: int, block: int) -> int:
    """The tiled core backward's block pair (its workspace less the D of every row, counted per token)."""
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return tiled_core_workspace(rows, heads, kv, seq_len, hd, block, backward=True) - 4 * rows * heads * seq_len


def gpu_peak(gpu: dict[str, int]) -> int:
    """Persistent buffers + the larger of the two transients (they never coexist) + the context."""
    transient = max(gpu["recompute"], gpu["loss"])
    return sum(gpu.values()) - gpu["recompute"] - gpu["loss"] + transient


def planned_slots(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    offload_inputs: bool,
    gpu_mem: int | None,
    row_chunk: int | None = None,
) -> int:
    """The weight slots ``num_slots="auto"`` settles on for this run in `gpu_mem` (2 without a limit): the
    engine's rule (device_memory.auto_slot_count) on the plan's figures with 2 slots, free = `gpu_mem` less
    the persistent items and the context, transient = the rest of the peak."""
    if gpu_mem is None:
        return 2
    free, transient = free_and_transient(config, seq_len, micro_batch, precision, offload_inputs, gpu_mem, row_chunk)
    slot = block_numel(config) * compute_bytes(precision)
    return auto_slot_count(free, transient, slot, config.num_hidden_layers)


def free_and_transient(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    offload_inputs: bool,
    gpu_mem: int,
    row_chunk: int | None = None,
) -> tuple[int, int]:
    """What the engine measures after its first step with 2 slots, as the plan has it: the GPU memory free
    beyond the persistent items and the context, and what the step needed on top of them."""
    gpu = gpu_breakdown(config, seq_len, micro_batch, precision, 2, offload_inputs, gpu_mem, row_chunk=row_chunk)
    persistent = gpu["weight_slots"] + gpu["grad_slots"] + gpu["outer"] + gpu["cuda_context"]
    return gpu_mem - persistent, gpu_peak(gpu) - persistent


def auto_offloads_inputs(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    num_slots: int,
    gpu_mem: int | None,
    row_chunk: int | None = None,
) -> bool:
    """Whether ``offload_inputs="auto"`` offloads: when the run would not fit `gpu_mem` with its inputs kept."""
    if gpu_mem is None:
        return False
    gpu = gpu_breakdown(config, seq_len, micro_batch, precision, num_slots, False, gpu_mem, row_chunk=row_chunk)
    return gpu_peak(gpu) > gpu_mem


def _largest(fits: Callable[[int], bool], limit: int = 2**24) -> int:
    """The largest n >= 1 with fits(n) for a predicate that holds up to some n (0 when fits(1) fails)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_micro_batch(
    config: LlamaConfig,
    seq_len: int,
    precision: str,
    num_slots: int,
    gpu_mem: int,
    offload_inputs: bool = False,
    row_chunk: int | None = None,
) -> int:
    """Largest micro-batch whose GPU peak fits in ``gpu_mem`` (0 when even one sequence does not)."""
    return _largest(
        lambda b: (
            gpu_peak(
                gpu_breakdown(config, seq_len, b, precision, num_slots, offload_inputs, gpu_mem, row_chunk=row_chunk)
            )
            <= gpu_mem
        )
    )


def max_row_chunk(
    config: LlamaConfig, seq_len: int, micro_batch: int, precision: str, num_slots: int, gpu_mem: int
) -> int:
    """The most rows a block call may compute at a time (``row_chunk``) for a micro-batch of `micro_batch` rows
    to fit ``gpu_mem``, its block inputs offloaded (0 when not even one row a call does)."""

    def fits(rows: int) -> bool:
        gpu = gpu_breakdown(config, seq_len, micro_batch, precision, num_slots, True, gpu_mem, row_chunk=rows)
        return rows <= micro_batch and gpu_peak(gpu) <= gpu_mem

    return _largest(fits, limit=micro_batch + 1)


def auto_row_chunk(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    num_slots: int,
    gpu_mem: int | None,
    offload_inputs: bool | str,
    row_chunk: int | str | None,
) -> int | None:
    """``row_chunk`` as planned: as asked, or for ``"auto"`` None (every call whole) when the micro-batch fits
    `gpu_mem` whole (with its inputs offloaded or not, as ``offload_inputs`` allows) or there is no limit, else
    the most rows a call may take (:func:`max_row_chunk`; None when not even one row fits, which the plan
    reports). The engine decides at each call from what the block measurably saves and the memory free then
    (engine/device/rows.py), within half of it: it may take fewer rows a chunk than this, never more."""
    if row_chunk != "auto":
        return row_chunk
    if gpu_mem is None or micro_batch < 2:
        return None
    choices = (False, True) if offload_inputs == "auto" else (bool(offload_inputs),)
    for offload in choices:
        if gpu_peak(gpu_breakdown(config, seq_len, micro_batch, precision, num_slots, offload, gpu_mem)) <= gpu_mem:
            return None
    return max_row_chunk(config, seq_len, micro_batch, precision, num_slots, gpu_mem) or None


def max_seq_len(
    config: LlamaConfig, micro_batch: int, precision: str, num_slots: int, gpu_mem: int, offload_inputs: bool = True
) -> int:
    """Longest sequence whose GPU peak fits in ``gpu_mem`` at `micro_batch` (0 when none does)."""
    return _largest(
        lambda t: (
            gpu_peak(gpu_breakdown(config, t, micro_batch, precision, num_slots, offload_inputs, gpu_mem)) <= gpu_mem
        )
    )


@dataclass(frozen=True)
class Plan:
    """Host and GPU memory of one training run, itemized; build it with :func:`plan`."""

    name: str
    """What was planned (preset name or config path), for the table's title."""
    config: LlamaConfig = field(repr=False)
    seq_len: int
    micro_batch: int
    precision: str
    accumulate: int
    num_slots: int
    offload_inputs: bool
    host: dict[str, int]
    """Host bytes per buffer: master, adam, copy, slab, acc, activations (default layout); the lean layout has
    staging and grad_ring in place of copy; with Adam on NVMe, nvme_buffers replaces adam."""
    gpu: dict[str, int]
    """GPU bytes per item: weight_slots, grad_slots, outer, saved_inputs, rope, recompute, loss, cuda_context."""
    host_mem: int | None = None
    """Host memory limit checked against (None: not checked)."""
    gpu_mem: int | None = None
    """GPU memory limit checked against (None: not checked)."""
    max_micro_batch: int | None = None
    """Largest micro-batch that fits in ``gpu_mem`` (None without a GPU limit, 0 when none fits)."""
    tile: int | None = None
    """Tokens per tile of each block (None: untiled)."""
    tiled_core: bool = False
    """Whether the tiled blocks run the tiled attention core (models/tiled_attention.py)."""
    per_token: dict[str, int] = field(default_factory=dict)
    """GPU bytes per token of the micro-batch, per item (the part of ``gpu`` that grows with the sequence)."""
    max_seq_len: int | None = None
    """Longest sequence that fits in ``gpu_mem`` at this micro-batch, inputs offloaded (None without a limit)."""
    measured: Any = None
    """The GPU peak of one step measured on fake tensors (:class:`megatrain_lightning.planning.measure.Measured`), or None."""
    host_layout: str = "default"
    """The host layout planned: "default" or "lean" (what "auto" chose)."""
    host_layout_asked: str = "default"
    """The layout asked for: "default", "lean" or "auto"."""
    nvme_dir: str | None = None
    """The NVMe directory given (None: none)."""
    nvme: bool = False
    """Whether Adam m, v are planned in files on ``nvme_dir`` ("auto" leaves them in host memory when that fits)."""
    clipping: bool = False
    """Gradient clipping on (the lean layout then keeps a gradient slab per unit until the step)."""
    nvme_gbps: float = NVME_GBPS
    """Drive bandwidth the NVMe time per step assumes, GB/s read and as much write."""
    slots_asked: int | str = 2
    """``num_slots`` as asked: a count, or "auto" (``num_slots`` is then what auto settles on)."""
    devices: int = 1
    """GPUs (ranks) per node of a data-parallel run; ``host`` is then per node, ``gpu`` per GPU."""
    nodes: int = 1
    """Nodes of a data-parallel run: each holds 1/nodes of the sharded host state."""
    recompute: Recompute = True
    """``recompute`` as asked: True, False or "auto" (engine/device/recompute.py)."""
    kept_blocks: int = 0
    grad_sums: int = 0
    """Blocks whose gradient sum over the micro-batches stays on the device (``device_grad_sums``)."""
    """Blocks per forward pass that keep their graph (:func:`kept_blocks`); their activations are the
    ``kept_graphs`` GPU item."""
    row_chunk: int | None = None
    """Rows a block call computes at a time (``row_chunk``, engine/device/rows.py; None: the micro-batch's)."""
    max_row_chunk: int | None = None
    """The most rows a block call may compute at a time for this micro-batch to fit ``gpu_mem`` with its inputs
    offloaded (None without a GPU limit or with one row a micro-batch, 0 when not even one row does)."""
    rows_asked: int | str | None = None
    """``row_chunk`` as the options asked it ("auto": :attr:`row_chunk` is what the planner picked)."""
    options: EngineConfig | None = field(default=None, repr=False)
    """The engine's options as planned (what the fields above resolved "auto" from)."""

    @property
    def ranks(self) -> int:
        """W = devices x nodes: the shards each unit's host buffers are cut into."""
        return self.devices * self.nodes

    offload_inputs_dtype: OffloadInputsDtype = None
    """How offloaded block inputs are stored on the host (None: exactly; "bf16"; "fp8")."""

    @property
    def num_parameters(self) -> int:
        return self.config.num_parameters()

    @property
    def nvme_bytes(self) -> int:
        """Bytes of the Adam m, v files on the NVMe directory (0 when they stay in host memory)."""
        return -(-nvme_bytes(self.config) // self.nodes) if self.nvme else 0

    @property
    def nvme_traffic(self) -> int:
        """Drive bytes per optimizer step: every Adam m, v read, then written back."""
        return 2 * self.nvme_bytes

    @property
    def nvme_seconds(self) -> float:
        """Drive time per optimizer step at ``nvme_gbps``, reads and writes not overlapped (a drive's mixed
        throughput is rarely the sum of its read and write rates)."""
        return self.nvme_traffic / (self.nvme_gbps * 1e9)

    def host_total_for(self, layout: str, nvme: bool) -> int:
        """Host bytes (per node) of this run with another host layout or NVMe choice."""
        tokens = self.seq_len * self.micro_batch
        one = host_breakdown(
            self.config,
            self.precision,
            self.accumulate,
            tokens,
            self.offload_inputs,
            layout=layout,
            nvme=nvme,
            clipping=self.clipping,
            num_slots=self.num_slots,
            inputs_dtype=self.offload_inputs_dtype,
            speculative=self.options is not None and self.options.speculative_step,
            kept_attention=self.options is not None and self.options.keep_attention,
        )
        return sum(per_node(one, self.devices, self.nodes).values())

    def host_plan_line(self) -> str:
        """The machine-readable summary ``megatrain plan`` prints last."""
        return (
            f"host_plan: model={self.name} params={self.num_parameters} host_gib={self.host_total / GiB:.1f} "
            f"nvme_gib={self.nvme_bytes / GiB:.1f} fits={'yes' if self.fits else 'no'}"
            + self.when_data_parallel(" devices={devices} nodes={nodes}")
        )

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def gpu_peak(self) -> int:
        return gpu_peak(self.gpu)

    @property
    def fits(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        """Why the run does not fit the given limits, each naming the need, the limit and what to change."""
        out = []
        if self.host_mem is not None and self.host_total > self.host_mem:
            out.append(self._host_problem())
        if self.gpu_mem is not None and self.gpu_peak > self.gpu_mem:
            out.append(self._gpu_problem())
        elif self.gpu_mem is not None and self.measured_peak is not None and self.measured_peak > self.gpu_mem:
            out.append(
                f"GPU memory: the formulas fit {format_size(self.gpu_mem)} but one step measured on fake tensors "
                f"needs {format_size(self.measured_peak)} with the context allowance; plan less (shorter "
                "seq_len, a smaller micro-batch or token_chunk_size)."
            )
        return out

    @property
    def measured_peak(self) -> int | None:
        """The measured allocator peak plus the CUDA context allowance (None when not measured)."""
        return None if self.measured is None else self.measured.peak + self.gpu["cuda_context"]

    def _host_problem(self) -> str:
        """What the host needs with each tier tried, the limit, and the first leaner tier that fits."""
        tried = TIERS[: TIERS.index(self._tier) + 1] if self.host_layout_asked == "auto" else [self._tier]
        totals = [(t, self.host_total_for(*t)) for t in tried]
        needs = _and(
            [
                f"{format_size(b)} with {_tier_text(*t)} ({_per_param(b / self.num_parameters)} bytes/param)"
                for t, b in totals
            ]
        )
        return (
            f"host memory: the {self.num_parameters / 1e9:.2f}B-parameter model needs {needs}{self._per_node()} but "
            "the limit is "
            f"{format_size(self.host_mem)}. {self._host_fix()}"
        )

    def _per_node(self) -> str:
        return self.when_data_parallel(" per node ({devices} GPUs x {nodes} nodes)")

    def when_data_parallel(self, text: str) -> str:
        """`text` with ``{devices}``, ``{nodes}`` and ``{ranks}`` filled in when this run has several ranks, ""
        when it has one (planning/ranks.py)."""
        return data_parallel_text(self.devices, self.nodes, text)

    @property
    def _tier(self) -> tuple[str, bool]:
        return self.host_layout, self.nvme

    def _host_fix(self) -> str:
        """The first leaner tier that fits the host limit, as the options to give; then the other ways out."""
        later = TIERS[TIERS.index(self._tier) + 1 :] if self._tier in TIERS else [("lean", True)]
        advice = ""
        for layout, nvme in later:
            total, flags = self.host_total_for(layout, nvme), self._flags(layout, nvme)
            if total <= self.host_mem:
                disk = f" + {format_size(-(-nvme_bytes(self.config) // self.nodes))} on the drive" if nvme else ""
                advice = f"{flags} fits: {format_size(total)} of host memory{disk}. Or use"
                break
            advice = f"Even {flags} needs {format_size(total)}. Use"
        hints = []
        if self.accumulate > 1:
            hints.append("accumulate=1 drops the 4 bytes/param fp32 accumulator")
        if self.host_layout == "lean" and self.clipping and self.accumulate == 1:
            hints.append(
                f"without gradient clipping lean drops the {compute_bytes(self.precision)} bytes/param gradient slab"
            )
        way_out = f"{advice or 'Use'} a machine with more host memory or a smaller model"
        return way_out + "".join(f"; {h}" for h in hints) + "."

    def _flags(self, layout: str, nvme: bool) -> str:
        """The options that move this plan to (layout, nvme), on the command line and the strategy, and what
        they do ("auto" moves to lean by itself)."""
        flags, args, what = [], [], []
        if layout != self.host_layout and self.host_layout_asked != "auto":
            flags.append(f"--host-layout {layout}")
            args.append(f"host_layout={layout!r}")
            what.append("no pinned compute copy, gradients through a ring")
        if nvme and not self.nvme:
            flags.append("--nvme-dir DIR")
            args.append("nvme_dir=DIR")
            what.append("Adam m + v in files on a local NVMe drive, 16 bytes/param of drive traffic per optimizer step")
        return f"{' '.join(flags)} (MegatrainStrategy({', '.join(args)}): {'; '.join(what)})"

    def _gpu_problem(self) -> str:
        need = (
            f"micro-batch {self.micro_batch} at seq_len {self.seq_len} needs {format_size(self.gpu_peak)} of GPU memory"
        )
        limit = f"the limit is {format_size(self.gpu_mem)}"
        rows = ""
        if self.max_row_chunk and self.max_row_chunk < self.micro_batch:
            rows = (
                f" Or keep the micro-batch and run each block call in chunks: --row-chunk {self.max_row_chunk} "
                "--offload-inputs."
            )
        if self.max_micro_batch:
            return (
                f"GPU memory: {need} but {limit}. The largest micro-batch that fits is {self.max_micro_batch}: use "
                f"--micro-batch {self.max_micro_batch} and raise --accumulate to keep the tokens per step.{rows}"
            )
        if rows:
            return f"GPU memory: {need} but {limit}.{rows}"
        big = max(("saved_inputs", "recompute", "loss"), key=lambda k: self.gpu[k])
        offload = "" if self.offload_inputs else "offload the saved block inputs (--offload-inputs), "
        return (
            f"GPU memory: {need} but {limit}, and no micro-batch fits (largest item: {_GPU_LABELS[big].split(' (')[0]}, "
            f"{format_size(self.gpu[big])}). Shorten seq_len, {offload}lower loss_chunk_size, use bf16-mixed, "
            "or use a GPU with more memory."
        )

    def table(self) -> str:
        """The plan as a plain-text table (what ``megatrain plan`` prints)."""
        title = (
            f"{self.name}: {_count(self.num_parameters)} parameters ({self.config.num_hidden_layers} blocks of "
            f"{_count(block_numel(self.config))}), seq_len {self.seq_len} x micro-batch {self.micro_batch}, "
            f"{self.precision}, accumulate {self.accumulate}, {self.num_slots} slots"
            + (" (auto)" if self.slots_asked == "auto" else "")
            + (", block inputs offloaded to host" if self.offload_inputs else "")
            + (f", tiles of {self.tile} tokens" if self.tile else "")
            + (" (attention core tiled too)" if self.tiled_core else "")
            + (f", block calls in chunks of {self.row_chunk} rows" if self.row_chunk else "")
            + (
                (", block calls whole" if not self.row_chunk else "") + " (row_chunk auto)"
                if self.rows_asked == "auto"
                else ""
            )
            + f", host layout {self.host_layout}"
            + (", Adam on NVMe" if self.nvme else "")
            + self.when_data_parallel(
                "; data parallel over {devices} GPUs x {nodes} nodes (W={ranks}): host memory per node, GPU memory "
                "per GPU"
            )
        )
        return "\n".join(
            [
                title,
                "",
                *self._host_lines(),
                *self._nvme_lines(),
                "",
                *self._gpu_lines(),
                self.recompute_line(),
                *self._limit_lines(),
            ]
        )

    def recompute_line(self) -> str:
        """How many blocks keep their graph from the forward instead of a recompute, and why that many."""
        layers, kept = self.config.num_hidden_layers, self.kept_blocks
        head = f"recompute={self.recompute!r}: {kept} of {layers} blocks keep their graph (forward computed once)"
        if self.recompute is True:
            return f"{head}; every block is recomputed in backward"
        if self.recompute is False:
            return f"{head}; the slot pool grows to one slot per block"
        if self.gpu_mem is None:
            return f"{head}; give --gpu-mem to plan how many fit (the first step recomputes all and measures)"
        per_block = kept_bytes_per_token(self.config, compute_bytes(self.precision), self.tile, self.tiled_core)
        return (
            f"{head}: the last blocks, while their activations ({per_block / 1024:.1f} KiB/token each, "
            f"{format_size(per_block * self.seq_len * self.micro_batch)} a block) fit in {KEEP_SHARE:g} of the "
            f"GPU memory free at the pass's first block and {STREAMING_SLOTS} of {self.num_slots} slots stream"
        )

    def host_items(self) -> list[tuple[str, int]]:
        """(label, bytes) of each host buffer, as the table names them."""
        dtype = _DTYPE[compute_bytes(self.precision)]
        copy = "bf16" if dtype == "bf16" else "none: the fp32 master is the copy"
        labels = {**_HOST_LABELS, **(_LEAN_LABELS if self.host_layout == "lean" else {})}
        stored = f", {self.offload_inputs_dtype}" if self.offload_inputs_dtype else ""  # as the host holds inputs
        fields = dict(dtype=dtype, copy=copy, units=NVME_PIECES_IN_FLIGHT, stored=stored)
        return [(labels.get(key, key).format(**fields), value) for key, value in self.host.items()]

    def gpu_peak_items(self) -> list[tuple[str, int]]:
        """(label, bytes) of what the GPU peak holds: every persistent item, the larger transient (the two
        never coexist) and the context allowance; they sum to ``gpu_peak``."""
        other = "loss" if self.gpu["recompute"] >= self.gpu["loss"] else "recompute"
        shape = self._gpu_label_fields()
        return [(_GPU_LABELS[key].format(**shape), value) for key, value in self.gpu.items() if key != other]

    def _host_lines(self) -> list[str]:
        n = self.num_parameters
        unit, scale = self._unit()
        lines = [f"{'host memory' + self.when_data_parallel(' per node'):<58}{'bytes/param':>12}{unit:>10}"]
        for label, value in [*self.host_items(), ("total", self.host_total)]:
            lines.append(f"  {label:<56}{_per_param(value / n):>12}{value / scale:>10.2f}")
        return [*lines, f"  {self._layout_note()}", *filter(None, [self._shard_note()])]

    def _shard_note(self) -> str:
        """Data parallel: what a node holds of the sharded state and of its ranks' own buffers ("" with one rank)."""
        return self.when_data_parallel(
            "  per node: 1/{nodes} of one copy of the state (master, Adam, copy, slab, accumulator: W={ranks} "
            "shards, {devices} here), plus each of its {devices} ranks' own rings, NVMe pieces in flight and "
            "offloaded inputs"
        )

    def _layout_note(self) -> str:
        """Which layout is planned and why ("auto": the leaner tiers it passed over)."""
        where = "Adam m + v on NVMe" if self.nvme else "Adam m + v in host memory"
        if self.host_layout_asked != "auto":
            return f"host_layout={self.host_layout!r} as asked; {where}"
        if self.host_mem is None:
            return f"host_layout={self.host_layout!r} (auto, with no host limit to fit); {where}"
        passed = TIERS[: TIERS.index(self._tier)]
        over = "; ".join(f"{_tier_text(*t)} needs {format_size(self.host_total_for(*t))}" for t in passed)
        return f"host_layout={self.host_layout!r} chosen by auto; {where}" + (f" ({over})" if over else "")

    def _nvme_lines(self) -> list[str]:
        """The drive tier: bytes on it and the traffic (and time) of each optimizer step."""
        if self.nvme_dir is None:
            return []
        if not self.nvme:  # only "auto" leaves a given directory unused
            why = "no host limit to fit" if self.host_mem is None else "Adam m + v fit in host memory"
            return ["", f"NVMe ({self.nvme_dir}): not used by host_layout='auto' ({why})"]
        unit, scale = self._unit()
        n, gb = self.num_parameters, self.nvme_traffic / 1e9
        return [
            "",
            f"{f'NVMe ({self.nvme_dir})':<58}{'bytes/param':>12}{unit:>10}",
            f"  {'Adam m + v files (fp32)':<56}{_per_param(self.nvme_bytes / n):>12}{self.nvme_bytes / scale:>10.2f}",
            f"  traffic per optimizer step: read 8 + write 8 bytes/param = {gb:.1f} GB, {self.nvme_seconds:.1f} s at "
            f"{self.nvme_gbps:.1f} GB/s read and {self.nvme_gbps:.1f} GB/s write (not overlapped)",
        ]

    def _gpu_label_fields(self) -> dict[str, int]:
        c = self.config
        return dict(
            s=self.num_slots,
            layers=1 if self.offload_inputs else c.num_hidden_layers,
            b=self.micro_batch,
            t=self.seq_len,
            h=c.hidden_size,
            elt=compute_bytes(self.precision),
            kept=self.kept_blocks,
            sums=self.grad_sums,
        )

    def _gpu_lines(self) -> list[str]:
        shape = self._gpu_label_fields()
        unit, scale = self._unit()
        lines = [f"{'GPU memory':<70}{'KiB/token':>10}{unit:>10}"]
        for key, value in [*self.gpu.items(), ("peak", self.gpu_peak)]:
            rate = self.per_token.get(key, 0) if key != "peak" else sum(self._transient_rates())
            lines.append(f"  {_GPU_LABELS[key].format(**shape):<68}{rate / 1024:>10.1f}{value / scale:>10.2f}")
        if self.measured is not None:
            m = self.measured
            lines.append(
                f"  {'measured: one step on fake tensors + context allowance':<68}{'':>10}"
                f"{self.measured_peak / scale:>10.2f}"
            )
            lines.append(
                f"    (allocator peak {format_size(m.peak)}: forward {format_size(m.forward_peak)}, backward "
                f"{format_size(m.backward_peak)}, of which modelled kernel workspace {format_size(m.workspace)}"
                + (f"; {m.kept_calls} blocks kept their graph" if self.recompute is not True else "")
                + ")"
            )
        return lines

    def _transient_rates(self) -> list[int]:
        """Per-token rates of the persistent items and of the transient the peak takes."""
        big = "recompute" if self.gpu["recompute"] >= self.gpu["loss"] else "loss"
        return [r for k, r in self.per_token.items() if k not in ("recompute", "loss") or k == big]

    def _unit(self) -> tuple[str, int]:
        return ("GiB", GiB) if self.host_total >= GiB else ("MiB", 2**20)

    def _limit_lines(self) -> list[str]:
        lines = [""]
        if self.host_mem is not None:
            ok = "fits" if self.host_total <= self.host_mem else "DOES NOT FIT"
            lines.append(f"host limit {format_size(self.host_mem)}: {ok}")
        if self.gpu_mem is not None:
            ok = (
                "fits"
                if self.gpu_peak <= self.gpu_mem and (self.measured_peak or 0) <= self.gpu_mem
                else "DOES NOT FIT"
            )
            best = self.max_micro_batch
            auto = " (num_slots auto keeps 2 there)" if self.slots_asked == "auto" else ""
            lines.append(f"GPU limit {format_size(self.gpu_mem)}: {ok}; largest micro-batch that fits: {best}{auto}")
            lines.append(
                f"largest sequence that fits at micro-batch {self.micro_batch} (inputs offloaded): "
                f"{self.max_seq_len} tokens{auto}"
            )
            if self.micro_batch > 1:
                lines.append(
                    f"most rows a block call may take at micro-batch {self.micro_batch} (row_chunk, inputs "
                    f"offloaded): {self.max_row_chunk}{auto}"
                )
        return lines if len(lines) > 1 else []


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _per_param(value: float) -> str:
    """Bytes per parameter: whole numbers as such (16), the rings' and buffers' fractions to two places."""
    return f"{value:.0f}" if abs(value - round(value)) < 0.005 else f"{value:.2f}"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _tier_text(layout: str, nvme: bool) -> str:
    return f"host_layout={layout!r}" + (" and Adam on NVMe" if nvme else "")


_DTYPE = {2: "bf16", 4: "fp32"}
_HOST_LABELS = {
    "master": "fp32 master weights",
    "adam": "Adam m + v (fp32)",
    "copy": "pinned compute copy ({copy})",
    "spare": "spare compute copy ({copy}, speculative_step)",
    "slab": "pinned gradient slab ({dtype})",
    "acc": "fp32 gradient accumulator (only when accumulate > 1)",
    "activations": "offloaded block inputs (pinned, offload_inputs{stored})",  # (keep_attention: its outputs too)
    "staging": "upload staging ring (4 pieces, {dtype})",
    "grad_ring": "gradient ring (a block's pieces + 1, {dtype})",
    "nvme_buffers": "Adam m + v of {units} pieces in flight (Adam on NVMe)",
}
_LEAN_LABELS = {"slab": "gradient slab until the step (clipping only, {dtype})"}
_GPU_LABELS = {
    "weight_slots": "weight slots ({s} x largest block)",
    "grad_slots": "gradient slots (2 x largest block)",
    "grad_sums": "device gradient sums ({sums} blocks + outer, 4 B/param, accumulate > 1)",
    "outer": "embedding, final norm, head (tied counted once)",
    "saved_inputs": "saved block inputs ({layers} x {b} x {t} x {h} x {elt} B)",
    "rope": "RoPE cos and sin (all blocks share them)",
    "recompute": "one block's recompute with grad (transient)",
    "loss": "chunked loss + head gradient (transient)",
    "kept_graphs": "kept graphs ({kept} blocks' activations, recompute)",
    "kept_attention": "kept attention outputs and log-sum-exp (keep_attention)",
    "cuda_context": "CUDA context and allocator slack (allowance)",
    "collectives": "collective library buffers (allowance; collectives in place)",
    "peak": "peak (persistent + larger transient + context)",
}


@dataclass(frozen=True)
class RunShape:
    """What a run computes with, beside the engine's options: the model, the tokens of a micro-batch, the
    micro-batches per optimizer step and the data-parallel ranks (``devices`` GPUs on each of ``nodes`` nodes).
    Checked on construction (a one-line ValueError)."""

    config: LlamaConfig = field(repr=False)
    seq_len: int
    micro_batch: int
    accumulate: int = 1
    devices: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch", "accumulate"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be an integer >= 1")
        check_ranks(self.devices, self.nodes)

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


def plan(
    shape: RunShape,
    options: EngineConfig | None = None,
    *,
    host_mem: int | None = None,
    gpu_mem: int | None = None,
    name: str = "model",
    measure: bool = False,
    nvme_gbps: float = NVME_GBPS,
    host_layout: str | None = None,
) -> Plan:
    """Itemized host and GPU bytes of training ``shape`` with ``strategy="megatrain"`` and the engine's
    `options` (None: its defaults), checked by the engine's own checks when they were built.

    ``host_mem``/``gpu_mem`` (bytes) are the limits :attr:`Plan.fits` checks; with ``gpu_mem`` the plan
    also finds the largest micro-batch and the longest sequence that fit. ``offload_inputs`` "auto" offloads
    the block inputs when they would not fit ``gpu_mem``. ``measure`` also runs one training step on fake
    tensors and records its GPU peak beside the formulas (a few seconds for an 8B model).

    `host_layout`, when given, is planned instead of the options' own: a layout, or "auto" (``megatrain plan
    --host-layout auto``), the first of default, lean, lean with Adam on NVMe (only given ``nvme_dir``) that
    fits ``host_mem``. ``nvme_dir`` is planned as given. ``clipping``: gradient clipping on (the lean layout keeps each gradient until the step).
    ``nvme_gbps``: the drive's read and its write bandwidth, GB/s, for the NVMe time per step.
    ``offload_inputs_dtype``: offloaded block inputs stored as bf16 or fp8.

    ``devices`` and ``nodes`` plan the data-parallel mode (module docstring): host bytes per node,
    GPU bytes per GPU, ``host_mem`` a node's limit and ``gpu_mem`` a GPU's.

    ``recompute``: the blocks that keep their graph (:func:`kept_blocks`, with ``num_slots`` as planned) and
    their activations (the ``kept_graphs`` item). The largest micro-batch and sequence that fit are those of
    the recompute, whose memory "auto" never exceeds by more than it finds free; ``False`` plans one slot per
    block.
    """
    options = EngineConfig() if options is None else options
    config, seq_len, micro_batch, accumulate = shape.config, shape.seq_len, shape.micro_batch, shape.accumulate
    sum_bytes = -(-block_numel(config) // (shape.devices * shape.nodes)) * 4  # one block's fp32 sum (its shard)
    sums_asked = options.device_grad_sums if accumulate > 1 else 0
    sums = 0 if sums_asked == "auto" else min(sums_asked, config.num_hidden_layers)
    outer_sums = -(-outer_numel(config) // (shape.devices * shape.nodes)) * 4  # with any block's: the outer units'
    fixed_sums = sums * sum_bytes + (outer_sums if sums else 0)
    devices, nodes, tokens = shape.devices, shape.nodes, shape.tokens
    precision, recompute, clipping = options.precision, options.recompute, options.clipping
    offload_inputs, offload_inputs_dtype, nvme_dir = (
        options.offload_inputs,
        options.offload_inputs_dtype,
        options.nvme_dir,
    )
    slots_asked, row_chunk = options.num_slots, options.row_chunk
    num_slots = 2 if slots_asked == "auto" else slots_asked  # the sizes below: auto's least
    if isinstance(nvme_gbps, bool) or not isinstance(nvme_gbps, (int, float)) or not nvme_gbps > 0:
        raise ValueError(f"nvme_gbps={nvme_gbps!r} must be a positive number of GB/s, e.g. 6.0 for a PCIe 4.0 drive")
    elt = compute_bytes(precision)
    collectives = collective_bytes(config, precision, devices * nodes)
    # What everything sized from the GPU limit gets (sums asked by count are there from the first step).
    room = None if gpu_mem is None else gpu_mem - collectives - fixed_sums
    row_chunk = auto_row_chunk(config, seq_len, micro_batch, precision, num_slots, room, offload_inputs, row_chunk)
    if offload_inputs == "auto":
        offload_inputs = auto_offloads_inputs(config, seq_len, micro_batch, precision, num_slots, room, row_chunk)
    best = None if room is None else max_micro_batch(config, seq_len, precision, num_slots, room, offload_inputs)
    longest = None if room is None else max_seq_len(config, micro_batch, precision, num_slots, room)
    most_rows = None
    if room is not None and micro_batch > 1:
        most_rows = max_row_chunk(config, seq_len, micro_batch, precision, num_slots, room)
    if slots_asked == "auto":
        num_slots = planned_slots(config, seq_len, micro_batch, precision, offload_inputs, room, row_chunk)
    if recompute is False:  # every block pins its slot until its backward: the pool grows to one per block
        num_slots = max(num_slots, config.num_hidden_layers)
    kept = kept_blocks(config, seq_len, micro_batch, precision, num_slots, offload_inputs, room, recompute, row_chunk)
    if sums_asked == "auto" and room is not None:  # from what the slots leave (the engine's order)
        free, transient = free_and_transient(config, seq_len, micro_batch, precision, offload_inputs, room, row_chunk)
        free -= (num_slots - 2) * block_numel(config) * compute_bytes(precision)
        sums = auto_sum_count(free, transient, [sum_bytes // 4] * config.num_hidden_layers, 0, outer_sums // 4)

    def host(layout: str, nvme: bool) -> dict[str, int]:
        one = host_breakdown(
            config,
            precision,
            accumulate,
            tokens,
            offload_inputs,
            layout=layout,
            nvme=nvme,
            clipping=clipping,
            num_slots=num_slots,
            inputs_dtype=offload_inputs_dtype,
            speculative=options.speculative_step,
            kept_attention=options.keep_attention,
        )
        return per_node(one, devices, nodes)

    host_layout = options.host_layout if host_layout is None else check_host_layout(host_layout, allow_auto=True)
    layout, nvme = choose_tiers(lambda *t: sum(host(*t).values()), host_layout, nvme_dir, host_mem)
    items = gpu_items(config, seq_len, micro_batch, precision, num_slots, offload_inputs, room, kept, row_chunk)
    if collectives:
        items["collectives"] = (collectives, 0)
    if sums:
        items["grad_sums"] = (sums * sum_bytes + outer_sums, 0)
    if options.keep_attention:  # beside the saved inputs: every block's, or the block in use's when offloaded
        layers = 1 if offload_inputs else config.num_hidden_layers
        items["kept_attention"] = (0, layers * kept_attention_bytes(config, 1, precision))
    rows = call_rows(micro_batch, row_chunk)
    tile = planned_tile(config, seq_len, rows, elt, room)
    core = planned_core(config, seq_len, rows, elt, room, tile)
    measured = None
    if measure:
        from megatrain_lightning.planning.measure import measure_step  # imports the engine; only when asked

        print(
            f"measuring one training step of {name} on fake tensors (about a minute at 512k tokens; "
            "--no-measure skips it)...",
            file=sys.stderr,
            flush=True,
        )
        capacity = None if room is None else room - CUDA_CONTEXT_BYTES
        measured = measure_step(
            _with_tile(config, tile, core),
            seq_len,
            micro_batch,
            precision,
            num_slots,
            offload_inputs,
            recompute,
            capacity,
            grad_sums=sums,
            row_chunk=row_chunk,
        )
    return Plan(
        name=name,
        config=config,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        accumulate=accumulate,
        num_slots=num_slots,
        offload_inputs=offload_inputs,
        host=host(layout, nvme),
        gpu={k: fixed + rate * tokens for k, (fixed, rate) in items.items()},
        host_mem=host_mem,
        gpu_mem=gpu_mem,
        max_micro_batch=best,
        tile=tile,
        tiled_core=core,
        per_token={k: rate for k, (_, rate) in items.items()},
        max_seq_len=longest,
        measured=measured,
        host_layout=layout,
        host_layout_asked=host_layout,
        nvme_dir=nvme_dir,
        nvme=nvme,
        clipping=bool(clipping),
        nvme_gbps=float(nvme_gbps),
        slots_asked=slots_asked,
        devices=devices,
        nodes=nodes,
        offload_inputs_dtype=offload_inputs_dtype,
        recompute=recompute,
        kept_blocks=kept,
        grad_sums=sums,
        row_chunk=row_chunk,
        max_row_chunk=most_rows,
        rows_asked=options.row_chunk,
        options=options,
    )


def _with_tile(config: LlamaConfig, tile: int | None, tiled_core: bool = False) -> LlamaConfig:
    """The config with the planned tile and core fixed (the fake run has no free device memory to size "auto"
    from)."""
    import dataclasses

    return dataclasses.replace(config, token_chunk_size=tile, tiled_attention=tiled_core)
