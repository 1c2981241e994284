"""A vision-language model trains under strategy="megatrain" exactly as in ordinary training.

Hugging Face LLaVA (``LlavaForConditionalGeneration``: a CLIP vision tower, a two-layer projector and a
Llama decoder) with dropout on in both attentions, on random images and token ids with the image's
tokens placed where the model expects them. The decoder's layers stream (the largest module list); the
vision tower's encoder layers are the other large list and train as ordinary modules on the device, named
in the setup line. The vision tower gets its gradients only through the image embeddings the decoder's
blocks take, so a gradient lost at the boundary of the streamed stack would leave it untrained or wrong.

fp32 on the CPU with the torch-op optimizer backend: every loss and every weight bitwise equal.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from megatrain_lightning.engine.discover import find_blocks
from tests.helpers import CausalLM, assert_same, fit, params_of

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic

VOCAB, IMAGE_TOKEN = 40, 39
IMAGE, PATCH = 8, 4
IMAGE_TOKENS = (IMAGE // PATCH) ** 2  # the "default" feature strategy drops CLIP's CLS token


def hf_llava() -> nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
        patch_size=PATCH, projection_dim=16, attention_dropout=0.1,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False,
    )  # fmt: skip
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )  # fmt: skip
    return LlavaForConditionalGeneration(cfg)


def image_batches(n: int, batch: int = 2, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    """Random text with one image's tokens after the first token; the loss skips the image positions."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, IMAGE_TOKEN, (batch, seq), generator=g)
        ids[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN
        labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
        pixels = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
        out.append({"input_ids": ids, "pixel_values": pixels, "labels": labels})
    return out


def vlm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def test_llava_trains_exactly_with_its_decoder_streamed(caplog):
    """Dropout on, gradient accumulation and clipping: the recompute replays the forward's RNG draws."""
    torch.manual_seed(0)
    a = hf_llava()
    torch.manual_seed(0)
    b = hf_llava()
    assert find_blocks(b).name == "model.language_model.layers"
    start = params_of(b)
    ref, mt = CausalLM(a, loss_fn=vlm_loss, weight_decay=0.0), CausalLM(b, loss_fn=vlm_loss, weight_decay=0.0)
    batches = image_batches(4)
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    torch.manual_seed(1)
    fit(ref, batches, strategy="auto", **kwargs)
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        fit(mt, batches, strategy="megatrain", **kwargs)
    assert_same(mt, ref)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming ")]
    assert lines == [
        "streaming model.model.language_model.layers: 3 blocks, 49% of the parameters; not streamed, trained as "
        "ordinary modules on the device: model.model.vision_tower.encoder.layers (2 blocks, 31% of the parameters)"
    ]
    # Without weight decay a weight moves only by its gradient: every vision weight the image features
    # depend on moved (post_layernorm does not: vision_feature_layer=-1 takes the encoder's last hidden
    # state before it), so the equality above is not two untrained towers agreeing.
    after = params_of(b)
    unchanged = sorted(n for n in after if n.startswith("model.vision_tower.") and torch.equal(after[n], start[n]))
    assert unchanged == ["model.vision_tower.post_layernorm.bias", "model.vision_tower.post_layernorm.weight"]
