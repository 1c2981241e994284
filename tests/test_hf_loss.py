"""hf_causal_lm_loss (models/hf_loss.py): a transformers causal LM's own loss, in chunks of tokens.

The oracle is the model's own ``model(input_ids, labels=labels, attention_mask=...).loss``. In fp32 the values
and every gradient agree within 1e-6 relative (measured: the losses equal, the gradients within 3e-7 for the
Llama, 5e-7 for the tied Qwen2), not bit for bit: the model's loss is one [tokens, vocab] product and
``cross_entropy``'s mean over all tokens, the chunked loss one product per chunk (a matmul over other rows may
sum in another order) and per-chunk sums added up before the one division, and the head's gradient is summed
chunk by chunk. Under strategy="megatrain" the helper trains bit for bit as ordinary training does with it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_lightning.models import hf_causal_lm_loss
from tests.helpers import SEED, VOCAB, CausalLM, assert_same, hf_mixtral, hf_model, loader, max_rel_diff, quiet, trainer
from tests.zoo_families import t5

CHUNK = 8  # tokens per chunk: below the 2 x 16 tokens of a batch, so the loss runs over 4 chunks


def llama():
    return hf_model("Llama")


def qwen2_tied():
    return hf_model("Qwen2", tie_word_embeddings=True)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [2, 16], an attention mask padding the second row's last 5 positions, labels leaving out the pads
    and the first row's 3-token prompt."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    return ids, mask, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(a.item() - b.item()) / abs(b.item())


@pytest.mark.parametrize("make", [llama, qwen2_tied], ids=["llama", "qwen2-tied"])
def test_value_and_gradients_equal_the_models_own_loss(make):
    ours, theirs = make(), make()
    ids, mask, labels = padded_batch()
    loss = hf_causal_lm_loss(ours, ids, labels, attention_mask=mask, chunk_size=CHUNK)
    ref = theirs(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    ref.backward()
    assert loss.dtype == torch.float32
    assert rel(loss, ref) <= 1e-6, (loss.item(), ref.item())
    g, r = grads(ours), grads(theirs)
    assert all(t.abs().max() > 0 for t in r.values())  # every parameter gets a gradient to compare
    assert max_rel_diff(g, r) <= 1e-6
    if make is qwen2_tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight  # one tensor: head and embedding grads summed


def gemma2_uncapped():
    model = hf_model("Gemma2", head_dim=8, query_pre_attn_scalar=8)
    model.config.final_logit_softcapping = None
    return model


@pytest.mark.parametrize(
    "make",
    [gemma2_uncapped, lambda: hf_model("Cohere", logit_scale=1.0)],
    ids=["gemma2-without-softcap", "cohere-logit-scale-1"],
)
def test_the_check_is_by_behaviour_not_family(make):
    """Families that change the logits in general are taken where their config makes the change the identity."""
    model = make()
    ids, mask, labels = padded_batch()
    loss = hf_causal_lm_loss(model, ids, labels, attention_mask=mask, chunk_size=CHUNK)
    assert rel(loss, model(input_ids=ids, attention_mask=mask, labels=labels).loss) <= 1e-6


def test_labels_default_to_the_input_ids():
    model = llama()
    ids, _, _ = padded_batch()
    assert torch.equal(hf_causal_lm_loss(model, ids), hf_causal_lm_loss(model, ids, labels=ids))


def test_the_forward_is_checked_once_per_model_and_head(monkeypatch):
    """The check reads its results on the host (a device sync): not at every step, but again for a new head."""
    from megatrain_lightning.models import hf_loss

    runs = []
    check = hf_loss._forward_with
    monkeypatch.setattr(hf_loss, "_forward_with", lambda *args: runs.append(1) or check(*args))
    model = llama()
    ids, _, _ = padded_batch()
    hf_causal_lm_loss(model, ids)
    hf_causal_lm_loss(model, ids)
    assert len(runs) == 1
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=False)
    hf_causal_lm_loss(model, ids)
    assert len(runs) == 2


# -- under the engine --------------------------------------------------------------------------------


def masked_prompt_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    labels = batch.clone()
    labels[:, :4] = -100
    return hf_causal_lm_loss(model, batch, labels, chunk_size=CHUNK)


@pytest.mark.parametrize("make", [llama, qwen2_tied], ids=["llama", "qwen2-tied"])
def test_megatrain_trains_with_it_bit_for_bit_like_ordinary_training(make, monkeypatch):
    """3 optimizer steps of 2 micro-batches, norm clipping, two param groups, a schedule (as the zoo runs)."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    model = make()
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    kwargs = dict(loss_fn=masked_prompt_loss, split_decay=True, schedule=3)
    ref, mt = CausalLM(copy.deepcopy(model), **kwargs), CausalLM(model, **kwargs)
    for strategy, module in (("auto", ref), ("megatrain", mt)):
        torch.manual_seed(SEED)
        with quiet():
            trainer(strategy, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(module, loader(batches))
    assert len(mt.losses) == 6
    assert_same(ref, mt)


# -- what it refuses ---------------------------------------------------------------------------------


def biased_head():
    model = llama()
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    return model


def scaled_hidden():
    """A user's subclass whose forward halves the hidden states before the head (no config field says so)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class HalvedLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state * 0.5)
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    return HalvedLlama(LlamaConfig(**llama().config.to_dict()))


def doubled_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = llama()
    model.loss_function = lambda logits, labels, vocab_size, **kw: 2 * ForCausalLMLoss(logits, labels, vocab_size, **kw)
    return model


REFUSED = {
    "gemma2-softcap": (lambda: hf_model("Gemma2", head_dim=8, query_pre_attn_scalar=8), "final_logit_softcapping=30.0"),
    "cohere-scale": (lambda: hf_model("Cohere", logit_scale=0.5), "logit_scale=0.5"),
    "granite-scale": (lambda: hf_model("Granite", logits_scaling=4.0), "logits_scaling=4.0"),
    "hidden-scaled": (scaled_hidden, "changes the hidden states before its head"),
    "other-loss": (doubled_loss, "another loss than the shifted mean cross entropy"),
    "head-bias": (biased_head, "lm_head has a bias"),
    "router-aux-loss": (hf_mixtral, "output_router_logits=True"),
    "encoder-decoder": (t5, "encoder-decoder"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_what_it_would_compute_differently(name):
    make, what = REFUSED[name]
    ids, _, _ = padded_batch()
    with pytest.raises(ValueError, match=what) as refusal:
        hf_causal_lm_loss(make(), ids)
    assert "model(..., labels=labels).loss" in str(refusal.value) or "output_router_logits=False" in str(refusal.value)


def test_refuses_a_loss_argument_the_decoder_would_drop():
    ids, _, _ = padded_batch()
    with pytest.raises(ValueError, match="num_items_in_batch"):
        hf_causal_lm_loss(llama(), ids, num_items_in_batch=torch.tensor(20))


# -- memory ------------------------------------------------------------------------------------------


class LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an op makes whose last dimension is the vocabulary: logits and their
    gradient. Views are left out: they hold no memory of their own (the head's weight transposed is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_more_than_a_chunk_of_logits_exists():
    """Forward and backward: the largest logits tensor is chunk x vocab with the helper, tokens x vocab with the
    model's own loss (which shows the count sees logits)."""
    ids, mask, labels = padded_batch()
    counts = {}
    for name, loss_fn in (
        ("ours", lambda m: hf_causal_lm_loss(m, ids, labels, attention_mask=mask, chunk_size=CHUNK)),
        ("theirs", lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss),
    ):
        model = llama()
        with LargestLogits() as mode:
            loss_fn(model).backward()
        counts[name] = mode.largest
    assert counts == {"ours": CHUNK * VOCAB, "theirs": ids.numel() * VOCAB}
