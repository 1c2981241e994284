"""Shared pieces of the tests: tiny models (this project's Llama, a zoo of Hugging Face ones), fixed data, a
LightningModule, a run-and-record helper, bitwise comparisons, the native AdamW kernel against torch's."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.optim import native

VOCAB = 97


def hf_llama(layers: int = 3, **overrides: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def hf_qwen2(layers: int = 3) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg)


def hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def token_batches(n: int, batch: int = 2, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return f


class CausalLM(L.LightningModule):
    """An ordinary LightningModule around a causal LM; records each micro-batch's loss."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = hf_loss,
        lr: float = 1e-2,
        weight_decay: float = 0.1,
        split_decay: bool = False,
        schedule: int | None = None,
        manual: int | None = None,  # manual optimization with this many accumulation micro-batches
        manual_clip: float | None = None,
    ) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.lr, self.weight_decay, self.split_decay, self.schedule = lr, weight_decay, split_decay, schedule
        self.manual, self.manual_clip = manual, manual_clip
        self.automatic_optimization = manual is None
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss_fn(self.model, batch)
        self.losses.append(loss.detach().float().item())
        if self.manual is None:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.manual)
        if (batch_idx + 1) % self.manual == 0:
            if self.manual_clip:
                self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched = self.lr_schedulers()
            if sched is not None:
                sched.step()
        return None

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss_fn(self.model, batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(self.model, batch)

    def configure_optimizers(self) -> Any:
        params = [(n, p) for n, p in self.model.named_parameters()]
        if self.split_decay:
            groups = [
                {"params": [p for n, p in params if p.ndim >= 2]},
                {"params": [p for n, p in params if p.ndim < 2], "weight_decay": 0.0},
            ]
        else:
            groups = [p for _, p in params]
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), weight_decay=self.weight_decay)
        if self.schedule is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, self.schedule))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batches: list[torch.Tensor]) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False)


@contextmanager
def quiet() -> Iterator[None]:
    """Silence the warnings every tiny CPU run triggers (few workers, no val loader, the disabled KV cache)."""
    with warnings.catch_warnings():
        for pattern in (
            ".*does not have many workers.*",
            ".*KV cache is disabled.*",
            ".*val_dataloader.*",
            ".*LeafSpec.*",
            ".*in eval mode at the start of training.*",
            ".*enable_nested_tensor is True.*",
        ):
            warnings.filterwarnings("ignore", pattern)
        yield


def trainer(strategy: Any = "megatrain", **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer: one epoch, no logger, checkpoints, progress bar or sanity validation."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    with quiet():
        return L.Trainer(**defaults)


def fit(module: CausalLM, batches: list[torch.Tensor], strategy: Any = "megatrain", **trainer_kwargs: Any) -> L.Trainer:
    """Fit quietly on the CPU; `strategy="auto"` is ordinary training; `ckpt_path` goes to `trainer.fit`."""
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    t = trainer(strategy, **trainer_kwargs)
    with quiet():
        t.fit(module, loader(batches), ckpt_path=ckpt_path)
    return t


def twin(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two identical copies of one freshly built model."""
    model = make()
    return model, copy.deepcopy(model)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| / max|b| over tensors (relative to each tensor's scale, so near-zero entries don't explode)."""
    assert a.keys() == b.keys()
    return max(
        ((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12)).item() for k in a
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def own_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    """A plain training loop over this project's Llama (next-token targets = the batch itself): the losses."""
    losses = []
    for batch in batches:
        loss = model(batch, targets=batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, megatrain_lightning.HostAdamW):
        opt.engine.flush()  # the last steps run in the background: done before the caller reads the weights
    return losses


# -- this project's Llama -------------------------------------------------------------------------------


def own_llama(layers: int = 4) -> nn.Module:
    """The "tiny" preset of this project's Llama with `layers` blocks, the same weights on every call."""
    from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.from_preset("tiny", num_hidden_layers=layers))


def own_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
    return model(batch, targets=targets)


def update_error(params: dict, ref: dict, start: dict) -> float:
    """||params - ref|| / ||ref - start|| over the whole model: the relative error of the total update (on the
    CPU: a run on a GPU may leave some of its parameters there)."""
    params, ref, start = ({k: v.cpu() for k, v in d.items()} for d in (params, ref, start))
    num = sum(float((params[k] - ref[k]).norm()) ** 2 for k in start) ** 0.5
    return num / sum(float((ref[k] - start[k]).norm()) ** 2 for k in start) ** 0.5


def assert_same_params(a: CausalLM, b: CausalLM) -> None:
    """The same parameter names, each tensor bitwise equal."""
    pa, pb = params_of(a.model), params_of(b.model)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def assert_same(a: CausalLM, b: CausalLM) -> None:
    """Bitwise the same training: every recorded loss (at least one) and every parameter."""
    assert a.losses == b.losses and len(a.losses) > 0
    assert_same_params(a, b)


# -- the model zoo (tests/test_zoo.py; tests/test_compile_blocks.py compiles two of it) -------------

SEQ = 16
DROPOUT = 0.1
SEED = 1234  # torch's global RNG is set to this before every fit: dropout masks are drawn from it


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """A freshly built model with the KV cache off in its config, for ordinary and megatrain training alike.

    The strategy trains with ``use_cache=False`` (each block is recomputed, so a cache would be filled
    twice; transformers turns it off under gradient checkpointing for the same reason). Ordinary training
    with a cache computes attention over keys concatenated into the cache's buffer, which rounds
    differently in GPT-2 and OPT (16 of 28 and 21 of 36 gradient tensors differ at round-off in plain
    ordinary training, cache on vs off), so the bit-exact reference is ordinary training without it."""
    torch.manual_seed(0)
    model = build()
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not None:
        config.use_cache = False
    return model


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attn_pdrop=DROPOUT,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return _seeded(lambda: GPT2LMHeadModel(cfg))


def hf_model(family: str, model_class: str | None = None, **config: Any) -> nn.Module:
    """transformers' ``<family>ForCausalLM`` (or `model_class`) with a tiny ``<family>Config``: the
    vocabulary and positions shared by the zoo, the shape of a small GQA decoder (2 layers, width 32,
    4 heads, 2 KV heads) unless `config` says otherwise, and every dropout the caller names."""
    import transformers

    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    fields = {k: v for k, v in {**shape, **config}.items() if v is not None}  # None: a field the family lacks
    cfg = getattr(transformers, f"{family}Config")(vocab_size=VOCAB, max_position_embeddings=64, **fields)
    return _seeded(lambda: getattr(transformers, model_class or f"{family}ForCausalLM")(cfg))


def hf_gpt_neox() -> nn.Module:
    return hf_model(
        "GPTNeoX",
        num_key_value_heads=None,
        rotary_pct=0.25,
        hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def hf_opt() -> nn.Module:
    return hf_model(
        "OPT",
        intermediate_size=None,
        num_key_value_heads=None,
        ffn_dim=64,
        word_embed_proj_dim=32,
        dropout=DROPOUT,
        attention_dropout=DROPOUT,
        activation_dropout=DROPOUT,
        attn_implementation="eager",
    )


def hf_mistral() -> nn.Module:
    # sliding_window < SEQ: the sliding-window mask is exercised too.
    return hf_model("Mistral", sliding_window=8, attention_dropout=DROPOUT, attn_implementation="sdpa")


def hf_qwen2_tied() -> nn.Module:
    return hf_model("Qwen2", tie_word_embeddings=True, attention_dropout=DROPOUT, attn_implementation="sdpa")


def hf_qwen3() -> nn.Module:
    return hf_model("Qwen3", head_dim=8, attention_dropout=DROPOUT, attn_implementation="eager")


def hf_gemma2() -> nn.Module:
    # Alternating sliding (window 8 < SEQ) and full attention layers, logit soft-capping, tied head.
    return hf_model(
        "Gemma2",
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=8,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def hf_phi3() -> nn.Module:
    return hf_model(
        "Phi3",
        original_max_position_embeddings=64,
        resid_pdrop=DROPOUT,
        embd_pdrop=DROPOUT,
        attention_dropout=DROPOUT,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )


AUX_COEF = 0.1  # large enough that the auxiliary loss visibly moves the router weights


def hf_mixtral(router_aux_loss_coef: float = AUX_COEF) -> nn.Module:
    return hf_model(
        "Mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=router_aux_loss_coef,
        router_jitter_noise=DROPOUT,
        attention_dropout=DROPOUT,
        attn_implementation="eager",
    )


def hf_qwen2_moe(router_aux_loss_coef: float = AUX_COEF) -> nn.Module:
    return hf_model(
        "Qwen2Moe",
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=router_aux_loss_coef,
        attention_dropout=DROPOUT,
        attn_implementation="sdpa",
    )


class UserEncoderLM(nn.Module):
    """A user's own causal LM: nn.TransformerEncoderLayer blocks in an nn.ModuleList, the causal mask
    passed to each block as an argument, an embedding, learned positions and a head."""

    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=DROPOUT, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def user_encoder() -> nn.Module:
    return _seeded(UserEncoderLM)


def user_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The user's own loss: next-token cross entropy with label smoothing."""
    logits = model(batch)[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1), label_smoothing=0.05)


def hf_logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch).logits


def user_logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch)


class FrozenPartsLM(CausalLM):
    """Freezes the second block's MLP (inside a block) and the embedding (outside the blocks) in `setup`,
    i.e. before configure_optimizers, which still hands every parameter to AdamW (the common pattern:
    torch's AdamW skips a parameter whose .grad is None)."""

    FROZEN = ("model.embed_tokens.", "model.layers.1.mlp.")

    def setup(self, stage: str) -> None:
        self.model.model.embed_tokens.requires_grad_(False)
        self.model.model.layers[1].mlp.requires_grad_(False)


def _key_third(t: torch.Tensor) -> torch.Tensor:
    """Fused [q; k; v] bias (GPT-2's c_attn, nn.MultiheadAttention's in_proj_bias): the key third."""
    mask = torch.zeros_like(t, dtype=torch.bool)
    n = t.shape[0] // 3
    mask[n : 2 * n] = True
    return mask


def _whole(t: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(t, dtype=torch.bool)


def _neox_key_unrotated(t: torch.Tensor, heads: int = 4, rotary_dims: int = 2) -> torch.Tensor:
    """GPT-NeoX's query_key_value bias is laid out per head as [q | k | v] (head_dim each); rotary
    embeddings turn the first `rotary_dims` key dims, which makes their bias position-dependent (a real
    gradient). The other key dims add a constant to every score of a row: zero true gradient."""
    head_dim = t.shape[0] // (3 * heads)
    mask = torch.zeros(heads, 3, head_dim, dtype=torch.bool)
    mask[:, 1, rotary_dims:] = True
    return mask.reshape(-1)


@dataclass
class Zoo:
    make: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = hf_loss
    logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = hf_logits
    module: type[CausalLM] = CausalLM
    # Native backend only: elements whose true gradient is zero, by parameter-name suffix.
    key_bias: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # Native backend only: tensors held to a looser per-tensor update bound, by parameter-name suffix.
    loose: dict[str, float] = field(default_factory=dict)


ZOO: dict[str, Zoo] = {
    # A key bias adds q.b_k to every score of a query's row; softmax is invariant to that shift, so the
    # gradient of b_k is exactly zero and what autograd computes is round-off. Each exclusion below was
    # found by measuring ordinary training's gradients (the native test re-checks it every run).
    "gpt2": Zoo(hf_gpt2, key_bias={"attn.c_attn.bias": _key_third}),
    "gpt-neox": Zoo(hf_gpt_neox, key_bias={"attention.query_key_value.bias": _neox_key_unrotated}),
    "opt": Zoo(hf_opt, key_bias={"self_attn.k_proj.bias": _whole}),
    "mistral": Zoo(hf_mistral),
    # Qwen2's k_proj.bias is rotated by RoPE with the keys, so q.R(b_k) varies with the key's position: a
    # real gradient (measured up to 1e-4, like q_proj.bias's), nothing to exclude. But its dims on the lowest
    # rotary frequencies (rope_theta 1e4, head_dim 8: 1e-2 and 1e-3 rad per position) turn so little over
    # 16 positions that their gradient is ~1e-3 of the others' and carries 1e-4..1e-3 relative round-off
    # (measured against a float64 backward). The native kernel's ulp differences perturb that round-off,
    # so these tensors' updates differ by up to 4e-5 (measured, Qwen2-MoE). They are held to 1e-3 instead
    # of 1e-5: a real bug (a stale, lost or doubled gradient) moves an update by O(1).
    "qwen2-tied": Zoo(hf_qwen2_tied, loose={"self_attn.k_proj.bias": 1e-3}),
    "qwen3": Zoo(hf_qwen3),
    "gemma2": Zoo(hf_gemma2),
    "phi3": Zoo(hf_phi3),
    "mixtral-aux": Zoo(hf_mixtral),
    "qwen2-moe-aux": Zoo(hf_qwen2_moe, loose={"self_attn.k_proj.bias": 1e-3}),
    "user-encoder": Zoo(user_encoder, user_loss, user_logits, key_bias={"self_attn.in_proj_bias": _key_third}),
    "llama-frozen": Zoo(lambda: hf_llama(layers=3), module=FrozenPartsLM),
}


def excluded_mask(entry: Zoo, name: str, t: torch.Tensor) -> torch.Tensor | None:
    for suffix, mask in entry.key_bias.items():
        if name.endswith(suffix):
            return mask(t)
    return None


# -- the native AdamW kernel against torch's optimizers (tests/test_native_adamw.py, tests/test_threads.py)

requires_native = pytest.mark.skipif(
    not native.available(), reason=f"native AdamW library not available: {native.load_error()}"
)

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8
ADAMW_STEPS = 50
RTOL, ATOL = 1e-6, 1e-7


def adamw_grad(n: int, step: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # magnitudes vary by step so exp_avg_sq sees changing scales
    return (torch.randn(n, generator=gen) * (0.5 + step % 3)).to(dtype)


def run_adamw_pair(n, ref_kind, grad_dtype, weight_decay, grad_scale, steps=ADAMW_STEPS, beta1=BETA1, beta2=BETA2):
    """The native kernel and torch's optimizer (`ref_kind`: "single", "fused" or L2 "adam") on the same
    gradients: ((master, exp_avg, exp_avg_sq, copy), (param, exp_avg, exp_avg_sq))."""
    gen = torch.Generator().manual_seed(1234 + n)
    p0 = torch.randn(n, generator=gen)
    ref = torch.nn.Parameter(p0.clone())
    if ref_kind == "adam":
        opt = torch.optim.Adam([ref], lr=LR, betas=(beta1, beta2), eps=EPS, weight_decay=weight_decay, foreach=False)
    elif ref_kind == "fused":
        opt = torch.optim.AdamW([ref], lr=LR, betas=(beta1, beta2), eps=EPS, weight_decay=weight_decay, fused=True)
    else:
        opt = torch.optim.AdamW([ref], lr=LR, betas=(beta1, beta2), eps=EPS, weight_decay=weight_decay, foreach=False)
    master, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=grad_dtype)  # bf16 copy with bf16 grads, fp32 copy with fp32 grads
    for step in range(1, steps + 1):
        g = adamw_grad(n, step, gen, grad_dtype)
        ref.grad = g.float() * grad_scale if grad_scale != 1.0 else g.float()
        opt.step()
        native.adamw_step_(
            master,
            m,
            v,
            g,
            copy,
            lr=LR,
            beta1=beta1,
            beta2=beta2,
            eps=EPS,
            weight_decay=weight_decay,
            step=step,
            grad_scale=grad_scale,
            decoupled=ref_kind != "adam",
        )
    state = opt.state[ref]
    return (master, m, v, copy), (ref.detach(), state["exp_avg"], state["exp_avg_sq"])


def assert_adamw_matches(ours, theirs):
    (master, m, v, copy), (p_ref, m_ref, v_ref) = ours, theirs
    torch.testing.assert_close(master, p_ref, rtol=RTOL, atol=ATOL, msg=lambda s: f"master: {s}")
    torch.testing.assert_close(m, m_ref, rtol=RTOL, atol=ATOL, msg=lambda s: f"exp_avg: {s}")
    torch.testing.assert_close(v, v_ref, rtol=RTOL, atol=ATOL, msg=lambda s: f"exp_avg_sq: {s}")
    # the copy is the new master in the copy dtype, bit for bit
    assert torch.equal(as_bits(copy), as_bits(master.to(copy.dtype)))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, to compare bitwise (NaNs and signed zeros included)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@contextmanager
def gloo_rank(rank: int, world: int, out: str) -> Iterator[None]:
    """This process as rank `rank` of `world` in a gloo process group (torch.multiprocessing.spawn's ranks),
    one CPU thread each. The ranks meet through a file in `out`, not a TCP port found free beforehand: the
    ranks take seconds to start on a busy machine, time for another process to take that port (another run of
    the same test on the machine among them, whose ranks would then meet ours)."""
    import faulthandler

    import torch.distributed as dist

    # A rank that dies of a signal (an abort inside gloo or torch) leaves only "terminated with signal" in
    # the spawning test: print the Python stack of each of its threads first, to its stderr, which the test
    # shows.
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
