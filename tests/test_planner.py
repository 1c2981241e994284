"""The memory planner against what a real training step allocates, its refusals and size parsing."""

from __future__ import annotations

import dataclasses
import multiprocessing
from typing import Any

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.host.units import host_bytes_per_param
from megatrain_lightning.lightning.callbacks import rss_bytes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.models.tiling import tile_bytes_per_token
from megatrain_lightning.planning.device_memory import auto_slot_count
from megatrain_lightning.planning.planner import (
    RunShape,
    block_numel,
    format_size,
    host_breakdown,
    largest_unit,
    max_micro_batch,
    parse_size,
    plan,
)
from tests.streamed import precision_of

PRECISION = {torch.bfloat16: "bf16-mixed", torch.float32: "32-true"}


def small_config(layers: int = 4, hidden: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64) * 2,
        num_key_value_heads=max(1, hidden // 64),
        loss_chunk_size=64,
    )


def train(
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    accumulate: int,
    offload_inputs: bool = False,
    stored: str | None = None,
    **extra: Any,
) -> Engine:
    """One optimizer step of `accumulate` micro-batches on the CPU, as the strategy drives the engine
    (`stored`: offload_inputs_dtype; `extra`: more engine options)."""
    config = model.config
    options = dict(offload_inputs=offload_inputs, offload_inputs_dtype=stored, **extra)
    engine = Engine(model, EngineConfig(device="cpu", precision=precision_of(dtype), **options))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, config.vocab_size, (1, 32))
    for i in range(accumulate):
        with engine.backward(accumulate=i < accumulate - 1):
            model(tokens, targets=tokens).backward()
    opt.step()
    engine.flush()
    return engine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_host_estimate_matches_engine_accounting(dtype, accumulate):
    """The planner's host bytes are the engine's own buffers after a step, kind by kind, and the figure the
    engine's host-memory check refuses a model by (the fp32 accumulator included when accumulating)."""
    config = small_config()
    engine = train(LlamaForCausalLM(config), dtype, accumulate)
    measured = engine.host_bytes()
    estimate = plan(RunShape(config, 32, 1, accumulate=accumulate), EngineConfig(precision=PRECISION[dtype]))
    assert {k: v for k, v in estimate.host.items() if k != "activations"} == measured
    checked = host_bytes_per_param(dtype, training=True, accumulating=accumulate > 1) * engine.num_parameters()
    assert estimate.host_total == sum(measured.values()) == checked
    assert (estimate.host["acc"] > 0) == (measured["acc"] > 0) == (accumulate > 1)


def test_speculative_steps_are_planned_as_the_engine_allocates_them():
    """speculative_step: one more bf16 copy per parameter (the spare the steps write), in the planner's host
    bytes as in the engine's buffers and its host-memory check."""
    config = small_config()
    engine = train(LlamaForCausalLM(config), torch.bfloat16, 1, speculative_step=True)
    measured = engine.host_bytes()
    estimate = plan(RunShape(config, 32, 1), EngineConfig(precision="bf16-mixed", speculative_step=True))
    assert {k: v for k, v in estimate.host.items() if k != "activations"} == measured
    assert measured["spare"] == 2 * engine.num_parameters() == measured["copy"]
    checked = host_bytes_per_param(torch.bfloat16, training=True, speculative=True) * engine.num_parameters()
    assert estimate.host_total == sum(measured.values()) == checked
    plain = plan(RunShape(config, 32, 1), EngineConfig(precision="bf16-mixed"))
    assert estimate.host_total - plain.host_total == measured["spare"] and plain.host["spare"] == 0


@pytest.mark.parametrize(
    ("dtype", "stored"),
    [(torch.bfloat16, None), (torch.float32, None), (torch.float32, "fp8"), (torch.bfloat16, "fp8")],
)
def test_offloaded_inputs_are_planned_as_the_engine_allocates_them(dtype, stored):
    """offload_inputs: the planner's host bytes for block inputs are the engine's pinned buffers, also stored
    as fp8 (offload_inputs_dtype), and the GPU keeps one input at the peak (the block in use; the next is
    fetched once its recompute is issued, tests/test_measure.py) instead of one per block."""
    config = small_config()
    engine = train(LlamaForCausalLM(config), dtype, accumulate=1, offload_inputs=True, stored=stored)
    shape, precision = RunShape(config, seq_len=32, micro_batch=1), PRECISION[dtype]
    offloaded = plan(shape, EngineConfig(precision=precision, offload_inputs=True, offload_inputs_dtype=stored))
    kept = plan(shape, EngineConfig(precision=precision))
    assert offloaded.host["activations"] == engine.saved_inputs.host_bytes() > 0 == kept.host["activations"]
    if stored == "fp8":  # a byte per element and a 4-byte scale per token, whatever the compute dtype
        assert offloaded.host["activations"] == config.num_hidden_layers * 32 * (config.hidden_size + 4)
        offloaded = plan(
            shape, EngineConfig(precision=precision, offload_inputs=True)
        )  # the GPU items below are the lossless run's
    per_input = offloaded.host["activations"] // config.num_hidden_layers
    assert (
        kept.gpu["saved_inputs"] == config.num_hidden_layers * per_input and offloaded.gpu["saved_inputs"] == per_input
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_attention_is_planned_as_the_engine_allocates_it(dtype):
    """keep_attention with offloaded inputs: the planner's host bytes are the engine's pinned buffers, the inputs' and
    each call's attention output and fp32 log-sum-exp beside them (engine/device/kept_attention.py); on the GPU the
    block in use's kept outputs, or every block's while the inputs stay there."""
    config = small_config()
    engine = train(LlamaForCausalLM(config), dtype, accumulate=1, offload_inputs=True, keep_attention=True)
    assert engine.stats["kept_attention"] == config.num_hidden_layers  # (the outputs did stand in)
    shape, precision = RunShape(config, seq_len=32, micro_batch=1), PRECISION[dtype]
    offloaded = plan(shape, EngineConfig(precision=precision, offload_inputs=True, keep_attention=True))
    plain = plan(shape, EngineConfig(precision=precision, offload_inputs=True))
    assert offloaded.host["activations"] == engine.saved_inputs.host_bytes() > plain.host["activations"]
    per_call = (offloaded.host["activations"] - plain.host["activations"]) // config.num_hidden_layers
    on_device = plan(shape, EngineConfig(precision=precision, offload_inputs=False, keep_attention=True))
    assert (
        offloaded.gpu["kept_attention"] == per_call
        and on_device.gpu["kept_attention"] == per_call * config.num_hidden_layers
    )


def _rss_growth(dtype: torch.dtype) -> dict:
    """In a fresh process: resident-memory growth from handing a model to the engine through one step."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        loss_chunk_size=256,
    )
    model = LlamaForCausalLM(config)
    before = rss_bytes()
    engine = train(model, dtype, accumulate=1)
    return {"growth": rss_bytes() - before, "params": engine.num_parameters(), "config": config}


@pytest.mark.slow
def test_host_estimate_matches_process_rss():
    """RSS growth of a real step vs the plan. On a CPU-only machine the "device" buffers (weight slots,
    gradient slots, outer-parameter copies) are host memory too, so they are added to the host estimate;
    the model's own fp32 parameters (4 B/param) are given back as the engine takes them over. What is left
    is a roughly fixed ~35 MB (the host worker thread's malloc arena, transients), hence a ~50M model."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        r = pool.apply(_rss_growth, (torch.bfloat16,))
    p = plan(RunShape(r["config"], 32, 1), EngineConfig(precision="bf16-mixed"))
    device_on_host = p.gpu["weight_slots"] + p.gpu["grad_slots"] + p.gpu["outer"]
    allocated = r["growth"] + 4 * r["params"]  # the model's parameters existed before `before` was read
    ratio = (p.host_total + device_on_host) / allocated
    print(f"planned {p.host_total + device_on_host:,} B vs allocated {allocated:,} B: ratio {ratio:.3f}")
    assert abs(ratio - 1) < 0.10


def test_refuses_a_model_too_big_for_host_memory():
    p = plan(
        RunShape(LlamaConfig.from_preset("qwen2.5-72b"), 4096, 1),
        host_mem=parse_size("512GiB"),
        gpu_mem=parse_size("80GiB"),
    )
    assert not p.fits
    [problem] = p.problems()
    assert "1083.4 GiB" in problem and "512.0 GiB" in problem and "more host memory" in problem


def test_refuses_when_no_micro_batch_fits_the_gpu():
    p = plan(
        RunShape(LlamaConfig.from_preset("llama-3.1-8b"), 131072, 1),
        EngineConfig(offload_inputs=False),
        gpu_mem=parse_size("24GiB"),
    )
    assert p.max_micro_batch == 0 and not p.fits
    assert "no micro-batch fits" in p.problems()[0] and "seq_len" in p.problems()[0]


def test_suggests_the_largest_micro_batch_that_fits():
    config, gpu = LlamaConfig.from_preset("llama-3.1-8b"), parse_size("80GiB")
    p = plan(RunShape(config, 4096, 64), EngineConfig(offload_inputs=False), gpu_mem=gpu)
    assert 1 <= p.max_micro_batch < 64
    assert f"--micro-batch {p.max_micro_batch}" in p.problems()[0]
    fitting = plan(RunShape(config, 4096, p.max_micro_batch), EngineConfig(offload_inputs=False), gpu_mem=gpu)
    assert fitting.fits and fitting.gpu_peak <= gpu
    assert (
        plan(RunShape(config, 4096, p.max_micro_batch + 1), EngineConfig(offload_inputs=False), gpu_mem=gpu).gpu_peak
        > gpu
    )


def test_max_micro_batch_is_monotonic():
    """More GPU memory never allows fewer sequences; longer sequences never allow more."""
    config = LlamaConfig.from_preset("qwen2.5-7b")
    by_memory = [max_micro_batch(config, 4096, "bf16-mixed", 2, parse_size(f"{g}GiB")) for g in (16, 24, 40, 80, 141)]
    assert by_memory == sorted(by_memory) and by_memory[-1] > by_memory[0]
    by_length = [max_micro_batch(config, t, "bf16-mixed", 2, parse_size("80GiB")) for t in (1024, 4096, 16384)]
    assert by_length == sorted(by_length, reverse=True)


def test_table_states_every_item():
    p = plan(RunShape(LlamaConfig.from_preset("llama-3.1-8b"), 4096, 1))
    table = p.table()
    assert "8.03B parameters" in table and f"{p.host_total / 2**30:.2f}" in table
    for label in ("fp32 master weights", "Adam m + v", "gradient slab", "weight slots", "saved block inputs", "peak"):
        assert label in table
    assert p.host_total == 16 * p.num_parameters  # 4 master + 8 Adam + 2 copy + 2 slab


def test_fp32_has_no_separate_copy_and_accumulation_adds_four_bytes():
    config = LlamaConfig.from_preset("llama-3.2-1b")
    assert plan(RunShape(config, 1024, 1), EngineConfig(precision="32-true")).host["copy"] == 0
    n = config.num_parameters()
    assert plan(RunShape(config, 1024, 1, accumulate=4)).host_total == 20 * n


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512GiB", 512 * 2**30),
        ("80GB", 80 * 10**9),
        ("1.5TiB", int(1.5 * 2**40)),
        ("4096", 4096),
        ("80 gib", 80 * 2**30),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("80G", "ambiguous.*80GB.*80GiB"), ("lots", "not a number"), ("5 parsecs", "unknown unit 'parsecs'")],
)
def test_parse_size_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_size(text)


def test_plan_refuses_bad_settings():
    with pytest.raises(ValueError, match="num_slots=1"):
        plan(RunShape(LlamaConfig.from_preset("tiny"), 128, 1), EngineConfig(num_slots=1))
    with pytest.raises(ValueError, match="num_slots='all': give at least 2 slots .* or 'auto'"):
        plan(RunShape(LlamaConfig.from_preset("tiny"), 128, 1), EngineConfig(num_slots="all"))
    with pytest.raises(ValueError, match="precision='16-mixed'"):
        plan(RunShape(LlamaConfig.from_preset("tiny"), 128, 1), EngineConfig(precision="16-mixed"))


def test_auto_slots_are_planned_by_the_engines_rule():
    """num_slots="auto" plans what the engine settles on after its first step, from the plan's own figures
    with 2 slots (device_memory.auto_slot_count). llama-3.1-8b in 80 GiB, 0.41 GiB a slot: at 4k tokens the
    step needs little, so every one of the 32 blocks gets a slot; at 32k, 80 - 4.58 persistent = 75.42 GiB
    free, 4 x 18.18 GiB transient + 1 = 73.7 GiB kept, 1.7 GiB for 4 more slots; at 128k none more."""
    config, gpu = LlamaConfig.from_preset("llama-3.1-8b"), parse_size("80GiB")
    slot = block_numel(config) * 2
    for tokens, slots in [(4096, 32), (32768, 6), (131072, 2)]:
        # recompute=True: the slots alone (kept graphs: the test below)
        auto = plan(RunShape(config, tokens, 1), EngineConfig(recompute=True), gpu_mem=gpu)
        two = plan(RunShape(config, tokens, 1), EngineConfig(num_slots=2, recompute=True), gpu_mem=gpu)
        persistent = sum(two.gpu[k] for k in ("weight_slots", "grad_slots", "outer", "cuda_context"))
        assert auto.num_slots == auto_slot_count(gpu - persistent, two.gpu_peak - persistent, slot, 32) == slots
        assert auto.gpu["weight_slots"] == slots * slot and auto.fits
        assert auto.gpu_peak - two.gpu_peak == (slots - 2) * slot
        assert f"{slots} slots (auto)" in auto.table() and "2 slots," in two.table()
    assert plan(RunShape(config, 4096, 1)).num_slots == 2  # no GPU limit to size from: auto's first step


def test_format_size():
    assert format_size(119.66 * 2**30) == "119.7 GiB" and format_size(13 * 2**20) == "13.0 MiB"


def test_tiles_shrink_the_planned_recompute_to_one_tile_of_intermediates():
    """Tiled, the recompute keeps the tile's intermediates for one tile only; what grows with the sequence
    is the attention core's tensors. Untiled, every intermediate grows with it."""
    config = LlamaConfig.from_preset("llama-3.1-8b")
    tokens, tile = 131072, 16384
    untiled = plan(RunShape(dataclasses.replace(config, token_chunk_size=None), tokens, 1))
    tiled = plan(RunShape(dataclasses.replace(config, token_chunk_size=tile), tokens, 1))
    assert tiled.tile == tile and untiled.tile is None
    weight_grads = block_numel(config) * 2
    # 128k tokens: the attention's backward is the peak, nothing of a tile in it
    assert tiled.gpu["recompute"] == weight_grads + tiled.per_token["recompute"] * tokens
    assert tiled.per_token["recompute"] < untiled.per_token["recompute"] / 2
    # 32k tokens: a tile's backward (its intermediates for 16k tokens) is the larger moment
    short = plan(RunShape(dataclasses.replace(config, token_chunk_size=tile), 32768, 1))
    fixed = tile * tile_bytes_per_token(config, 2)
    assert short.gpu["recompute"] == weight_grads + fixed + short.per_token["recompute"] * 32768
    assert short.per_token["recompute"] < tiled.per_token["recompute"]
    short = plan(RunShape(dataclasses.replace(config, token_chunk_size=tile), 8192, 1))
    assert short.tile is None and short.gpu["recompute"] == plan(RunShape(config, 8192, 1)).gpu["recompute"]


def test_the_8b_models_fit_half_a_million_tokens_in_80_gib():
    """The defaults (tiles and input offload sized automatically) fit 512k tokens of llama-3.1-8b and
    qwen2.5-7b on an 80 GiB GPU, by formula; tests/test_measure.py checks the formula on fake tensors."""
    for name in ("llama-3.1-8b", "qwen2.5-7b"):
        p = plan(RunShape(LlamaConfig.from_preset(name), 524288, 1), gpu_mem=parse_size("80GiB"))
        assert p.fits and p.offload_inputs and p.tile is not None, name
        assert p.gpu_peak <= parse_size("70GiB") and p.max_seq_len > 524288, name
        assert "largest sequence that fits" in p.table()


def test_a_million_tokens_of_llama_8b_plan_within_80_gib_with_the_tiled_core():
    """At 1M tokens "auto" tiles the attention core too: one block's recompute is the tiled core's backward,
    per token 2 x (4A + 4K + 3H) + 8 heads = 65792 bytes (q, the output, its gradient, dq; k, v, dk, dv; the
    block's output, incoming and input gradients; log-sum-exp and D), plus its block pair; the fused kernel's
    dq accumulator and expanded dk, dv (32 KiB/token) are gone. tests/test_measure.py checks it on fake tensors."""
    config = LlamaConfig.from_preset("llama-3.1-8b")
    p = plan(RunShape(config, 1048576, 1), gpu_mem=parse_size("80GiB"))
    assert p.tiled_core and p.tile == 16384 and p.offload_inputs
    assert p.per_token["recompute"] == 2 * (4 * 4096 + 4 * 1024 + 3 * 4096) + 8 * 32 == 65792
    assert p.fits and p.gpu_peak <= parse_size("80GiB") and p.max_seq_len >= 1048576
    assert "attention core tiled too" in p.table()
    fused = plan(RunShape(dataclasses.replace(config, tiled_attention=False), 1048576, 1), gpu_mem=parse_size("80GiB"))
    assert not fused.tiled_core and not fused.fits
    assert fused.per_token["recompute"] - p.per_token["recompute"] == 4 * 4096 + 2 * 4096 * 2 - 4 * 32  # less D
    assert not plan(RunShape(config, 524288, 1), gpu_mem=parse_size("80GiB")).tiled_core  # the fused kernel fits there


# ---------------------------------------------------------------------------- host layouts and the NVMe tier

GIB = 2**30


@pytest.mark.parametrize(("precision", "elt"), [("bf16-mixed", 2), ("32-true", 4)])
def test_lean_layout_is_twelve_bytes_per_param_plus_rings(precision, elt):
    """lean: master 4 + Adam 8 per parameter, plus rings of pieces (engine/host/ring.py): 4 staging pieces (bf16;
    in fp32 the pinned master is the upload source) and a block's pieces + 1 for gradients; clipping keeps
    each gradient in a slab until the step (elt bytes/param); accumulating uses the fp32 accumulator instead."""
    config = LlamaConfig.from_preset("llama-3.1-8b")
    assert largest_unit(config) == config.vocab_size * config.hidden_size  # the 128k-token embedding beats a block
    # A piece is 1/32 of the 525M embedding rounded up to a multiple of 2^20: 16 x 2^20 elements; a block
    # (218.1M, just over 13 pieces) takes 14 of them, so 15 gradient pieces.
    piece = 16 * 2**20
    assert 15 * 2**20 < largest_unit(config) / 32 <= piece and 13 * piece < block_numel(config) <= 14 * piece
    n, grad_ring = config.num_parameters(), 15 * piece * elt
    staging = 4 * piece * elt if elt == 2 else 0
    rings = staging + grad_ring

    def lean(accumulate=1, clipping=False):
        options = EngineConfig(precision=precision, host_layout="lean", clipping=clipping)
        return plan(RunShape(config, 4096, 1, accumulate=accumulate), options)

    assert lean().host_total == 12 * n + rings
    assert lean().host["staging"] == staging and lean().host["grad_ring"] == grad_ring
    assert lean(clipping=True).host_total == (12 + elt) * n + rings
    assert lean(accumulate=4).host_total == lean(accumulate=4, clipping=True).host_total == 16 * n + rings
    assert lean().host["master"] == 4 * n and lean().host["adam"] == 8 * n and "copy" not in lean().host


def test_default_layout_ignores_clipping():
    """The default layout keeps a slab per unit anyway: clipping costs it nothing."""
    config = LlamaConfig.from_preset("llama-3.2-1b")
    assert (
        plan(RunShape(config, 1024, 1), EngineConfig(clipping=True)).host
        == plan(RunShape(config, 1024, 1)).host
        == host_breakdown(config, "bf16-mixed", 1)
    )


def test_nvme_moves_adam_to_the_drive_keeping_four_pieces_in_flight():
    config = LlamaConfig.from_preset("llama-120b")
    n, unit = config.num_parameters(), largest_unit(config)
    # The largest unit is a block (1.91B > the 1.58B embedding); a piece is 1/32 of it rounded up to a
    # multiple of 2^20 elements: 58 x 2^20. A block takes 32 pieces: 33 in the gradient ring, 4 staging.
    piece = 58 * 2**20
    assert unit == block_numel(config) and 57 * 2**20 < unit / 32 <= piece and 31 * piece < unit <= 32 * piece
    p = plan(RunShape(config, 4096, 1), EngineConfig(nvme_dir="/mnt/nvme", host_layout="lean"), nvme_gbps=4.0)
    assert p.nvme and "adam" not in p.host and p.host["nvme_buffers"] == 4 * piece * 8
    assert p.host_total == 4 * n + 4 * piece * 2 + 33 * piece * 2 + 4 * piece * 8
    assert p.nvme_bytes == 8 * n and p.nvme_traffic == 16 * n
    assert p.nvme_seconds == pytest.approx(16 * n / 4e9)
    table = p.table()
    assert "NVMe (/mnt/nvme)" in table and "Adam m + v files (fp32)" in table
    assert f"{16 * n / 1e9:.1f} GB, {16 * n / 4e9:.1f} s at 4.0 GB/s read and 4.0 GB/s write" in table
    assert p.host_plan_line().endswith(f"host_gib={p.host_total / GIB:.1f} nvme_gib={8 * n / GIB:.1f} fits=yes")


def test_llama_120b_fits_1536_gib_by_choosing_the_lean_layout():
    """16 bytes/param would be 1757 GiB; auto takes lean (12 + rings), which fits."""
    config = LlamaConfig.from_preset("llama-120b")
    p = plan(RunShape(config, 4096, 1), host_mem=parse_size("1536GiB"), host_layout="auto")
    assert p.fits and p.host_layout == "lean" and not p.nvme and p.nvme_bytes == 0
    assert plan(RunShape(config, 4096, 1), host_mem=parse_size("1536GiB")).host_total > parse_size("1536GiB")  # default
    assert "chosen by auto" in p.table() and "host_layout='default' needs 1757.0 GiB" in p.table()
    roomy = plan(
        RunShape(config, 4096, 1), EngineConfig(nvme_dir="/mnt/nvme"), host_mem=parse_size("2TiB"), host_layout="auto"
    )
    assert roomy.host_layout == "default" and not roomy.nvme and "not used" in roomy.table()  # the fastest that fits


def test_llama_120b_fits_512_gib_only_with_adam_on_nvme():
    config, limit = LlamaConfig.from_preset("llama-120b"), parse_size("512GiB")
    assert config.num_parameters() > 100e9
    p = plan(RunShape(config, 4096, 1), EngineConfig(nvme_dir="/mnt/nvme"), host_mem=limit, host_layout="auto")
    assert p.fits and (p.host_layout, p.nvme) == ("lean", True) and p.host_total <= limit and p.nvme_bytes > 0
    without = plan(RunShape(config, 4096, 1), host_mem=limit, host_layout="auto")
    assert not without.fits and (without.host_layout, without.nvme) == ("lean", False)
    [problem] = without.problems()
    nvme_host = 4 * config.num_parameters() + (4 * 2 + 33 * 2 + 4 * 8) * 58 * 2**20  # master + rings + NVMe buffers
    assert "--nvme-dir DIR" in problem and f"fits: {nvme_host / GIB:.1f} GiB of host memory" in problem
    assert "1757.0 GiB with host_layout='default'" in problem and "host_layout='lean' (12.04 bytes/param)" in problem


def test_an_explicit_layout_that_does_not_fit_names_the_options_that_would():
    config, limit = LlamaConfig.from_preset("llama-120b"), parse_size("1536GiB")
    [problem] = plan(RunShape(config, 4096, 1), EngineConfig(host_layout="default"), host_mem=limit).problems()
    assert "--host-layout lean (MegatrainStrategy(host_layout='lean')" in problem and "fits: 1321.9 GiB" in problem
    [problem] = plan(
        RunShape(config, 4096, 1),
        EngineConfig(nvme_dir="d", clipping=True, host_layout="lean"),
        host_mem=parse_size("256GiB"),
    ).problems()
    assert "more host memory" in problem and "without gradient clipping lean drops the 2 bytes/param" in problem


def test_plan_refuses_bad_host_options():
    tiny = LlamaConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="host_layout='small': choose one of default, lean, auto"):
        plan(RunShape(tiny, 128, 1), host_layout="small")
    with pytest.raises(ValueError, match="nvme_gbps=0 must be a positive number"):
        plan(RunShape(tiny, 128, 1), nvme_gbps=0)


@pytest.mark.parametrize(("name", "count"), [("llama-120b", 117_909_663_744), ("llama-3.1-405b", 405_853_388_800)])
def test_large_presets(name, count):
    """llama-3.1-405b is the published shape (405B); llama-120b a Llama-3-shaped ~118B for planning."""
    config = LlamaConfig.from_preset(name)
    with torch.device("meta"):
        built = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert config.num_parameters() == built == count
    assert config.intermediate_size % 256 == 0 and config.num_key_value_heads == 8 and config.vocab_size == 128256


# -- data parallel (devices x nodes ranks: host memory per node, GPU memory per GPU) ---------------------

DP_SHAPES = [(1, 1), (4, 1), (8, 2), (3, 5)]


@pytest.mark.parametrize(("devices", "nodes"), DP_SHAPES)
def test_a_node_holds_its_share_of_one_state_copy_and_each_ranks_own_buffers(devices, nodes):
    """Default layout, bf16, accumulating, inputs offloaded: per parameter fp32 master 4 + Adam 8 + bf16 copy 2
    + bf16 slab 2 + fp32 accumulator 4 = 20 bytes, one copy over all ranks (1/nodes of it per node, each kind
    rounded up); each rank keeps its own micro-batch's block inputs (layers x tokens x hidden x 2 bytes)."""
    config, seq = small_config(), 32
    got = plan(
        RunShape(config, seq, 1, accumulate=2, devices=devices, nodes=nodes),
        EngineConfig(precision="bf16-mixed", offload_inputs=True),
    )
    n = config.num_parameters()
    state = sum(-(-per_param * n // nodes) for per_param in (4, 8, 2, 2, 4))
    inputs = config.num_hidden_layers * seq * config.hidden_size * 2
    assert got.host_total == state + devices * inputs
    assert got.host["activations"] == devices * inputs


@pytest.mark.parametrize(("devices", "nodes"), DP_SHAPES)
def test_lean_rings_are_each_ranks_own(devices, nodes):
    """Lean layout, bf16, clipping: master 4 + Adam 8 + gradient slab 2 per parameter, sharded; the staging ring
    (4 pieces) and the gradient ring (a block's pieces + 1) per rank, a piece being the largest unit here
    (under 2^22 elements)."""
    config = small_config()
    got = plan(
        RunShape(config, 32, 1, devices=devices, nodes=nodes),
        EngineConfig(precision="bf16-mixed", clipping=True, host_layout="lean"),
    )
    n, piece = config.num_parameters(), max(block_numel(config), config.vocab_size * config.hidden_size)
    rings = 4 * piece * 2 + (-(-block_numel(config) // piece) + 1) * piece * 2
    assert got.host_total == sum(-(-b * n // nodes) for b in (4, 8, 2)) + devices * rings


def test_one_gpu_one_node_is_todays_plan():
    """devices=1, nodes=1: 16 bytes/param (bf16, default layout), the table and summary line of a plan that
    never heard of data parallelism, and no collective allowance on the GPU."""
    config = small_config()
    today = plan(RunShape(config, 32, 1), EngineConfig(precision="bf16-mixed"), gpu_mem=80 * 2**30)
    assert today.host_total == 16 * config.num_parameters()
    assert "collectives" not in today.gpu and "per node" not in today.table()
    assert today.host_plan_line().endswith("fits=yes")


def test_gpu_memory_per_gpu_is_the_single_gpu_figure_plus_the_collective_allowance():
    config = dataclasses.replace(small_config(), vocab_size=4096)  # the embedding (262144) outweighs a block
    one = plan(RunShape(config, 32, 1), EngineConfig(precision="bf16-mixed", num_slots=2))
    many = plan(RunShape(config, 32, 1, devices=8, nodes=2), EngineConfig(precision="bf16-mixed", num_slots=2))
    # The allowance, and the gradient exchange of the largest unit (here the embedding): its 16 chunks in
    # bf16, then one chunk's fp32 sum and bf16 result (engine/ranks.py's reduce_scatter).
    chunk = -(-config.vocab_size * config.hidden_size // 16)
    collectives = 2**29 + chunk * 16 * 2 + chunk * (4 + 2)
    assert many.gpu == {**one.gpu, "collectives": collectives}
    assert many.gpu_peak == one.gpu_peak + collectives


def test_megatrain_plan_devices_and_nodes(capsys):
    from megatrain_lightning.cli.main import run

    result = run(["plan", "--model", "tiny", "--devices", "4", "--nodes", "2", "--no-measure"])
    out = capsys.readouterr().out.splitlines()
    assert "data parallel over 4 GPUs x 2 nodes (W=8" in out[0]
    assert out[2].startswith("host memory per node") and any(line.startswith("  per node: 1/2") for line in out)
    assert out[-1] == result.host_plan_line() and out[-1].endswith(" devices=4 nodes=2")
    assert (result.devices, result.nodes, result.ranks) == (4, 2, 8)


# -- recompute: blocks that keep their graph ------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "tile", "core"),
    [(torch.bfloat16, None, False), (torch.float32, None, False), (torch.bfloat16, 16, False)]
    + [(torch.bfloat16, 16, True), (torch.float32, 16, True)],  # the tiled core: q, k, v, out, lse; no repeats
)
def test_kept_graph_bytes_are_what_a_block_saves_for_backward(dtype, tile, core):
    """The planner's per-token bytes of a kept graph equal what autograd saves in one block's forward with
    grad (saved-tensor hooks on a real block, each storage once, the weights excluded), as the engine
    measures it; grouped-query heads, so bf16 shares kv heads and fp32 repeats them."""
    from megatrain_lightning.models.llama import DecoderLayer, RotaryEmbedding
    from megatrain_lightning.planning.planner import kept_bytes_per_token

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    layer, tokens = DecoderLayer(config).to(dtype), 64
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = RotaryEmbedding(config)(torch.arange(tokens)[None], dtype)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in weights:
            saved[key] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, tile=tile, tiled_core=core)
    elt = 2 if dtype == torch.bfloat16 else 4
    assert kept_bytes_per_token(config, elt, tile, core) * tokens == sum(saved.values()) > 0


def test_auto_keeps_the_last_blocks_whose_activations_fit_half_the_free_memory():
    """llama-3.1-8b, bf16, untiled: a kept block holds per token 2 x (4H + 2A + 2K + 4I + 2 head_dim) + 8H
    + 4 heads + 8 = 201352 bytes (worked out here from the shapes). The count is the engine's rule on the
    plan's figures: the largest k with k blocks' activations within half of what the persistent items, the
    context, RoPE and the first block's input leave of the GPU memory, and 2 slots unpinned."""
    config = LlamaConfig.from_preset("llama-3.1-8b", token_chunk_size=None)
    per_token = 2 * (4 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 14336 + 2 * 128) + 8 * 4096 + 4 * 32 + 8
    assert per_token == 201352
    for gpu_mem, tokens, slots in [("80GiB", 4096, "auto"), ("80GiB", 32768, "auto"), ("40GiB", 4096, 8)]:
        p = plan(RunShape(config, tokens, 1), EngineConfig(num_slots=slots), gpu_mem=parse_size(gpu_mem))
        live = sum(p.gpu[k] for k in ("weight_slots", "grad_slots", "outer", "rope", "cuda_context"))
        free = parse_size(gpu_mem) - live - tokens * 4096 * 2
        expected = min(32, p.num_slots - 2, int(0.5 * free) // (per_token * tokens))
        assert p.kept_blocks == expected and p.gpu["kept_graphs"] == expected * per_token * tokens
        assert f"recompute='auto': {expected} of 32 blocks keep their graph" in p.table()
    assert plan(RunShape(config, 4096, 1), gpu_mem=parse_size("80GiB")).kept_blocks == 30  # 32 slots, 2 streaming
    never = plan(RunShape(config, 4096, 1), EngineConfig(recompute=True), gpu_mem=parse_size("80GiB"))
    always = plan(RunShape(config, 4096, 1), EngineConfig(num_slots=2, recompute=False))
    assert (never.kept_blocks, never.gpu["kept_graphs"], always.kept_blocks, always.num_slots) == (0, 0, 32, 32)
    assert plan(RunShape(config, 4096, 1)).kept_blocks == 0  # no GPU memory figure: auto keeps nothing


def test_megatrain_plan_recompute(capsys):
    from megatrain_lightning.cli.main import run

    args = ["plan", "--model", "llama-3.1-8b", "--gpu-mem", "80GiB", "--no-measure"]
    assert run([*args, "--recompute", "true"]).recompute is True
    assert "recompute=True: 0 of 32 blocks keep their graph" in capsys.readouterr().out
    assert run([*args, "--recompute", "FALSE"]).kept_blocks == 32
    assert run(args).recompute == "auto" and "recompute='auto': 30 of 32" in capsys.readouterr().out


def test_row_chunks_let_a_micro_batch_too_big_for_the_gpu_fit_and_the_plan_says_how_many_rows():
    """A micro-batch of 160 rows does not fit 80 GiB whole; the plan names the most rows a block call may take
    (``--row-chunk``), and planning with that many fits while one more does not."""
    config, gpu = LlamaConfig.from_preset("llama-3.1-8b"), parse_size("80GiB")
    shape = RunShape(config, 8192, 160)
    whole = plan(shape, EngineConfig(offload_inputs=True), gpu_mem=gpu)
    rows = whole.max_row_chunk
    assert not whole.fits and 1 <= rows < 160
    assert f"--row-chunk {rows} --offload-inputs" in whole.problems()[0]
    fits = plan(shape, EngineConfig(offload_inputs=True, row_chunk=rows), gpu_mem=gpu)
    assert fits.fits and fits.kept_blocks == 0 and fits.row_chunk == rows
    assert not plan(shape, EngineConfig(offload_inputs=True, row_chunk=rows + 1), gpu_mem=gpu).fits


def test_row_chunk_auto_plans_whole_calls_where_they_fit_and_else_the_most_rows_that_do():
    """``row_chunk="auto"``: 160 rows of 8192 tokens do not fit 80 GiB whole, so the plan takes the most rows a
    call may (one more would not fit); 64 rows fit whole, so their calls stay whole. The title says which."""
    config, gpu = LlamaConfig.from_preset("llama-3.1-8b"), parse_size("80GiB")
    big = plan(RunShape(config, 8192, 160), EngineConfig(row_chunk="auto"), gpu_mem=gpu)
    rows = big.row_chunk
    assert big.fits and rows is not None and 1 <= rows < 160
    assert not plan(
        RunShape(config, 8192, 160), EngineConfig(offload_inputs=True, row_chunk=rows + 1), gpu_mem=gpu
    ).fits
    assert f"block calls in chunks of {rows} rows (row_chunk auto)" in big.table()
    small = plan(RunShape(config, 8192, 64), EngineConfig(row_chunk="auto"), gpu_mem=gpu)
    assert small.fits and small.row_chunk is None and "block calls whole (row_chunk auto)" in small.table()
    assert plan(RunShape(config, 8192, 160), EngineConfig(row_chunk="auto")).row_chunk is None  # no GPU limit


def test_the_planned_gpu_peak_of_row_chunks_covers_the_measured_one():
    """On fake tensors: calls of 2 rows take less GPU memory than whole calls of 16, and the plan's figure is
    at least what the step measures."""
    config = LlamaConfig.from_preset("tiny", token_chunk_size=None)
    shape = RunShape(config, 256, 16)
    peaks = {}
    for rows in (None, 2):
        p = plan(shape, EngineConfig(offload_inputs=True, row_chunk=rows, recompute=True), measure=True)
        peaks[rows] = p.measured.peak
        assert p.gpu_peak >= p.measured_peak, rows
    assert peaks[2] < peaks[None]
