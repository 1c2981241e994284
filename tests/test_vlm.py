"""Vision-language models train under strategy="megatrain" exactly as in ordinary training.

Two Hugging Face VLMs, dropout on in their attentions, on random images and token ids with the image's
tokens placed where the model expects them:

- LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector, a Llama decoder.
- Qwen2-VL (``Qwen2VLForConditionalGeneration``): its own vision transformer with a patch merger, a decoder
  with multimodal rotary positions (M-RoPE: 3-D position ids computed from the image grid).

Both stacks stream: the vision tower's layers, then the decoder's (the order the model registers and runs
them in), named in the setup line. The vision tower gets its gradients only through the image embeddings
the decoder's blocks take, so a gradient lost between the two streamed stacks would leave it untrained or
wrong.

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


def llava_batches(n: int, batch: int = 2, seq: int = 12) -> list[dict[str, torch.Tensor]]:
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


def hf_qwen2_vl() -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False, bos_token_id=0,
        eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )  # fmt: skip
    vision = dict(
        depth=2, embed_dim=16, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=PATCH // 2, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=38,
        vision_start_token_id=37, vision_end_token_id=36,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(cfg)


def qwen2_vl_batches(n: int, batch: int = 2, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    """The Qwen2-VL processor's layout: <vision_start>, the image's merged tokens, <vision_end>; the patches of
    all images flattened to rows (2x2-patch grid cells of temporal pairs), one (t, h, w) grid per image, and
    the token types M-RoPE needs to place the image tokens on their grid."""
    g = torch.Generator().manual_seed(3)
    grid = IMAGE // (PATCH // 2)  # 4x4 patches, merged 2x2 into IMAGE_TOKENS tokens
    out = []
    for _ in range(n):
        ids = torch.randint(0, 36, (batch, seq), generator=g)
        ids[:, 1], ids[:, 2 + IMAGE_TOKENS] = 37, 36
        ids[:, 2 : 2 + IMAGE_TOKENS] = IMAGE_TOKEN
        out.append(
            {
                "input_ids": ids,
                "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
                "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
                "pixel_values": torch.randn(batch * grid * grid, 3 * 2 * (PATCH // 2) ** 2, generator=g),
                "image_grid_thw": torch.tensor([[1, grid, grid]] * batch),
            }
        )
    return out


CASES = {
    # name: (build, batches, streamed stacks, setup line, vision parameters no loss depends on)
    "llava": (
        hf_llava,
        llava_batches,
        ["model.vision_tower.encoder.layers", "model.language_model.layers"],
        "streaming model.model.vision_tower.encoder.layers (2 blocks, 31% of the parameters) and "
        "model.model.language_model.layers (3 blocks, 49% of the parameters)",
        # vision_feature_layer=-1 takes the encoder's last hidden state, before post_layernorm
        ["model.vision_tower.post_layernorm.bias", "model.vision_tower.post_layernorm.weight"],
    ),
    "qwen2-vl": (
        hf_qwen2_vl,
        qwen2_vl_batches,
        ["model.visual.blocks", "model.language_model.layers"],
        "streaming model.model.visual.blocks (2 blocks, 11% of the parameters) and "
        "model.model.language_model.layers (3 blocks, 67% of the parameters)",
        [],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vlm_trains_exactly_with_both_stacks_streamed(name, caplog):
    """Dropout on, gradient accumulation and clipping: the recompute replays the forward's RNG draws."""
    build, make_batches, stacks, line, unused = CASES[name]
    torch.manual_seed(0)
    a = build()
    torch.manual_seed(0)
    b = build()
    assert [c.name for c in find_blocks(b).stacks] == stacks
    start = params_of(b)
    ref, mt = CausalLM(a, loss_fn=vlm_loss, weight_decay=0.0), CausalLM(b, loss_fn=vlm_loss, weight_decay=0.0)
    batches = make_batches(4)
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    torch.manual_seed(1)
    fit(ref, batches, strategy="auto", **kwargs)
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        fit(mt, batches, strategy="megatrain", **kwargs)
    assert_same(mt, ref)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming ")] == [line]
    # Without weight decay a weight moves only by its gradient: every vision weight the image features
    # depend on moved, so the equality above is not two untrained towers agreeing.
    after = params_of(b)
    vision = [n for n in after if n.startswith(("model.vision_tower.", "model.visual."))]
    assert vision and sorted(n for n in vision if torch.equal(after[n], start[n])) == unused
