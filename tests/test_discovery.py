"""Which blocks stream (engine/discover.py): found by a stated rule, named with ``blocks=``, never silently wrong.

Trainings are compared with ordinary Lightning training bitwise (torch backend), with tests/test_zoo.py's
helpers; what the engine refuses, it refuses at setup with one line naming what it found and the fix.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.discover import find_blocks
from tests.helpers import (
    VOCAB,
    CausalLM,
    UserEncoderLM,
    Zoo,
    _seeded,
    hf_llama,
    token_batches,
    user_loss,
)
from tests.helpers import trainer as make_trainer
from tests.test_zoo import ACCUMULATE, TRAIN_KWARGS, assert_bitwise, run_pair, seeded_fit
from tests.zoo_families import bamba, jamba, zamba2

pytestmark = pytest.mark.usefixtures("torch_adam")


@pytest.mark.parametrize(("make", "classes"), [(jamba, 2), (bamba, 1)], ids=["jamba", "bamba"])
def test_hybrid_blocks_are_one_stack(make, classes):
    """One list, blocks of several classes and sizes (they train like ordinary training in the zoo)."""
    model = make()
    (stack,) = find_blocks(model).stacks
    assert stack.blocks is model.model.layers and len({type(b) for b in stack.blocks}) == classes
    assert len({sum(p.numel() for p in b.parameters()) for b in stack.blocks}) > 1  # blocks of different sizes


def _repeated() -> nn.Module:
    model = hf_llama(layers=3)
    model.model.layers[2] = model.model.layers[0]  # weights shared across depth, ALBERT-style
    model.config.use_cache = False  # (see test_a_repeated_block_with_a_kv_cache_is_refused)
    return model


def _tied_across_blocks() -> nn.Module:
    model = hf_llama(layers=3)
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    return model


def _tied_to_outside() -> nn.Module:
    model = hf_llama(layers=3)
    model.model.norm.weight = model.model.layers[1].post_attention_layernorm.weight
    return model


@pytest.mark.parametrize(
    ("make", "line"),
    [
        (
            _repeated,
            "streaming model.model.layers (3 blocks, 75% of the parameters); one host unit for each block at several "
            "positions (model.model.layers.0 at positions 0, 2)",
        ),
        (
            _tied_across_blocks,
            "streaming model.model.layers (3 blocks, 81% of the parameters); 1 parameters shared between blocks or "
            "with the rest of the model held once on the device (model.model.layers.0.mlp.up_proj.weight)",
        ),
        (
            _tied_to_outside,
            "streaming model.model.layers (3 blocks, 82% of the parameters); 1 parameters shared between blocks or "
            "with the rest of the model held once on the device (model.model.layers.1.post_attention_layernorm.weight)",
        ),
    ],
    ids=["repeated-block", "tied-across-blocks", "tied-to-outside"],
)
def test_shared_blocks_and_parameters_train_like_ordinary_training(make, line, caplog):
    """A module at several positions is one host unit whose gradients are summed over its calls; a parameter
    reachable from two blocks, or from a block and the rest of the model, is one outer parameter whose gradient
    autograd sums over its uses: both stepped once. (Zamba2, whose hybrid layers share one transformer block,
    trains in the zoo: tests/zoo_families.py.)"""
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        ref, mt, _ = run_pair(Zoo(make), token_batches(2 * ACCUMULATE), steps=2, **TRAIN_KWARGS)
    assert_bitwise(ref, mt)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(line)]


@pytest.mark.parametrize(
    ("make", "shared"),
    [
        (zamba2, lambda m: list(m.model.layers[1].shared_transformer.parameters())),
        (_repeated, lambda m: []),
        (_tied_across_blocks, lambda m: [m.model.layers[0].mlp.up_proj.weight]),
        (_tied_to_outside, lambda m: [m.model.norm.weight]),
    ],
    ids=["zamba2", "repeated-block", "tied-across-blocks", "tied-to-outside"],
)
def test_shared_weights_are_held_once(make, shared):
    model = make()
    distinct = sum(p.numel() for p in model.parameters())  # (parameters() yields a shared one once)
    expected = {id(p) for p in shared(model)}
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    try:
        assert set(engine.layout.shared) == expected
        outer = {id(e.param) for u in engine.outer_units for e in u.entries}
        assert expected <= outer and not any(id(e.param) in expected for u in engine.units for e in u.entries)
        assert engine.num_parameters() == distinct
        assert engine.host_bytes()["master"] == 4 * distinct
        blocks = engine.layout.stacks[0].blocks
        assert len(engine.units) == len({id(b) for b in blocks})  # a repeated module: one unit
    finally:
        engine.close()


def test_a_repeated_block_with_a_kv_cache_is_refused():
    """With ``use_cache=True`` ordinary training lets the second call of a layer index attend to the keys its
    first call cached; a recomputed block cannot repeat that, so the engine refuses instead of differing."""
    model = _repeated()
    model.config.use_cache = True
    with pytest.raises(ValueError) as err:
        Engine(model, EngineConfig(device="cpu", precision="32-true"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("model.layers.0 at positions 0, 2 of LlamaForCausalLM is one module")
    assert "model.config.use_cache = False" in line
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


class TwoStacksLM(UserEncoderLM):
    """A user's model with two stacks of the same size: neither holds half the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.more = copy.deepcopy(self.blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in [*self.blocks, *self.more]:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def test_two_stacks_of_the_same_size_both_stream(caplog):
    model = _seeded(TwoStacksLM)
    batches = token_batches(2 * ACCUMULATE)
    ref, mt = CausalLM(copy.deepcopy(model), loss_fn=user_loss), CausalLM(model, loss_fn=user_loss)
    seeded_fit(make_trainer("auto", **TRAIN_KWARGS), ref, batches)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        seeded_fit(make_trainer("megatrain", **TRAIN_KWARGS), mt, batches)
    assert_bitwise(ref, mt)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming ")]
    assert lines == [
        "streaming model.blocks (2 blocks, 42% of the parameters) and model.more (2 blocks, 42% of the parameters)"
    ]


@pytest.mark.parametrize("pick", ["model.more", lambda m: m.model.more], ids=["name", "callable"])
def test_blocks_option_streams_the_named_list(pick, caplog):
    make = lambda: _seeded(TwoStacksLM)  # noqa: E731
    batches = token_batches(2 * ACCUMULATE)
    ref, mt = CausalLM(make(), loss_fn=user_loss), CausalLM(make(), loss_fn=user_loss)
    seeded_fit(make_trainer("auto", **TRAIN_KWARGS), ref, batches)
    strategy = MegatrainStrategy(blocks=pick)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        seeded_fit(make_trainer(strategy, **TRAIN_KWARGS), mt, batches)
    assert_bitwise(ref, mt)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming ")]
    assert lines == [
        "streaming model.more (2 blocks, 42% of the parameters); not streamed, trained as ordinary modules on the "
        "device: model.blocks (2 blocks, 42% of the parameters)"
    ]


@pytest.mark.parametrize(
    ("pick", "stacks"), [("blocks", ["blocks"]), (["more", "blocks"], ["more", "blocks"]), (None, ["blocks", "more"])]
)
def test_blocks_option_picks_the_lists_for_the_engine(pick, stacks):
    engine = Engine(_seeded(TwoStacksLM), EngineConfig(device="cpu", precision="32-true", blocks=pick))
    assert [c.blocks for c in engine.layout.stacks] == [getattr(engine.model, s) for s in stacks]
    assert [u.name for u in engine.units] == [f"{s}.{i}" for s in stacks for i in range(2)]
    engine.close()


def test_blocks_option_naming_one_stack_twice_is_refused():
    with pytest.raises(ValueError, match=r"^blocks: blocks and blocks hold the same modules .*name each stack") as err:
        Engine(_seeded(TwoStacksLM), EngineConfig(device="cpu", precision="32-true", blocks=["blocks", "blocks"]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("pick", "expected"),
    [
        ("model.stack", "blocks='model.stack' is not a module of TwoStacksLM: choose one of its module lists"),
        ("norm", "blocks='norm' is a LayerNorm, not a non-empty nn.ModuleList of TwoStacksLM"),
        (lambda m: m.norm, "returned a LayerNorm, not a non-empty nn.ModuleList inside the model"),
    ],
    ids=["missing", "not-a-list", "callable"],
)
def test_bad_blocks_option_names_it_and_the_candidates(pick, expected):
    with pytest.raises(ValueError) as err:
        Engine(_seeded(TwoStacksLM), EngineConfig(device="cpu", precision="32-true", blocks=pick))
    line = str(err.value)
    assert expected in line and "\n" not in line
    assert line.endswith("(blocks (2 blocks, 42% of the parameters), more (2 blocks, 42% of the parameters))")


@pytest.mark.parametrize("bad", [3, "", nn.ModuleList, [], ["blocks", 3]])
@pytest.mark.parametrize("build", [MegatrainStrategy, EngineConfig])
def test_blocks_option_of_the_wrong_type_is_refused(build, bad):
    with pytest.raises(ValueError, match=r"^blocks=.*: give the dotted name of the model's nn.ModuleList") as err:
        build(blocks=bad)
    assert "\n" not in str(err.value)


class OneMoELayer(nn.Module):
    """No list of layers, but a list of experts inside the one layer: not the blocks to stream."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)  # 3104 parameters
        self.layer = nn.Module()
        self.layer.experts = nn.ModuleList(nn.Linear(32, 8) for _ in range(2))  # 2 x 264
        self.head = nn.Linear(32, VOCAB)  # 3201


def test_a_list_nested_in_a_layer_is_not_streamed():
    with pytest.raises(ValueError) as err:
        Engine(OneMoELayer(), EngineConfig(device="cpu", precision="32-true"))
    assert "holds less than 20% of its parameters (found: layer.experts (2 blocks, 8% of the parameters))" in str(
        err.value
    )


def _aliased() -> nn.Module:
    model = hf_llama(layers=3)
    model.first_layer = model.model.layers[0]  # the same block under a second name, never called there
    return model


def test_a_block_kept_under_a_second_name_trains_like_ordinary_training():
    """Sharing is judged by module, not by name: a block the model also holds elsewhere is one block."""
    ref, mt, _ = run_pair(Zoo(_aliased), token_batches(2 * ACCUMULATE), steps=2, **TRAIN_KWARGS)
    assert_bitwise(ref, mt)


def test_fabric_strategy_streams_the_named_list():
    from lightning.fabric import Fabric

    from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy

    strategy = MegatrainFabricStrategy(blocks="more")
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", strategy=strategy)
    fabric.launch()  # (the megatrain strategy is not a SingleDeviceStrategy: Fabric requires it)
    model = _seeded(TwoStacksLM)
    fabric.setup(model, torch.optim.AdamW(model.parameters()))
    assert [c.blocks for c in strategy.engine.layout.stacks] == [model.more]
    strategy.teardown()


@pytest.mark.parametrize("make", [zamba2, _repeated], ids=["zamba2", "repeated-block"])
def test_shared_weights_round_trip_through_a_checkpoint(make, tmp_path):
    """A shared weight is one record of the checkpoint; a fresh engine over a zeroed copy restores every
    parameter (each name a shared weight has included)."""
    model = make()
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
        engine.save(str(tmp_path / "ckpt"), optimizer=False)
        want = {k: v.clone() for k, v in engine.master_state_dict().items()}
    with Engine(other, EngineConfig(device="cpu", precision="32-true")) as engine:
        engine.load(str(tmp_path / "ckpt"), optimizer=False)
        got = engine.master_state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in other.parameters())


# -- stacks in an nn.Sequential ----------------------------------------------------------------------------


class ViTBlock(nn.Module):
    """A timm-style vision transformer block: pre-norm attention and MLP, with dropout."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patches in, a class token out; the blocks in an nn.Sequential (with a parameterless layer between two)."""

    def __init__(self, width: int = 16, patch: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Linear(patch, width)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, width))
        self.blocks = nn.Sequential(ViTBlock(width), ViTBlock(width), nn.Identity(), ViTBlock(width))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images)
        x = self.blocks(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1))
        return self.head(self.norm(x)[:, 0])


def train_vit(model: nn.Module, streamed: bool, steps: int = 3) -> list[float]:
    torch.manual_seed(SEED_VIT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true")) if streamed else None
    if engine is not None:
        opt = engine.optimizer(opt)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        images, labels = torch.randn(3, 4, 8, generator=g), torch.randint(0, 5, (3,), generator=g)
        loss = nn.functional.cross_entropy(model(images), labels)
        with engine.backward() if engine is not None else nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:
        engine.close()
    return losses


SEED_VIT = 11


def test_blocks_in_an_nn_sequential_stream_and_train_like_ordinary_training():
    torch.manual_seed(0)
    ref = ViT()
    mt = copy.deepcopy(ref)
    layout = find_blocks(mt)
    assert [c.blocks for c in layout.stacks] == [mt.blocks] and layout.names == ["blocks.0", "blocks.1", "blocks.3"]
    assert layout.describe(mt) == "streaming blocks (4 blocks, 96% of the parameters)"
    assert train_vit(mt, streamed=True) == train_vit(ref, streamed=False)
    for (name, p), q in zip(ref.named_parameters(), mt.parameters()):
        assert torch.equal(p, q), name


def test_an_nn_sequential_of_single_layers_is_not_a_stack():
    """An MLP (Linear, activation, Linear) is one layer's insides, not a stack of blocks: nothing to stream."""
    model = nn.Module()
    model.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    with pytest.raises(ValueError, match=r"has none: it looks for an nn\.ModuleList .* or an nn\.Sequential"):
        find_blocks(model)
    assert [c.blocks for c in find_blocks(model, "mlp").stacks] == [model.mlp]  # (named, it streams)
