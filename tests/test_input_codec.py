"""offload_inputs_dtype's stored forms: their sizes, and round trips within the bounds their formats promise.

The bounds come from the formats, not from the code: bfloat16 keeps 8 significant bits (round to nearest: a
relative error of at most 2**-8); float8_e4m3fn keeps 4 (at most 2**-4) down to its smallest normal 2**-6,
below which its spacing is 2**-9 (an absolute error of at most 2**-10 before the scale).
"""

from __future__ import annotations

import pytest
import torch

from megatrain_lightning.engine.device import input_codec
from megatrain_lightning.engine.device.input_codec import InputCodec

SHAPE = (2, 5, 48)  # batch, tokens, hidden


def hidden_state(dtype: torch.dtype) -> torch.Tensor:
    """Rows of different magnitudes, an outlier, tiny values, exact zeros, and one all-zero token."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g) * torch.logspace(-3, 3, SHAPE[1]).view(1, -1, 1)
    x[0, 1, 7] = 900.0  # an outlier sets its token's scale
    x[1, 2, :5] = 1e-9 * x[1, 2, 5]  # far below the token's e4m3 range: flushed or subnormal
    x[1, 3, 3] = 0.0
    x[1, 4] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize(
    ("stored", "dtype", "bytes_per_token"),
    [
        (None, torch.float32, 4 * 48),
        (None, torch.bfloat16, 2 * 48),
        ("bf16", torch.float32, 2 * 48),
        ("fp8", torch.float32, 48 + 4),
        ("fp8", torch.bfloat16, 48 + 4),
    ],
)
def test_stored_size(stored, dtype, bytes_per_token):
    codec, x = InputCodec(stored), hidden_state(dtype)
    numel, stored_dtype = codec.stored(x)
    packed = codec.encode(x)
    assert packed.dtype == stored_dtype and packed.numel() == numel
    assert packed.nbytes == 10 * bytes_per_token  # 2 x 5 tokens


def test_none_is_the_input_itself():
    x = hidden_state(torch.float32)
    codec = InputCodec(None)
    back = codec.decode(codec.encode(x).clone(), x.shape, x.dtype)
    assert back.dtype == x.dtype and torch.equal(back, x)


def test_bf16_rounds_to_nearest():
    x = hidden_state(torch.float32)
    codec = InputCodec("bf16")
    back = codec.decode(codec.encode(x).clone(), x.shape, torch.float32)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert ((back - x).abs() <= 2**-8 * x.abs()).all()
    assert not torch.equal(back, x)  # lossy: it did round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_with_a_scale_per_token(dtype):
    x = hidden_state(dtype)
    codec = InputCodec("fp8")
    back = codec.decode(codec.encode(x).clone(), x.shape, dtype)
    assert back.dtype == dtype and back.shape == x.shape and torch.isfinite(back).all()
    xf, bf = x.float(), back.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 448  # each token's own: its largest value maps to 448
    out_bf16 = 2**-8 if dtype == torch.bfloat16 else 0.0  # the decoded value is rounded once more, to bf16
    bound = (2**-4 + out_bf16) * xf.abs() + 2**-10 * scale * (1 + out_bf16)
    assert ((bf - xf).abs() <= bound * (1 + 1e-5)).all()
    amax = xf.abs().amax(dim=-1)
    assert torch.allclose(bf.abs().amax(dim=-1), amax, rtol=1e-5 + out_bf16)  # each token's largest survives
    assert torch.equal(bf[1, 4], torch.zeros_like(bf[1, 4])) and bf[1, 3, 3] == 0
    assert (bf[1, 2, :5] == 0).all()  # 1e-9 of the token's values: below e4m3's subnormals
    # per token: the small tokens keep their precision beside the one with the outlier
    small = xf[0, 0]
    assert ((bf[0, 0] - small).abs() <= (2**-4 + out_bf16) * small.abs() + 2**-10 * scale[0, 0] * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_encodes_tokens_in_parts_as_at_once(dtype, monkeypatch):
    """The encoding takes ENCODE_ROWS tokens at a time: parts of 3 (10 tokens: a short last part) give the
    bytes of one pass over all of them."""
    x = hidden_state(dtype)
    whole = InputCodec("fp8").encode(x)
    monkeypatch.setattr(input_codec, "ENCODE_ROWS", 3)
    assert torch.equal(InputCodec("fp8").encode(x), whole)
