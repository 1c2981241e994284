"""How an offloaded block input is stored on the host: exactly, as bfloat16, or as fp8 with a scale per token.

``offload_inputs_dtype`` trades exactness for host memory and link bytes (engine/device/saved_inputs.py). The
encoding runs on the device, on the compute stream, before the D2H copy; the decoding on the device, on the
compute stream, after the H2D copy, so the link carries only the smaller form::

    compute | fwd i | encode x_i |  ...   | decode x_i | bwd i (recompute)
    D2H     |                    | packed -> host
    H2D     |                             | host -> packed (prefetch, one block ahead)

Stored forms, per element of a ``[..., hidden]`` input:

- None: the input's own dtype (4 bytes in fp32, 2 in bf16), bit for bit.
- "bf16": bfloat16, 2 bytes (for fp32 runs; a bf16 input passes through unchanged). Round to nearest even:
  a relative error of at most 2**-8 per element.
- "fp8": float8_e4m3fn, 1 byte, plus one fp32 scale per row of the hidden state (per token), amax / 448,
  so each token's largest value maps to e4m3's largest: 1 + 4 / hidden bytes per element. The relative
  error is at most 2**-4 for elements above e4m3's smallest normal (2**-6 / 448 of the token's amax);
  smaller ones keep fewer bits or flush to zero: a token's outliers set its scale.

An fp8 input is one flat uint8 buffer: the scales (4 bytes each, first, so the payload needs no alignment),
then the payload. One buffer per call keeps one copy per direction and the pool keyed by (numel, dtype). The encoding takes
ENCODE_ROWS tokens at a time, so its fp32 temporaries stay small beside a block's recompute at any length.
"""

from __future__ import annotations

import torch

from megatrain_lightning.engine.config import OffloadInputsDtype, check_offload_inputs_dtype

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero token: its payload stays 0
ENCODE_ROWS = 1 << 14  # tokens encoded at once: fp32 temporaries of 16384 x hidden x 4 bytes at most


class InputCodec:
    """Encodes a block input into the flat tensor that goes to the host, and decodes it back."""

    def __init__(self, dtype: OffloadInputsDtype = None) -> None:
        self.dtype = check_offload_inputs_dtype(dtype)

    def stored(self, hidden: torch.Tensor) -> tuple[int, torch.dtype]:
        """(numel, dtype) of the host buffer holding `hidden`: what the pool is keyed by."""
        if self.dtype == "fp8":
            rows = hidden.numel() // hidden.shape[-1]
            return 4 * rows + hidden.numel(), torch.uint8
        if self.dtype == "bf16":
            return hidden.numel(), torch.bfloat16
        return hidden.numel(), hidden.dtype

    def encode(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden` as its flat stored form, computed on the current (compute) stream (stored exactly: a flat
        view of it, no copy)."""
        flat = hidden.detach().reshape(-1)
        if self.dtype == "bf16":
            return flat.to(torch.bfloat16)
        if self.dtype is None:
            return flat
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        n = rows.shape[0]
        packed = torch.empty(4 * n + rows.numel(), dtype=torch.uint8, device=hidden.device)
        scales = packed[: 4 * n].view(torch.float32).view(n, 1)
        payload = packed[4 * n :].view(torch.float8_e4m3fn).view(rows.shape)
        for lo in range(0, n, ENCODE_ROWS):  # the fp32 quotient of some tokens at a time, not of all of them
            part, scale = rows[lo : lo + ENCODE_ROWS], scales[lo : lo + ENCODE_ROWS]
            torch.div(part.abs().amax(dim=1, keepdim=True).float(), E4M3_MAX, out=scale)
            scale.clamp_(min=_TINY)
            # e4m3fn has no infinity: round-off above 448 must not become NaN, hence the clamp before the cast.
            payload[lo : lo + ENCODE_ROWS].copy_(torch.div(part, scale).clamp_(-E4M3_MAX, E4M3_MAX))
        return packed

    def decode(self, stored: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The input of `shape` and `dtype` from its stored form on the device (current stream)."""
        if self.dtype is None:
            return stored.view(shape)
        if self.dtype == "bf16":
            return stored.to(dtype).view(shape)
        n = stored.numel() // (shape[-1] + 4)
        scale = stored[: 4 * n].view(torch.float32).view(n, 1)
        # fp8 -> bf16 or fp32 is exact; the product is rounded once, to `dtype`.
        out = stored[4 * n :].view(torch.float8_e4m3fn).view(n, shape[-1]).to(dtype)
        return out.mul_(scale).view(shape)
