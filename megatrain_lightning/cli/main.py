"""The ``megatrain`` command.

    megatrain fit --config configs/demo.yaml [--trainer.max_steps=50 --model.lr=1e-3 ...]
    megatrain validate | test | predict ...        (Lightning's own subcommands, same options)
    megatrain plan --model llama-3.1-8b --seq-len 4096 --micro-batch 1 [--gpu-mem 80GiB --host-mem 512GiB]
    megatrain plan --model llama-120b --host-mem 512GiB --nvme-dir /mnt/nvme
    megatrain plan --config configs/llama-3.1-8b.yaml
    megatrain schedule --model llama-3.1-8b --device h100-sxm --seq-len 4096 [--clip 1.0 --micro-batches 4]
    megatrain convert CKPT --to torch OUT.ckpt | --to hf OUT_DIR [--dtype bf16]
    megatrain env

``fit`` and friends are a ``LightningCLI`` over :class:`CausalLMModule` and :class:`TextDataModule` with
``strategy="megatrain"`` by default and :class:`MegatrainMonitor` always attached (``--monitor.*``);
every Trainer, model and data option can be set in the YAML file and overridden on the command line.
``plan``, ``schedule``, ``convert`` and ``env`` are dispatched on the first argument, without importing Lightning
(about 4 s of CPU); everything else goes to LightningCLI (megatrain_lightning/cli/fit.py).
Mistakes in the user's input end in one line, ``megatrain: error: ...`` (exit status 2), not a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

USAGE = """usage: megatrain {fit,validate,test,predict,plan,schedule,convert,env} ...

  fit        train:  megatrain fit --config configs/demo.yaml [--trainer.max_steps=50 ...]
  validate   evaluate a model on the validation data (also test, predict)
  plan       host and GPU memory a run needs:  megatrain plan --model llama-3.1-8b --seq-len 4096 --micro-batch 1
  schedule   a training step's time on a GPU profile:  megatrain schedule --model llama-3.1-8b --device h100-sxm
  convert    a sharded checkpoint to Lightning's single file or to Hugging Face:
               megatrain convert last.ckpt --to torch model.ckpt    megatrain convert last.ckpt --to hf hf_dir
  env        versions, devices, memory and the optimizer backend

`megatrain fit --help` lists every option; `megatrain fit --print_config` prints a config to start from."""


# The fit side's names, for configs that name them here (``megatrain_lightning.cli.main.MegatrainProgressBar``, as
# the user guide shows) and for code that imported them from here: loaded with Lightning on first use.
_FIT_NAMES = ("MegatrainArgumentParser", "MegatrainCLI", "MegatrainProgressBar", "one_line")


def __getattr__(name: str) -> Any:
    if name in _FIT_NAMES:
        from megatrain_lightning.cli import fit

        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- entry points ---------------------------------------------------------------------------------
def run(argv: list[str] | None = None) -> Any:
    """Run one ``megatrain`` command; returns the LightningCLI, the Plan, the ModelledStep, convert's summary
    line, or the env report's lines."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return None
    if args[0] in ("plan", "schedule", "convert"):
        from megatrain_lightning.cli.commands import convert_command, plan_command, schedule_command

        command = {"plan": plan_command, "schedule": schedule_command, "convert": convert_command}[args[0]]
        return command(args[1:])
    if args[0] == "env":
        from megatrain_lightning.cli.env import env_lines

        lines = env_lines()
        print("\n".join(lines))
        return lines
    from megatrain_lightning.cli.fit import fit

    return fit(argv)


def main(argv: list[str] | None = None) -> None:
    """The console script (returns None: a returned object would become the exit status)."""
    run(argv)


if __name__ == "__main__":
    main()
