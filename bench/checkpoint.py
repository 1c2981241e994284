"""Sharded checkpoint throughput: save and load MB/s to a local directory and to a local S3 server.

    python bench/checkpoint.py [--layers 8] [--hidden 1024]

Saves the engine's host state (fp32 master + Adam m and v: 12 bytes/param) of this project's Llama
and loads it back, timing each; the S3 server is SeaweedFS on 127.0.0.1, sharing the 2 cores with the
benchmark (a floor for object stores, not a forecast for a real one). Run from the repository root.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.checkpoint import restore, save
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM


def build(layers: int, hidden: int) -> Engine:
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
    )
    engine = Engine(LlamaForCausalLM(cfg), EngineConfig(device="cpu", precision="32-true"))
    for unit in engine.all_units():
        unit.alloc_optimizer_state()
        unit.m.normal_()
        unit.v.uniform_()
    return engine


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    engine = build(args.layers, args.hidden)
    mb = sum(u.numel for u in engine.all_units()) * 12 / 2**20
    sys.path.insert(0, os.getcwd())
    from tests.s3_server import seaweedfs

    print("| storage | state MB | save s | save MB/s | load s | load MB/s |\n|---|---|---|---|---|---|")
    row(engine, mb, "local dir", os.path.join(tempfile.mkdtemp(), "last.ckpt"))
    with seaweedfs("bench") as env:
        os.environ.update(env)
        row(engine, mb, "S3 (SeaweedFS, loopback)", "s3://bench/run/last.ckpt")


def row(engine: Engine, mb: float, name: str, url: str) -> None:
    t_save = timed(lambda: save(engine, url, {}))
    t_load = timed(lambda: restore(engine, url, optimizer=True))
    print(f"| {name} | {mb:.0f} | {t_save:.2f} | {mb / t_save:.0f} | {t_load:.2f} | {mb / t_load:.0f} |")


if __name__ == "__main__":
    main()
