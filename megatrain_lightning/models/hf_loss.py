"""The chunked vocabulary loss for a Hugging Face causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...).

``model(input_ids, labels=labels).loss`` makes the logits of every token before its cross entropy, and an
fp32 copy of them for the loss: for 8k tokens of Llama 3's 128k vocabulary 2 GiB in bf16 plus 4 GiB in fp32,
and as much again for their gradient, more than a decoder layer. :func:`hf_causal_lm_loss` asks the model's
decoder (``model.get_decoder()``) for the final hidden states and hands them with the head's weight to
:func:`chunked_cross_entropy`, so only ``chunk_size x vocab`` logits exist at a time.

That is the model's own loss only where its forward turns the decoder's output into logits by
``lm_head(hidden_states)`` alone and takes transformers' causal-LM loss of them. Many do more: Gemma2 soft-caps
the logits, Cohere and Granite scale them, GPT-J's head has a bias, an MoE adds its routers' loss. That is
checked, not looked up in a list of families: at the first call for a model (and again if its head or decoder
module is replaced), its forward runs once with a stand-in decoder and head (no block runs; one ``3 x vocab``
product), and whatever it does between the two, or to the head's output before the loss, refuses the call.
Checked once because the check reads its results on the host, a device sync a training step should not pay; a
config changed after that first call is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .loss import chunked_cross_entropy

IGNORE = -100  # transformers' label for a position that does not count
# Keyword arguments the model's forward would hand to its loss, not to its decoder.
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index", "logits_to_keep")
# Config fields that change the logits in transformers' models, named in a refusal when set.
LOGIT_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier", "logit_softcapping")
# The stand-in head's logits span this range: far beyond any soft-cap's knee (Gemma2's is 30), so a cap, a
# scale or a mask cannot leave them bit for bit unchanged.
PROBE_RANGE = 1000.0
# The models checked, each with the (decoder, head) it was checked with.
_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, nn.Module]] = weakref.WeakKeyDictionary()


def hf_causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 4096,
    **model_kwargs: Any,
) -> torch.Tensor:
    """``model(input_ids, labels=labels, attention_mask=attention_mask).loss`` without the full logits.

    Args:
        model: a transformers causal LM whose forward computes ``lm_head(decoder(...).last_hidden_state)``
            (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``, ...; tied head or not).
        input_ids: [B, T] token ids.
        labels: [B, T], as transformers takes them: shifted here (position t is scored on ``labels[t + 1]``),
            ``-100`` ignored. Default ``input_ids``, padding included, as ``labels=input_ids`` would: set
            padded positions to -100 to leave them out.
        chunk_size: tokens whose logits exist at once (``chunk_size x vocab`` fp32 elements, and as many for
            their gradient).
        model_kwargs: passed to the decoder (``position_ids``, ...); ``use_cache`` is False unless given.

    Returns the fp32 mean over the counted tokens (0, not NaN, when none counts). Equal to the model's own loss
    up to the order of the additions (a few ulp; tests/test_hf_loss.py).

    Raises ValueError, naming what and how to go on, for a model whose forward does more than that: a head
    with a bias, logits soft-capped, scaled or masked, a router's auxiliary loss added, or a loss argument
    (``num_items_in_batch``, ...) the decoder would drop.
    """
    name = type(model).__name__
    passed = [k for k in LOSS_KWARGS if k in model_kwargs]
    if passed:
        raise ValueError(
            f"hf_causal_lm_loss takes no {passed[0]}=: the model's forward hands it to its loss, not its decoder; "
            "compute the loss with model(..., labels=labels).loss instead"
        )
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{name} is an encoder-decoder model: hf_causal_lm_loss is for decoder-only causal LMs; "
            "use model(..., labels=labels).loss"
        )
    head, decoder = _head(model), _decoder(model)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{name} has config.output_router_logits=True: its forward adds router_aux_loss_coef x the routers' "
            "load-balancing loss, which hf_causal_lm_loss does not; set model.config.output_router_logits=False "
            "to train without it, or use model(..., labels=labels).loss"
        )
    _check_forward(model, decoder, head)
    model_kwargs.setdefault("use_cache", False)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)[0]  # last_hidden_state
    labels = input_ids if labels is None else labels
    # transformers' shift: every position is scored on the next label, the last on a padded -100. The hidden
    # states stay whole (a view, not a sliced copy) and the extra position costs one row of logits per sequence.
    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    return chunked_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1).to(hidden.device), chunk_size
    )


def _head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        raise ValueError(
            f"{type(model).__name__}'s output embeddings are {type(head).__name__}, not an nn.Linear: "
            "hf_causal_lm_loss needs a plain lm_head; use model(..., labels=labels).loss"
        )
    if head.bias is not None:
        raise ValueError(
            f"{type(model).__name__}'s lm_head has a bias, which the chunked loss does not add (it would not "
            "train); use model(..., labels=labels).loss"
        )
    return head


def _decoder(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(
            f"{type(model).__name__}.get_decoder() gives no decoder apart from the model: hf_causal_lm_loss needs "
            "one whose output is the final hidden states; use model(..., labels=labels).loss"
        )
    return decoder


def _check_forward(model: nn.Module, decoder: nn.Module, head: nn.Linear) -> None:
    """Refuse unless the model's forward feeds the decoder's output unchanged to the head, returns the head's
    output unchanged as its logits, and takes the shifted mean cross entropy of those as its loss.

    Runs the forward on 3 tokens with the decoder standing in (it returns a fixed tensor) and the head's output
    replaced by fixed logits, under no_grad. Once per model, decoder and head."""
    checked = _CHECKED.get(model)
    if checked is not None and checked[0] is decoder and checked[1] is head:
        return
    weight = head.weight
    vocab, width = weight.shape
    hidden = torch.linspace(-1.0, 1.0, 3 * width, device=weight.device).reshape(1, 3, width).to(weight.dtype)
    ramp = torch.linspace(-PROBE_RANGE, PROBE_RANGE, vocab, device=weight.device)
    logits = torch.stack([ramp.roll(p) for p in range(3)]).unsqueeze(0).to(weight.dtype)
    target = 1  # the smallest logit of row 1 (the ramp rolled by 1): a large loss, compared without cancellation
    labels = torch.tensor([[0, IGNORE, target]], device=weight.device)
    seen: list[torch.Tensor] = []
    out = _forward_with(model, decoder, head, hidden, logits, seen, labels)

    config = getattr(model, "config", None)
    fields = [f"{f}={getattr(config, f)}" for f in LOGIT_FIELDS if getattr(config, f, None) is not None]
    does = f" (its config sets {', '.join(fields)})" if fields else ""
    if len(seen) != 1 or seen[0].shape != hidden.shape or not torch.equal(seen[0], hidden):
        what = f"calls its head {len(seen)} times" if len(seen) != 1 else "changes the hidden states before its head"
        raise ValueError(_refusal(model, f"{what}{does}"))
    got = getattr(out, "logits", None)
    if got is None or got.shape != logits.shape or not torch.equal(got.float(), logits.float()):
        raise ValueError(_refusal(model, f"changes the head's output before the loss{does}"))
    row = logits[0, 1].float()
    expected = torch.logsumexp(row, 0) - row[target]
    loss = getattr(out, "loss", None)
    if loss is None or not torch.allclose(loss.float(), expected, rtol=1e-5, atol=0.0):
        raise ValueError(_refusal(model, "computes another loss than the shifted mean cross entropy of its logits"))
    _CHECKED[model] = (decoder, head)


def _forward_with(model, decoder, head, hidden, logits, seen, labels):
    """The model's output for `labels` with its decoder returning `hidden` and its head `logits` (the head's
    inputs appended to `seen`)."""
    calls = []

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return _StandInOutput(hidden)

    own = decoder.__dict__.get("forward")  # an instance attribute someone set: restored afterwards
    decoder.forward = stand_in
    hooks = [
        head.register_forward_pre_hook(lambda module, args: seen.append(args[0])),
        head.register_forward_hook(lambda module, args, output: logits),
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros_like(labels), labels=labels, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        if own is None:
            del decoder.forward
        else:
            decoder.forward = own
    if len(calls) != 1:
        raise ValueError(
            _refusal(model, f"calls model.get_decoder() ({type(decoder).__name__}) {len(calls)} times, not once")
        )
    return out


class _StandInOutput:
    """The stand-in decoder's output: the last hidden state by name and at index 0, as a decoder's output gives
    it, and None in any other field a model's forward reads (``past_key_values``, ``router_logits``, ...),
    whichever output class its real decoder returns. (A plain class: this package does not import
    transformers, and a subclass of its output classes would be registered with torch's pytree.)"""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, key: int | str) -> torch.Tensor:
        if key in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise KeyError(f"the stand-in decoder output holds only the last hidden state, not {key!r}")

    def __getattr__(self, name: str) -> None:
        if name.startswith("_"):
            raise AttributeError(name)
        return None


def _refusal(model: nn.Module, what: str) -> str:
    return (
        f"{type(model).__name__}'s forward {what}, which hf_causal_lm_loss would skip (it computes "
        "hidden @ lm_head.weight.T and their cross entropy): use model(..., labels=labels).loss"
    )
