"""``megatrain plan``, ``schedule`` and ``convert``: the commands that size, predict and convert without
training (``main.py`` dispatches them on the first argument; ``fit`` and friends are the LightningCLI there;
``env`` is env.py). A mistake in the user's input ends in one line, ``megatrain <command>: error: ...``
(exit status 2), not a traceback.

Why one file of about 490 lines: the commands share their option parsers (sizes, "auto or a number", the
engine's flags derived from EngineConfig's declarations, the data-parallel options that bench/schedule.py takes
too) and the one-line error path;
each command is a parser and a short function that calls the planner, the schedule model or the converter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.engine import EngineConfig, check_row_chunk, declared, int_or_auto
from megatrain_lightning.lightning import plots
from megatrain_lightning.models.named import resolve_config
from megatrain_lightning.planning.plan_any import ModelPlan, is_any_model, plan_from_args
from megatrain_lightning.planning.planner import NVME_GBPS, Plan, RunShape, parse_size, plan
from megatrain_lightning.schedule import LINKS, PROFILES, DataParallel, ModelledStep, modelled_step, profile
from megatrain_lightning.schedule.modelled import check_options


def default_precision() -> str:
    """What ``trainer.precision: null`` means here: bf16 streams half the bytes on a GPU; CPU autocast
    gains nothing, so fp32 there."""
    return "bf16-mixed" if torch.cuda.is_available() else "32-true"


def user_error(message: str, prog: str = "megatrain") -> NoReturn:
    """The user's input is wrong: one line naming the value and the fix, exit status 2 (as argparse)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_config(path: str) -> dict[str, Any]:
    """A ``megatrain fit`` YAML config file as a mapping; a ValueError naming the file when it is missing, a
    directory, not UTF-8, not YAML, or not a mapping of options (jsonargparse would trace or quote it whole)."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory, not a YAML file" if file.is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {path!r} {what}")
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"config file {path!r} is not UTF-8 (byte {data[err.start]:#04x} on line {line}); save it as UTF-8"
        ) from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(
            f"config file {path!r} is not valid YAML{at}: {getattr(err, 'problem', None) or err}"
        ) from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(
            f"config file {path!r} holds a {type(loaded).__name__}, not a mapping of options; start from "
            "`megatrain fit --print_config`"
        )
    return loaded or {}


# One-line advice for options whose validation message would be a list of type names.


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``megatrain SUB: error: ...`` (exit status 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        user_error(f"{message} (see {self.prog} --help)", prog=self.prog)


# -- megatrain plan -------------------------------------------------------------------------------
PLAN_EPILOG = """\
host layouts (MegatrainStrategy(host_layout=...)), host bytes per parameter in bf16:
  default  16: fp32 master 4, Adam m + v 8, pinned bf16 copy 2, gradient slab 2 (+4 accumulating)
  lean     12: master and Adam only, plus two small rings of the largest unit in flight
           (+2 with gradient clipping, +4 accumulating)
  --nvme-dir moves Adam m + v (8) into files there: 16 bytes/param of drive traffic per optimizer step
  auto (the default with --model) plans default if it fits --host-mem, else lean, else lean + --nvme-dir

data parallel (--devices N --nodes M, as Trainer(devices=N, num_nodes=M) runs it): the host state
is cut into N x M shards, so a node holds 1/M of it plus each of its N ranks' own rings and offloaded
inputs (host memory per node); every GPU still holds whole blocks in its slots (GPU memory per GPU)

The last line printed is machine-readable, one line on stdout whenever a plan is made:
  host_plan: model=NAME params=N host_gib=X nvme_gib=Y fits=yes|no   (+ devices=N nodes=M when N x M > 1)
Exit status 0 when the plan fits, 1 when it does not (the reasons on stderr, before that line), 2 on bad
input (no plan, no host_plan line).

any other model (--model a Hugging Face config.json or checkpoint directory of another family, e.g.
Mistral, Qwen3-MoE, DeepSeek-V3, Jamba, T5, Llava; or package.module:function, a zero-argument callable
returning the nn.Module): built on the meta device, its stacks found as the strategy finds them, host
bytes counted from the engine's units, the GPU peak measured by one training step on fake tensors (no
formulas: --no-measure leaves the GPU unplanned; no --png, --token-chunk-size, --devices/--nodes)

examples:  megatrain plan --model llama-120b --host-mem 1536GiB
           megatrain plan --model llama-120b --host-mem 512GiB --nvme-dir /mnt/nvme
           megatrain plan --config configs/llama-3.1-8b.yaml --host-mem 512GiB --gpu-mem 80GiB
           megatrain plan --model llama-3.1-8b --gpu-mem 80GiB --png plan.png   (the breakdown drawn)
           megatrain plan --model ./Mixtral-8x7B-v0.1 --seq-len 8192 --gpu-mem 80GiB   (a checkpoint directory)
           megatrain plan --model my_pkg.models:build_model --gpu-mem 24GiB"""

MODEL_DEFAULTS = {"seq_len": 4096, "micro_batch": 1}
"""What --model plans when --seq-len / --micro-batch are not given."""


def plan_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="megatrain plan",
        description="Host and GPU memory of a megatrain run.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", help="a megatrain fit YAML config to plan (its model, seq_len, batch, precision)")
    ap.add_argument(
        "--model",
        help="preset (e.g. llama-3.1-8b), a Hugging Face config.json or checkpoint directory of any family, or "
        "package.module:function returning the nn.Module (built on the meta device; see below)",
    )
    ap.add_argument("--seq-len", type=int, help=f"tokens per sequence (--model: default {MODEL_DEFAULTS['seq_len']})")
    ap.add_argument(
        "--micro-batch", type=int, help=f"sequences per micro-batch (--model: default {MODEL_DEFAULTS['micro_batch']})"
    )
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--host-mem", type=_size, help="host memory to fit in, e.g. 512GiB")
    ap.add_argument("--gpu-mem", type=_size, help="GPU memory to fit in, e.g. 80GiB")
    ap.add_argument(
        "--token-chunk-size",
        type=_tile,
        help="tokens per tile of each block, or auto (the model's token_chunk_size; long context)",
    )
    ap.add_argument(
        "--nvme-gbps",
        type=float,
        default=NVME_GBPS,
        metavar="X",
        help=f"the drive's bandwidth in GB/s, read and write each, for the NVMe time per optimizer step "
        f"(default {NVME_GBPS}: a PCIe 4.0 x4 drive)",
    )
    ap.add_argument(
        "--clip",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan with gradient clipping, which the lean layout pays for with a gradient slab (2 bytes/param "
        "in bf16) (default: the config's trainer.gradient_clip_val, else off)",
    )
    add_engine_flags(ap)
    ap.add_argument("--devices", type=int, default=1, metavar="N", help="GPUs per node, data parallel (default 1)")
    ap.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes, data parallel (default 1)")
    ap.add_argument(
        "--no-measure",
        dest="measure",
        action="store_false",
        help="skip the check of the GPU formulas by one training step on fake tensors (seconds; ~15 CPU minutes at 1M tokens)",
    )
    ap.add_argument(
        "--png",
        metavar="FILE",
        help="also draw the host and GPU memory breakdown into the PNG file FILE (needs matplotlib: "
        "pip install 'megatrain_lightning[plot]')",
    )
    return ap


FLAG_DEFAULTS = {
    "host_layout": "as the config says, else auto: the first of default, lean, lean with Adam on --nvme-dir that fits --host-mem"
}
"""What `megatrain plan` plans where a flag is not given and the config says nothing, when it is not the option's
own default."""


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(
    ap: argparse.ArgumentParser, names: tuple[str, ...] | None = None, default: dict[str, Any] | None = None
) -> None:
    """A flag for each engine option that declares one (engine/config.py), or for those `names`: its argparse
    type, choices and help from the declaration. Unset (None), it means what the config file says, else the
    option's default; `default` sets a value instead (megatrain schedule: the option's default)."""
    for d in declared():
        if d.option.flag is None or (names is not None and d.name not in names):
            continue
        spec = dict(d.option.flag)
        first = d.help.split(". ")[0].rstrip(".")
        value = (default or {}).get(d.name)
        fallback = FLAG_DEFAULTS.get(d.name, f"as the config says, else {d.default!r}")
        said = f"default {value!r}" if value is not None else f"default: {fallback}"
        text = f"{d.name}=...: {first} ({said})".replace("%", "%%")
        ap.add_argument(flag_name(d.name), default=value, help=text, **spec)


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given as flags (those left unset are not in it)."""
    return {d.name: getattr(args, d.name) for d in declared() if getattr(args, d.name, None) is not None}


def add_recompute(ap: argparse.ArgumentParser, default: bool | str | None = "auto") -> None:
    """--recompute: MegatrainStrategy(recompute=...) (megatrain schedule, bench/schedule.py)."""
    add_engine_flags(ap, ("recompute",), {"recompute": default})


_tile = int_or_auto("a number of tokens")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse would replace the message with "invalid value"
        raise argparse.ArgumentTypeError(str(err)) from err


def plan_from_config(
    path: str,
    flags: dict[str, Any] | None = None,
    host_mem: int | None = None,
    gpu_mem: int | None = None,
    overrides: dict[str, Any] | None = None,
    measure: bool = False,
    clipping: bool | None = None,
    nvme_gbps: float = NVME_GBPS,
    devices: int = 1,
    nodes: int = 1,
    host_layout: str | None = None,
) -> Plan:
    """The plan of a ``megatrain fit`` YAML config: what the host-memory comments in configs/ state. The engine
    options in `flags`, `clipping` and model `overrides` add to (or replace) what the config sets; the config's
    strategy options, then each option's own default, fill in the rest (host_layout "default", no NVMe
    directory; `host_layout` "auto": ``--host-layout auto``)."""
    cfg = read_config(path)
    model, data, trainer = cfg.get("model") or {}, cfg.get("data") or {}, cfg.get("trainer") or {}
    if not model.get("model") and not model.get("init_from"):
        raise ValueError(f"config file {path!r} names no model: set model.model (a preset or config.json) or init_from")
    config = resolve_config(
        model.get("model") or model["init_from"], {**(model.get("overrides") or {}), **(overrides or {})}
    )
    strategy = trainer.get("strategy", {})
    init_args = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    planned = {
        d.name: init_args[d.name] for d in declared("option") if d.option.flag is not None and d.name in init_args
    }
    planned["precision"] = trainer.get("precision") or default_precision()
    planned["clipping"] = bool(trainer.get("gradient_clip_val")) if clipping is None else clipping  # 0/null: off
    planned.update(flags or {})
    shape = RunShape(
        config,
        data.get("seq_len", 2048),
        data.get("batch_size", 1),
        trainer.get("accumulate_grad_batches", 1),
        devices,
        nodes,
    )
    name = model.get("model") or model["init_from"]
    return plan(
        shape,
        EngineConfig(**planned),
        host_mem=host_mem,
        gpu_mem=gpu_mem,
        name=name,
        measure=measure,
        nvme_gbps=nvme_gbps,
        host_layout=host_layout,
    )


def plan_command(argv: list[str]) -> Plan | ModelPlan:
    ap = plan_parser()
    args = ap.parse_args(argv)
    try:
        if args.png:
            plots.require()
        result = _plan_of(args, ap)
    except (ValueError, FileNotFoundError, ImportError) as err:
        user_error(str(err), ap.prog)
    print(result.table(), flush=True)
    if args.png:
        try:
            print(f"memory breakdown drawn: {plots.plan_png(result, args.png)}", flush=True)
        except OSError as err:
            user_error(f"--png {args.png}: {err.strerror or err}", ap.prog)
    if not result.fits:  # before the summary, so that it stays the last line in a terminal too
        print("\n".join(f"megatrain plan: error: {p}" for p in result.problems()), file=sys.stderr, flush=True)
    print(result.host_plan_line(), flush=True)
    if not result.fits:
        raise SystemExit(1)
    return result


def _plan_of(args: argparse.Namespace, ap: argparse.ArgumentParser) -> Plan | ModelPlan:
    """The plan the parsed `megatrain plan` options ask for: of a config, or of a model (any model: plan_any.py)."""
    overrides = {} if args.token_chunk_size is None else {"token_chunk_size": args.token_chunk_size}
    flags = engine_flags(args)
    auto = flags.get("host_layout") == "auto"  # the planner's choice among the layouts, not a layout of its own
    if auto:
        del flags["host_layout"]
    if args.config:
        limits = dict(host_mem=args.host_mem, gpu_mem=args.gpu_mem, measure=args.measure, nvme_gbps=args.nvme_gbps)
        ranks = dict(devices=args.devices, nodes=args.nodes)
        layout = "auto" if auto else None
        return plan_from_config(
            args.config, flags, overrides=overrides, clipping=args.clip, **limits, **ranks, host_layout=layout
        )
    if not args.model:
        ap.error("give --config FILE or --model NAME")
    layout = "auto" if auto or args.host_layout is None else None  # --model alone: auto
    options = EngineConfig(**flags, clipping=bool(args.clip))
    if is_any_model(args.model):  # another family, or a module factory: stacks found, one step measured
        return plan_from_args(args, options, layout)
    seq_len = MODEL_DEFAULTS["seq_len"] if args.seq_len is None else args.seq_len
    micro_batch = MODEL_DEFAULTS["micro_batch"] if args.micro_batch is None else args.micro_batch
    shape = RunShape(
        resolve_config(args.model, overrides), seq_len, micro_batch, args.accumulate, args.devices, args.nodes
    )
    return plan(
        shape,
        options,
        host_mem=args.host_mem,
        gpu_mem=args.gpu_mem,
        name=args.model,
        measure=args.measure,
        nvme_gbps=args.nvme_gbps,
        host_layout=layout,
    )


# -- megatrain schedule ---------------------------------------------------------------------------
SCHEDULE_EPILOG = """\
A few bf16-mixed optimizer steps of the model run here on fake tensors (no GPU, no memory for the tensors)
with the engine recording every copy, kernel, wait and host job; the recording is replayed
on the device profile's rates and the last step is measured. Token tiles and input offload are the
planner's choices for the profile's GPU memory. The table gives each lane's busy time and share of the step;
the step's bound is its busiest resource, or the optimizer step's chain when that is longer.

--gpus N models one rank of N GPUs of one node in the data-parallel mode (Trainer(devices=N)): each rank
uploads and downloads 1/N of every unit, the GPUs all-gather and reduce-scatter it over --link (nvlink: the
profile's NVLink; pcie: the same x16 link as the host copies), and the N ranks' host Adam share the node's
DRAM bandwidth. --micro-batches is then per GPU.

The last line printed is machine-readable:
  schedule: model=NAME tokens_per_step=N clip=C step_s=X bound_s=Y ratio=X/Y bound=LANE mfu=Z
  (with --gpus N > 1, then: gpus=N link=L tokens_per_s=T; tokens_per_step is one GPU's)

examples:  megatrain schedule --model llama-3.1-8b --device h100-sxm --seq-len 4096
           megatrain schedule --model llama-3.1-8b --device rtx4090 --seq-len 8192 --clip 1.0 --micro-batches 4"""


def schedule_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="megatrain schedule",
        description="Predict a megatrain training step on a GPU that is not here: its time, its bound and MFU.",
        epilog=SCHEDULE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model", required=True, help="preset (e.g. llama-3.1-8b), Hugging Face config.json or checkpoint directory"
    )
    ap.add_argument("--device", required=True, help=f"GPU profile: {', '.join(PROFILES)}")
    ap.add_argument(
        "--seq-len",
        type=int,
        default=MODEL_DEFAULTS["seq_len"],
        help=f"tokens per micro-batch of one sequence (default {MODEL_DEFAULTS['seq_len']})",
    )
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step, as Trainer(accumulate_grad_batches) (default 1)",
    )
    ap.add_argument(
        "--batch-size", type=int, default=1, help="rows (sequences of --seq-len tokens) per micro-batch (default 1)"
    )
    ap.add_argument(
        "--clip", type=float, help="global-norm gradient clipping, as Trainer(gradient_clip_val) (default: none)"
    )
    add_engine_flags(
        ap,
        ("num_slots", "device_grad_sums", "row_chunk", "speculative_step", "keep_attention"),
        {
            "num_slots": "auto",
            "device_grad_sums": 0,
            "row_chunk": None,
            "speculative_step": False,
            "keep_attention": False,
        },
    )
    # (compile_blocks declares no flag of its own: it changes nothing a plan counts; here it is modelled)
    ap.add_argument(
        "--compile-blocks",
        action="store_true",
        help="model MegatrainStrategy(compile_blocks=True): each block's memory-bound GPU work as inductor fuses it, "
        "measured by compiling one block on this CPU (schedule/fusion.py; untiled blocks only)",
    )
    ap.add_argument(
        "--steps", type=int, default=3, help="optimizer steps recorded; the last is measured (default 3, at least 2)"
    )
    add_recompute(ap)
    add_data_parallel(ap)
    add_host_rates(ap)
    return ap


def add_host_rates(ap: argparse.ArgumentParser, adam: bool = True) -> None:
    """--host-gbps (and --host-adam-gparams): the host's rates as measured on a machine, in place of the
    profile's spec figures (megatrain schedule, bench/schedule.py)."""
    ap.add_argument(
        "--host-gbps",
        type=float,
        help="host memory bandwidth the worker achieves, GB/s, for gradient accumulation and norms (and Adam at 28 "
        "B/param unless --host-adam-gparams); default: the profile's socket spec x 0.75. The first H100 machine "
        "measured about 60 while a step ran (docs/benchmarks.md, GPU)",
    )
    if adam:
        ap.add_argument("--host-adam-gparams", type=float, help="host Adam rate, 10^9 params/s, as measured")


def add_data_parallel(ap: argparse.ArgumentParser) -> None:
    """--gpus and --link: one rank of the data-parallel mode (megatrain schedule, bench/schedule.py)."""
    ap.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs of one node, data parallel (default 1)")
    ap.add_argument("--link", choices=LINKS, default="nvlink", help="how the GPUs reach each other (default nvlink)")


def schedule_command(argv: list[str]) -> ModelledStep:
    ap = schedule_parser()
    args = ap.parse_args(argv)
    try:  # every input checked before the recording, so that an error inside it is not taken for the user's
        device = profile(args.device).with_host(args.host_gbps, args.host_adam_gparams)
        config = resolve_config(args.model)
        check_options(args.seq_len, args.micro_batches, args.clip, args.num_slots, args.steps, args.batch_size)
        check_row_chunk(args.row_chunk)
        DataParallel(args.gpus, args.link).rank_profile(device)
    except (ValueError, FileNotFoundError) as err:
        user_error(str(err), ap.prog)
    step = modelled_step(
        config,
        device,
        args.seq_len,
        args.micro_batches,
        args.clip,
        args.num_slots,
        args.steps,
        name=args.model,
        gpus=args.gpus,
        link=args.link,
        recompute=args.recompute,
        grad_sums=args.device_grad_sums,
        batch_size=args.batch_size,
        row_chunk=args.row_chunk,
        speculative_step=args.speculative_step,
        compile_blocks=args.compile_blocks,
        keep_attention=args.keep_attention,
    )
    print("\n".join(step.report()), flush=True)
    return step


# -- megatrain convert ----------------------------------------------------------------------------
def convert_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="megatrain convert",
        description="Convert a sharded megatrain checkpoint (the default format of strategy='megatrain') to "
        "Lightning's single file, which MyModule.load_from_checkpoint and ordinary strategies read, or to a "
        "Hugging Face directory.",
        epilog="examples:  megatrain convert runs/x/checkpoints/last.ckpt --to torch model.ckpt\n"
        "           megatrain convert runs/x/checkpoints/last.ckpt --to hf hf_dir --dtype bf16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("checkpoint", help="the sharded checkpoint: its commit marker file, e.g. .../checkpoints/last.ckpt")
    ap.add_argument(
        "--to",
        required=True,
        choices=("torch", "hf"),
        help="torch: Lightning's single-file checkpoint (fp32 weights, trainer state, AdamW state); "
        "hf: config.json + safetensors",
    )
    ap.add_argument("out", help="torch: the file to write; hf: the directory to write")
    ap.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        help="--to hf only: the weights' dtype (default fp32, the masters as trained)",
    )
    return ap


def convert_command(argv: list[str]) -> str:
    from megatrain_lightning.lightning.convert import to_hf, to_lightning

    ap = convert_parser()
    args = ap.parse_args(argv)
    if args.dtype is not None and args.to != "hf":
        user_error(f"--dtype={args.dtype} applies to --to hf; --to torch keeps the fp32 masters as trained", ap.prog)
    try:
        if args.to == "torch":
            line = to_lightning(args.checkpoint, args.out)
        else:
            line = to_hf(args.checkpoint, args.out, args.dtype)
    except (mt_checkpoint.CheckpointError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        user_error(str(err), ap.prog)
    print(line)
    return line
