"""The ``megatrain`` command.

    megatrain fit --config configs/demo.yaml [--trainer.max_steps=50 --model.lr=1e-3 ...]
    megatrain validate | test | predict ...        (Lightning's own subcommands, same options)
    megatrain plan --model llama-3.1-8b --seq-len 4096 --micro-batch 1 [--gpu-mem 80GiB --host-mem 512GiB]
    megatrain plan --config configs/llama-3.1-8b.yaml
    megatrain env

``fit`` and friends are a ``LightningCLI`` over :class:`CausalLMModule` and :class:`TextDataModule` with
``strategy="megatrain"`` by default and :class:`MegatrainMonitor` always attached (``--monitor.*``);
every Trainer, model and data option can be set in the YAML file and overridden on the command line.
``plan`` and ``env`` are dispatched on the first argument before LightningCLI sees the rest.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.callbacks import MegatrainMonitor
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.module import CausalLMModule, check_init_from, resolve_config
from megatrain_lightning.planner import PRECISIONS, Plan, parse_size, plan

USAGE = """usage: megatrain {fit,validate,test,predict,plan,env} ...

  fit        train:  megatrain fit --config configs/demo.yaml [--trainer.max_steps=50 ...]
  validate   evaluate a model on the validation data (also test, predict)
  plan       host and GPU memory a run needs:  megatrain plan --model llama-3.1-8b --seq-len 4096 --micro-batch 1
  env        versions, devices, memory and the optimizer backend

`megatrain fit --help` lists every option; `megatrain fit --print_config` prints a config to start from."""


def default_precision() -> str:
    """What ``trainer.precision: null`` means here: bf16 streams half the bytes on a GPU; CPU autocast
    gains nothing, so fp32 there."""
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


class MegatrainCLI(LightningCLI):
    """LightningCLI with the megatrain defaults and checks of the user's model and data choices."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(
            CausalLMModule, TextDataModule, trainer_defaults={"strategy": "megatrain"},
            save_config_kwargs={"overwrite": True}, parser_kwargs={"prog": "megatrain"}, args=args, **kwargs,
        )  # fmt: skip

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_lightning_class_args(MegatrainMonitor, "monitor")

    def _parse_ckpt_path(self) -> None:
        """With --ckpt_path, LightningCLI takes the model's hyper-parameters from the checkpoint by
        ``torch.load``-ing it; a megatrain (sharded) checkpoint is a commit marker keeping them in its
        trainer state instead, so read them from there."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if not (path and mt_checkpoint.is_checkpoint(str(path))):
            return super()._parse_ckpt_path()
        hparams = mt_checkpoint.load_trainer_state(str(path)).get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if hparams:
            self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        """Fill in the precision default and check model and data names before anything heavy is built."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.trainer.precision is None:
            config.trainer.precision = default_precision()
        name = config.model.model or config.model.init_from
        try:
            if isinstance(name, str):  # a full LlamaConfig mapping is checked by LlamaConfig itself
                model = resolve_config(name, config.model.overrides)
                if config.model.init_from is not None:
                    check_init_from(model, config.model.init_from)
            TextDataModule(**vars(config.data))  # checks paths and formats; reads no data yet
        except (ValueError, FileNotFoundError, ImportError) as err:  # the user's input: report, don't trace
            self.parser.error(str(err))

    def before_fit(self) -> None:
        vocab = self.datamodule.vocab_size
        if vocab is not None and vocab > self.model.config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {vocab} token ids but the model's vocab_size is "
                f"{self.model.config.vocab_size}; use the model's own tokenizer or set --model.overrides.vocab_size"
            )


# -- megatrain plan -------------------------------------------------------------------------------
def plan_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatrain plan", description="Host and GPU memory of a megatrain run.")
    ap.add_argument("--config", help="a megatrain fit YAML config to plan (its model, seq_len, batch, precision)")
    ap.add_argument("--model", help="preset (e.g. llama-3.1-8b), Hugging Face config.json or checkpoint directory")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, help="sequences per micro-batch")
    ap.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--num-slots", type=int, default=2, help="device weight slots")
    ap.add_argument("--host-mem", type=_size, help="host memory to fit in, e.g. 512GiB")
    ap.add_argument("--gpu-mem", type=_size, help="GPU memory to fit in, e.g. 80GiB")
    return ap


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse would replace the message with "invalid value"
        raise argparse.ArgumentTypeError(str(err)) from err


def plan_from_config(path: str, host_mem: int | None = None, gpu_mem: int | None = None) -> Plan:
    """The plan of a ``megatrain fit`` YAML config: what the host-memory comments in configs/ state."""
    import yaml

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    model, data, trainer = cfg.get("model", {}), cfg.get("data", {}), cfg.get("trainer", {})
    config = resolve_config(model.get("model") or model["init_from"], model.get("overrides"))
    strategy = trainer.get("strategy", {})
    slots = strategy.get("init_args", {}).get("num_slots", 2) if isinstance(strategy, dict) else 2
    return plan(
        config, seq_len=data.get("seq_len", 2048), micro_batch=data.get("batch_size", 1),
        precision=trainer.get("precision") or default_precision(), accumulate=trainer.get("accumulate_grad_batches", 1),
        num_slots=slots, host_mem=host_mem, gpu_mem=gpu_mem, name=model.get("model") or model["init_from"],
    )  # fmt: skip


def plan_command(argv: list[str]) -> Plan:
    ap = plan_parser()
    args = ap.parse_args(argv)
    try:
        if args.config:
            result = plan_from_config(args.config, args.host_mem, args.gpu_mem)
        else:
            if not (args.model and args.seq_len and args.micro_batch):
                ap.error("give --config, or --model, --seq-len and --micro-batch")
            result = plan(resolve_config(args.model), args.seq_len, args.micro_batch, args.precision, args.accumulate,
                          args.num_slots, args.host_mem, args.gpu_mem, name=args.model)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        ap.error(str(err))
    print(result.table())
    if not result.fits:
        print("\n".join(f"megatrain plan: error: {p}" for p in result.problems()), file=sys.stderr)
        raise SystemExit(1)
    return result


# -- megatrain env --------------------------------------------------------------------------------
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return ["devices: none (no CUDA GPU visible; training runs on the CPU)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"device {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


def _memlock() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"


def env_lines() -> list[str]:
    """What ``megatrain env`` prints: versions, devices, memory, CPU cores and the optimizer backend."""
    from megatrain_lightning.engine.host import available_host_bytes
    from megatrain_lightning.optim import kernels, native

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = [f"{name} {_version(name)}" for name in ("torch", "lightning", "megatrain_lightning", "transformers")]
    return [
        f"python {platform.python_version()}, " + ", ".join(versions),
        *_devices(),
        f"host memory: {total / 2**30:.1f} GiB total, {available_host_bytes() / 2**30:.1f} GiB available",
        f"pinned-memory limit (ulimit -l, RLIMIT_MEMLOCK): {_memlock()}",
        f"CPU cores: {os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        f"optimizer backend: {kernels.backend()} (native kernel: {native.backend()})",
    ]


# -- entry points ---------------------------------------------------------------------------------
def run(argv: list[str] | None = None) -> Any:
    """Run one ``megatrain`` command; returns the LightningCLI, the Plan, or the env report's lines."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return None
    if args[0] == "plan":
        return plan_command(args[1:])
    if args[0] == "env":
        lines = env_lines()
        print("\n".join(lines))
        return lines
    _check_config_files(args)
    return MegatrainCLI(args=argv)  # None: LightningCLI reads sys.argv itself


def _check_config_files(args: list[str]) -> None:
    """A missing --config file gets one line naming it and the ready configs, not the full usage."""
    for path in _config_args(args):
        if not Path(path).expanduser().is_file():
            ready = sorted(str(p) for p in Path("configs").glob("*.yaml"))
            hint = "the ready configs are in the repository's configs/"
            if ready:
                hint = f"ready configs here: {', '.join(ready)}"
            print(f"megatrain: error: config file {path!r} does not exist; {hint}", file=sys.stderr)
            raise SystemExit(2)


def _config_args(args: list[str]) -> list[str]:
    paths = [a.split("=", 1)[1] for a in args if a.startswith(("--config=", "-c="))]
    return paths + [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-c", "--config")]


def main(argv: list[str] | None = None) -> None:
    """The console script (returns None: a returned object would become the exit status)."""
    run(argv)


if __name__ == "__main__":
    main()
