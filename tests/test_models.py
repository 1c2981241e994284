"""The Llama/Qwen2 model, its chunked loss and HF checkpoint I/O, checked against ``transformers``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatrain_lightning.models import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    chunked_cross_entropy,
    from_pretrained,
    load_hf_config,
    load_hf_weights,
    save_hf_checkpoint,
    save_pretrained,
)
from megatrain_lightning.models.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that head_dim=16 frequencies fall in all three bands (kept, blended, scaled).
    "original_max_position_embeddings": 64,
}


def _config(kind: str) -> LlamaConfig:
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        loss_chunk_size=7,
    )
    if kind == "llama_gqa_rope":
        return LlamaConfig(**common, rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE))
    if kind == "llama_tied":
        return LlamaConfig(**common, tie_word_embeddings=True, rms_norm_eps=1e-6)
    if kind == "qwen2_bias":
        return LlamaConfig(**common, model_type="qwen2", rope_theta=1e6)
    raise AssertionError(kind)


KINDS = ["llama_gqa_rope", "llama_tied", "qwen2_bias"]


def _hf_model(config: LlamaConfig):
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict(), attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()


@torch.no_grad()
def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    # Init leaves norms at 1 and biases at 0; random values make those code paths observable.
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)


def _pair(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config = _config(kind)
    ours = LlamaForCausalLM(config)
    _randomize_norms_and_biases(ours)
    hf = _hf_model(config)
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf.load_state_dict(ours.state_dict(), strict=True)
    return ours, hf


def _tokens(config: LlamaConfig, batch: int = 2, seq: int = 40, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=g)


def _assert_logits_close(ours, hf, ids, **kw):
    with torch.no_grad():
        expected = hf(input_ids=ids, **kw).logits
        got = ours(ids, **kw)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- forward / loss vs HF


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    ours, hf = _pair(kind)
    _assert_logits_close(ours, hf, _tokens(ours.config))
    if kind == "llama_tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_logits_match_transformers_with_offset_positions():
    # Positions past original_max_position_embeddings exercise the down-scaled low frequencies.
    ours, hf = _pair("llama_gqa_rope")
    ids = _tokens(ours.config, seq=24)
    positions = torch.arange(300, 324).unsqueeze(0).expand(2, -1)
    _assert_logits_close(ours, hf, ids, position_ids=positions)


def test_bf16_logits_match_transformers():
    ours, hf = _pair("qwen2_bias")
    inv_freq = hf.model.rotary_emb.inv_freq.clone()
    ours, hf = ours.to(torch.bfloat16), hf.to(torch.bfloat16)
    # Module.to() also rounds HF's inv_freq buffer to bf16, which HF's own from_pretrained avoids;
    # restore it so both models see the same fp32 RoPE frequencies.
    hf.model.rotary_emb.inv_freq = inv_freq
    ids = _tokens(ours.config)
    with torch.no_grad():
        got, expected = ours(ids), hf(input_ids=ids).logits
    assert got.dtype == torch.bfloat16
    # Same op order (fp32 norm statistics, cast before weight) means near bit-identical results.
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_grads_match_transformers(kind):
    ours, hf = _pair(kind)
    ids = _tokens(ours.config, seq=19)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    targets[0, :5] = -100
    loss = ours(ids, targets=targets)
    logits = hf(input_ids=ids).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, hf_loss, atol=1e-6, rtol=1e-6)
    loss.backward()
    hf_loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-7, rtol=1e-5, msg=name)


def test_layers_hold_no_buffers_and_are_pure():
    model = LlamaForCausalLM(_config("llama_gqa_rope"))
    assert list(model.buffers()) == []
    layer = model.model.layers[0]
    x = torch.randn(2, 10, 64)
    cos, sin = model.model.rotary_emb(torch.arange(10).unsqueeze(0), x.dtype)
    torch.testing.assert_close(layer(x, cos, sin), layer(x.clone(), cos, sin), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_block_math_is_hf_bit_for_bit(dtype, grad):
    """RMSNorm, RoPE and SwiGLU equal HF's LlamaRMSNorm, apply_rotary_pos_emb and silu(gate) * up bit for bit,
    outputs and input gradients, with a graph and without one (where they run in place): the engine's
    forward runs without a graph, its recompute and ordinary training with one."""
    from transformers.models.llama import modeling_llama as hf

    from megatrain_lightning.models.llama import RotaryEmbedding, apply_rope, swiglu
    from megatrain_lightning.models.ops import rms_norm

    g = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 10, 16), (2, 2, 10, 16), (2, 10, 64), (2, 10, 96), (2, 10, 96)]
    q, k, hidden, gate, up = (torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad) for shape in shapes)
    config = _config("llama_gqa_rope")
    cos, sin = RotaryEmbedding(config)(torch.arange(300, 310).unsqueeze(0), dtype)
    norm = hf.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=g)
    with torch.set_grad_enabled(grad):
        ours = [apply_rope(q, cos, sin), apply_rope(k, cos, sin), rms_norm(hidden, norm.weight, 1e-5), swiglu(gate, up)]
        theirs = [*hf.apply_rotary_pos_emb(q, k, cos, sin), norm(hidden), F.silu(gate) * up]
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if grad:
        inputs = [q, k, hidden, gate, up, norm.weight]
        grads = [torch.autograd.grad(sum(o.float().square().sum() for o in outs), inputs) for outs in (ours, theirs)]
        for name, a, b in zip(["q", "k", "hidden", "gate", "up", "norm.weight"], *grads):
            assert torch.equal(a, b), name


def test_generate_greedy_matches_argmax():
    model = LlamaForCausalLM(_config("llama_tied")).eval()
    prompt = _tokens(model.config, batch=2, seq=5)
    out = model.generate(prompt, max_new_tokens=4, temperature=0)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        for step in range(4):
            expected = model(out[:, : 5 + step])[:, -1].argmax(-1)
            assert torch.equal(out[:, 5 + step], expected)
    sampled = model.generate(prompt, max_new_tokens=3, temperature=0.7, top_k=5)
    assert sampled.shape == (2, 8)


def test_models_package_does_not_import_transformers():
    """Checked statically: at run time Lightning's torchmetrics imports transformers whenever it is
    installed, so sys.modules cannot tell whether *this* package needs it."""
    import ast
    from pathlib import Path

    import megatrain_lightning.models as models

    for path in Path(models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "transformers" for n in names), f"{path.name} imports transformers"


# ---------------------------------------------------------------------------- chunked cross-entropy


def _ce_inputs(n, v=50, h=12, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("n,chunk", [(37, 8), (16, 8), (5, 64), (1, 1)])
def test_chunked_cross_entropy_matches_reference(n, chunk):
    hidden, weight, targets = _ce_inputs(n)
    targets[::3] = -100 if n > 1 else targets[::3]
    loss = chunked_cross_entropy(hidden, weight, targets, chunk)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    # Gradients are O(0.1); atol covers fp32 rounding of the few near-zero entries.
    torch.testing.assert_close(gh, rh, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw, rw, atol=1e-6, rtol=1e-6)


def test_chunked_cross_entropy_scales_with_upstream_grad():
    hidden, weight, targets = _ce_inputs(9)
    (3.0 * chunked_cross_entropy(hidden, weight, targets, 4)).backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (3.0 * F.cross_entropy(hidden @ weight.T, targets)).backward()
    torch.testing.assert_close(ref_h, hidden.grad)
    torch.testing.assert_close(ref_w, weight.grad)


def test_chunked_cross_entropy_all_ignored_is_zero_without_nan():
    hidden, weight, targets = _ce_inputs(11)
    targets.fill_(-100)
    loss = chunked_cross_entropy(hidden, weight, targets, 4)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_chunked_cross_entropy_bf16_grad_dtypes():
    hidden, weight, targets = _ce_inputs(20, dtype=torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, targets, 8)
    loss.backward()
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref = F.cross_entropy((hidden @ weight.T).float(), targets)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def test_chunked_cross_entropy_under_autocast_backs_its_products_as_autocast_does():
    """Under bf16 autocast (bf16-mixed: fp32 hidden states and head weight) the backward recomputes the logits
    and takes its products under the forward's autocast, as autograd runs an autocast matmul's backward: the
    hidden states' gradient is the ordinary one's but for the order of additions (the chunks' rows are
    independent), where recomputing in fp32 left it 1e-2 off (the logits' bf16 rounding against the forward's
    log-sum-exp). The weight's gradient sums one bf16 product per chunk, so within bf16 rounding."""
    hidden, weight, targets = _ce_inputs(64)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, targets, 16)
        ref = F.cross_entropy((hidden @ weight.T).float(), targets)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    assert torch.equal(loss, ref)
    assert rel(gh, rh) < 1e-4 and rel(gw, rw) < 2**-7


def _upcast_first_grads(hidden, weight, targets, chunk, autocast):
    """The chunked loss's gradients by its math written out with every upcast taken first: the logits upcast to
    fp32, shifted, exponentiated, scaled in fp32 and then cast; each chunk's weight product upcast, then summed."""
    h, w = hidden.detach(), weight.detach()
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with context:
        lse = torch.cat([torch.logsumexp((h[s : s + chunk] @ w.t()).float(), -1) for s in range(0, len(h), chunk)])
    valid = targets != -100
    scale = 1.0 / valid.sum().clamp(min=1).float()
    grad_h, grad_w = torch.empty_like(h), torch.zeros(w.shape, dtype=torch.float32)
    for s in range(0, len(h), chunk):
        hc, v, t = h[s : s + chunk], valid[s : s + chunk], targets[s : s + chunk]
        with context:
            probs = ((hc @ w.t()).float() - lse[s : s + chunk].unsqueeze(1)).exp()
            probs[torch.arange(len(hc)), torch.where(v, t, 0)] -= v.float()
            g = (probs * torch.where(v, scale, 0.0).unsqueeze(1)).to(h.dtype)
            grad_w += (g.t() @ hc).float()
            grad_h[s : s + chunk] = g @ w
    return grad_h, grad_w.to(w.dtype)


@pytest.mark.parametrize(
    ("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_chunked_cross_entropy_backward_is_its_math_with_every_upcast_taken_first(dtype, autocast):
    """The backward writes fp32 only where fp32 is kept (models/loss.py: no fp32 copy of the logits, of the scaled
    gradient or of each chunk's weight product) and gets the very bits of the formulas upcasting first."""
    hidden, weight, targets = _ce_inputs(37, dtype=dtype)
    targets[::5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = chunked_cross_entropy(hidden, weight, targets, 8)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = _upcast_first_grads(hidden, weight, targets, 8, autocast)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize(
    "config",
    [_config("llama_gqa_rope"), PRESETS["llama-3.1-8b"], PRESETS["llama-3.2-1b"], PRESETS["qwen2.5-7b"]],
    ids=["tiny", "llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b"],
)
def test_rope_inv_freq_matches_transformers(config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    if config.rope_scaling is None:
        hf_inv_freq = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq
    else:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(config), hf_inv_freq, atol=0, rtol=0)


# ---------------------------------------------------------------------------- config and presets

PUBLISHED_SIZES = {
    "llama-3.2-1b": 1.236e9,
    "llama-3.1-8b": 8.030e9,
    "llama-3.1-70b": 70.55e9,
    "qwen2.5-7b": 7.616e9,
    "qwen2.5-14b": 14.77e9,
    "qwen2.5-32b": 32.76e9,
    "qwen2.5-72b": 72.71e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_preset_parameter_counts(name):
    config = LlamaConfig.from_preset(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    built = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    assert config.num_parameters() == built
    assert abs(built - PUBLISHED_SIZES[name]) / PUBLISHED_SIZES[name] < 0.005


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="llama-3.1-8b") as info:
        LlamaConfig.from_preset("llama-9b")
    assert "llama-9b" in str(info.value)


def test_from_preset_returns_independent_copy():
    config = LlamaConfig.from_preset("llama-3.1-8b", loss_chunk_size=1024)
    config.rope_scaling["factor"] = 1.0
    assert PRESETS["llama-3.1-8b"].rope_scaling["factor"] == 8.0
    assert config.loss_chunk_size == 1024


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_hf_dict_round_trip(name):
    config = PRESETS[name]
    # loss_chunk_size is a training knob, not part of the checkpoint: it comes back as the default.
    expected = dataclasses.replace(config, loss_chunk_size=LlamaConfig.loss_chunk_size)
    assert LlamaConfig.from_hf_dict(config.to_hf_dict()) == expected
    # transformers' own serialization (5.x puts RoPE under rope_parameters) reads back the same.
    # (HF's LlamaConfig invents bos=1/eos=2 when none are given, so token ids are only a superset.)
    parsed = LlamaConfig.from_hf_dict(transformers.AutoConfig.for_model(**config.to_hf_dict()).to_dict())
    assert dataclasses.replace(parsed, token_ids={}) == dataclasses.replace(expected, token_ids={})
    assert config.token_ids.items() <= parsed.token_ids.items()


def test_config_reads_legacy_rope_dialect():
    legacy = {k: v for k, v in PRESETS["llama-3.1-8b"].to_hf_dict().items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {k: v for k, v in legacy["rope_scaling"].items() if k != "rope_theta"}
    assert LlamaConfig.from_hf_dict(legacy) == PRESETS["llama-3.1-8b"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads=3"),
        (dict(hidden_size=66), "hidden_size=66"),
        (dict(head_dim=15), "head_dim=15"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),
        (dict(model_type="qwen2", attention_bias=False), "attention_bias=True"),
        (dict(attention_bias=True), "o_proj"),
        (dict(vocab_size=0), "vocab_size=0"),
    ],
)
def test_config_validation(overrides, needle):
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        LlamaConfig(**{**base, **overrides})


# ---------------------------------------------------------------------------- checkpoint I/O


@pytest.mark.parametrize(
    "kind,max_shard_bytes", [("llama_gqa_rope", 40_000), ("llama_tied", 5 * 2**30), ("qwen2_bias", 60_000)]
)
def test_save_pretrained_loads_in_transformers(tmp_path, kind, max_shard_bytes):
    ours, _ = _pair(kind)
    save_pretrained(ours, tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes < 2**30)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temporary files left behind"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa")
    _assert_logits_close(ours, hf.eval(), _tokens(ours.config))
    # ...and back into our own loader, bit for bit.
    ids = _tokens(ours.config)
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path)(ids), ours(ids), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["llama_gqa_rope", "llama_tied", "qwen2_bias"])
def test_transformers_sharded_checkpoint_loads_here(tmp_path, kind):
    ours, hf = _pair(kind)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = from_pretrained(tmp_path)
    assert loaded.config == LlamaConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    if ours.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_logits_close(loaded, hf, _tokens(ours.config))


def test_from_pretrained_bf16(tmp_path):
    ours, _ = _pair("llama_tied")
    save_pretrained(ours, tmp_path)
    loaded = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded.model.embed_tokens.weight, ours.model.embed_tokens.weight.bfloat16())


def _tampered_checkpoint(tmp_path, mutate):
    ours, _ = _pair("llama_gqa_rope")
    tensors = dict(ours.state_dict())
    mutate(tensors)
    save_hf_checkpoint(tensors.items(), ours.config, tmp_path, max_shard_bytes=50_000)
    return LlamaForCausalLM(ours.config)


@pytest.mark.parametrize(
    "mutate,needles",
    [
        (
            lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(96, 65)),
            ["up_proj", "(96, 65)", "(96, 64)", "model-0000"],
        ),
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"), ["k_proj"]),
        (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)), ["model.layers.0.extra.weight"]),
    ],
    ids=["shape", "missing", "unexpected"],
)
def test_bad_checkpoint_raises_before_touching_model(tmp_path, mutate, needles):
    model = _tampered_checkpoint(tmp_path, mutate)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_hf_weights(model, tmp_path)
    for needle in needles:
        assert needle in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed load"


def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path):
    model = _tampered_checkpoint(tmp_path / "ckpt", lambda t: None)
    index_file = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key, shard = next(iter(index["weight_map"].items()))
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "ckpt" / shard).read_bytes())  # valid, misplaced
    index["weight_map"][key] = "../outside.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps .* to '\.\./outside\.safetensors', which is not a file name in"):
        load_hf_weights(model, tmp_path / "ckpt")


def test_save_streams_shards_and_casts(tmp_path):
    model = LlamaForCausalLM(_config("llama_gqa_rope"))
    names_written = []

    def stream():
        for name, tensor in model.state_dict().items():
            # Once a shard's worth has gone by, it must already be on disk (under a temp name).
            if sum(t.numel() * 2 for _, t in names_written) > 2 * 30_000:
                assert any(p.suffix == ".tmp" for p in tmp_path.iterdir())
            names_written.append((name, tensor))
            yield name, tensor

    save_hf_checkpoint(stream(), model.config, tmp_path, max_shard_bytes=30_000, dtype=torch.bfloat16)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(f"-of-{len(shards):05d}" in s for s in shards)
    assert all((tmp_path / s).stat().st_size < 30_000 + 20_000 for s in shards)
    assert load_hf_config(tmp_path) == dataclasses.replace(model.config, loss_chunk_size=4096)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # A second, unsharded save into the same directory must not leave the old shards or index.
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_failed_save_leaves_no_files(tmp_path):
    model = LlamaForCausalLM(_config("llama_gqa_rope"))

    def failing_stream():
        for i, item in enumerate(model.state_dict().items()):
            if i == 12:
                raise RuntimeError("disk on fire")
            yield item

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_hf_checkpoint(failing_stream(), model.config, tmp_path, max_shard_bytes=20_000)
    assert list(tmp_path.iterdir()) == []


def test_more_tokens_than_one_loss_chunk_fold_the_final_norm_into_the_loss():
    """Many rows (a layer-major micro-batch) untiled: the final norm runs chunk by chunk inside the loss, never
    on the whole micro-batch (whose backward would hold five fp32 copies of it); the loss and gradients are those
    of the norm applied whole, up to the fp32 order of the norm weight's gradient sum."""
    torch.manual_seed(0)
    config = LlamaConfig.from_preset("tiny", token_chunk_size=None, loss_chunk_size=32)
    ids = torch.randint(0, config.vocab_size, (4, 24))  # 96 tokens: three loss chunks
    folded = LlamaForCausalLM(config)
    whole = LlamaForCausalLM(dataclasses.replace(config, loss_chunk_size=96))  # one chunk: the norm whole
    whole.load_state_dict(folded.state_dict())
    calls = []
    folded.model.norm.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    a, b = folded(ids, targets=ids), whole(ids, targets=ids)
    assert calls == []
    assert torch.allclose(a, b, rtol=1e-6, atol=0)
    a.backward()
    b.backward()
    for (name, p), q in zip(folded.named_parameters(), whole.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
