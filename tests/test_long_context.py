"""Long context with this project's Llama: token tiles, the final norm folded into the loss, documents in
attention, and offloaded block inputs, each against the untiled model or ordinary training.

fp32 on the CPU with the torch-op optimizer. Tiles of 3 tokens over sequences of 16 (uneven: 5 x 3 + 1)
and loss chunks of 5 put a tile and a chunk boundary in every stretch of a few tokens.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.models.llama import document_segments
from megatrain_lightning.models.tiling import (
    auto_core,
    auto_tile,
    fused_core_bytes_per_token,
    resolve_tile,
    tile_bytes_per_token,
    tiled_core_bytes_per_token,
)
from tests import async_streams
from tests.helpers import CausalLM, fit, own_loop, params_of

TILE = 3


pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


def llama(tile: int | None = None, preset: str = "tiny", tiled_core: bool = False) -> LlamaForCausalLM:
    """A tiny preset with grouped-query attention, the same weights whatever the tiling."""
    torch.manual_seed(0)
    config = LlamaConfig.from_preset(preset, token_chunk_size=tile, loss_chunk_size=5, tiled_attention=tiled_core)
    assert config.num_attention_heads > config.num_key_value_heads  # GQA is exercised
    return LlamaForCausalLM(config)


def batches(steps: int = 10, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (batch, seq), generator=g) for _ in range(steps)]


def train(model: LlamaForCausalLM, streamed: bool, offload: bool = False, steps: int = 10) -> list[float]:
    # lr 1e-3: at 1e-2 Adam's normalization amplifies the last-bit differences of tiny gradients (a key
    # bias's true gradient is exactly 0) into lr-sized steps, and after 10 steps the losses of two
    # summation orders of the same function part by ~5e-6 in the Qwen shape.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if streamed:
        engine = Engine(model, EngineConfig(device="cpu", precision="32-true", offload_inputs=offload))
        opt = engine.optimizer(opt)
    return own_loop(model, opt, batches(steps))


def relative_update_error(model: torch.nn.Module, ref: torch.nn.Module, start: dict) -> float:
    """||p - p_ref|| / ||p_ref - p_0|| over the whole model, key biases aside: their true gradient is 0
    (softmax ignores a shift of all scores), so their updates are Adam-normalized rounding noise."""
    start = {k: v for k, v in start.items() if not k.endswith("k_proj.bias")}
    p, r = dict(model.named_parameters()), dict(ref.named_parameters())
    error = sum(float((p[k] - r[k]).detach().norm()) ** 2 for k in start) ** 0.5
    update = sum(float((r[k] - start[k]).detach().norm()) ** 2 for k in start) ** 0.5
    return error / update


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen"])  # Qwen: q/k/v biases and a tied head
def test_tiled_offloaded_training_equals_untiled_training(preset):
    """10 streamed steps with tiles of 3 tokens, loss chunks of 5 and offloaded block inputs against 10
    ordinary steps of the untiled model: losses within 1e-6. Not bit for bit: a weight's gradient summed
    tile by tile (and the final norm's chunk by chunk) adds in another order, and Adam turns last-bit
    differences of tiny gradients into updates of up to lr, so parameters are bounded on the whole
    model's update, ||p_tiled - p|| / ||p - p_0|| <= 5e-5 (as the native kernel's rounding is bounded in
    tests/test_strategy.py)."""
    untiled, tiled = llama(None, preset), llama(TILE, preset)
    start = params_of(untiled)
    ref, got = train(untiled, streamed=False), train(tiled, streamed=True, offload=True)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-6
    assert 0 < relative_update_error(tiled, untiled, start) <= 5e-5


def test_tiled_core_trains_like_the_untiled_core(monkeypatch):
    """4 streamed steps (offloaded inputs, tiles of 3 tokens) with the attention core tiled too, in query and
    key blocks of 2 tokens (uneven over 16: every pair kind, kept few so the test stays fast), against the
    same with the fused core: losses within 1e-6 and parameters within 5e-5 of the update, the bounds of the
    tiled-vs-untiled test above. The cores agree to ~1e-7 in fp32 (tests/test_tiled_attention.py); Adam turns
    last-bit gradient differences into updates."""
    monkeypatch.setattr("megatrain_lightning.models.llama.attention_block", lambda tile: 2)
    fused, tiled = llama(TILE), llama(TILE, tiled_core=True)
    start = params_of(fused)
    ref, got = train(fused, streamed=True, offload=True, steps=4), train(tiled, streamed=True, offload=True, steps=4)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-6
    assert 0 < relative_update_error(tiled, fused, start) <= 5e-5


def test_auto_tiles_the_attention_core_when_the_fused_backward_would_not_fit():
    """ "auto" keeps the fused kernel while its backward takes at most 3/4 of the free memory: llama-3.1-8b at
    512k tokens on ~76 GiB free keeps it (~48 GiB), at 1M (~96 GiB) tiles the core; never on the CPU."""
    config = LlamaConfig.from_preset("llama-3.1-8b")
    free = 76 * 2**30
    assert fused_core_bytes_per_token(config, 2) * 1048576 > free > fused_core_bytes_per_token(config, 2) * 524288
    assert not auto_core(config, 524288, 1, 2, free) and auto_core(config, 1048576, 1, 2, free)
    assert not auto_core(config, 1048576, 1, 2, None)
    assert tiled_core_bytes_per_token(config, 2) * 1048576 < free  # what the tiled core holds at 1M
    model = llama(4)
    assert model.model.tiled_core_for(torch.zeros(1, 16, dtype=torch.int64), 4) is False  # CPU: fused
    model.config.tiled_attention = True
    assert model.model.tiled_core_for(torch.zeros(1, 16, dtype=torch.int64), 4) is True
    assert model.model.tiled_core_for(torch.zeros(1, 16, dtype=torch.int64), None) is False  # untiled blocks
    with pytest.raises(ValueError, match="tiled_attention='yes'"):
        LlamaConfig.from_preset("tiny", tiled_attention="yes")


def test_tiled_offloaded_streaming_equals_ordinary_lightning_training():
    """The tiled model trained by Lightning with strategy="megatrain" (offloaded inputs) and ordinarily:
    forward without grad, recompute and each tile's recompute take the same tiles, so bit for bit."""
    ref, mt = CausalLM(llama(TILE), loss_fn=own_loss), CausalLM(llama(TILE), loss_fn=own_loss)
    fit(ref, batches(6), strategy="auto")
    fit(mt, batches(6), strategy=MegatrainStrategy(offload_inputs=True))
    assert mt.losses == ref.losses and len(ref.losses) == 6
    pr, pm = params_of(ref.model), params_of(mt.model)
    assert all(torch.equal(pm[k], pr[k]) for k in pr)


def own_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    return model(batch[:, :-1], targets=batch[:, 1:])


def test_folded_final_norm_gives_the_norm_its_gradient():
    """With tiles the final norm runs inside the chunked loss: same loss and same gradients (the final
    norm's weight included) as the unfolded model, to fp32 rounding."""
    plain, folded = llama(), llama(TILE)
    with torch.no_grad():
        plain.model.norm.weight.uniform_(0.5, 1.5)  # a non-trivial norm weight
        folded.model.norm.weight.copy_(plain.model.norm.weight)
    x = batches(1)[0]
    losses = [m(x, targets=x) for m in (plain, folded)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), folded.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_tiles_keep_one_tile_of_intermediates():
    """Under grad a tiled block saves its tiles' inputs and the attention core's tensors, never an
    intermediate of the MLP's width for the whole sequence."""
    model, seq = llama(4), 16
    config = model.config
    x = torch.randn(1, seq, config.hidden_size, requires_grad=True)
    cos, sin = model.model.position_embeddings(x[..., 0].long(), None, x.dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model.model.layers[0](x, cos, sin, None, 4).sum().backward()
    assert max(saved) < config.intermediate_size * seq
    assert max(saved) >= config.intermediate_size * 4  # (the tile recompute did run with grad)


def test_resolve_tile():
    cpu = torch.device("cpu")
    assert resolve_tile(LlamaConfig.from_preset("tiny", token_chunk_size=None), 100, 1, cpu, 4) is None
    assert resolve_tile(LlamaConfig.from_preset("tiny", token_chunk_size=64), 100, 1, cpu, 4) == 64
    assert (
        resolve_tile(LlamaConfig.from_preset("tiny", token_chunk_size=64), 64, 1, cpu, 4) is None
    )  # one tile: untiled
    assert resolve_tile(LlamaConfig.from_preset("tiny", token_chunk_size="auto"), 100_000, 1, cpu, 4) == 8192
    assert resolve_tile(LlamaConfig.from_preset("tiny", token_chunk_size="auto"), 8192, 1, cpu, 4) is None


def test_auto_tile_is_sized_from_free_device_memory():
    """Untiled while the whole block transient takes at most 1/4 of the free memory; else the largest power
    of two whose tile intermediates take at most 1/16 of it."""
    config = LlamaConfig.from_preset("llama-3.1-8b")
    per_token = tile_bytes_per_token(config, 2)  # ~248 KiB in bf16
    free = 70 * 2**30
    assert auto_tile(config, 8192, 4, 2, free) is None  # 32k tokens: ~10 GiB untiled, no need to tile
    tile = auto_tile(config, 524288, 1, 2, free)
    assert tile * per_token <= free // 16 < 2 * tile * per_token and tile == 16384
    assert auto_tile(config, 131072, 4, 2, free) == 4096  # four rows per tile token
    assert auto_tile(config, 524288, 1, 2, 2**30) == 1024  # never below 1024 tokens
    with pytest.raises(ValueError, match="token_chunk_size='big'"):
        LlamaConfig.from_preset("tiny", token_chunk_size="big")


# -- documents in attention --------------------------------------------------------------------------


def test_document_segments():
    assert document_segments(None) is None
    assert document_segments(torch.arange(6).unsqueeze(0)) is None
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_segments(pos) == (((0, 3), (3, 5), (5, 6)), ((0, 6),))


@pytest.mark.parametrize(("tile", "tiled_core"), [(None, False), (TILE, False), (TILE, True)])
def test_packed_documents_see_only_themselves(tile, tiled_core):
    """Logits of three documents packed in one row with restarting positions equal those of each
    document run alone: attention keeps to documents, and RoPE sees each document's own positions."""
    model = llama(tile, tiled_core=tiled_core).eval()
    docs = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 4, 5)]
    packed = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(d.shape[1]) for d in docs]).unsqueeze(0)
    with torch.no_grad():
        together = model(packed, position_ids=pos)
        alone = torch.cat([model(d) for d in docs], dim=1)
    assert torch.allclose(together, alone, rtol=1e-5, atol=1e-6)


def test_packed_documents_train_like_ordinary_training():
    """Rows holding different document boundaries, streamed (tiled and offloaded) vs ordinary: the same
    segments reach every block's forward and recompute, bit for bit."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(15))])

    def loss(model, batch):
        return model(batch[:, :-1], targets=batch[:, 1:], position_ids=pos)

    ref, mt = CausalLM(llama(TILE), loss_fn=loss), CausalLM(llama(TILE), loss_fn=loss)
    fit(ref, batches(4), strategy="auto")
    fit(mt, batches(4), strategy=MegatrainStrategy(offload_inputs=True))
    assert mt.losses == ref.losses
    pr, pm = params_of(ref.model), params_of(mt.model)
    assert all(torch.equal(pm[k], pr[k]) for k in pr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_query_attention_shares_kv_heads_in_bf16(dtype, monkeypatch):
    """bf16 hands the kernel k and v with their own (fewer) heads and enable_gqa=True; fp32 repeats them,
    since the fp32 CUDA kernel has no GQA and enable_gqa would fall back to the T x T math kernel."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = llama().to(dtype)
    config = model.config
    with torch.no_grad():
        model(batches(1)[0])
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    expected = (heads, kv, True) if dtype == torch.bfloat16 else (heads, heads, False)
    assert seen and all(s == expected for s in seen)


# (the first step's sequence length, the later steps', free memory in transients beyond the later input, early?)
EARLY_FETCH_CASES = {
    "room": (16, 16, 1 << 20, True),
    "no-room": (16, 16, -1, False),
    "room-for-one-transient": (16, 16, 1, True),
    "longer-batch-one-transient": (16, 32, 1, False),
    "longer-batch-scaled-transient": (16, 32, 2, True),
}


@pytest.mark.parametrize("case", EARLY_FETCH_CASES)
def test_an_offloaded_input_comes_back_during_the_later_blocks_backward_where_memory_allows(monkeypatch, case):
    """Memory readings (probes standing in for a device's) with room for a second input beside the first step's
    measured transient, that transient scaled by how much longer the later batches are than the first (twice
    as long here: twice the transient): from the second step on, each offloaded input is prefetched before the
    later block's backward, not after it, on copy streams that run nothing until waited for
    (tests/async_streams.py). Bit for bit ordinary training either way; without room, no input is fetched early."""
    first_seq, later_seq, transients, early_expected = EARLY_FETCH_CASES[case]
    async_streams.install(monkeypatch, hold=1.0)
    data = batches(1, seq=first_seq) + batches(2, seq=later_seq)
    ref_model, model = llama(), llama()
    ref = own_loop(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3), data)
    transient = 1 << 20
    later_input = 2 * later_seq * model.config.hidden_size * 4  # batch 2, fp32: the input it fetches
    free = later_input + transients * transient if transients >= 0 else 1 << 10
    probes = Probes(device_free_bytes=lambda: free, step_transient_bytes=lambda: transient)
    options = EngineConfig(device="cpu", precision="32-true", offload_inputs=True, recompute=True, num_slots=2)
    engine = Engine(model, options, probes)
    got = own_loop(model, engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)), data)
    early = engine.stats["early_input_fetches"]
    engine.close()
    assert got == ref
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    blocks = model.config.num_hidden_layers
    assert early == (2 * (blocks - 1) if early_expected else 0)  # steps 2 and 3: every block's input but the first's


@pytest.mark.parametrize("room", ["input-and-attention", "input-only"])
def test_attention_outputs_kept_beside_an_input_come_back_early_with_it_where_memory_allows(monkeypatch, room):
    """keep_attention (engine/device/kept_attention.py): each call's attention output and log-sum-exp go to the host
    beside its offloaded input and come back with it, early where the free memory holds all three beside the first
    step's transient (the transient scaled by the input's size alone, not taken for a twice-longer batch), and
    none early where it holds the input only. Bit for bit ordinary training either way."""
    async_streams.install(monkeypatch, hold=1.0)
    data = batches(3)
    ref_model, model = llama(), llama()
    ref = own_loop(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-3), data)
    c, transient = model.config, 1 << 20
    input_bytes = 2 * 16 * c.hidden_size * 4  # batch 2 x 16 tokens, fp32
    kept_bytes = 2 * 16 * c.num_attention_heads * (c.head_dim * 4 + 4)  # the output and an fp32 log-sum-exp per head
    free = input_bytes + transient + (kept_bytes if room == "input-and-attention" else 0)
    probes = Probes(device_free_bytes=lambda: free, step_transient_bytes=lambda: transient)
    options = EngineConfig(device="cpu", precision="32-true", offload_inputs=True, recompute=True, keep_attention=True)
    engine = Engine(model, options, probes)
    got = own_loop(model, engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)), data)
    stats = dict(engine.stats)
    engine.close()
    assert got == ref
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    blocks = c.num_hidden_layers
    assert stats["kept_attention"] == 3 * blocks
    # steps 2 and 3, every block but the first: its input, attention output and log-sum-exp
    assert stats["early_input_fetches"] == (2 * (blocks - 1) * 3 if room == "input-and-attention" else 0)
