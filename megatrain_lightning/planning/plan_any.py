"""``megatrain plan --model`` for any model: a Hugging Face config.json or checkpoint directory of any family,
or a user's module factory.

``--model`` takes (:func:`model_source`):

- a preset name, or a config.json / checkpoint directory of ``model_type`` llama or qwen2 that the
  project's own Llama reads: the planner's formulas and their fake-tensor check (planner.py), as before;
- any other Hugging Face config.json or checkpoint directory (only config.json is read; nothing is
  downloaded, no remote code runs). The class is the one transformers' Auto classes map its
  ``model_type`` to, tried in this order: ``AutoModelForImageTextToText`` (vision-language models),
  ``AutoModelForSeq2SeqLM`` (encoder-decoder configs), ``AutoModelForCausalLM``;
- ``package.module:function``: a zero-argument callable, importable from the current directory or
  ``PYTHONPATH``, that returns the ``nn.Module`` to train. It is called on the meta device and under a
  fake-tensor mode, so it must build from a config (no weights read, no ``from_pretrained``).

For these models nothing is a formula (:func:`plan_model`):

- the model is built on the meta device (no memory for its weights), and the engine's own discovery
  (``engine/discover.py``) decides the stacks that stream; the engine's unit split
  (``discover.unit_parameters``: each block's own parameters, every other parameter a unit) gives the
  units;
- host bytes are counted: each unit's parameters times the bytes per parameter of the host layout
  (``engine.host.units.host_bytes_by_kind``, as the planner's), plus the lean layout's rings and the NVMe tier's
  pieces in flight sized from the largest unit, as the engine allocates them; offloaded block inputs are
  the bytes the measured step put in host buffers;
- the GPU peak is measured: one training step through the engine on fake tensors (measure_any.py), plus
  the CUDA context allowance. The weight slots, gradient slots and outer parameters are stated beside it
  from the largest block, as the engine sizes them.

Not planned for these models: data parallelism (``--devices``/``--nodes``), token tiles (the project's
Llama's option), the drawing (``--png``), and the largest micro-batch or sequence that fits (each is a
measured step). ``num_slots="auto"`` is planned at 2, where the engine starts.

Why one file of about 500 lines: what ``--model`` names, the units it makes, their host bytes and the plan
that prints them are one path read top to bottom, each step a short function; the step on fake tensors,
which imports the engine, is measure_any.py.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatrain_lightning.engine.config import EngineConfig, check_host_layout
from megatrain_lightning.engine.discover import Layout, find_blocks, unit_parameters
from megatrain_lightning.engine.host.nvme import BUFFERS as NVME_BUFFERS
from megatrain_lightning.engine.host.ring import piece_numel, ring_counts
from megatrain_lightning.engine.host.units import host_bytes_by_kind
from megatrain_lightning.planning.measure_any import Family, check_measurable
from megatrain_lightning.planning.planner import CUDA_CONTEXT_BYTES, GiB, choose_tiers, compute_bytes, format_size

_FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class ModelSource:
    """What ``--model`` names: how to build it (on whatever device or fake mode is current) and its family."""

    name: str
    build: Callable[[], nn.Module]
    family: Family | None  # None: decided from the module built (a factory's)
    config: Any = None  # the Hugging Face config, when there is one


def is_any_model(spec: str) -> bool:
    """Whether ``plan --model spec`` plans any model here: a module factory, or a config.json / checkpoint
    directory the project's own Llama does not read (a preset or a Llama / Qwen2 config goes to planner.py)."""
    from megatrain_lightning.models.config import LlamaConfig

    if _FACTORY.match(spec) and not Path(spec).exists():
        return True
    path = Path(spec).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        return False  # a preset, or a missing path: planner.py's error names both
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        LlamaConfig.from_hf_dict(data)
    except (ValueError, KeyError, TypeError):  # another family, or a Llama the project's model does not read
        return True
    return False


def model_source(spec: str) -> ModelSource:
    """The model ``--model spec`` names (module docstring); a one-line ValueError when it names none."""
    if _FACTORY.match(spec) and not Path(spec).exists():
        return factory_source(spec)
    return hf_source(spec)


def hf_source(spec: str) -> ModelSource:
    """A Hugging Face config.json or checkpoint directory, read locally (no download, no remote code)."""
    import transformers
    from transformers.models.auto import modeling_auto

    path = Path(spec).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"--model {spec}: no config.json there; give a Hugging Face config.json or checkpoint directory"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"--model {spec}: transformers cannot read this config.json ({_first_line(err)})") from None
    kind = config.model_type
    config.use_cache = False  # training: no key/value cache
    choices: list[tuple[dict, str, Family]] = [
        (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "AutoModelForImageTextToText", "vlm"),
        (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "AutoModelForSeq2SeqLM", "seq2seq"),
        (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM", "causal"),
    ]
    for mapping, auto, family in choices:
        if kind in mapping and (family != "seq2seq" or config.is_encoder_decoder):
            cls = getattr(transformers, auto)
            return ModelSource(spec, functools.partial(cls.from_config, config, dtype=torch.float32), family, config)
    raise ValueError(
        f"--model {spec}: transformers has no causal LM, encoder-decoder or image-text-to-text class for "
        f"model_type={kind!r}; give a module factory instead (--model package.module:function)"
    )


def factory_source(spec: str) -> ModelSource:
    """``package.module:function``: the zero-argument callable that returns the model."""
    module_name, attr = spec.split(":")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({err}); check PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {spec}: {module_name} has no {attr!r}; name a function that returns the model")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec}: {attr} is a {type(target).__name__}, not a function returning the model")
    return ModelSource(spec, target, None)


def build_on_meta(source: ModelSource) -> nn.Module:
    """The model with every parameter on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        model = source.build()
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {source.name} returned a {type(model).__name__}, not an nn.Module")
    return model


def family_of(model: nn.Module) -> Family:
    """A factory's model: a Hugging Face model's family by its config (as :func:`hf_source`), else "module"."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return "module"
    from transformers.models.auto import modeling_auto

    if config.model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "vlm"
    return "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"


@dataclass(frozen=True)
class Units:
    """The engine's host units of a model: per streamed block and per outer parameter, its element count."""

    layout: Layout
    blocks: list[int]
    outer: list[int]

    @property
    def numel(self) -> int:
        return sum(self.blocks) + sum(self.outer)

    @property
    def largest_block(self) -> int:
        return max(self.blocks)

    @property
    def piece(self) -> int:
        """Elements per ring piece, as the engine sizes it (engine/host/ring.py): from the largest unit."""
        return piece_numel(max([self.largest_block, *self.outer]))


def units_of(model: nn.Module) -> Units:
    """The stacks the engine would stream and its units (module docstring)."""
    layout = find_blocks(model)
    block_params, outer = unit_parameters(model, layout)
    return Units(layout, [sum(p.numel() for _, p in ps) for ps in block_params], [p.numel() for _, p in outer])


def host_bytes(
    units: Units,
    precision: str,
    accumulate: int,
    layout: str = "default",
    nvme: bool = False,
    clipping: bool = False,
    speculative: bool = False,
) -> dict[str, int]:
    """Host bytes per buffer kind as the engine allocates them for `units` (planner.host_breakdown's kinds)."""
    elt, n = compute_bytes(precision), units.numel
    per_param = host_bytes_by_kind(elt, True, accumulate > 1, layout, clipping, speculative and layout != "lean")
    out = {kind: b * n for kind, b in per_param.items()}
    if layout == "lean":  # no copy: rings of pieces instead (engine/host/ring.py), in planner.lean_breakdown's order
        staging, grads = ring_counts(units.largest_block, units.piece)
        out = {
            "master": out["master"],
            "adam": out["adam"],
            "staging": staging * units.piece * elt if elt == 2 else 0,  # in fp32 the master is the source
            "grad_ring": grads * units.piece * elt,
            "slab": out["slab"],
            "acc": out["acc"],
        }
    if nvme:  # in the Adam line's place, so the table keeps its order
        held = NVME_BUFFERS * units.piece * 8
        out = {("nvme_buffers" if k == "adam" else k): (held if k == "adam" else v) for k, v in out.items()}
    return out


_HOST_LABELS = {
    "master": "fp32 master weights",
    "adam": "Adam m + v (fp32)",
    "copy": "pinned compute copy",
    "slab": "pinned gradient slab",
    "acc": "fp32 gradient accumulator (only when accumulate > 1)",
    "staging": "upload staging ring (4 pieces)",
    "grad_ring": "gradient ring (a block's pieces + 1)",
    "nvme_buffers": f"Adam m + v of {NVME_BUFFERS} pieces in flight (Adam on NVMe)",
    "activations": "offloaded block inputs (pinned, measured)",
}


@dataclass(frozen=True)
class ModelPlan:
    """Host and GPU memory of training any model; build it with :func:`plan_model`. It answers what
    ``megatrain plan`` prints from planner.Plan: ``table()``, ``problems()``, ``fits``, ``host_plan_line()``."""

    name: str
    kind: str  # the model's class and family, for the title
    units: Units = field(repr=False)
    seq_len: int
    micro_batch: int
    precision: str
    accumulate: int
    num_slots: int
    host: dict[str, int]
    host_layout: str
    nvme: bool
    measured: Any = None  # measure.Measured, or None with --no-measure
    offloaded: bool = False  # whether the measured step kept its block inputs in host memory
    host_mem: int | None = None
    gpu_mem: int | None = None
    recompute: bool | str = "auto"

    @property
    def num_parameters(self) -> int:
        return self.units.numel

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def slot_bytes(self) -> dict[str, int]:
        """The engine's fixed device buffers: weight slots, gradient slots and the outer parameters."""
        elt = compute_bytes(self.precision)
        return {
            "weight_slots": self.num_slots * self.units.largest_block * elt,
            "grad_slots": 2 * self.units.largest_block * elt,
            "outer": sum(self.units.outer) * elt,
        }

    @property
    def gpu_peak(self) -> int | None:
        """The measured allocator peak plus the CUDA context allowance (None when not measured)."""
        return None if self.measured is None else self.measured.peak + CUDA_CONTEXT_BYTES

    @property
    def nvme_bytes(self) -> int:
        return 8 * self.num_parameters if self.nvme else 0

    @property
    def fits(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        out = []
        if self.host_mem is not None and self.host_total > self.host_mem:
            out.append(
                f"host memory: the {self.num_parameters / 1e9:.2f}B-parameter model needs {format_size(self.host_total)} "
                f"with host_layout={self.host_layout!r}{' and Adam on NVMe' if self.nvme else ''} but the limit is "
                f"{format_size(self.host_mem)}; "
                + ("" if self.nvme else "--host-layout auto with --nvme-dir DIR moves Adam m + v to a drive; or use ")
                + "a machine with more host memory."
            )
        if self.gpu_mem is not None and self.gpu_peak is not None and self.gpu_peak > self.gpu_mem:
            out.append(
                f"GPU memory: micro-batch {self.micro_batch} at seq_len {self.seq_len} measured "
                f"{format_size(self.gpu_peak)} with the context allowance but the limit is {format_size(self.gpu_mem)}; "
                "plan a shorter seq_len, a smaller micro-batch, --offload-inputs, or a GPU with more memory."
            )
        return out

    def host_plan_line(self) -> str:
        """The machine-readable summary ``megatrain plan`` prints last (as planner.Plan's)."""
        return (
            f"host_plan: model={self.name} params={self.num_parameters} host_gib={self.host_total / GiB:.1f} "
            f"nvme_gib={self.nvme_bytes / GiB:.1f} fits={'yes' if self.fits else 'no'}"
        )

    def table(self) -> str:
        stacks = " and ".join(c.describe() for c in self.units.layout.stacks)
        title = (
            f"{self.name}: {self.kind}, {_count(self.num_parameters)} parameters in {len(self.units.blocks)} "
            f"streamed blocks and {len(self.units.outer)} other units; streams {stacks}; seq_len {self.seq_len} x "
            f"micro-batch {self.micro_batch}, {self.precision}, accumulate {self.accumulate}, {self.num_slots} slots, "
            f"host layout {self.host_layout}" + (", Adam on NVMe" if self.nvme else "")
        )
        return "\n".join([title, "", *self._host_lines(), "", *self._gpu_lines(), *self._limit_lines()])

    def _unit(self) -> tuple[str, int]:
        """GiB for both tables once the host needs a GiB (as planner.Plan), else MiB."""
        return ("GiB", GiB) if self.host_total >= GiB else ("MiB", 2**20)

    def _host_lines(self) -> list[str]:
        n, (unit, scale) = self.num_parameters, self._unit()
        lines = [f"{'host memory (counted from the units)':<58}{'bytes/param':>12}{unit:>12}"]
        for key, value in [*self.host.items(), ("total", self.host_total)]:
            lines.append(f"  {_HOST_LABELS.get(key, key):<56}{value / n:>12.2f}{value / scale:>12.2f}")
        return lines

    def _gpu_lines(self) -> list[str]:
        unit, scale = self._unit()
        lines = [f"{'GPU memory':<70}{unit:>12}"]
        labels = {
            "weight_slots": f"weight slots ({self.num_slots} x largest block), in the peak",
            "grad_slots": "gradient slots (2 x largest block), in the peak",
            "outer": "parameters outside the blocks (on the device), in the peak",
        }
        for key, value in self.slot_bytes.items():
            lines.append(f"  {labels[key]:<68}{value / scale:>12.2f}")
        m = self.measured
        if m is None:
            return [*lines, "  peak: not measured (--no-measure)"]
        where = "offloaded to host memory" if self.offloaded else "kept on the device"
        return [
            *lines,
            f"  {'measured: one training step on fake tensors (allocator peak)':<68}{m.peak / scale:>12.2f}",
            f"    (forward {format_size(m.forward_peak)}, backward {format_size(m.backward_peak)}, of which modelled "
            f"kernel workspace {format_size(m.workspace)}; block inputs {where}; recompute={self.recompute!r}: "
            f"{m.kept_calls} block calls kept their graph; measured in {m.seconds:.0f} s)",
            f"  {'CUDA context and allocator slack (allowance)':<68}{CUDA_CONTEXT_BYTES / scale:>12.2f}",
            f"  {'peak (measured + context)':<68}{self.gpu_peak / scale:>12.2f}",
        ]

    def _limit_lines(self) -> list[str]:
        lines = []
        if self.host_mem is not None:
            ok = "fits" if self.host_total <= self.host_mem else "DOES NOT FIT"
            lines.append(f"host limit {format_size(self.host_mem)}: {ok}")
        if self.gpu_mem is not None:
            if self.gpu_peak is None:
                lines.append(f"GPU limit {format_size(self.gpu_mem)}: not checked (--no-measure)")
            else:
                ok = "fits" if self.gpu_peak <= self.gpu_mem else "DOES NOT FIT"
                lines.append(f"GPU limit {format_size(self.gpu_mem)}: {ok}")
        return ["", *lines] if lines else []


def plan_model(
    spec: str,
    seq_len: int,
    micro_batch: int = 1,
    accumulate: int = 1,
    options: EngineConfig | None = None,
    *,
    host_mem: int | None = None,
    gpu_mem: int | None = None,
    measure: bool = True,
    host_layout: str | None = "auto",
) -> ModelPlan:
    """Plan training the model `spec` names (module docstring) with the engine's `options` (None: its defaults):
    stacks and host bytes from the meta model, the GPU peak measured (``measure``) on fake tensors with the
    options as the strategy takes them. `host_layout`, when given, is planned instead of the options' own: a
    layout, or "auto" (the default), the first that fits `host_mem`."""
    for key, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("accumulate", accumulate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    options = EngineConfig() if options is None else options
    precision, clipping, recompute, nvme_dir = options.precision, options.clipping, options.recompute, options.nvme_dir
    host_layout = options.host_layout if host_layout is None else check_host_layout(host_layout, allow_auto=True)
    source = model_source(spec)
    model = build_on_meta(source)
    family = source.family or family_of(model)
    units = units_of(model)
    layout, nvme = choose_tiers(
        lambda lay, nv: sum(
            host_bytes(units, precision, accumulate, lay, nv, clipping, options.speculative_step).values()
        ),
        host_layout,
        nvme_dir,
        host_mem,
    )
    host = host_bytes(units, precision, accumulate, layout, nvme, clipping, options.speculative_step)
    slots = 2 if options.num_slots == "auto" else options.num_slots
    measured, offloaded = None, 0
    if measure:
        check_measurable(getattr(model, "config", None), family, seq_len)
        measured, offloaded = _measure(source, family, seq_len, micro_batch, precision, slots, options, gpu_mem)
    host["activations"] = offloaded
    return ModelPlan(
        name=spec,
        kind=f"{type(model).__name__} ({_FAMILY_TEXT[family]})",
        units=units,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision=precision,
        accumulate=accumulate,
        num_slots=slots,
        host=host,
        host_layout=layout,
        nvme=nvme,
        measured=measured,
        offloaded=offloaded > 0,
        host_mem=host_mem,
        gpu_mem=gpu_mem,
        recompute=recompute,
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


_FAMILY_TEXT = {"causal": "causal LM", "seq2seq": "encoder-decoder", "vlm": "vision-language", "module": "module"}


def _measure(source, family, seq_len, micro_batch, precision, slots, options, gpu_mem):
    """One step on fake tensors (measure_any.py) with the engine's `options`; the engine may take `gpu_mem` less
    the context allowance."""
    from megatrain_lightning.planning.measure_any import measure_model_step  # imports the engine; only when asked

    print(
        f"measuring one training step of {source.name} on fake tensors (--no-measure skips it)...",
        file=sys.stderr,
        flush=True,
    )
    capacity = None if gpu_mem is None else gpu_mem - CUDA_CONTEXT_BYTES
    return measure_model_step(
        source.build,
        family,
        seq_len,
        micro_batch,
        precision,
        slots,
        options.offload_inputs,
        options.recompute,
        capacity,
        options.offload_inputs_dtype,
        row_chunk=options.row_chunk,
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def plan_from_args(args: Any, options: EngineConfig, host_layout: str | None) -> ModelPlan:
    """``megatrain plan --model`` of any model (commands.py's parsed options, the engine's `options` from its
    flags); a ValueError for an option these models are not planned with (module docstring)."""
    refused = [
        ("--png", args.png is not None),
        ("--token-chunk-size", args.token_chunk_size is not None),
        ("--devices/--nodes", args.devices * args.nodes > 1),
        ("--device-grad-sums", options.device_grad_sums != 0),  # (the measured step is not an accumulating one)
    ]
    for flag, given in refused:
        if given:
            raise ValueError(
                f"{flag} plans the project's Llama and Qwen2 (presets, their config.json); --model {args.model} is "
                f"planned by one measured step instead: leave {flag} out"
            )
    return plan_model(
        args.model,
        4096 if args.seq_len is None else args.seq_len,
        1 if args.micro_batch is None else args.micro_batch,
        args.accumulate,
        options,
        host_mem=args.host_mem,
        gpu_mem=args.gpu_mem,
        measure=args.measure,
        host_layout=host_layout,
    )
