"""A zoo of tiny models trained with strategy='megatrain' must equal ordinary Lightning training.

The oracle is the same as in tests/test_strategy.py: ordinary training (``strategy="auto"``, the model's
own forward, torch.optim.AdamW) of an identical copy of the model on identical batches from an identical
RNG state. Every zoo run uses gradient accumulation (2 micro-batches), norm clipping (0.5), two param
groups (matrices with weight decay, vectors without) and a LambdaLR warm-up/cosine schedule.

fp32 on the CPU with MEGATRAIN_CPU_ADAM=torch is *bitwise*: every micro-batch loss and every parameter
must be ``torch.equal`` to ordinary training. Every dropout a family has is switched on (and the router
jitter of Mixtral), so the recompute of each block must replay the forward's RNG draws exactly, and the
blocks must run in the train/eval mode the user gave the model.

With the native C++ AdamW (MEGATRAIN_CPU_ADAM=native) each step rounds 1-2 ulp differently from torch's
AdamW (tests/test_native_adamw.py bounds that at 1e-6 per step). The bounds here are: each micro-batch loss
within 1e-6 relative, and each parameter tensor's update within 1e-5 of the reference update,
``||p_native - p_ref|| / ||p_ref - p_0|| <= 1e-5``. That per-tensor bound is meaningless for elements whose
true gradient is exactly zero but whose computed gradient is round-off (a key bias: softmax ignores a
constant added to every score of a row). Adam normalizes that noise into +-lr steps whose signs any ulp
flips, so those elements are excluded, each named with its reason in ``ZOO`` (``key_bias``); the native
test first checks, on ordinary training's own gradients, that every excluded element's gradient is
round-off sized, so the list cannot hide a real gradient. RoPE-rotated key biases (Qwen2) have a real but
ill-conditioned gradient and get a looser, stated bound (``loose``; see the comment at ``ZOO``). Elements
whose gradient was, at some step of ordinary training, nonzero but tiny next to the rest of its tensor
are left out too (``TINY_GRAD``, with the measured OLMo2 case that shows why): the native kernel computes
what torch's fused AdamW computes bit for bit, and torch's single-tensor and fused AdamW drift apart there
as far (``test_native_backend_is_torch_fused_adamw``).
Parameters that ordinary training leaves unchanged (frozen ones) must stay exactly unchanged with either
backend.

The file also covers what a dropout model needs around fit: validate/predict after fit, validation in the
middle of an epoch, a model put in eval() before fit and back in train() by on_train_start (the
``from_pretrained`` situation), and an explicit ``use_cache=True`` in training_step.

The models, ``ZOO`` and its exclusions are in tests/helpers.py (tests/test_compile_blocks.py trains two of them);
more families, trained for 3 steps instead of 5, in tests/zoo_families.py (``FAMILIES``).
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.optim import kernels
from tests.helpers import (
    AUX_COEF,
    SEED,
    ZOO,
    CausalLM,
    FrozenPartsLM,
    Zoo,
    excluded_mask,
    hf_gpt2,
    hf_llama,
    hf_mixtral,
    hf_qwen2_moe,
    loader,
    params_of,
    quiet,
    token_batches,
    trainer,
)
from tests.zoo_families import FAMILIES, qwen3_moe

OPT_STEPS = 5
ACCUMULATE = 2
CLIP = 0.5

# The native bound leaves out the elements whose gradient in ordinary training was, at some step, nonzero
# but below TINY_GRAD times the largest of its tensor. Such a gradient is a near-cancellation, so its
# relative round-off is large: when the weights it is computed from differ in their last bit, as any two
# AdamW implementations leave them (torch's single-tensor and fused ones, or the native kernel, which
# computes what the fused one does bit for bit), it changes by up to percents. Adam does not damp that:
# it moves an element by lr * m / (sqrt(v) + eps), a ratio of its own gradients, so an element that only
# ever got a tiny gradient still moves most of an lr, and its move carries the gradient's relative
# error (times up to 1 near eps = 1e-8). Measured on OLMo2 (test_native_backend_is_torch_fused_adamw):
# embedding element (48, 24), at its one step with a gradient, got -7.1e-8 (5e-7 of the tensor's largest)
# with torch's single-tensor AdamW and -6.8e-8 with the fused one; it moved 5.6e-3 and the two moves
# differ by 1.4e-4, 2.5e-4 of the whole embedding's update. With these elements left out, every native
# case here is within 1e-5 per tensor. At most 5% of a tensor may be left out, and exact zeros never
# are (a gradient lost wholesale is zero, not tiny); measured: up to 2% of GPT-2's and GPT-NeoX's fused
# QKV weights, 3% of Mamba's A_log, one to six elements elsewhere.
TINY_GRAD = 1e-5

MODULE_KWARGS = dict(split_decay=True, schedule=OPT_STEPS)
TRAIN_KWARGS = dict(accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)


# The native kernel on a subset (each pair of fits costs ~1-2 s): one of each distinct kind of exclusion
# or structure (fused and strided key biases, separate key bias, MoE with aux loss, user module, frozen).
NATIVE = ("gpt2", "gpt-neox", "opt", "qwen2-moe-aux", "user-encoder", "llama-frozen")
CASES = [(name, "torch") for name in ZOO] + [(name, "native") for name in NATIVE]


# -- running -----------------------------------------------------------------------------------------


def seeded_fit(trainer: L.Trainer, module: L.LightningModule, train: list, val: list | None = None) -> None:
    torch.manual_seed(SEED)
    with quiet():
        trainer.fit(module, loader(train), None if val is None else loader(val))


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", backend)
    if backend == "native" and kernels.backend() != "native":
        if os.environ.get("CI"):
            pytest.fail("the native optimizer must be built in CI")
        pytest.skip("native optimizer not built")


def run_pair(
    entry: Zoo, batches: list, steps: int = OPT_STEPS, **trainer_kwargs: Any
) -> tuple[CausalLM, CausalLM, dict]:
    """Ordinary and megatrain fits of two identical copies (a warm-up/cosine schedule over `steps`
    optimizer steps); returns both modules and the initial params. The ordinary fit does not depend on the
    optimizer backend under test: it runs once per model and setting, and each backend's case reuses it."""
    model, ref, start = ordinary_fit(entry, batches, steps, **trainer_kwargs)
    mt = entry.module(copy.deepcopy(model), loss_fn=entry.loss_fn, **dict(MODULE_KWARGS, schedule=steps))
    seeded_fit(trainer("megatrain", **trainer_kwargs), mt, batches)
    return ref, mt, start


# Keyed by the entry's id; each value holds its entry, so that no later entry (a Zoo made inside a test) can be given
# the id of one already collected and find that one's fit.
_ORDINARY: dict[tuple, tuple[Zoo, nn.Module, CausalLM, dict]] = {}


def ordinary_fit(entry: Zoo, batches: list, steps: int, **trainer_kwargs: Any) -> tuple[nn.Module, CausalLM, dict]:
    """(an untouched copy of the initial model, ordinary training's fitted module, the initial params) for
    `entry` on `batches`, computed by the first caller (ordinary Lightning training, torch.optim.AdamW)."""
    data = hashlib.sha256(b"".join(b.numpy().tobytes() for b in batches)).hexdigest()
    key = (id(entry), steps, data, repr(sorted(trainer_kwargs.items())))
    if key not in _ORDINARY:
        model = entry.make()
        initial, start = copy.deepcopy(model), params_of(model)
        ref = entry.module(model, loss_fn=entry.loss_fn, **dict(MODULE_KWARGS, schedule=steps))
        ref.adam_inputs = AdamInputs()
        seeded_fit(trainer("auto", callbacks=[ref.adam_inputs], **trainer_kwargs), ref, batches)
        _ORDINARY[key] = (entry, initial, ref, start)
    return _ORDINARY[key][1:]


class AdamInputs(Callback):
    """Records the gradients of each optimizer step of ordinary training (accumulated, before clipping,
    which scales them all alike): ``tiny[name]`` marks the elements whose gradient was, at some step,
    nonzero but below TINY_GRAD times the largest of its tensor."""

    def __init__(self) -> None:
        self.tiny: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for n, p in pl_module.model.named_parameters():
            if p.grad is not None:
                g = p.grad.abs()
                mark = (g > 0) & (g < TINY_GRAD * g.max())
                self.tiny[n] = mark | self.tiny[n] if n in self.tiny else mark


def assert_bitwise(ref: CausalLM, mt: CausalLM) -> None:
    """Every micro-batch loss and every parameter torch.equal; the message says where and by how much."""
    assert len(mt.losses) == len(ref.losses) > 0
    pr, pm = params_of(ref.model), params_of(mt.model)
    assert pm.keys() == pr.keys()
    bad = {n: (pm[n] - pr[n]).abs().max().item() for n in pr if not torch.equal(pm[n], pr[n])}
    first = next((i for i, (a, b) in enumerate(zip(mt.losses, ref.losses)) if a != b), None)
    assert first is None and not bad, (
        f"first differing loss: {None if first is None else (first, mt.losses[first], ref.losses[first])}; "
        f"{len(bad)} of {len(pr)} tensors differ, largest |diff|: {sorted(bad.items(), key=lambda kv: -kv[1])[:4]}"
    )


def ordinary_gradients(entry: Zoo, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    model = entry.make().train()
    torch.manual_seed(SEED)
    entry.loss_fn(model, batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- the zoo -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "backend"), CASES, ids=[f"{n}-{b}" for n, b in CASES])
def test_zoo_trains_like_ordinary_training(name, backend, monkeypatch):
    use_backend(backend, monkeypatch)
    entry = ZOO[name]
    ref, mt, start = run_pair(entry, token_batches(OPT_STEPS * ACCUMULATE), **TRAIN_KWARGS)
    if name == "llama-frozen":
        pr = params_of(ref.model)
        frozen = [n for n in pr if n.startswith(FrozenPartsLM.FROZEN)]
        unchanged = [n for n in pr if torch.equal(pr[n], start[n])]
        assert frozen and sorted(frozen) == sorted(unchanged)  # the oracle: ordinary training leaves exactly those
    assert_trained_alike(entry, backend, ref, mt, start)


def assert_trained_alike(entry: Zoo, backend: str, ref: CausalLM, mt: CausalLM, start: dict) -> None:
    """torch backend: bitwise. native: losses within 1e-6, each tensor's update within its bound (1e-5 unless
    `entry.loose` says otherwise) outside the elements `entry.key_bias` excludes and those Adam was handed a
    tiny gradient for (TINY_GRAD), frozen tensors unchanged."""
    pr, pm = params_of(ref.model), params_of(mt.model)
    unchanged = [n for n in pr if torch.equal(pr[n], start[n])]
    for n in unchanged:  # ordinary training did not move them: neither may megatrain, with either backend
        assert torch.equal(pm[n], start[n]), f"{n} changed (max |diff| {(pm[n] - start[n]).abs().max().item():.3g})"
    if backend == "torch":
        assert_bitwise(ref, mt)
        return

    assert len(mt.losses) == len(ref.losses) > 0
    rel = max(abs(a - b) / abs(b) for a, b in zip(mt.losses, ref.losses))
    assert rel <= 1e-6, f"loss relative difference {rel:.3g}"
    grads = ordinary_gradients(entry, token_batches(1)[0])
    scale = max(g.abs().max().item() for g in grads.values())
    errors = {}
    for n in pr:
        if n in unchanged:
            continue
        keep = torch.ones_like(pr[n], dtype=torch.bool)
        mask = excluded_mask(entry, n, pr[n])
        if mask is not None:
            # The exclusion is honest only if ordinary training's gradient there is round-off.
            noise = grads[n][mask].abs().max().item()
            assert noise <= 1e-6 * scale, f"{n}: excluded elements have a real gradient ({noise:.3g} vs {scale:.3g})"
            keep = ~mask
        tiny = ref.adam_inputs.tiny.get(n)
        if tiny is not None:
            tiny = tiny & keep
            # Few, or the exclusion could hide a gradient gone wrong wholesale (all zeros are not tiny).
            assert tiny.sum() <= max(1, tiny.numel() // 20), f"{n}: {int(tiny.sum())} tiny gradients"
            keep &= ~tiny
        if not keep.any():
            continue
        update = (pr[n] - start[n])[keep].norm().item()
        assert update > 0, f"{n}: ordinary training moved only excluded elements"
        errors[n] = (pm[n] - pr[n])[keep].norm().item() / update
    bound = {n: next((b for suffix, b in entry.loose.items() if n.endswith(suffix)), 1e-5) for n in errors}
    worst = sorted(errors.items(), key=lambda kv: -kv[1] / bound[kv[0]])[:5]
    over = [(n, e, bound[n]) for n, e in worst if e > bound[n]]
    assert not over, f"per-tensor update errors above their bound (name, error, bound): {over}"


# More families (tests/zoo_families.py), cheaper: 3 optimizer steps of 2 micro-batches each. The torch
# backend for every one; the native kernel where it adds a structure the native cases above lack: a
# multi-query fused QKV bias with ALiBi, post-norms without a pre-norm (OLMo2, see
# test_native_backend_is_torch_fused_adamw), latent attention over blocks of different sizes, Qwen3-MoE's
# aux loss, a state-space block.
FAMILY_STEPS = 3
FAMILY_NATIVE = ("falcon-alibi", "olmo2", "deepseek-v3", "qwen3-moe-aux", "mamba")
FAMILY_CASES = [(name, "torch") for name in FAMILIES] + [(name, "native") for name in FAMILY_NATIVE]


@pytest.mark.parametrize(("name", "backend"), FAMILY_CASES, ids=[f"{n}-{b}" for n, b in FAMILY_CASES])
def test_family_trains_like_ordinary_training(name, backend, monkeypatch):
    use_backend(backend, monkeypatch)
    entry = FAMILIES[name]
    batches = token_batches(FAMILY_STEPS * ACCUMULATE)
    ref, mt, start = run_pair(entry, batches, steps=FAMILY_STEPS, **TRAIN_KWARGS)
    assert_trained_alike(entry, backend, ref, mt, start)


class WithAdamW(CausalLM):
    """CausalLM whose AdamW groups take `impl` (foreach=False: the single-tensor loop; fused=True)."""

    def __init__(self, model: nn.Module, impl: dict, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.impl = impl

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group.update(self.impl)
        return config


def test_native_backend_is_torch_fused_adamw(monkeypatch):
    """Why the native backend drifts from the torch backend on OLMo2 (2.5e-4 of the embedding's update after
    3 steps): the native kernel computes what torch's fused AdamW computes, bit for bit (the kernel takes
    its square root as that kernel does, and every OLMo2 tensor here is a multiple of 16 elements long, so
    torch's vector loop covers all of it), and ordinary training drifts exactly as far between torch's
    single-tensor and fused AdamW. The drift is one embedding element that got a gradient near Adam's eps
    (see TINY_GRAD); outside such elements the two torch AdamWs agree within the zoo's 1e-5."""
    use_backend("native", monkeypatch)
    entry = FAMILIES["olmo2"]
    batches = token_batches(FAMILY_STEPS * ACCUMULATE)
    model = entry.make()
    start = params_of(model)
    kwargs = dict(MODULE_KWARGS, schedule=FAMILY_STEPS)
    single = WithAdamW(copy.deepcopy(model), dict(foreach=False), **kwargs)
    fused = WithAdamW(copy.deepcopy(model), dict(fused=True), **kwargs)
    native = WithAdamW(model, {}, **kwargs)
    single.adam_inputs = AdamInputs()
    seeded_fit(trainer("auto", callbacks=[single.adam_inputs], **TRAIN_KWARGS), single, batches)
    seeded_fit(trainer("auto", **TRAIN_KWARGS), fused, batches)
    seeded_fit(trainer("megatrain", **TRAIN_KWARGS), native, batches)
    assert_bitwise(fused, native)

    ps, pf = params_of(single.model), params_of(fused.model)
    name = "model.embed_tokens.weight"
    update = ps[name] - start[name]
    drift = (pf[name] - ps[name]).norm() / update.norm()
    assert drift > 1e-4, f"torch's two AdamWs now agree on the embedding ({drift:.3g}): TINY_GRAD needs a new example"
    tiny = single.adam_inputs.tiny[name]
    assert 0 < tiny.sum() <= tiny.numel() // 20
    rest = (pf[name] - ps[name])[~tiny].norm() / update[~tiny].norm()
    assert rest <= 1e-5, f"outside the tiny-gradient elements the embeddings differ by {rest:.3g}"


@pytest.mark.parametrize("name", ["mixtral-aux", "qwen2-moe-aux", "qwen3-moe-aux"])
def test_router_aux_loss_gradient_reaches_the_router(name):
    """The oracle notices a dropped auxiliary loss: in ordinary training the router weights' gradient with
    the aux loss differs from the one without it (so a run that lost it cannot equal ordinary training)."""
    build = {"mixtral-aux": hf_mixtral, "qwen2-moe-aux": hf_qwen2_moe, "qwen3-moe-aux": qwen3_moe}[name]
    batch = token_batches(1)[0]
    grads, losses = {}, {}
    for coef in (AUX_COEF, 0.0):
        model = build(router_aux_loss_coef=coef).eval()  # eval: no jitter, the same routing both times
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        losses[coef] = out.loss.item()
        grads[coef] = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(grads[AUX_COEF]) == 2  # one router per layer
    assert losses[AUX_COEF] > losses[0.0]  # the aux loss reaches the loss...
    for n, g in grads[AUX_COEF].items():  # ...and its gradient reaches every router
        assert not torch.allclose(g, grads[0.0][n], rtol=1e-3, atol=0), n


# -- a dropout model around fit -----------------------------------------------------------------------

DROPOUT_MODELS = ["opt", "user-encoder"]


class PredictLogits(CausalLM):
    def __init__(self, model: nn.Module, logits_fn: Callable, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.logits_fn = logits_fn

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.logits_fn(self.model, batch)


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_validate_and_predict_after_fit_equal_ordinary(name, monkeypatch):
    """With dropout, evaluation must run the blocks in eval mode: the same metrics and logits as ordinary
    Lightning, and a second predict gives the same logits again."""
    use_backend("torch", monkeypatch)
    entry = ZOO[name]
    train, held_out = token_batches(4), token_batches(2, seed=5)
    model = entry.make()
    ref = PredictLogits(model, entry.logits_fn, loss_fn=entry.loss_fn, split_decay=True)
    mt = PredictLogits(copy.deepcopy(model), entry.logits_fn, loss_fn=entry.loss_fn, split_decay=True)
    results = {}
    for strategy, module in (("auto", ref), ("megatrain", mt)):
        t = trainer(strategy)
        seeded_fit(t, module, train)
        with quiet():
            val = t.validate(module, loader(held_out), verbose=False)
            first = t.predict(module, loader(held_out))
            second = t.predict(module, loader(held_out))
        results[strategy] = (val, first, second)
    (val, first, second), (ref_val, ref_first, ref_second) = results["megatrain"], results["auto"]
    assert len(first) == len(second) == len(ref_first) == len(held_out)
    assert all(torch.equal(x, y) for x, y in zip(ref_first, ref_second))  # the oracle: dropout is off in eval
    for i, (x, y) in enumerate(zip(second, first)):
        assert torch.equal(x, y), f"repeated predict batch {i}: max |diff| {(x - y).abs().max().item():.3g}"
    assert_bitwise(ref, mt)  # the same weights going in...
    for i, (x, y) in enumerate(zip(first, ref_first)):  # ...the same logits and metrics coming out
        assert torch.equal(x, y), f"predict batch {i}: max |diff| {(x - y).abs().max().item():.3g}"
    assert val == ref_val


class RecordVal(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.values.append(float(trainer.callback_metrics["val_loss"]))


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_mid_epoch_validation_equals_ordinary(name, monkeypatch):
    """Validation every 2 micro-batches (after each optimizer step) puts the model in eval mode and back:
    the training around it, and the validation losses, are those of ordinary training bit for bit."""
    use_backend("torch", monkeypatch)
    entry = ZOO[name]
    recs = {"auto": RecordVal(), "megatrain": RecordVal()}
    model = entry.make()
    twin = copy.deepcopy(model)
    kwargs = dict(loss_fn=entry.loss_fn, **MODULE_KWARGS)
    ref, mt = entry.module(model, **kwargs), entry.module(twin, **kwargs)
    train, held_out = token_batches(OPT_STEPS * ACCUMULATE), token_batches(2, seed=5)
    for strategy, module in (("auto", ref), ("megatrain", mt)):
        t = trainer(strategy, val_check_interval=2, callbacks=[recs[strategy]], **TRAIN_KWARGS)
        seeded_fit(t, module, train, held_out)
    assert len(recs["auto"].values) == OPT_STEPS
    assert recs["megatrain"].values == recs["auto"].values
    assert_bitwise(ref, mt)


class TrainInTrainStart(CausalLM):
    def on_train_start(self) -> None:
        self.model.train()


@pytest.mark.parametrize("name", DROPOUT_MODELS)
def test_model_put_back_in_train_mode_in_on_train_start(name, monkeypatch):
    """from_pretrained returns a model in eval mode; Lightning keeps the mode it is given, so a user calls
    self.model.train() in on_train_start. Dropout is then on in training, as in ordinary training."""
    use_backend("torch", monkeypatch)
    entry = ZOO[name]
    model = entry.make().eval()
    twin = copy.deepcopy(model)
    kwargs = dict(loss_fn=entry.loss_fn, **MODULE_KWARGS)
    ref, mt = TrainInTrainStart(model, **kwargs), TrainInTrainStart(twin, **kwargs)
    batches = token_batches(OPT_STEPS * ACCUMULATE)
    eval_loss = entry.loss_fn(entry.make().eval(), batches[0]).item()
    for strategy, module in (("auto", ref), ("megatrain", mt)):
        seeded_fit(trainer(strategy, **TRAIN_KWARGS), module, batches)
    assert ref.losses[0] != eval_loss  # the oracle: dropout really was on in ordinary training
    assert_bitwise(ref, mt)


# -- an explicit KV cache in training -----------------------------------------------------------------


def loss_with_cache(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch, use_cache=True).loss


@pytest.mark.parametrize("make", [hf_gpt2, lambda: hf_llama(layers=3)], ids=["gpt2", "llama"])
def test_use_cache_in_training_step_is_refused(make, monkeypatch):
    """training_step calls the HF model with use_cache=True: ordinary training runs, megatrain stops with an
    error naming the cache (its recompute would fill the cache a second time), never a silently different result."""
    use_backend("torch", monkeypatch)
    model = make()
    ref, mt = (
        CausalLM(model, loss_with_cache, **MODULE_KWARGS),
        CausalLM(copy.deepcopy(model), loss_with_cache, **MODULE_KWARGS),
    )
    batches = token_batches(2)
    seeded_fit(trainer("auto"), ref, batches)
    assert len(ref.losses) == 2
    with pytest.raises(RuntimeError, match=r"block model[\w.]*\.0 got a KV cache \(\w*Cache"):
        seeded_fit(trainer("megatrain"), mt, batches)


# keep_attention (engine/device/kept_attention.py) on the zoo's models whose attention torch runs as a fused kernel
# on the CPU with their dropout on: T5's position bias as a mask, Falcon, hybrids with attention blocks between
# state-space ones, a frozen part (every other model's attention dropout takes torch's math backend, or the model
# computes attention itself: recomputed as without the option, and bitwise too, measured). Bitwise to ordinary
# training, and the kept outputs really stood in (the engine's count).
KEPT_ATTENTION = ("llama-frozen", "falcon-new", "bamba", "zamba2", "t5")


class KeptAttentionCount(Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.kept = trainer.strategy.engine.stats["kept_attention"]


@pytest.mark.parametrize("name", KEPT_ATTENTION)
def test_kept_attention_trains_like_ordinary_training(name, monkeypatch):
    use_backend("torch", monkeypatch)
    entry, steps = (ZOO[name], OPT_STEPS) if name in ZOO else (FAMILIES[name], FAMILY_STEPS)
    batches = token_batches(steps * ACCUMULATE)
    model, ref, _ = ordinary_fit(entry, batches, steps, **TRAIN_KWARGS)
    mt = entry.module(copy.deepcopy(model), loss_fn=entry.loss_fn, **dict(MODULE_KWARGS, schedule=steps))
    count = KeptAttentionCount()
    seeded_fit(trainer(MegatrainStrategy(keep_attention=True), callbacks=[count], **TRAIN_KWARGS), mt, batches)
    assert count.kept > 0
    assert_bitwise(ref, mt)
