"""The planner's rank code (megatrain_lightning/planning/ranks.py): a one-rank plan names no devices or nodes and
sets nothing aside for collectives; a plan of several says so, in the words its texts give."""

from __future__ import annotations

import pytest

from megatrain_lightning.planning.ranks import COLLECTIVE_BYTES, data_parallel_text, exchange_bytes


def test_one_rank_says_nothing_of_devices_or_nodes():
    assert data_parallel_text(1, 1, " per node ({devices} GPUs x {nodes} nodes)") == ""


@pytest.mark.parametrize(("devices", "nodes"), [(2, 1), (1, 3), (4, 2)])
def test_several_ranks_fill_in_the_shape(devices, nodes):
    text = data_parallel_text(devices, nodes, " {devices} GPUs x {nodes} nodes (W={ranks})")
    assert text == f" {devices} GPUs x {nodes} nodes (W={devices * nodes})"


def test_one_rank_sets_nothing_aside_for_collectives():
    assert exchange_bytes(10, 2, 1) == 0


def test_several_ranks_set_aside_the_library_and_the_largest_units_exchange():
    # 10 elements over 4 ranks: chunks of 3, parts 4 x 3 x 2 B, the chunk's fp32 sum and bf16 result 3 x (4 + 2) B
    assert exchange_bytes(10, 2, 4) == COLLECTIVE_BYTES + 24 + 18
    assert COLLECTIVE_BYTES == 2**29  # half a GiB, an allowance
