"""How fast strategy='megatrain' sets a model up from a Hugging Face checkpoint, and how much host memory that takes.

    python bench/setup_load.py [--dir DIR] [--layers 32] [--hidden 896] [--shard-mb 200] [--ordinary] [--steps N]
                               [--json]

A Qwen2 of about 0.5B parameters (Qwen2-0.5B's blocks, 32 of them, a vocabulary of 4096) is written once as
bf16 safetensors shards into DIR (a temporary directory by default; random weights, no hub), then loaded in a
fresh process the way a large model must be: built under ``fabric.init_module(empty_init=True)``,
``load_hf_weights`` names each parameter's tensor, and ``fabric.setup(model, AdamW)`` reads the checkpoint
tensor by tensor into the engine's fp32 masters and allocates the Adam moments. Printed:

- setup time and throughput: fp32 master bytes over the seconds ``fabric.setup`` took, and what a 70B and a
  405B setup would take at that rate (the masters pinned where there is a GPU, as training uses them);
- RSS before setup (the model as built and loaded: nothing here, 4 bytes/param the ordinary way);
- peak RSS during setup against the RSS after it (the steady state: masters, compute copy, Adam moments),
  both less the process's RSS before the model was built. The loader holds one tensor at a time, so the
  peak stays within one shard of the steady state; the ordinary way (``--ordinary``: ``from_pretrained``, a
  full fp32 model, then the strategy) adds the model's 4 bytes/param.

The measuring process fixes glibc's mmap and trim thresholds (1 MiB), as bench/host_memory.py does, so that
a freed tensor's memory goes back to the system and RSS reads what is held.

``--steps N`` then trains N steps on one fixed batch and prints SHA-256 digests of the fp32 masters before
and after them: the same digests with and without ``--ordinary`` show the two loads train bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def qwen2_config(layers: int, hidden: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 38 // 7 // 64 * 64 or 64,  # 4864 at 896, as Qwen2-0.5B
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 448),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_cache=False,
    )


def write_checkpoint(directory: Path, layers: int, hidden: int, shard_mb: int) -> None:
    """Random bf16 weights of the model's shapes, streamed shard by shard (no fp32 model is built)."""
    from transformers import Qwen2ForCausalLM

    import megatrain_lightning as mt
    from megatrain_lightning.models import save_hf_checkpoint

    config = qwen2_config(layers, hidden)
    with mt.empty_init():
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, p in model.state_dict().items():
            if name != "lm_head.weight":  # tied
                yield name, (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)

    save_hf_checkpoint(tensors(), config.to_dict(), directory, max_shard_bytes=shard_mb << 20)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def digest(fabric) -> str:
    """A SHA-256 of the engine's fp32 masters, by parameter name: equal digests are equal bits."""
    h = hashlib.sha256()
    for name, tensor in sorted(fabric.strategy.engine.master_state_dict().items()):
        h.update(name.encode())
        h.update(memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()))  # (no copy of the bytes)
    return h.hexdigest()


def train(fabric, model, opt, steps: int, vocab: int) -> list[float]:
    """`steps` optimizer steps on one fixed batch of 1 x 16 tokens; the losses."""
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0)).to(fabric.device)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def measure(
    directory: Path, layers: int, hidden: int, ordinary: bool = False, steps: int = 0, precision: str = "bf16-mixed"
) -> dict:
    """One setup from the checkpoint, in this (fresh) process; `ordinary`: the model loaded whole in fp32 by
    ``from_pretrained`` first (the timing then covers ``fabric.setup`` alone, the RSS both). With `steps`,
    then that many training steps, and digests of the masters before and after them."""
    from lightning.fabric import Fabric
    from transformers import Qwen2ForCausalLM

    import megatrain_lightning as mt

    cuda = torch.cuda.is_available()
    config = qwen2_config(layers, hidden)
    fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=1, strategy="megatrain", precision=precision)
    fabric.launch()
    try:  # the peak so far (imports) is not setup's: reset VmHWM to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    base = _status_kb("VmRSS")
    if ordinary:
        model = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).train()
    else:
        with fabric.init_module(empty_init=True):
            model = Qwen2ForCausalLM(config)
        mt.load_hf_weights(model, directory)
    params = sum(p.numel() for p in model.parameters())
    before = _status_kb("VmRSS") - base  # the model as built and loaded, before the strategy takes it
    start = time.perf_counter()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    seconds = time.perf_counter() - start
    steady, peak = _status_kb("VmRSS") - base, _status_kb("VmHWM") - base
    rate = 4 * params / seconds  # fp32 master bytes per second
    trained = {}
    if steps:
        torch.manual_seed(0)
        loaded = digest(fabric)
        losses = train(fabric, model, opt, steps, config.vocab_size)
        trained = {"loaded_digest": loaded, "trained_digest": digest(fabric), "losses": losses}
    return {
        "params": params,
        "device": "cuda (pinned masters)" if cuda else "cpu",
        "load": "from_pretrained, then fabric.setup" if ordinary else "init_module(empty_init=True) + load_hf_weights",
        "setup_s": round(seconds, 3),
        "gb_per_s": round(rate / 1e9, 3),
        "minutes_70b": round(4 * 70e9 / rate / 60, 1),
        "minutes_405b": round(4 * 405e9 / rate / 60, 1),
        "before_setup_gb": round(before * 1024 / 1e9, 3),
        "steady_gb": round(steady * 1024 / 1e9, 3),
        "peak_gb": round(peak * 1024 / 1e9, 3),
        **trained,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="checkpoint directory (written when it holds none); default: a temporary one")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--shard-mb", type=int, default=200)
    ap.add_argument("--ordinary", action="store_true", help="load with from_pretrained first, for comparison")
    ap.add_argument("--steps", type=int, default=0, help="train this many steps after setup; digests of the masters")
    ap.add_argument(
        "--precision",
        default="bf16-mixed",
        help="Fabric's precision (default bf16-mixed, as training on a GPU; 32-true trains the steps many times "
        "faster on a CPU, whose bf16 matmuls are emulated)",
    )
    ap.add_argument("--json", action="store_true", help="print only the result, as one JSON line")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # (the fresh measuring process)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.dir), args.layers, args.hidden, args.ordinary, args.steps, args.precision)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp)
        if not (directory / "config.json").is_file():
            write_checkpoint(directory, args.layers, args.hidden, args.shard_mb)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
        cmd = [sys.executable, __file__, "--measure", "--dir", str(directory)]
        cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--steps", str(args.steps)]
        cmd += ["--precision", args.precision]
        cmd += ["--ordinary"] if args.ordinary else []
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result))
        return
    r = result
    print(f"{r['params'] / 1e9:.2f}B parameters from bf16 safetensors, {r['device']}: {r['load']}")
    print(f"setup: {r['setup_s']:.2f} s, {r['gb_per_s']:.2f} GB/s of fp32 masters")
    print(f"at that rate: 70B {r['minutes_70b']:.1f} min, 405B {r['minutes_405b']:.1f} min")
    if "trained_digest" in r:
        print(f"{len(r['losses'])} steps, losses {r['losses']}: masters {r['trained_digest'][:16]}")
    print(
        f"RSS: {r['before_setup_gb']:.2f} GB before setup (the model as built), peak during setup "
        f"{r['peak_gb']:.2f} GB, after it {r['steady_gb']:.2f} GB "
        f"({r['peak_gb'] / r['steady_gb']:.3f} x)"
    )


if __name__ == "__main__":
    main()
