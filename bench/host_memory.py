"""Host bytes per parameter that strategy='megatrain' actually allocates, by accounting and by RSS.

    python bench/host_memory.py [--layers 20] [--hidden 2048] [--nvme-dir DIR] [--devices N]

Builds this project's Llama (about 1B parameters by default) on the CPU, hands it to the engine, runs two
training steps and prints, per host layout, the engine's own per-buffer accounting next to the growth of
the process's resident memory, each run in a fresh process:

- allocated (RSS) = RSS after the steps - RSS before the engine + 4 B/param: the model's own fp32
  parameters (4 B/param) are released while the engine takes over, so they are added back;
- host (RSS) = allocated - the engine's "device" buffers: on a CPU-only machine the weight slots, gradient
  slots and outer-parameter copies that a GPU run keeps on the GPU are host memory too, so they are taken
  off to show what the host holds in a GPU run.

With ``--devices N`` (N > 1) the default layout also runs data parallel: N rank processes on this machine
(gloo), each holding 1/N of every unit's host state (engine/ranks.py), each measured as above; the node
row sums them, to be read against the one-process row: one copy of the state in total, plus each rank's
own buffers (its gradient slab shard, and on the CPU its device slots).

Every run's process fixes glibc's mmap and trim thresholds (1 MiB): with its default, dynamic threshold a
freed transient (on the CPU the "device" side's gradient exchange of a data-parallel rank is host memory)
raises the threshold and later buffers of that size stay resident after they are freed, which adds about
4 B/param to a rank's RSS that no buffer of the engine holds.

With ``--nvme-dir`` the lean layout also runs with the Adam moments in files there, and the same run
compares the drive speeds the tier reached while training (bytes over the time its IO threads spent in
reads and writes) with a dd-style sequential pass and bench/nvme.py's tier pass over that directory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import tempfile

import torch
from nvme import measure_sequential, measure_tier

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.lightning.callbacks import rss_bytes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM


def measure(
    layers: int, hidden: int, dtype: torch.dtype, layout: str, nvme_dir: str | None, group: object = None
) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        loss_chunk_size=256,
        token_chunk_size=None,
    )
    model = LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    before = rss_bytes()
    engine = Engine(
        model,
        EngineConfig(
            device="cpu",
            precision="32-true" if dtype == torch.float32 else "bf16-true",
            host_layout=layout,
            nvme_dir=nvme_dir,
            group=group,
        ),
    )
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (1, 32))
        with engine.backward():  # as the strategy runs it: the optimizer overlaps backward
            model(tokens, targets=tokens).backward()
        opt.step()
        opt.zero_grad()
    engine.flush()
    allocated = (rss_bytes() - before) / n + 4
    device = sum(engine.device_bytes().values()) / n
    acct = {k: v / n for k, v in engine.host_bytes().items()}
    nvme = engine.nvme_bytes() / n
    io = dict(engine.tier.stats, piece=engine.piece) if engine.tier is not None else None
    if group is not None:  # (close would gather the whole model into every rank: not what is measured)
        return {"params": n, "acct": acct, "allocated": allocated, "host": allocated - device, "nvme": nvme, "io": io}
    engine.close()
    return {"params": n, "acct": acct, "allocated": allocated, "host": allocated - device, "nvme": nvme, "io": io}


def _rank(rank: int, world: int, port: int, args: tuple, out: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = measure(*args, group=dist.group.WORLD)
    dist.barrier()
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def measure_ranks(world: int, args: tuple) -> list[dict]:
    """`measure` in `world` rank processes (gloo on this machine), one result per rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"rank process exited with {p.exitcode}")
        results = []
        for r in range(world):
            with open(f"{out}/{r}.json") as f:
                results.append(json.load(f))
    return results


def _row(name: str, r: dict) -> str:
    """A table row: bytes per parameter of the model, by kind."""
    a = r["acct"]
    return (
        f"| {name} | {r['params'] / 1e9:.2f}B | {a['master']:.2f} | {a['adam']:.2f} | {a['copy']:.2f} | "
        f"{a['slab']:.2f} | {a.get('ring', 0.0):.2f} | {r['nvme']:.2f} | {sum(a.values()):.2f} B/param | "
        f"{r['allocated']:.2f} B/param | {r['host']:.2f} B/param |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--nvme-dir", help="also run the lean layout with the Adam moments in files here")
    ap.add_argument("--devices", type=int, default=1, help="also run the default layout with this many ranks")
    args = ap.parse_args()
    for knob in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):  # read by each spawned run at its start
        os.environ.setdefault(knob, str(1 << 20))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    runs = [("default", None), ("lean", None)] + ([("lean", args.nvme_dir)] if args.nvme_dir else [])
    print(
        "| layout | params | master | adam m+v | copy | grad slab | rings | NVMe | total (accounting) | allocated (RSS) | host (RSS) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ctx = multiprocessing.get_context("spawn")  # a fresh process per run, so RSS figures don't mix
    io = None
    for layout, nvme in runs:
        with ctx.Pool(1) as pool:
            r = pool.apply(measure, (args.layers, args.hidden, dtype, layout, nvme))
        io = r["io"] or io
        print(_row(layout + (" + NVMe" if nvme else "") + f" ({args.dtype})", r))
    if args.devices > 1:
        ranks = measure_ranks(args.devices, (args.layers, args.hidden, dtype, "default", None))
        for i, r in enumerate(ranks):
            print(_row(f"default, rank {i} of {args.devices} ({args.dtype})", r))
        node = {  # each rank's figures are per parameter of the whole model, so the node's are their sums
            "params": ranks[0]["params"],
            "acct": {k: sum(r["acct"][k] for r in ranks) for k in ranks[0]["acct"]},
            "allocated": sum(r["allocated"] for r in ranks),
            "host": sum(r["host"] for r in ranks),
            "nvme": 0.0,
        }
        print(_row(f"default, node of {args.devices} ranks ({args.dtype})", node))

    if io is not None:
        print_drive(args.nvme_dir, io)


def print_drive(directory: str, io: dict) -> None:
    """The tier's GB/s while training beside dd-style and tier passes over 2 GiB in the same directory."""
    seq = measure_sequential(directory, 2 << 30)
    tier = measure_tier(directory, 2 << 30, io["piece"] * 8)
    print(
        f"\nNVMe directory {directory}, pieces of {io['piece']} elements ({io['piece'] * 8 / 2**20:.0f} MiB of m + v)"
    )
    print("| path | write GB/s | read GB/s |")
    print("|---|---|---|")
    print(
        f"| tier while training (bytes / IO seconds) | {io['write_bytes'] / max(io['write_seconds'], 1e-9) / 1e9:.2f} | "
        f"{io['read_bytes'] / max(io['read_seconds'], 1e-9) / 1e9:.2f} |"
    )
    print(f"| tier pass (bench/nvme.py, 2 GiB) | {tier['write']:.2f} | {tier['read']:.2f} |")
    print(f"| sequential (dd-style, 64 MiB blocks, fsync) | {seq['write']:.2f} | {seq['read']:.2f} |")


if __name__ == "__main__":
    main()
