"""The device-memory figures the "auto" choices read, and the rule num_slots="auto" sizes the slots by."""

from __future__ import annotations

import torch

from megatrain_lightning.planning.device_memory import SLOT_RESERVE_BYTES, auto_slot_count, step_transient_bytes

GiB = 2**30


def test_auto_slots_take_what_is_left_beyond_four_transients_and_the_reserve():
    """free 80 GiB, a step needing 5 GiB, 1 GiB slots: 80 - 4 x 5 - 1 = 59 GiB left for 59 more slots."""
    assert auto_slot_count(80 * GiB, 5 * GiB, GiB, blocks=100) == 2 + 59
    assert auto_slot_count(80 * GiB - 1, 5 * GiB, GiB, blocks=100) == 2 + 58  # whole slots only


def test_auto_slots_stop_at_one_per_block_and_never_shrink():
    assert auto_slot_count(80 * GiB, 5 * GiB, GiB, blocks=32) == 32
    assert auto_slot_count(4 * 5 * GiB + SLOT_RESERVE_BYTES - 1, 5 * GiB, GiB, blocks=32) == 2  # no room: the 2 stay
    assert auto_slot_count(0, 5 * GiB, GiB, blocks=32, current=3) == 3
    assert auto_slot_count(80 * GiB, 0, GiB, blocks=2) == 2


def test_four_transients_keep_the_other_auto_choices_where_they_were():
    """After the slots grow, the free memory is still at least four times the step's transient, which
    holds the saved inputs (offloaded beyond half of the free memory) and one block's recompute (tiled
    beyond a quarter): a step that kept its inputs and ran untiled still does."""
    free, saved, recompute, slot = 75 * GiB, 8 * GiB, 10 * GiB, GiB // 2
    transient = saved + recompute
    slots = auto_slot_count(free, transient, slot, blocks=1000)
    left = free - (slots - 2) * slot
    assert slots > 2 and not saved > left // 2 and recompute <= left // 4


def test_step_transient_is_the_peak_above_what_is_allocated_now(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 12 * GiB)
    assert step_transient_bytes(torch.device("cuda", 0)) == 18 * GiB
    assert step_transient_bytes(torch.device("cpu")) is None
