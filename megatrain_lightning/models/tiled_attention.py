"""The attention core tiled over query blocks: causal (and document-masked) attention whose memory is its
inputs, its outputs and one pair of blocks at a time, in plain torch.

Forward: for each block of queries the keys and values are streamed block by block and the softmax is merged
online: a running row maximum m, row sum l and output accumulator, rescaled by exp(m_old - m_new) as each key
block arrives. Only the output and each row's log-sum-exp (lse = m + log l) are kept for backward, with q, k,
v. Backward recomputes every score block from q, k and the saved lse, P = exp(q k^T / sqrt(d) - lse), with
D = rowsum(dO * O):

    dS_ij = P_ij * (dO_i V_j^T - D_i)     dQ_i = sum_j dS_ij K_j / sqrt(d)
    dV_j = sum_i P_ij^T dO_i              dK_j = sum_i dS_ij^T Q_i / sqrt(d)

in two sweeps, one over query blocks (dQ) and one over key blocks (dK, dV), so that each sum is held in fp32
for one block only: one sweep would need a whole-sequence fp32 accumulator for dQ or for dK and dV (4 bytes
per element, more than the output they round to). The price is the score and dP blocks computed twice.

Inside a block pair everything is fp32 (the blocks of q, k, v and dO are upcast), as the fused kernels
accumulate; each output is rounded to the inputs' dtype once. Grouped-query attention: the G query heads of
a kv head are laid side by side ([B, kv_heads, G x rows, head_dim]) and multiplied by that kv head's block,
so k and v are never repeated.

Which key blocks a query block visits (causality and documents) is decided on the host from the documents'
spans, so the loops never read the device. Both sweeps are registered operators (torch.library): on fake
tensors (measure.py) each is one op with outputs of the right shapes, and what it holds inside (the blocks
of one pair) is modelled by :func:`workspace_bytes`, as the fused kernels' workspace is, instead of running
10^5 small ops per block at a million tokens.
"""

from __future__ import annotations

import bisect
import math

import torch

Segments = tuple[tuple[tuple[int, int], ...], ...] | None


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, block: int) -> torch.Tensor:
    """Causal attention [B, heads, T, hd] of q [B, heads, T, hd] over k, v [B, kv_heads, T, hd] in blocks of
    `block` queries and keys; with `segments` (llama.document_segments) each document attends to itself."""
    t = q.shape[2]
    starts = _row_starts(segments, q.shape[0])
    first_keys, last_starts = _block_bounds(starts, t, block)
    doc_start = None if segments is None else _doc_start(starts, t, q.device)
    return _TiledAttention.apply(q, k, v, doc_start, block, first_keys, last_starts)


class _TiledAttention(torch.autograd.Function):
    """Saves q, k, v, the output and its row log-sum-exp; the backward recomputes the score blocks."""

    @staticmethod
    def forward(ctx, q, k, v, doc_start, block, first_keys, last_starts):
        out, lse = torch.ops.megatrain.tiled_attention(q, k, v, doc_start, block, first_keys, last_starts)
        ctx.save_for_backward(q, k, v, out, lse, doc_start)
        ctx.plan = (block, first_keys, last_starts)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, doc_start = ctx.saved_tensors
        grads = torch.ops.megatrain.tiled_attention_backward(dout, q, k, v, out, lse, doc_start, *ctx.plan)
        return *grads, None, None, None, None


def workspace_bytes(
    rows: int, heads: int, kv_heads: int, tokens: int, head_dim: int, block: int, backward: bool
) -> int:
    """What one call of the forward (or backward) operator holds beyond its inputs and outputs, at most, for
    `rows` x `tokens` tokens: one pair's blocks, all fp32 (n = rows of a block): the query-side blocks
    (q, dO, accumulators, a product; rows x heads x n x head_dim each), the key-side blocks (k, v, their
    accumulators, a product; rows x kv_heads x n x head_dim), the score blocks (rows x heads x n x n; one in forward, the
    probabilities and dS in backward), per-row statistics (rows x heads x n) and the mask (n x n bools and
    the positions); in backward also D = rowsum(dO * O) for every row (rows x heads x tokens).
    tests/test_tiled_attention.py checks it against the operators' own allocations on fake tensors."""
    n = min(block, tokens)
    query, key, score, stat = (
        4 * rows * h * n * x for h, x in ((heads, head_dim), (kv_heads, head_dim), (heads, n), (heads, 1))
    )
    mask = n * n + 8 * (2 * n + 2)
    if backward:
        return 4 * rows * heads * tokens + 2 * score + 4 * query + 5 * key + 4 * stat + mask
    return score + 5 * query + 2 * key + 6 * stat + mask


# -- which key blocks each query block visits, from the documents (host side) ----------------------------------


def _row_starts(segments: Segments, rows: int) -> list[list[int]]:
    """Per row, the sorted token indices where its documents start ([[0]]: one document)."""
    if segments is None:
        return [[0]]
    return [[s for s, _ in spans] for spans in segments]


def _block_bounds(starts: list[list[int]], t: int, block: int) -> tuple[list[int], list[int]]:
    """Per query block [qs, qe): the first key any of its queries sees (the document start of qs, least over
    rows) and the last document start inside it (greatest over rows): keys before that need the mask."""
    first, last = [], []
    for qs in range(0, t, block):
        qe = min(qs + block, t)
        first.append(min(row[bisect.bisect_right(row, qs) - 1] for row in starts))
        last.append(max(row[bisect.bisect_right(row, qe - 1) - 1] for row in starts))
    return first, last


def _doc_start(starts: list[list[int]], t: int, device: torch.device) -> torch.Tensor:
    """[rows, T] int64: the index where each token's document starts."""
    out = torch.zeros(len(starts), t, dtype=torch.int64)
    for r, row in enumerate(starts):
        for s in row[1:]:
            out[r, s:] = s
    return out.to(device)


def _key_blocks(i: int, qs: int, qe: int, block: int, first_keys: list[int]) -> range:
    """The starts of the key blocks query block i (rows [qs, qe)) sees: from its first key's block to qe."""
    return range(first_keys[i] // block * block, qe, block)


# -- the two operators and their block arithmetic ---------------------------------------------------------


def _rows(x: torch.Tensor, s: int, e: int, kv_heads: int, scale: float = 1.0) -> torch.Tensor:
    """Rows s..e of x [B, heads, T, hd] in fp32 as [B, kv_heads, G x rows, hd] (a new tensor)."""
    b, heads, _, d = x.shape
    return (x[:, :, s:e].float() * scale).reshape(b, kv_heads, heads // kv_heads * (e - s), d)


def _row_stat(x: torch.Tensor, s: int, e: int, kv_heads: int) -> torch.Tensor:
    """Rows s..e of a per-row statistic [B, heads, T] as [B, kv_heads, G x rows, 1]."""
    b, heads, _ = x.shape
    return x[:, :, s:e].reshape(b, kv_heads, heads // kv_heads * (e - s), 1)


def _mask_(
    s: torch.Tensor, qs: int, qe: int, ks: int, ke: int, last_start: int, doc_start: torch.Tensor | None, g: int
) -> torch.Tensor:
    """Scores s [B, kv_heads, G x (qe - qs), ke - ks] with the keys a query may not see set to -inf, in place:
    later keys (causal) and, with documents, keys before its document's start. Only where some are."""
    causal, docs = ke - 1 > qs, doc_start is not None and ks < last_start
    if not (causal or docs):
        return s
    qpos = torch.arange(qs, qe, device=s.device)[:, None]
    kpos = torch.arange(ks, ke, device=s.device)[None, :]
    hidden = (kpos > qpos)[None]  # [1, rows, keys]
    if docs:
        hidden = hidden | (kpos[None] < doc_start[:, qs:qe, None])
    b, kv, _, m = s.shape
    s.view(b, kv, g, qe - qs, m).masked_fill_(hidden[:, None, None], float("-inf"))
    return s


def _probs(
    qi: torch.Tensor, kj: torch.Tensor, lse_i: torch.Tensor, bounds: tuple, doc_start: torch.Tensor | None, g: int
) -> torch.Tensor:
    """P = exp(q k^T - lse) of one block pair (q already scaled), masked keys 0."""
    return _mask_(qi @ kj.transpose(-1, -2), *bounds, doc_start, g).sub_(lse_i).exp_()


def forward_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_start: torch.Tensor | None,
    block: int,
    first_keys: list[int],
    last_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [B, heads, T, hd], fp32 row log-sum-exp [B, heads, T])."""
    b, heads, t, d = q.shape
    kv, g, scale = k.shape[1], heads // k.shape[1], 1 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(b, heads, t, dtype=torch.float32, device=q.device)
    for i, qs in enumerate(range(0, t, block)):
        qe = min(qs + block, t)
        qi = _rows(q, qs, qe, kv, scale)
        m = torch.full((*qi.shape[:-1], 1), float("-inf"), device=q.device)
        row_sum, acc = torch.zeros_like(m), torch.zeros_like(qi)
        for ks in _key_blocks(i, qs, qe, block, first_keys):
            ke = min(ks + block, qe)
            s = _mask_(qi @ k[:, :, ks:ke].float().transpose(-1, -2), qs, qe, ks, ke, last_starts[i], doc_start, g)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            base = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with no visible key yet: all zeros
            p = s.sub_(base).exp_()
            rescale = (m - base).exp_()
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + p @ v[:, :, ks:ke].float()
            m = m_new
            del s, p  # before the next pair's scores exist: one score block at a time
        n = qe - qs
        out[:, :, qs:qe] = (acc / row_sum).view(b, heads, n, d)
        lse[:, :, qs:qe] = (m + row_sum.log()).view(b, heads, n)
    return out, lse


def backward_blocks(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_start: torch.Tensor | None,
    block: int,
    first_keys: list[int],
    last_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): a sweep over query blocks for dq, then one over key blocks for dk and dv."""
    b, heads, t, d = q.shape
    kv, g, scale = k.shape[1], heads // k.shape[1], 1 / math.sqrt(d)
    delta = torch.empty_like(lse)  # D = rowsum(dO * O), fp32
    for s in range(0, t, block):
        delta[:, :, s : s + block] = (dout[:, :, s : s + block].float() * out[:, :, s : s + block].float()).sum(-1)
    dq = torch.empty_like(q)
    for i, qs in enumerate(range(0, t, block)):
        qe = min(qs + block, t)
        qi, doi = _rows(q, qs, qe, kv, scale), _rows(dout, qs, qe, kv)
        lse_i, delta_i = _row_stat(lse, qs, qe, kv), _row_stat(delta, qs, qe, kv)
        acc = torch.zeros_like(qi)
        for ks in _key_blocks(i, qs, qe, block, first_keys):
            ke = min(ks + block, qe)
            kj = k[:, :, ks:ke].float()
            p = _probs(qi, kj, lse_i, (qs, qe, ks, ke, last_starts[i]), doc_start, g)
            ds = (doi @ v[:, :, ks:ke].float().transpose(-1, -2)).sub_(delta_i).mul_(p)
            del p
            acc += ds @ kj
            del ds  # before the next pair's probabilities exist: two score blocks at most
        dq[:, :, qs:qe] = acc.mul_(scale).view(b, heads, qe - qs, d)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for ks in range(0, t, block):
        ke = min(ks + block, t)
        kj, vj = k[:, :, ks:ke].float(), v[:, :, ks:ke].float()
        dk_acc, dv_acc = torch.zeros_like(kj), torch.zeros_like(vj)
        for i, qs in enumerate(range(0, t, block)):
            qe = min(qs + block, t)
            if qe <= ks or ks not in _key_blocks(i, qs, qe, block, first_keys):
                continue
            qi, doi = _rows(q, qs, qe, kv, scale), _rows(dout, qs, qe, kv)
            p = _probs(qi, kj, _row_stat(lse, qs, qe, kv), (qs, qe, ks, ke, last_starts[i]), doc_start, g)
            dv_acc += p.transpose(-1, -2) @ doi
            ds = (doi @ vj.transpose(-1, -2)).sub_(_row_stat(delta, qs, qe, kv)).mul_(p)
            del p
            dk_acc += ds.transpose(-1, -2) @ qi
            del ds
        dk[:, :, ks:ke], dv[:, :, ks:ke] = dk_acc, dv_acc
    return dq, dk, dv


@torch.library.custom_op("megatrain::tiled_attention", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_start: torch.Tensor | None,
    block: int,
    first_keys: list[int],
    last_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_blocks(q, k, v, doc_start, block, first_keys, last_starts)


@_forward_op.register_fake
def _(q, k, v, doc_start, block, first_keys, last_starts):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megatrain::tiled_attention_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_start: torch.Tensor | None,
    block: int,
    first_keys: list[int],
    last_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_blocks(dout, q, k, v, out, lse, doc_start, block, first_keys, last_starts)


@_backward_op.register_fake
def _(dout, q, k, v, out, lse, doc_start, block, first_keys, last_starts):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
