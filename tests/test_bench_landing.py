"""bench/landing.py runs end to end on a small unit, and its parameters tile the unit as the engine's do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import requires_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
landing = pytest.importorskip("landing")


@pytest.mark.parametrize("numel", [1000, 1 << 20, (1 << 26) + 3])
def test_block_spans_tile_the_unit_in_order(numel):
    spans = landing.block_spans(numel)
    assert len(spans) == 9 and all(n > 0 for _, n in spans)
    assert [o for o, _ in spans] == [sum(n for _, n in spans[:i]) for i in range(9)]
    assert sum(n for _, n in spans) == numel


@requires_native
def test_prints_every_variant_and_the_summary_line(capsys, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "native")
    assert landing.main(["--numel", "100003", "--reps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| ") and "variant" not in line]
    assert sorted({r.split("|")[1].strip() for r in rows}) == ["fused", "two native", "two passes"]
    assert out[-1].startswith("landing: fused/two_passes=")
