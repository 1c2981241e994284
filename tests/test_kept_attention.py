"""keep_attention (engine/device/kept_attention.py): a recomputed block call's fused attention outputs kept from its
forward and handed to its recompute, which runs no attention forward; training equal to the engine without it.

Bit for bit on the CPU: attention's backward gets the output and log-sum-exp its forward computed, which a recompute
computes again identically (the same kernel on the same query, key and value), so the gradients cannot differ by a
bit. What is checked besides: that the recomputes really ran no attention forward (``kept_attention`` counts the calls
handed back, and a counting mode sees no attention kernel in them), with the outputs on the device, offloaded beside
the block's input, and per row chunk; that a recompute whose query differs from its forward's is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.device.kept_attention import KEPT_CALL, KEPT_OPS, Tape
from tests.helpers import hf_llama, hf_loss, own_llama, own_loss, token_batches
from tests.test_compile_blocks import eager_backend as eager_backend  # (a fixture)

pytestmark = pytest.mark.usefixtures("torch_adam")  # bit-for-bit claims need torch's own AdamW arithmetic

ROWS, SEQ, STEPS, LAYERS = 4, 16, 2, 3
BATCHES = token_batches(STEPS, batch=ROWS, seq=SEQ)
MODELS = {"hf-llama": (hf_llama, hf_loss), "own-llama": (own_llama, own_loss)}
CASES = {
    "on the device": {},
    "offloaded": {"offload_inputs": True},
    "row chunks, offloaded": {"offload_inputs": True, "row_chunk": 2},
}


def train(make, lossf, **config):
    """Losses, every step's gradients and the final weights of a plain loop with the engine; its stats."""
    model = make(LAYERS)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", overlap_optimizer=False, **config))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, grads = [], []
    for batch in BATCHES:
        with engine.backward():
            loss = lossf(model, batch)
            loss.backward()
        with engine.gradients_visible():
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    engine.flush()
    stats = dict(engine.stats)
    engine.close()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, stats


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in b) and a.keys() == b.keys()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", MODELS)
def test_kept_attention_trains_bit_for_bit_as_the_recompute_of_it(family, case):
    make, lossf = MODELS[family]
    ref = train(make, lossf, **CASES[case])
    got = train(make, lossf, keep_attention=True, **CASES[case])
    assert got[0] == ref[0]
    assert all(same(g, r) for g, r in zip(got[1], ref[1]))
    assert same(got[2], ref[2])
    chunks = ROWS // CASES[case].get("row_chunk", ROWS)
    assert got[3]["kept_attention"] == STEPS * LAYERS * chunks  # every recompute's attention came from its forward
    assert ref[3]["kept_attention"] == 0
    if "offload_inputs" in CASES[case]:
        assert got[3]["input_offload_bytes"] > ref[3]["input_offload_bytes"]  # the outputs went to the host and back


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.attention += int(func in KEPT_OPS)
        return func(*args, **(kwargs or {}))


def test_the_backward_runs_no_attention_forward():
    counts = {}
    for keep in (False, True):
        model = hf_llama(LAYERS)
        engine = Engine(model, EngineConfig(device="cpu", precision="32-true", keep_attention=keep))
        loss = hf_loss(model, BATCHES[0])
        with _Count() as mode:
            loss.backward()
        counts[keep] = mode.attention
        engine.close()
    assert counts == {False: LAYERS, True: 0}


class _Block(nn.Module):
    """Attention whose query is scaled by a plain attribute (not a buffer: nothing the engine replays)."""

    def __init__(self, width=8):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.scale = 1.0

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(
            F.scaled_dot_product_attention(q * self.scale, k, v, is_causal=True).transpose(1, 2).flatten(2)
        )


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def test_a_recompute_whose_query_differs_is_refused():
    # The block's output in the recompute comes from the kept attention output, whatever its query: only the check
    # of the query, key and value can tell that the kept output is not this recompute's.
    net = _Net()
    engine = Engine(net, EngineConfig(device="cpu", precision="32-true", blocks="layers", keep_attention=True))
    loss = net(torch.randn(2, 6, 8))
    net.layers[1].scale = 2.0  # changed between the forward and the backward
    with pytest.raises(RuntimeError, match="block layers.1: its recompute in backward did not reproduce"):
        loss.backward()
    engine.close()


def bare_tape(block: str = "b") -> Tape:
    """A tape on its own: no fingerprints to compare, counters of its own."""
    return Tape(block, lambda ts: None, lambda a, b: None, {"kept_attention": 0})


def kept_call(tape: Tape, shape: tuple[int, ...]) -> torch.Tensor:
    """One attention call the tape keeps; its query (key and value alike)."""
    q = torch.randn(shape)
    with tape.running():
        F.scaled_dot_product_attention(q, q, q)
    return q


def test_a_recompute_with_another_number_of_attention_calls_is_refused():
    tape = bare_tape()
    q = kept_call(tape, (1, 2, 4, 8))
    with tape.running(), tape.replay():
        F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(RuntimeError, match="more often than its forward"):
            F.scaled_dot_product_attention(q, q, q)
    with tape.running():
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with tape.running(), tape.replay(), pytest.raises(RuntimeError, match="other arguments than its forward"):
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    tape.kept.clear()
    with tape.running():
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError, match="1 times fewer"):
        tape.left_over()


def test_an_attention_with_dropout_is_refused():
    # (On the CPU torch computes an attention with dropout by its math backend, which is recomputed: the fused
    # kernels of a GPU take dropout, and a kernel handed back would not advance the generator.)
    tape = bare_tape("layers.0")
    q = torch.randn(1, 2, 4, 8)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with pytest.raises(RuntimeError, match="block layers.0: keep_attention=True cannot keep an attention with dropout"):
        tape.record(op, (q, q, q, 0.1), {})
    assert len(tape.kept) == 0
    tape.record(op, (q, q, q), {"dropout_p": 0.0})
    assert len(tape.kept) == 1


def test_keep_attention_refuses_a_lossy_input():
    with pytest.raises(ValueError, match="keep_attention=True with offload_inputs_dtype='fp8'"):
        EngineConfig(device="cpu", keep_attention=True, offload_inputs_dtype="fp8")


def test_compiled_blocks_keep_their_attention_between_compiled_pieces():
    # Inductor compiles the block in two pieces around the eager attention call (slow: C++ on two cores). Against
    # the compiled blocks without keep_attention: the same pieces' kernels up to where inductor splits the graph, so
    # within the round-off tests/test_compile_blocks.py bounds (its LOSS_BOUND); measured equal here.
    make, lossf = MODELS["hf-llama"]
    ref = train(make, lossf, compile_blocks=True)
    got = train(make, lossf, compile_blocks=True, keep_attention=True)
    assert got[3]["kept_attention"] == STEPS * LAYERS
    assert max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0])) <= 1e-5
    err = max(float((got[2][n] - ref[2][n]).norm() / ref[2][n].norm()) for n in ref[2])
    assert err <= 1e-5  # (measured 1.8e-6: each tensor's ||difference|| / ||weights|| after the steps)
    assert any(KEPT_CALL in reason for reason in counters["graph_break"])  # compiled around it, not run eagerly


class _Breaking(_Block):
    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


def test_another_graph_break_is_refused_with_keep_attention(eager_backend):
    net = _Net()
    net.layers[1] = _Breaking()
    engine = Engine(
        net, EngineConfig(device="cpu", precision="32-true", blocks="layers", keep_attention=True, compile_blocks=True)
    )
    with pytest.raises(RuntimeError, match="could not compile decoder block class _Breaking as one graph"):
        net(torch.randn(2, 6, 8)).backward()
    engine.close()


def test_stowed_outputs_come_back_with_the_forwards_strides_and_no_flattening_copy():
    tape = bare_tape()
    kept_call(tape, (2, 3, 5, 8))
    (kept,) = tape.kept
    before = [(t.shape, t.stride(), t.clone()) for t in kept.outputs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    assert any(stride != torch.empty(shape).stride() for shape, stride, _ in before)  # (the kernel's output is a view)
    host = []

    def store(t):
        assert t.is_contiguous()  # stored as it lies in memory: a flat view, no copy
        host.append(t.clone())
        return len(host) - 1

    tape.stow(store)
    assert tape.bring(lambda h: host[h]) == [0, 1]
    after = [t for t in kept.outputs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    assert [(t.shape, t.stride()) for t in after] == [(shape, stride) for shape, stride, _ in before]
    assert all(torch.equal(t, v) for t, (_, _, v) in zip(after, before))
