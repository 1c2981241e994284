"""Blocks that change their own state in forward, return any tree of tensors, or take arguments that need a
gradient train exactly as in ordinary training.

- State: BatchNorm's running statistics, a counter buffer, an EMA buffer used in the output and a plain
  int attribute are updated once per forward, as in ordinary training, though each block is recomputed in
  backward (engine/device/block_state.py's Mutations); eval outputs after training agree too.
- Outputs: a dict, a dataclass, a transformers ModelOutput, a nested tuple with a non-tensor leaf.
- Inputs: an encoder's output for cross-attention and a position bias the first block makes (as T5 does)
  get their gradients back; Hugging Face T5 and BART train under strategy="megatrain" (the decoder stack
  streams: it holds more parameters than the encoder's).

fp32 on the CPU with the torch-op optimizer backend: bitwise equal, step for step.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.discover import find_blocks
from tests.helpers import CausalLM, assert_same, fit

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic

VOCAB, WIDTH = 29, 16


def token_batches(n: int, seq: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (3, seq), generator=g) for _ in range(n)]


# -- blocks that update their state in forward ----------------------------------------------------------


class NormBlock(nn.Module):
    """BatchNorm over the features of every token: running statistics and num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.bn(self.lin(x).flatten(0, 1)).view_as(x))


class CountingBlock(nn.Module):
    """A counter buffer, an EMA buffer read by the output after its update, a buffer replaced by a new tensor
    and a plain int attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("seen", torch.zeros(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            self.count += 1
            self.calls += 1
            self.ema.mul_(0.5).add_(0.5 * h.detach().mean((0, 1)))  # (a buffer updated in place)
            self.seen = self.seen + h.detach().abs().mean()  # (a buffer replaced)
        return x + torch.tanh(h + self.ema) * (1 + 0.1 * self.calls) + 0.01 * self.count


class StackLM(nn.Module):
    def __init__(self, block: type[nn.Module], layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def stack_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def two_models(build) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first = build()
    torch.manual_seed(0)
    return first, build()


@pytest.mark.parametrize("block", [NormBlock, CountingBlock])
def test_state_a_forward_updates_ends_each_step_as_in_ordinary_training(block):
    """Lightning, 4 steps: the same losses, weights and buffers (the recompute would have counted twice and
    restarted from the updated EMA), the same plain attribute, and the same eval logits afterwards."""
    a, b = two_models(lambda: StackLM(block))
    ref, mt = CausalLM(a, loss_fn=stack_loss), CausalLM(b, loss_fn=stack_loss)
    batches = token_batches(4)
    fit(ref, batches, strategy="auto")
    fit(mt, batches, strategy="megatrain")
    assert_same(mt, ref)
    ref_buffers, mt_buffers = dict(a.named_buffers()), dict(b.named_buffers())
    assert ref_buffers.keys() == mt_buffers.keys() and ref_buffers
    for name, buf in ref_buffers.items():
        assert torch.equal(mt_buffers[name], buf), name
    assert [getattr(m, "calls", None) for m in b.layers] == [getattr(m, "calls", None) for m in a.layers]
    if block is NormBlock:
        assert int(b.layers[0].bn.num_batches_tracked) == len(batches)
    a.eval(), b.eval()
    with torch.no_grad():
        assert torch.equal(b(batches[0]), a(batches[0]))


@pytest.mark.cuda
@pytest.mark.parametrize("block", [NormBlock, CountingBlock])
def test_buffers_a_forward_updates_on_the_gpu_reach_the_model(block):
    """On a GPU a block runs on device copies of its host buffers: what its forward updates there is in
    the model's state dict while training and in the model handed back by close()."""
    torch.manual_seed(0)
    model = StackLM(block)
    engine = Engine(model, EngineConfig(device="cuda", precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for ids in token_batches(2):
        stack_loss(model, ids.cuda()).backward()
        opt.step()
        opt.zero_grad()
    counter = "bn.num_batches_tracked" if block is NormBlock else "count"
    stat = "bn.running_mean" if block is NormBlock else "seen"
    state = model.state_dict()
    assert [int(state[f"layers.{i}.{counter}"]) for i in range(3)] == [2, 2, 2]
    assert all(state[f"layers.{i}.{stat}"].abs().sum() > 0 for i in range(3))
    engine.close()
    after = dict(model.named_buffers())
    assert all(b.device.type == "cpu" for b in after.values())
    for name, value in state.items():
        if name in after:
            assert torch.equal(after[name], value.cpu()), name


class ListBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return x + self.lin(x)


def test_a_list_the_forward_appends_to_is_refused_in_one_line():
    """A container attribute changed again by the recompute cannot be put back: refused, naming it."""
    torch.manual_seed(0)
    model = StackLM(ListBlock, layers=2)
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    loss = stack_loss(model, token_batches(1)[0])
    with pytest.raises(RuntimeError, match=r"block layers.1 \(ListBlock\) changed its list attribute 'seen'") as e:
        loss.backward()
    assert "\n" not in str(e.value)


# -- blocks returning any tree of tensors ----------------------------------------------------------------


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    aux: torch.Tensor
    note: str = "kept"


def _model_output_type():
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class BlockOutput(ModelOutput):
        hidden: torch.Tensor | None = None
        aux: torch.Tensor | None = None

    return BlockOutput


class TreeBlock(nn.Module):
    """Returns (hidden, aux) packed as `kind`; aux (a computed tensor) goes into the loss."""

    kind = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> Any:
        h, aux = x + torch.tanh(self.lin(x)), self.gate(x).square().mean()
        if self.kind == "dict":
            return {"hidden": h, "aux": aux}
        if self.kind == "dataclass":
            return Out(h, aux)
        if self.kind == "ModelOutput":
            return _model_output_type()(hidden=h, aux=aux)
        return ([h, ("label", aux)], None)  # nested tuple/list with non-tensor leaves


class TreeLM(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(TreeBlock() for _ in range(3))
        for layer in self.layers:
            layer.kind = kind
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, aux = self.embed(ids), 0.0
        for layer in self.layers:
            out = layer(h)
            if isinstance(out, dict):  # (a ModelOutput is a dict too)
                h, a = out["hidden"], out["aux"]
            elif isinstance(out, Out):
                assert out.note == "kept"
                h, a = out.hidden, out.aux
            else:
                (h, (label, a)), none = out
                assert label == "label" and none is None
            aux = aux + a
        return F.cross_entropy(self.head(h)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + aux


def train_loop(model: nn.Module, streamed: bool, steps: int = 3, call=None) -> list[float]:
    """A plain loop, with or without the engine; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true")) if streamed else None
    if engine is not None:
        opt = engine.optimizer(opt)
    losses = []
    for ids in token_batches(steps):
        loss = model(ids) if call is None else call(model, ids)
        with engine.backward() if engine is not None else nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:
        engine.close()
    return losses


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["dict", "dataclass", "ModelOutput", "nested"])
def test_blocks_returning_any_tree_of_tensors_train_exactly(kind):
    ref, mt = two_models(lambda: TreeLM(kind))
    assert train_loop(mt, streamed=True) == train_loop(ref, streamed=False)
    assert_same_weights(ref, mt)


def test_a_block_returning_no_tensor_is_refused_in_one_line():
    class Nothing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> dict:
            return {"note": "no tensor"}

    model = StackLM(Nothing, layers=2)
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    with pytest.raises(TypeError, match="must return a tensor, or a tuple, list, dict, dataclass") as e:
        model(token_batches(1)[0])
    assert "\n" not in str(e.value)


# -- arguments that need a gradient: a hand-built encoder-decoder ----------------------------------------


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class DecoderLayer(nn.Module):
    """Cross-attention to `memory`; the first layer makes a position bias (from its own parameter) that the
    later layers take as an argument and return unchanged, as T5's blocks do."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.rel = nn.Parameter(torch.randn(32) * 0.1) if first else None

    def forward(self, x: torch.Tensor, memory: torch.Tensor, bias: torch.Tensor | None = None):
        if bias is None:
            pos = torch.arange(x.shape[1])[:, None] - torch.arange(memory.shape[1])[None, :]
            bias = self.rel[pos.clamp(-15, 16) + 15]
        k, v = self.kv(memory).chunk(2, -1)
        scores = self.q(x) @ k.transpose(1, 2) / WIDTH**0.5 + bias
        return x + self.out(scores.softmax(-1) @ v), bias


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.ModuleList(EncoderLayer() for _ in range(2))  # fewer parameters: not streamed
        self.decoder = nn.ModuleList(DecoderLayer(first=i == 0) for i in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        memory = self.embed(ids)
        for layer in self.encoder:
            memory = layer(memory)
        h, bias = self.embed(ids.flip(-1)), None
        for layer in self.decoder:
            h, bias = layer(h, memory=memory, bias=bias)
        return F.cross_entropy(self.head(h)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_encoder_output_and_position_bias_get_their_gradients_back():
    """The decoder streams; `memory` (the encoder's output) and `bias` (decoder block 0's output, an argument
    of blocks 1 and 2) require grad: their gradients reach the encoder and block 0's `rel` exactly."""
    ref, mt = two_models(EncDec)
    start = mt.decoder[0].rel.detach().clone(), mt.encoder[0].lin.weight.detach().clone()
    assert train_loop(mt, streamed=True) == train_loop(ref, streamed=False)
    assert_same_weights(ref, mt)
    assert not torch.equal(mt.decoder[0].rel, start[0]) and not torch.equal(mt.encoder[0].lin.weight, start[1])


class Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class HolderBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, held: Holder) -> torch.Tensor:
        return x + self.lin(x) * held.t


def test_a_tensor_needing_grad_inside_an_opaque_object_is_refused_in_one_line():
    """The engine cannot take such an object apart: its tensor would get no gradient, so the call is refused."""
    model = StackLM(HolderBlock, layers=2)
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    scale = torch.ones(WIDTH, requires_grad=True)
    with pytest.raises(TypeError, match=r"block layers.0 got a Holder \(in argument 1\) holding a tensor") as e:
        model.layers[0](torch.zeros(1, 2, WIDTH), Holder(scale))
    assert "\n" not in str(e.value)
    with torch.no_grad():  # without grad nothing is differentiated
        assert model.layers[0](torch.zeros(1, 2, WIDTH), Holder(scale)).shape == (1, 2, WIDTH)


def test_both_stacks_of_an_encoder_decoder_stream():
    found = find_blocks(EncDec())
    assert [c.name for c in found.stacks] == ["encoder", "decoder"]  # the order they are registered (and run) in
    assert found.names == [f"{s}.{i}" for s in ("encoder", "decoder") for i in range(len(getattr(EncDec(), s)))]


# -- Hugging Face encoder-decoders ------------------------------------------------------------------------


def hf_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=4, d_ff=32, num_layers=2, num_heads=4, dropout_rate=0.1,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def hf_bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        dropout=0.1, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, use_cache=False,
    )  # fmt: skip
    return BartForConditionalGeneration(cfg)


def seq2seq_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids.flip(-1)).loss


@pytest.mark.parametrize(
    "build,stacks",
    [(hf_t5, ["encoder.block", "decoder.block"]), (hf_bart, ["model.encoder.layers", "model.decoder.layers"])],
)
def test_hugging_face_encoder_decoders_train_exactly(build, stacks):
    """Both stacks stream; dropout on: the recompute replays the forward's RNG state."""
    a, b = two_models(build)
    assert [c.name for c in find_blocks(b).stacks] == stacks
    ref, mt = CausalLM(a, loss_fn=seq2seq_loss), CausalLM(b, loss_fn=seq2seq_loss)
    batches = token_batches(3, seq=8)
    torch.manual_seed(1)
    fit(ref, batches, strategy="auto")
    torch.manual_seed(1)
    fit(mt, batches, strategy="megatrain")
    assert_same(mt, ref)
