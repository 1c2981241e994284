"""Sharded checkpoint throughput: save and load MB/s to a local directory and to a local S3 server.

    python bench/checkpoint.py [--layers 8] [--hidden 1024]

Saves the engine's host state (fp32 master + Adam m and v: 12 bytes/param) of this project's Llama
and loads it back, timing each; the S3 server is moto on 127.0.0.1 (single-threaded Python, so its
figure is a floor for object stores, not a forecast for AWS).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from megatrain_lightning import StreamingEngine
from megatrain_lightning.checkpoint import restore, save
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM


def build(layers: int, hidden: int) -> StreamingEngine:
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256)  # fmt: skip
    engine = StreamingEngine(LlamaForCausalLM(cfg), device="cpu", compute_dtype=torch.float32)
    for unit in engine.all_units():
        unit.alloc_optimizer_state()
        unit.m.normal_()
        unit.v.uniform_()
    return engine


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def start_s3() -> str:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")  # fmt: skip
    import fsspec

    fsspec.filesystem("s3").mkdir("bench")
    return "s3://bench/run/last.ckpt"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    engine = build(args.layers, args.hidden)
    mb = sum(u.numel for u in engine.all_units()) * 12 / 2**20
    targets = {"local dir": os.path.join(tempfile.mkdtemp(), "last.ckpt"), "S3 (moto, loopback)": start_s3()}
    print("| storage | state MB | save s | save MB/s | load s | load MB/s |\n|---|---|---|---|---|---|")
    for name, url in targets.items():
        t_save = timed(lambda: save(engine, url, {}))
        t_load = timed(lambda: restore(engine, url, optimizer=True))
        print(f"| {name} | {mb:.0f} | {t_save:.2f} | {mb / t_save:.0f} | {t_load:.2f} | {mb / t_load:.0f} |")


if __name__ == "__main__":
    main()
