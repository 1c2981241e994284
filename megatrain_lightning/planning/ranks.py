"""The planner's rank code: what a plan says and sets aside differently when it is data parallel.

A plan of one rank (``devices=1``, ``nodes=1``) is a single GPU's: its text names no devices or nodes and its GPU
keeps nothing for collectives. A plan of several says its host figures are per node (planner.py's docstring
says why) and sets aside on each GPU the gradient exchange of the largest unit. The count is tested here only,
so that the table, the summary line, the refusals and the plot's title (lightning/plots.py) speak of a run
alike.
"""

from __future__ import annotations

COLLECTIVE_BYTES = 2**30 // 2
"""GPU allowance per rank for the collective library's own buffers when W > 1 (NCCL keeps a few MiB per
channel and peer, more with NVLink SHARP); an allowance, not a measurement."""


def data_parallel_text(devices: int, nodes: int, text: str) -> str:
    """`text` with ``{devices}``, ``{nodes}`` and ``{ranks}`` (W = devices x nodes) filled in when the run has
    several ranks; "" when it has one."""
    ranks = devices * nodes
    return text.format(devices=devices, nodes=nodes, ranks=ranks) if ranks > 1 else ""


def exchange_bytes(largest: int, dtype_bytes: int, ranks: int) -> int:
    """GPU bytes a rank sets aside for collectives (none with one rank): the library's allowance, and the
    gradient exchange of the largest unit (`largest` elements): its parts (the unit, padded to W chunks) in the
    compute dtype (`dtype_bytes` each) and its chunk's fp32 sum and compute-dtype result."""
    if ranks <= 1:
        return 0
    chunk = -(-largest // ranks)
    return COLLECTIVE_BYTES + chunk * ranks * dtype_bytes + chunk * (4 + dtype_bytes)
