"""The step's last gradient sums sent down needed first (engine/host/needed_first.py).

Under copy streams that really run late (tests/async_streams.py), polled as a link that never has room before
the backward ends, a step of micro-batches with every unit summed on the device and
speculative steps: the sums beyond the first IN_FLIGHT wait and go in the next forward's order, and the run is the
run without the ordering, bit for bit (the same bytes into the same accumulators, landed and stepped as before).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_lightning.engine.host.needed_first import IN_FLIGHT, NeededFirst
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import PROFILES
from megatrain_lightning.schedule.modelled import modelled_step
from tests.async_streams import AsyncStreams, install
from tests.helpers import hf_llama, twin
from tests.test_speculative_step import LAYERS, NOT_CLIPPED, assert_same_run, loop, units_of

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


class BusyLink:
    """Streams whose link never has room: every sum beyond IN_FLIGHT waits."""

    def ended(self, event) -> bool:
        return False


def in_backward(work) -> None:
    """Run `work()` inside a backward pass (where NeededFirst can queue autograd's final callback)."""

    class Ship(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            work()
            return g

    Ship.apply(torch.ones(1, requires_grad=True)).sum().backward()


def sent_ranks(monkeypatch) -> list[int]:
    """The ranks of the sums in the order NeededFirst sends them (appended to as the runs go)."""
    order: list[int] = []
    send = NeededFirst._send

    def spy(self, w):
        order.append(w.rank)
        return send(self, w)

    monkeypatch.setattr(NeededFirst, "_send", spy)
    return order


def test_sums_wait_for_the_link_and_go_needed_first_bit_for_bit(monkeypatch):
    made = install(monkeypatch, hold=1.0)
    monkeypatch.setattr(AsyncStreams, "ended", lambda self, event: False)  # the link busy until the end
    order = sent_ranks(monkeypatch)
    layers = 2 * IN_FLIGHT  # (more blocks than fit on the link)
    a, b = twin(lambda: hf_llama(layers))
    options = dict(clip=NOT_CLIPPED, micro=2, device_grad_sums=layers, num_slots=layers)  # (uploads ahead)
    ordered = loop(a, True, **options)
    assert made and ordered[3]["speculative_kept"] > 0
    units = layers + units_of(a) - LAYERS  # the blocks, and the embedding, final norm and head
    steps = len(order) // units
    assert len(order) == steps * units and steps == 3  # every unit's sum of each step's last backward
    for s in range(steps):
        ranks = order[s * units : (s + 1) * units]
        # The first IN_FLIGHT go as they come (the link had room: the head's, the final norm's, the last block's);
        # the rest waited and went needed first: the embedding's (rank 1), made last, then blocks 0, 1, ...
        assert ranks[IN_FLIGHT:] == [1, *range(2, 2 + layers - IN_FLIGHT + 2)], ranks
    assert ordered[3]["sums_held_for_the_link"] == steps * (units - IN_FLIGHT)

    monkeypatch.setattr(NeededFirst, "defer", lambda self, rank, unit, send: False)  # sent at once
    plain = loop(b, True, **options)
    assert plain[3]["sums_held_for_the_link"] == 0
    assert_same_run(ordered, plain)


def test_a_unit_waiting_for_the_link_is_sent_before_anything_reads_it():
    """send_now sends one waiting sum out of order; flush sends the rest needed first; defer outside a
    backward says no (nothing would send it at the end)."""

    stats = {"sums_held_for_the_link": 0}
    q = NeededFirst(BusyLink(), stats)
    sent: list[str] = []
    assert not q.defer(0, object(), lambda: sent.append("outside"))  # no backward running
    assert sent == []

    n = IN_FLIGHT + 2
    units = [object() for _ in range(n)]  # unit i: rank i (needed i-th)

    def ship():
        for i in reversed(range(n)):  # made last-needed first, as a backward makes them
            assert q.defer(i, units[i], lambda i=i: sent.append(i) or i)
        q.send_now(units[1])  # (it waits behind those on the link; unit 0 is needed before it)
        sent.append("|")  # (the final callback runs after this backward returns)

    in_backward(ship)
    # the last-needed IN_FLIGHT go at once (the link had room), unit 1 when asked for, unit 0 at the backward's end
    assert sent == [*reversed(range(2, n)), 1, "|", 0]
    assert stats["sums_held_for_the_link"] == 2 and not q.waiting()


def test_with_fewer_slots_than_blocks_no_sum_waits(monkeypatch):
    """Without a slot for every block (no uploads ahead) the sums go as they are made."""
    install(monkeypatch, hold=1.0)
    monkeypatch.setattr(AsyncStreams, "ended", lambda self, event: False)
    layers = 2 * IN_FLIGHT
    run = loop(hf_llama(layers), True, clip=NOT_CLIPPED, micro=2, device_grad_sums=layers, num_slots=2)
    assert run[3]["speculative_kept"] > 0 and run[3]["sums_held_for_the_link"] == 0


def test_the_schedule_model_answers_the_links_poll_live_and_the_step_is_shorter(monkeypatch):
    """Recorded on the tiny Llama, 2 micro-batches, every unit summed and speculated, over a link slow enough
    that the sums queue behind each other: the poll is answered by the live replay (as a GPU would answer it), so
    sums wait and go needed first, and the step is shorter than with each sum sent as it is made, for the same
    GPU work."""
    config = LlamaConfig.from_preset("tiny", token_chunk_size=None)
    blocks = config.num_hidden_layers
    slow_link = dataclasses.replace(PROFILES["a100"], link_gbps=0.01)

    def record():
        return modelled_step(
            config, slow_link, 32, micro_batches=2, clip=1.0, num_slots=blocks, steps=2, grad_sums=blocks,
            speculative_step=True,
        ).summary  # fmt: skip

    ordered = record()
    monkeypatch.setattr(NeededFirst, "defer", lambda self, rank, unit, send: False)
    plain = record()
    assert ordered.busy["gpu"] == pytest.approx(plain.busy["gpu"])
    assert ordered.step_s < 0.9 * plain.step_s


def test_a_backward_that_failed_leaves_its_sums_to_the_next_ones_final_callback():
    """A backward that raises after a sum waited runs no final callback; the next backward queues its own, which
    sends both (needed first)."""

    q = NeededFirst(BusyLink(), {"sums_held_for_the_link": 0})
    sent: list[int] = []

    def backward_deferring(ranks: list[int], fail: bool) -> None:
        def ship():
            for r in ranks:
                assert q.defer(r, object(), lambda r=r: sent.append(r) or r)
            if fail:
                raise RuntimeError("a failing backward")

        in_backward(ship)

    with pytest.raises(RuntimeError, match="a failing backward"):
        backward_deferring([*range(IN_FLIGHT + 2, 1, -1)], fail=True)  # the first IN_FLIGHT go, the last waits
    assert q.waiting() and sent == [*range(IN_FLIGHT + 2, 2, -1)]
    backward_deferring([0], fail=False)
    assert not q.waiting() and sent[IN_FLIGHT:] == [0, 2]
