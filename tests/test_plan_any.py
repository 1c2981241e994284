"""megatrain plan --model of any model (megatrain_lightning/planning/plan_any.py, measure_any.py).

One tiny config per family, written as a Hugging Face config.json (no download): the stacks the engine's
discovery finds, host bytes against an independent count of the model's own parameters (16 bytes each in
bf16 with the default layout: fp32 master 4, Adam m + v 8, pinned bf16 copy 2, bf16 gradient slab 2), and
a measured device peak above what the engine holds before the step (slots and outer parameters) plus the
fp32 logits of the family's loss. Each family's vocabulary is large against its width, so the logits are
most of the peak.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
import transformers

from megatrain_lightning.cli.main import run
from megatrain_lightning.engine import EngineConfig
from megatrain_lightning.planning.plan_any import is_any_model, plan_model
from megatrain_lightning.planning.planner import GiB

BYTES_PER_PARAM = 16  # bf16-mixed, default layout, accumulate 1 (the module docstring above)
SEQ = 16
VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**SMALL, num_hidden_layers=3, sliding_window=8)


def qwen3_moe() -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    )


def deepseek_v3() -> transformers.PretrainedConfig:
    # Multi-head latent attention, a dense first layer, then routed + shared experts with group-limited routing.
    return transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4},
        num_hidden_layers=3,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=2,
        topk_group=1,
    )


def jamba() -> transformers.PretrainedConfig:
    # A mamba layer with a 2-expert MoE, then an attention layer with a dense MLP: two classes in one list.
    return transformers.JambaConfig(
        **SMALL,
        **IDS,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_dt_rank=4,
        mamba_d_state=4,
        mamba_expand=2,
    )


def t5() -> transformers.PretrainedConfig:
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=4, **IDS
    )


IMAGE, PATCH, IMAGE_TOKEN = 8, 4, VOCAB - 1


def llava() -> transformers.PretrainedConfig:
    vision = transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
        patch_size=PATCH, projection_dim=16,
    )  # fmt: skip
    text = transformers.LlamaConfig(**SMALL, num_hidden_layers=3)
    return transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )  # fmt: skip


FAMILIES = {
    # name: (config, class built for the independent count, stacks (name, blocks), vocabulary of the loss)
    "mistral": (mistral, "MistralForCausalLM", [("model.layers", 3)]),
    "qwen3-moe": (qwen3_moe, "Qwen3MoeForCausalLM", [("model.layers", 2)]),
    "deepseek-v3": (deepseek_v3, "DeepseekV3ForCausalLM", [("model.layers", 3)]),
    "jamba": (jamba, "JambaForCausalLM", [("model.layers", 2)]),
    "t5": (t5, "T5ForConditionalGeneration", [("encoder.block", 3), ("decoder.block", 2)]),
    "llava": (
        llava,
        "LlavaForConditionalGeneration",
        [("model.vision_tower.encoder.layers", 2), ("model.language_model.layers", 3)],
    ),
}


def write(config: transformers.PretrainedConfig, directory) -> str:
    config.save_pretrained(directory)  # config.json only
    return str(directory)


def own_parameters(config: transformers.PretrainedConfig, cls: str) -> int:
    """The model's parameters counted from the family's own class (each shared one once)."""
    with torch.device("meta"):
        model = getattr(transformers, cls)(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_planned_from_its_config_json(name, tmp_path):
    make, cls, stacks = FAMILIES[name]
    config = make()
    plan = plan_model(write(config, tmp_path / name), seq_len=SEQ)
    assert [(c.name, len(c.blocks)) for c in plan.units.layout.stacks] == stacks
    assert plan.kind.startswith(cls)
    numel = own_parameters(config, cls)
    assert plan.num_parameters == numel
    assert plan.host_total == BYTES_PER_PARAM * numel
    m = plan.measured
    held = sum(plan.slot_bytes.values())  # weight slots, gradient slots, parameters outside the blocks
    assert m.persistent >= held > 0
    logits = SEQ * VOCAB * 4  # the loss's fp32 logits of one row, live in the forward
    assert m.peak >= m.persistent + logits
    assert plan.gpu_peak == m.peak + GiB


def test_host_bytes_follow_the_layout_asked(tmp_path):
    """fp32 with accumulation: master 4, Adam 8, no copy (the master is the copy), fp32 slab 4, accumulator 4."""
    config = mistral()
    options = EngineConfig(precision="32-true", host_layout="default")
    plan = plan_model(
        write(config, tmp_path), seq_len=SEQ, accumulate=2, options=options, measure=False, host_layout=None
    )
    assert plan.host_total == 20 * own_parameters(config, "MistralForCausalLM")
    assert plan.measured is None and plan.gpu_peak is None


def test_the_command_says_whether_it_fits_the_gpu(tmp_path, capsys):
    directory = write(mistral(), tmp_path)
    args = ["plan", "--model", directory, "--seq-len", "256", "--recompute", "true"]
    fits = run([*args, "--gpu-mem", "2GiB"])
    out = capsys.readouterr().out
    assert "GPU limit 2.0 GiB: fits" in out and out.splitlines()[-1].endswith("fits=yes")
    peak = fits.gpu_peak
    assert peak > GiB + 256 * VOCAB * 4
    with pytest.raises(SystemExit) as exit_info:
        run([*args, "--gpu-mem", str(peak - 1)])  # a byte short of the same step
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and captured.out.splitlines()[-1].endswith("fits=no")
    assert "GPU memory: micro-batch 1 at seq_len 256 measured" in captured.err


FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab=300, width=48, depth=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model():
    return Tiny()
"""


def test_a_module_factory_is_planned_by_its_python_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import tiny_factory

    spec = "tiny_factory:build_model"
    assert is_any_model(spec)
    plan = run(["plan", "--model", spec, "--seq-len", "64", "--host-mem", "1GiB"])
    out = capsys.readouterr().out
    assert re.search(r"Tiny \(module\), .* streams blocks \(5 blocks", out)
    assert [(c.name, len(c.blocks)) for c in plan.units.layout.stacks] == [("blocks", 5)]
    numel = sum(p.numel() for p in tiny_factory.Tiny().parameters())
    assert plan.host_total == BYTES_PER_PARAM * numel
    assert plan.measured.peak >= plan.measured.persistent + 64 * 300 * 4 > sum(plan.slot_bytes.values())


def test_which_models_take_this_path(tmp_path):
    """Presets and the configs the project's own Llama reads keep the formulas; any other family, a Llama it
    does not read, and a module factory are planned here."""
    transformers.LlamaConfig(**SMALL, num_hidden_layers=2).save_pretrained(tmp_path / "llama")
    transformers.LlamaConfig(**SMALL, num_hidden_layers=2, hidden_act="gelu").save_pretrained(tmp_path / "gelu")
    assert not is_any_model("llama-3.1-8b")
    assert not is_any_model(str(tmp_path / "llama")) and not is_any_model(str(tmp_path / "llama" / "config.json"))
    assert is_any_model(str(tmp_path / "gelu"))
    assert is_any_model(write(mistral(), tmp_path / "mistral"))
    assert is_any_model("my_pkg.models:build")
    assert not is_any_model(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no_such_module_here:build"], "cannot import 'no_such_module_here'"),
        (["--token-chunk-size", "1024"], "--token-chunk-size plans the project's Llama"),
        (["--devices", "2"], "--devices/--nodes plans the project's Llama"),
        (["--device-grad-sums", "2"], "--device-grad-sums plans the project's Llama"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, args, message):
    directory = write(mistral(), tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run(["plan", "--model", directory, "--no-measure", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def engine_host_bytes(config: transformers.PretrainedConfig, layout: str, accumulate: int) -> int:
    """Host bytes a real engine holds after one optimizer step of `accumulate` micro-batches on the CPU."""
    from megatrain_lightning import Engine, EngineConfig

    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    engine = Engine(model, EngineConfig(device="cpu", precision="bf16-mixed", host_layout=layout, pin_memory=False))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(3, VOCAB, (1, SEQ))
    for i in range(accumulate):
        with engine.autocast(), engine.backward(accumulate=i < accumulate - 1):
            model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss.backward()
    opt.step()
    engine.flush()
    total = sum(engine.host_bytes().values())
    engine.close()
    return total


@pytest.mark.parametrize("layout, accumulate", [("default", 2), ("lean", 1)])
def test_host_bytes_are_what_the_engine_allocates(tmp_path, layout, accumulate):
    """T5 shares its embedding between encoder, decoder and head: held once, as the engine holds it. The
    lean layout's rings are sized from the largest unit, as the engine sizes them."""
    config = t5()
    options = EngineConfig(host_layout=layout, clipping=False)
    plan = plan_model(
        write(config, tmp_path), SEQ, accumulate=accumulate, options=options, measure=False, host_layout=None
    )
    assert plan.host_layout == layout
    assert plan.host_total == engine_host_bytes(config, layout, accumulate)


def test_recompute_auto_keeps_graphs_in_the_slots_beyond_two(tmp_path):
    """With 4 slots and room on the GPU the engine's own "auto" keeps the last 2 blocks' graphs (2 slots keep
    streaming) in the measured step, which then holds their activations; with recompute=True none."""
    directory = write(mistral(), tmp_path)
    kept = plan_model(directory, SEQ, options=EngineConfig(num_slots=4, recompute="auto"), gpu_mem=2 * GiB)
    recomputed = plan_model(directory, SEQ, options=EngineConfig(num_slots=4, recompute=True), gpu_mem=2 * GiB)
    assert (kept.measured.kept_calls, recomputed.measured.kept_calls) == (2, 0)
    assert kept.measured.persistent == recomputed.measured.persistent
    assert kept.measured.backward_peak > recomputed.measured.backward_peak


def test_row_chunks_are_measured_as_the_engine_runs_them(tmp_path):
    """`--row-chunk` reaches the measured step of any model: block calls of 2 of 8 rows hold less than whole
    calls, with the same persistent buffers."""
    directory = write(mistral(), tmp_path)
    plans = {
        rows: plan_model(directory, SEQ, 8, options=EngineConfig(recompute=True, row_chunk=rows), gpu_mem=2 * GiB)
        for rows in (None, 2)
    }
    whole, chunked = plans[None].measured, plans[2].measured
    assert chunked.persistent == whole.persistent
    assert chunked.backward_peak < whole.backward_peak
