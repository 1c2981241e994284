"""Which blocks stream (engine/discover.py): found by a stated rule, named with ``blocks=``, never silently wrong.

Trainings are compared with ordinary Lightning training bitwise (torch backend), with tests/test_zoo.py's
helpers; what the engine refuses, it refuses at setup with one line naming what it found and the fix.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.discover import find_blocks
from tests.helpers import (
    DROPOUT,
    VOCAB,
    CausalLM,
    UserEncoderLM,
    Zoo,
    _seeded,
    hf_llama,
    hf_model,
    token_batches,
    user_loss,
)
from tests.helpers import trainer as make_trainer
from tests.test_zoo import ACCUMULATE, FAMILY_STEPS, TRAIN_KWARGS, assert_bitwise, run_pair, seeded_fit
from tests.zoo_families import IDS

pytestmark = pytest.mark.usefixtures("torch_adam")

MAMBA = dict(mamba_d_state=4, mamba_expand=2, **IDS)


def jamba() -> nn.Module:
    # Attention and mamba layers, two classes in one list; the mamba ones with a 2-expert MoE: two sizes.
    return hf_model(
        "Jamba",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_dt_rank=4,
        attention_dropout=DROPOUT,
        **MAMBA,
    )


def bamba() -> nn.Module:
    # One class whose blocks are mamba or attention by configuration: two sizes.
    return hf_model(
        "Bamba", num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, **MAMBA
    )


def zamba2() -> nn.Module:
    # Mamba layers and hybrid layers; every hybrid layer holds the one shared transformer block.
    return hf_model(
        "Zamba2",
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_headdim=8,
        n_mamba_heads=8,
        mamba_ngroups=1,
        num_mem_blocks=1,
        adapter_rank=4,
        **MAMBA,
    )


@pytest.mark.parametrize(("make", "classes"), [(jamba, 2), (bamba, 1)], ids=["jamba", "bamba"])
def test_hybrid_blocks_train_like_ordinary_training(make, classes):
    model = make()
    found = find_blocks(model)
    assert found.blocks is model.model.layers and len({type(b) for b in found.blocks}) == classes
    assert len({sum(p.numel() for p in b.parameters()) for b in found.blocks}) > 1  # blocks of different sizes
    ref, mt, _ = run_pair(Zoo(make), token_batches(FAMILY_STEPS * ACCUMULATE), steps=FAMILY_STEPS, **TRAIN_KWARGS)
    assert_bitwise(ref, mt)


def test_zamba2_shared_transformer_is_refused():
    """Zamba2's hybrid layers share one transformer block. Discovery once streamed a small list nested in it
    (77% off ordinary training); now the layer list is found and the sharing refused, naming it."""
    with pytest.raises(ValueError) as err:
        Engine(zamba2(), EngineConfig(device="cpu", precision="32-true"))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("model.layers.1.shared_transformer.") and " and model.layers.3.shared_transformer." in line
    assert "shared by two blocks" in line and "Untie them" in line


def _repeated() -> nn.Module:
    model = hf_llama(layers=3)
    model.model.layers[2] = model.model.layers[0]  # weights shared across depth, ALBERT-style
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
    ("make", "expected"),
    [
        (
            _repeated,
            "model.model.layers.0 and model.model.layers.2 are one module (LlamaDecoderLayer, weights shared across depth)",
        ),
        (
            _tied_across_blocks,
            "model.model.layers.0.mlp.up_proj.weight and model.model.layers.1.mlp.up_proj.weight are one parameter "
            "shared by two blocks",
        ),
        (
            _tied_to_outside,
            "model.model.layers.1.post_attention_layernorm.weight and model.model.norm.weight are one parameter "
            "shared by a block and the rest of the model",
        ),
    ],
    ids=["repeated-block", "tied-across-blocks", "tied-to-outside"],
)
def test_shared_weights_are_refused_at_setup(make, expected):
    module = CausalLM(make())
    with pytest.raises(ValueError) as err:
        make_trainer("megatrain").fit(module, [token_batches(1)[0]])
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())


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


def test_two_lists_of_about_the_same_size_are_refused():
    with pytest.raises(ValueError) as err:
        Engine(_seeded(TwoStacksLM), EngineConfig(device="cpu", precision="32-true"))
    line = str(err.value)
    assert "\n" not in line
    assert "two module lists of TwoStacksLM are about the same size" in line
    assert "found: blocks (2 blocks, 42% of the parameters); more (2 blocks, 42% of the parameters)" in line
    assert "blocks='<dotted name>'" in line


def test_the_larger_of_two_stacks_is_streamed_and_the_other_named(caplog):
    model = _seeded(TwoStacksLM)
    model.blocks.extend(copy.deepcopy(model.more))  # 4 blocks against 2 of the same class and size
    batches = token_batches(2 * ACCUMULATE)
    ref, mt = CausalLM(copy.deepcopy(model), loss_fn=user_loss), CausalLM(model, loss_fn=user_loss)
    seeded_fit(make_trainer("auto", **TRAIN_KWARGS), ref, batches)
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        seeded_fit(make_trainer("megatrain", **TRAIN_KWARGS), mt, batches)
    assert_bitwise(ref, mt)  # the unstreamed stack trains as ordinary modules, exactly
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("streaming ")]
    assert lines == [
        "streaming model.blocks: 4 blocks, 59% of the parameters; not streamed, trained as ordinary modules on "
        "the device: model.more (2 blocks, 29% of the parameters)"
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
        "streaming model.more: 2 blocks, 42% of the parameters; not streamed, trained as ordinary modules on the "
        "device: model.blocks (2 blocks, 42% of the parameters)"
    ]


def test_blocks_option_picks_the_list_for_the_engine():
    engine = Engine(_seeded(TwoStacksLM), EngineConfig(device="cpu", precision="32-true", blocks="blocks"))
    assert engine.blocks is engine.model.blocks and [u.name for u in engine.units[:2]] == ["blocks.0", "blocks.1"]
    engine.close()


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


@pytest.mark.parametrize("bad", [3, "", nn.ModuleList])
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

    from megatrain_lightning.fabric import MegatrainFabricStrategy

    strategy = MegatrainFabricStrategy(blocks="more")
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", strategy=strategy)
    fabric.launch()  # (the megatrain strategy is not a SingleDeviceStrategy: Fabric requires it)
    model = _seeded(TwoStacksLM)
    fabric.setup(model, torch.optim.AdamW(model.parameters()))
    assert strategy.engine.blocks is model.more
    strategy.teardown()
