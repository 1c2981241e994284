"""The streaming pipeline on a real GPU: equality, repeatability, flat device memory. Marked `cuda`."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from tests.helpers import CausalLM, fit, hf_llama, hf_loss, params_of, token_batches, twin, update_error
from tests.test_speculative_step import host_keeps_up

pytestmark = pytest.mark.cuda


def gpu_fit(module, batches, strategy, precision):
    return fit(module, batches, strategy=strategy, accelerator="gpu", precision=precision)


def test_fp32_on_cuda_matches_ordinary_training():
    """GPU kernels are the same in both runs; only the optimizer moves to the host (rounding-level)."""
    a, b = twin(hf_llama)
    ref, mt = CausalLM(a), CausalLM(b)
    batches = token_batches(20)
    gpu_fit(ref, batches, "auto", "32-true")
    gpu_fit(mt, batches, "megatrain", "32-true")
    assert max(abs(x - y) / abs(y) for x, y in zip(mt.losses, ref.losses)) < 1e-5


def test_bf16_on_cuda_tracks_fp32_as_well_as_amp():
    """Same bound and reasoning as tests/test_strategy.py::test_bf16_tracks_fp32_as_well_as_lightning_amp."""
    fp32, mt = twin(hf_llama)
    amp, start = copy.deepcopy(fp32), params_of(fp32)
    runs = {"fp32": CausalLM(fp32), "amp": CausalLM(amp), "mt": CausalLM(mt)}
    batches = token_batches(20)
    gpu_fit(runs["fp32"], batches, "auto", "32-true")
    gpu_fit(runs["amp"], batches, "auto", "bf16-mixed")
    gpu_fit(runs["mt"], batches, "megatrain", "bf16-mixed")
    assert max(abs(x - y) / abs(y) for x, y in zip(runs["mt"].losses, runs["fp32"].losses)) < 2e-2
    p = {k: params_of(r.model) for k, r in runs.items()}
    assert update_error(p["mt"], p["fp32"], start) <= 1.25 * update_error(p["amp"], p["fp32"], start)


def test_repeated_runs_are_bitwise_identical():
    """Three streams and a host worker: any missing wait would show up as run-to-run differences."""
    results = []
    for _ in range(2):
        module = CausalLM(hf_llama(layers=6))
        gpu_fit(module, token_batches(12), "megatrain", "bf16-mixed")
        results.append((module.losses, params_of(module.model)))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


def big_llama(layers: int) -> LlamaForCausalLM:
    cfg = LlamaConfig.from_preset("tiny")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads = 1024, 2816, 16
    cfg.num_key_value_heads, cfg.num_hidden_layers, cfg.vocab_size = 4, layers, 1024
    return LlamaForCausalLM(cfg)


def test_peak_gpu_memory_is_flat_across_depth():
    """Going from 4 to 16 blocks adds no device memory beyond the 12 extra saved block inputs."""
    batch, seq, hidden = 2, 256, 1024
    peaks = []
    for layers in (4, 16):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = big_llama(layers)
        engine = Engine(model, EngineConfig(device="cuda", precision="bf16-true"))
        assert engine.units[0].copy.is_pinned()
        tokens = torch.randint(0, 1024, (batch, seq), device="cuda")
        for _ in range(2):
            model(tokens, targets=tokens).backward()
            engine.zero_grad()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        engine.close()
        del model, engine
    saved_inputs = 12 * batch * seq * hidden * 2
    assert peaks[1] - peaks[0] <= saved_inputs + 2**20, (peaks, saved_inputs)


def three_steps(engine: Engine, model: LlamaForCausalLM) -> torch.Tensor:
    """Three AdamW steps of the engine on one fixed batch (returned), every host step done at the end."""
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(1)).cuda()
    for _ in range(3):
        with engine.backward():
            model(tokens, targets=tokens).backward()
        opt.step()
        opt.zero_grad()
    engine.flush()
    return tokens


def test_auto_slots_grow_on_the_device_and_change_no_result():
    """num_slots="auto" adds slots after the first step from the memory the device reports: a slot per block
    for this small model. The training is bit for bit that of 2 fixed slots (the same kernels in the same
    order; only what is resident changes), and steps after the first upload each block once. Both recompute
    every block: with ``recompute="auto"`` the extra slots would let blocks keep their graph, computed with
    grad on, where the GPU may pick another attention kernel (test_recompute_auto_is_true_within_rounding)."""
    runs = {}
    for num_slots in ("auto", 2):
        torch.manual_seed(0)
        model = big_llama(6)
        config = EngineConfig(device="cuda", precision="bf16-true", num_slots=num_slots, recompute=True)
        engine = Engine(model, config)
        tokens = three_steps(engine, model)
        with torch.no_grad():
            model(tokens)
        runs[num_slots] = (engine.pool.num_slots, engine.pool.uploads, params_of(model))
        engine.close()
    assert runs["auto"][0] == 6 and runs[2][0] == 2
    assert runs["auto"][1] == (6 + 4) + 2 * 6 + 6  # after the first step (2 slots): one upload per block and step
    assert all(torch.equal(runs["auto"][2][k], runs[2][2][k]) for k in runs[2][2])


@pytest.mark.parametrize("stored", ["bf16", "fp8"])
def test_stored_offloaded_inputs_on_cuda(stored):
    """offload_inputs_dtype through the real copy streams (encoded before the D2H copy, decoded after the H2D
    copy, on the compute stream): the first loss is exact and the others stay within the CPU test's fp8 bound
    of the lossless offload (tests/test_saved_inputs.py::test_stored_inputs_train_close_to_ordinary_training)."""
    a, b = twin(lambda: hf_llama(layers=3))
    exact, small = CausalLM(a, lr=1e-3), CausalLM(b, lr=1e-3)
    batches = token_batches(2) * 4
    gpu_fit(exact, batches, MegatrainStrategy(offload_inputs=True), "32-true")
    gpu_fit(small, batches, MegatrainStrategy(offload_inputs=True, offload_inputs_dtype=stored), "32-true")
    assert small.losses[0] == exact.losses[0] and len(small.losses) == 8
    assert 0 < max(abs(x - y) for x, y in zip(small.losses, exact.losses)) <= 1e-3


def test_recompute_auto_is_true_within_rounding():
    """``recompute="auto"`` against ``True``: a kept block runs its forward once, with grad on; a recomputed one
    runs it with grad off and again with grad on. On a GPU the attention backend can differ between the two
    modes, so the outputs a later block sees may differ in the last bits (on the CPU, and wherever the same
    kernel runs, they are equal: tests/test_recompute.py). The bound separates rounding from a different
    computation: in fp32, rounding differences of the attention kernels (~1e-6 relative) move the total
    update of three Adam steps by far less than 1e-3 of itself; a wrong gradient moves it by O(1)."""
    runs = {}
    for recompute in ("auto", True):
        torch.manual_seed(0)
        model = big_llama(6)
        start = params_of(model)
        config = EngineConfig(device="cuda", precision="32-true", num_slots="auto", recompute=recompute)
        engine = Engine(model, config)
        three_steps(engine, model)
        runs[recompute] = (engine.stats["kept_calls"], params_of(model))
        engine.close()
    assert runs["auto"][0] > 0 and runs[True][0] == 0  # blocks did keep their graphs: not vacuous
    assert update_error(runs["auto"][1], runs[True][1], start) < 1e-3


def test_a_prefetched_input_never_fetched_is_not_overwritten_by_its_late_copy():
    """A saved input prefetched to the device (H2D stream) but never fetched (a partial autograd.grad, an
    exception) is freed in the compute stream's order: without record_stream its memory could go to a new
    tensor while the copy still writes it (engine/device/saved_inputs.py). The CPU cannot show this (no caching
    allocator, no second stream)."""
    from megatrain_lightning.engine.device.saved_inputs import SavedInputs
    from megatrain_lightning.engine.device.streams import Streams

    streams = Streams(torch.device("cuda", torch.cuda.current_device()))
    saved_inputs = SavedInputs(streams, streams.device, True, {"input_offload_bytes": 0}, mode=True)
    hidden = torch.randn(4096, 1024, device="cuda")
    owner = type("Call", (), {})()
    saved = saved_inputs.store(hidden, owner)
    torch.cuda._sleep(50_000_000)  # the compute stream runs late: the H2D copy overlaps it
    saved_inputs.prefetch(saved)
    saved.device = None  # dropped unfetched
    fresh = torch.zeros(4096 * 1024, device="cuda")  # may reuse the freed memory
    torch.cuda.synchronize()
    assert torch.count_nonzero(fresh) == 0


def test_a_failed_pinning_leaves_no_error_for_the_next_kernel():
    """cudaHostRegister on a range already registered fails; its error must not surface at the next kernel
    launch (engine/host/pinned.py clears it), so a run retried without pinning works."""
    from megatrain_lightning.engine.host import pinned

    t = pinned.pinned_empty(1 << 20, torch.float32)
    try:
        code = pinned._host_register(t.data_ptr(), t.numel() * 4, pinned.CUDA_HOST_REGISTER_PORTABLE)
        assert code != 0  # cudaErrorHostMemoryAlreadyRegistered
        pinned._clear_last_error()
        x = torch.ones(8, device="cuda") * 2  # a kernel launch, checked by torch
        torch.cuda.synchronize()
        assert float(x.sum()) == 16.0
    finally:
        pinned.unregister([t])


def test_odd_sized_parameters_are_aligned_in_their_slot_on_the_gpu():
    """The slot layout's 16-byte alignment on the device itself (tests/test_engine.py checks it on the CPU)."""
    from tests.test_engine import _odd_loss, _OddLM

    model = _OddLM()
    engine = Engine(model, EngineConfig(device="cuda", precision="bf16-true"))
    starts = []
    for block in model.layers:
        block.down.register_forward_pre_hook(lambda *_, b=block: starts.extend(p.data_ptr() for p in b.parameters()))
    ids = torch.randint(0, 11, (2, 6), device="cuda")
    _odd_loss(model, ids).backward()
    engine.close()
    assert starts and all(p % 16 == 0 for p in starts)


def cuda_loop(
    model, config: EngineConfig, micro: int = 3, steps: int = 2, after_step=None, max_norm: float = 1.0
) -> tuple[list[float], list[float]]:
    """A plain accumulation loop on the GPU with the engine: `micro` micro-batches per step, clipped by norm
    at `max_norm`; `after_step(engine)` runs after each optimizer step. Returns the losses and each step's total
    norm."""
    engine = Engine(model, config)
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, norms = [], []
    batches = [b.cuda() for b in token_batches(micro * steps)]
    for step in range(steps):
        for i in range(micro):
            with engine.autocast():
                loss = hf_loss(model, batches[step * micro + i])
            with engine.backward(accumulate=i < micro - 1, clip="norm"):
                (loss / micro).backward()
            losses.append(loss.item())
        norms.append(float(engine.grad_norm()))
        engine.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(engine)
    engine.flush()
    engine.close()
    return losses, norms


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_device_grad_sums_on_cuda_are_the_host_paths_to_the_bit(precision):
    """The gradient sums kept on the GPU across micro-batches add the same fp32 values in the same order as the
    host's accumulators (tests/test_grad_sums.py on the CPU): losses, norms and weights equal to the bit."""
    runs = {}
    for sums in (0, "auto"):
        model = hf_llama(layers=4)
        runs[sums] = (*cuda_loop(model, EngineConfig(device="cuda", precision=precision, device_grad_sums=sums)),)
        runs[sums] += (params_of(model),)
    (losses, norms, params), (s_losses, s_norms, s_params) = runs[0], runs["auto"]
    assert s_losses == losses and s_norms == norms
    assert all(torch.equal(s_params[k], params[k]) for k in params)


def test_auto_sums_have_their_buffers_and_pinned_accumulators_before_the_second_step():
    """Pinning the fp32 accumulators a sum comes down into took seconds inside the first step with sums (the
    first H200 run); they are made between the first and second steps, with the device sums."""
    seen = []

    def after_step(engine) -> None:
        sums = engine.host.sums
        granted = sums.granted()
        seen.append((len(granted), all(u.acc is not None and u.acc.is_pinned() for u in granted), sums.nbytes()))

    cuda_loop(hf_llama(layers=4), EngineConfig(device="cuda", device_grad_sums="auto"), after_step=after_step)
    (count, pinned, nbytes), second = seen
    assert count > 4 and pinned and nbytes > 0 and second == seen[0]


def test_the_clipping_norm_on_cuda_is_ordinary_gpu_trainings_within_rounding():
    """Accumulated micro-batches have their norms taken on the host, in fp64 on a GPU run: the total norm is the
    one ordinary GPU training's clip_grad_norm_ gives, within fp32 rounding (torch's fp32 norm on the CPU
    would be 2e-5 off for the 2M-element embedding; tests/test_host_steps.py)."""
    build = lambda: hf_llama(layers=2, vocab_size=32768, hidden_size=64)  # noqa: E731
    ref = build().cuda()
    batches = [b.cuda() for b in token_batches(2)]
    for batch in batches:
        (hf_loss(ref, batch) / 2).backward()
    ordinary = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    config = EngineConfig(device="cuda", precision="32-true", blocks="model.layers")
    _, norms = cuda_loop(build(), config, micro=2, steps=1)
    assert abs(norms[0] / ordinary - 1) < 1e-6


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offloaded"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_kept_attention_on_cuda_is_the_recompute_to_the_bit(precision, offload):
    """keep_attention (engine/device/kept_attention.py) with the GPU's fused kernels (memory-efficient in fp32, flash in
    bf16): attention's backward gets the outputs the forward's kernel computed, which the recompute's kernel would
    compute again identically, so losses, norms and weights equal the run without it to the bit (the recompute's
    query/key/value check passes within its tolerance), and every recompute's attention was handed back."""
    runs, kept = {}, {}

    def count(engine):
        kept[keep] = engine.stats["kept_attention"]

    for keep in (False, True):
        model = hf_llama(layers=4)
        config = EngineConfig(device="cuda", precision=precision, offload_inputs=offload, keep_attention=keep)
        runs[keep] = (*cuda_loop(model, config, after_step=count), params_of(model))
    (losses, norms, params), (k_losses, k_norms, k_params) = runs[False], runs[True]
    assert kept == {False: 0, True: 2 * 3 * 4}  # 2 steps x 3 micro-batches x 4 blocks
    assert k_losses == losses and k_norms == norms
    assert all(torch.equal(k_params[k], params[k]) for k in params)


def test_row_chunks_on_cuda_train_as_whole_calls_within_rounding():
    """Layer-major calls of 2 rows on the GPU (engine/device/rows.py): the first loss as whole calls give it (each row
    computed alike; the behavioural row-independence check compares two GPU runs of the same shapes bit for bit,
    so it must not refuse a Llama block), and the weights' gradients within fp32 round-off of whole calls."""
    runs = {}
    for rows in (None, 2):
        model = hf_llama(layers=3)
        engine = Engine(
            model, EngineConfig(device="cuda", precision="32-true", row_chunk=rows, overlap_optimizer=False)
        )
        engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        batch = token_batches(1, batch=8)[0].cuda()
        with engine.backward():
            loss = hf_loss(model, batch)
            loss.backward()
        with engine.gradients_visible():
            runs[rows] = (loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
        engine.close()
    (whole, g_whole), (chunked, g_chunked) = runs[None], runs[2]
    assert abs(chunked - whole) <= 1e-6 * abs(whole)
    assert max(float((g_chunked[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in g_whole.items()) < 1e-5


@pytest.mark.parametrize("max_norm", [1e6, 1e-3], ids=["kept", "discarded"])
def test_speculative_steps_with_uploads_ahead_on_cuda_are_the_run_without_them(monkeypatch, max_norm):
    """speculative_step with a slot for every block on the GPU: each block's speculative weights go up during the
    backward into its slot (the host made to keep up, as in tests/test_speculative_step.py) and the next forward
    uses them when the step keeps them. Losses, norms and weights equal to the bit to the run without the
    option, whether the speculations were kept (not clipped) or discarded (clipped)."""
    host_keeps_up(monkeypatch)
    runs, ahead = {}, []
    for speculative in (False, True):
        model = hf_llama(layers=4)
        config = EngineConfig(device="cuda", precision="bf16-mixed", speculative_step=speculative, num_slots=4)
        count = (lambda engine: ahead.append(engine.stats["uploads_ahead"])) if speculative else None
        runs[speculative] = (*cuda_loop(model, config, micro=1, steps=3, after_step=count, max_norm=max_norm),)
        runs[speculative] += (params_of(model),)
    (losses, norms, params), (s_losses, s_norms, s_params) = runs[False], runs[True]
    assert s_losses == losses and s_norms == norms
    assert all(torch.equal(s_params[k], params[k]) for k in params)
    assert ahead[-1] == (2 * 3 if max_norm > 1 else 0)  # blocks 1..3 of the first two steps' backwards


def test_needed_first_downloads_on_cuda_are_the_run_without_them(monkeypatch):
    """Device sums over 3 micro-batches, speculative steps, a slot for every block: with the link polled busy
    until the backward ends (so every sum beyond the first three waits and goes in the next forward's order, on
    the real D2H stream) the run equals, to the bit, the one whose sums go as they are made
    (engine/host/needed_first.py; tests/test_needed_first.py on the CPU)."""
    from megatrain_lightning.engine.device.streams import Streams
    from megatrain_lightning.engine.host.needed_first import NeededFirst

    host_keeps_up(monkeypatch)
    runs, held = {}, []
    for ordered in (True, False):
        with monkeypatch.context() as m:
            if ordered:
                m.setattr(Streams, "ended", lambda self, event: False)
            else:
                m.setattr(NeededFirst, "defer", lambda self, rank, unit, send: False)
            model = hf_llama(layers=4)
            config = EngineConfig(
                device="cuda", precision="bf16-mixed", speculative_step=True, num_slots=4, device_grad_sums=4
            )
            count = lambda engine: held.append(engine.stats["sums_held_for_the_link"])  # noqa: E731
            runs[ordered] = (*cuda_loop(model, config, micro=3, steps=3, after_step=count, max_norm=1e6),)
            runs[ordered] += (params_of(model),)
    (losses, norms, params), (o_losses, o_norms, o_params) = runs[False], runs[True]
    assert o_losses == losses and o_norms == norms
    assert all(torch.equal(o_params[k], params[k]) for k in params)
    assert held[2] > 0 and held[-1] == 0  # sums waited in the ordered run, none in the other
