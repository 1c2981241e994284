"""The engine's options: one dataclass, each field declared once with its type, default, check and help
(:class:`Option`), validated once, and one ``check_*`` per option.

Every place that takes one of these options from a user (the Trainer and Fabric strategies, the planner,
the ``megatrain`` command, a sweep's YAML) derives its parameters from these declarations (:func:`declared`)
and calls the same check, so a bad value gets the same one-line error naming it and the fix wherever it
enters. :class:`EngineConfig` runs them all in ``__post_init__``.

Why one file of about 540 lines: it is the one declaration of every option (the point of it), and each
option's check sits beside its field.

Of the engine it imports only the option types (discover.py, device/recompute.py, device/rows.py); clients
reach it through the engine's facade, engine/__init__.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from megatrain_lightning.engine.device.recompute import Recompute, check_recompute
from megatrain_lightning.engine.device.rows import RowChunk, check_row_chunk
from megatrain_lightning.engine.discover import BlocksOption
from megatrain_lightning.optim.threads import resolve_host_threads

Precision = Literal["32-true", "bf16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
HostLayout = Literal["default", "lean"]
HOST_LAYOUTS: tuple[str, ...] = get_args(HostLayout)
NumSlots = int | Literal["auto"]
GradSums = int | Literal["auto"]
OffloadInputs = bool | Literal["auto"]
OffloadInputsDtype = Literal["bf16", "fp8"] | None
OFFLOAD_INPUTS_DTYPES: tuple[str, ...] = ("bf16", "fp8")
CheckpointFormat = Literal["sharded", "torch"]
CHECKPOINT_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)


def check_precision(value: Any) -> Precision:
    """`value` if it is one of :data:`PRECISIONS`, else a ValueError naming it and the choices."""
    if isinstance(value, str) and value in PRECISIONS:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"precision={value!r} is not supported: choose one of {', '.join(PRECISIONS)} (fp16 needs loss scaling, which the host "
        "optimizer does not do: use 'bf16-mixed' instead)"
    )


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype weights stream in and blocks compute in (the masters and Adam state are always fp32)."""
    return torch.float32 if check_precision(precision) == "32-true" else torch.bfloat16


def forward_context(precision: str, device_type: str) -> AbstractContextManager:
    """What the forward runs under: ``bf16-mixed`` is ``torch.autocast`` to bf16 (softmax and losses in
    fp32, as Lightning's AMP does; no weight cache, since the weights are already bf16 copies); the others
    run as they are."""
    if check_precision(precision) == "bf16-mixed":
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
    return nullcontext()


def check_num_slots(value: Any) -> NumSlots:
    """`value` if it is a slot count of at least 2 or "auto", else a ValueError naming it and the choices."""
    if (isinstance(value, int) and not isinstance(value, bool) and value >= 2) or value == "auto":
        return value
    raise ValueError(
        f"num_slots={value!r}: give at least 2 slots (one computing, one loading) or 'auto' (2, then after "
        "the first step as many as the device memory that step left free allows)"
    )


def check_device_grad_sums(value: Any) -> GradSums:
    """`value` if it is a block count of at least 0 or "auto", else a ValueError naming it and the choices."""
    if (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or value == "auto":
        return value
    raise ValueError(
        f"device_grad_sums={value!r}: give a number of blocks (0: every micro-batch's gradient lands on the host) "
        "or 'auto' (after the first step, as many as the device memory left free allows)"
    )


def check_offload_inputs(value: Any) -> OffloadInputs:
    """`value` if it is True, False or "auto", else a ValueError naming it and the choices."""
    # isinstance, not `in`: 1 == True would let an int through
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError(f"offload_inputs={value!r}: choose True (always offload), False (never) or 'auto'")


def check_offload_inputs_dtype(value: Any, precision: str | None = None) -> OffloadInputsDtype:
    """`value` if it is None, "bf16" or "fp8" and, given the run's `precision`, stores the block inputs in
    fewer bytes than they have; else a ValueError naming it and the fix."""
    if value is not None and not (isinstance(value, str) and value in OFFLOAD_INPUTS_DTYPES):
        raise ValueError(
            f"offload_inputs_dtype={value!r}: choose None (offloaded block inputs stored exactly), 'bf16' (fp32 "
            "runs: half the bytes, lossy) or 'fp8' (1 byte per element plus one fp32 scale per token, lossy)"
        )
    if value == "bf16" and precision is not None and check_precision(precision) != "32-true":
        raise ValueError(
            f"offload_inputs_dtype='bf16' with precision={precision!r}: the block inputs are bfloat16 already, so "
            "nothing is saved; use 'fp8' (half their bytes) or None"
        )
    return value


def check_keep_attention(value: bool, offload_inputs_dtype: str | None) -> None:
    """Kept attention outputs stand in only for a recompute from the forward's exact input: a ValueError otherwise."""
    if value and offload_inputs_dtype is not None:
        raise ValueError(
            f"keep_attention=True with offload_inputs_dtype={offload_inputs_dtype!r}: the recompute starts from a "
            "rounded input, so the forward's attention outputs are not its own; pass one or the other"
        )


def check_speculative_step(value: bool, precision: str, host_layout: str, nvme_dir: str | None) -> None:
    """A speculative step writes a spare compute copy, so it needs one: a ValueError naming what has none."""
    if not value:
        return
    why = None
    if check_precision(precision) == "32-true":
        why = f"precision={precision!r} uploads the fp32 masters themselves (no compute copy to write aside)"
    elif host_layout == "lean":
        why = "host_layout='lean' keeps no compute copy (uploads cast the masters)"
    elif nvme_dir is not None:
        why = "nvme_dir keeps the moments on the drive, which a speculative step would read twice"
    if why is not None:
        raise ValueError(f"speculative_step=True with {why}; pass speculative_step=False")


def check_host_layout(value: Any, allow_auto: bool = False) -> str:
    """`value` if it is one of :data:`HOST_LAYOUTS` (or, where the planner resolves it, "auto")."""
    choices = HOST_LAYOUTS + (("auto",) if allow_auto else ())
    if isinstance(value, str) and value in choices:
        return value
    auto = " (auto: default if it fits the host memory, else lean, else lean with Adam on NVMe)" if allow_auto else ""
    raise ValueError(f"host_layout={value!r}: choose one of {', '.join(choices)}{auto}")


def check_checkpoint_format(value: Any) -> CheckpointFormat:
    if isinstance(value, str) and value in CHECKPOINT_FORMATS:
        return value  # type: ignore[return-value]
    raise ValueError(f"checkpoint_format={value!r}: choose 'sharded' or 'torch'")


def check_flag(name: str, value: Any) -> bool:
    """A yes/no option: a bool, nothing else (``"false"`` from a YAML string would be truthy)."""
    if isinstance(value, bool):
        return value
    raise ValueError(f"{name}={value!r}: pass True or False")


def check_nvme_dir(value: Any) -> str | None:
    """None (the moments stay in host memory) or a directory path; an empty string is refused, not read as
    None (it would turn the tier off without a word)."""
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise ValueError(
        f"nvme_dir={value!r}: give a directory on a local drive (e.g. /mnt/nvme/megatrain), or leave nvme_dir "
        "unset (None) to keep the Adam moments in host memory"
    )


def check_host_threads(value: Any) -> int | None:
    """None (all cores but one) or an int from 1 to the cores this process may use."""
    resolve_host_threads(value)
    return value


def check_piece(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"piece={value!r}: elements per piece must be an int of at least 1 (None picks a size)")


def check_device(value: Any) -> torch.device:
    """None: the current CUDA device when there is one, else the CPU. A CUDA device without an index
    ("cuda") is the current one, resolved now: the host worker pins its thread to the engine's GPU with
    ``torch.cuda.set_device``, which refuses a device with no index."""
    if value is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={value!r}: give a torch.device or a string such as 'cuda:0' or 'cpu' ({e})") from e
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}: no CUDA GPU is visible to this process; pass device='cpu'")
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_blocks(value: Any) -> str | tuple[str, ...] | Callable | None:
    """None (found by the rule of engine/discover.py), a dotted module name, several (a list or tuple), or a
    callable model -> ModuleList (or a list of them)."""
    if value is None or (isinstance(value, str) and value) or (callable(value) and not isinstance(value, type)):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(
        f"blocks={value!r}: give the dotted name of the model's nn.ModuleList of blocks (e.g. 'model.layers'), "
        "a list of such names (one per stack), a callable model -> nn.ModuleList, or None to find them"
    )


@dataclass(frozen=True)
class Option:
    """What :class:`EngineConfig` declares of one field besides its type and default: its `help` (the text every
    client's docs show), its `check` (value -> value, a one-line ValueError otherwise), who sets it (`role`) and
    the argparse keywords of its ``megatrain plan`` flag (`flag`; None: no flag).

    Roles: ``"option"``, the user's, which both strategies take under its name with its default; ``"loop"``,
    what the training loop does (clipping, accumulating): the Trainer strategy reads it from the Trainer, a
    Fabric loop declares it to the Fabric strategy; ``"run"``, what the client tells the engine itself (the
    precision flag, training or evaluation, the process group)."""

    help: str
    check: Callable[[Any], Any] | None = None
    role: Literal["option", "loop", "run"] = "option"
    flag: Mapping[str, Any] | None = None


def option(default: Any, help: str, check: Callable[[Any], Any] | None = None, **declared: Any) -> Any:
    """A field of :class:`EngineConfig` with its :class:`Option` (see there)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, check, **declared)})


def _flag_check(name: str) -> Callable[[Any], bool]:
    return lambda value: check_flag(name, value)


def _optional_flag(name: str) -> Callable[[Any], bool | None]:
    return lambda value: value if value is None else check_flag(name, value)


def int_or_auto(what: str) -> Callable[[str], int | str]:
    """An argparse type: an integer, or the word auto; otherwise an error naming `what` was expected (the
    option's own check follows)."""

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} or auto") from None

    return parse


def _recompute_word(text: str) -> bool | str:
    """--recompute auto|true|false as the option's value: "auto", True or False."""
    choices = {"auto": "auto", "true": True, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose auto (keep the last blocks' graphs while they fit), true (recompute every block "
            "in backward) or false (keep every block's graph)"
        )
    return choices[text.lower()]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine streams a model: each option declared once, here, with its type, default, check and help
    (:class:`Option`). The Trainer and Fabric strategies take every ``"option"`` field under its name with its
    default, ``megatrain plan`` has a flag for every field that declares one, and the planner takes the whole
    config; their parameters and docs are derived from these fields (:func:`declared`). Validated on
    construction; every field has a working default."""

    device: torch.device | str | None = option(
        None,
        "the compute device. Default: the Trainer's or Fabric's device (the GPU when there is one; with several "
        "devices, each rank's own); for a plain Engine the current CUDA device when there is one, else the CPU.",
        check_device,
    )
    precision: Precision = option(
        "bf16-mixed",
        "``32-true`` streams fp32 weights; ``bf16-mixed`` and ``bf16-true`` stream bf16 copies of the fp32 masters, "
        "``bf16-mixed`` with the forward under autocast (:meth:`Engine.autocast`). The strategies take it from "
        "the Trainer's or Fabric's precision flag.",
        check_precision,
        role="run",
        flag={"choices": PRECISIONS},
    )
    num_slots: NumSlots = option(
        "auto",
        'device weight slots blocks stream through (>= 2: one computing, one loading). ``"auto"`` (default): 2, '
        "then, after the first optimizer step, as many more as the device memory that step left free allows "
        "beyond four times what it needed (at most one per block; the CPU keeps 2). More slots keep more blocks "
        "resident from a forward to its backward and across the micro-batches of an accumulation, so fewer "
        "uploads; with one per block the backward uploads nothing.",
        check_num_slots,
        flag={"type": int_or_auto("a number of slots"), "metavar": "NUM_SLOTS"},
    )
    device_grad_sums: GradSums = option(
        0,
        "blocks whose gradient stays on the device across the micro-batches of a step (gradient accumulation): "
        "summed there in fp32 (4 bytes per parameter of device memory each; the embedding, final norm and head "
        "too whenever a block is) and sent to the host once, at the step's last backward, instead of every "
        "micro-batch's gradient going down and being added on the host. Bit for bit the same sums. 0 (default): "
        'every gradient lands on the host; a number: the model\'s first that many blocks; ``"auto"``: after the '
        "first optimizer step, as many as the device memory the weight slots leave allows (none on the CPU, "
        "which has no memory measure). It saves host work and downloads, and costs GPU time and the memory "
        "kept graphs would use: worth it where the host or the link bounds the step, not where the optimizer "
        "chain does (docs/benchmarks.md; engine/device/grad_sums.py).",
        check_device_grad_sums,
        flag={"type": int_or_auto("a number of blocks"), "metavar": "BLOCKS"},
    )
    row_chunk: RowChunk = option(
        None,
        "layer-major steps: a training call of a block on more rows (the hidden state's first dimension) than this "
        "runs in chunks of this many rows, every chunk through the block before the next block, in the forward "
        "and in the backward's recompute; each block's weights go up and its gradient comes down once per "
        "micro-batch, and the device holds one chunk's activations inside a block. Equal to one call up to the "
        "order the weights' gradients are summed in (over each chunk, then over the chunks, in fp32). A block "
        "whose rows affect each other (BatchNorm), that draws random numbers, changes its state or has side "
        'outputs is refused at its first chunked call. ``"auto"``: at each call, the most rows whose activations '
        "fit half the device memory free then (the block's first call measures one row), the call whole when "
        "they all fit; whole on the CPU, which has no memory measure. None (default): every call whole "
        "(engine/device/rows.py).",
        check_row_chunk,
        flag={"type": int_or_auto("a number of rows"), "metavar": "ROWS"},
    )
    overlap_optimizer: bool = option(
        True,
        "step each block on the host as soon as its gradient of the step's last backward lands, while backward "
        "goes on (only when nothing needs the whole gradient first: no clipping, no hook reading gradients). "
        "Under Fabric this declares that every ``fabric.backward`` outside ``no_backward_sync`` completes the "
        "step's gradient (micro-batches before it run under ``no_backward_sync``); a loop that breaks the "
        "promise has already stepped on a partial gradient when the engine raises at its next backward, so "
        "pass False for a loop that does not keep it (the gradients then land and wait for "
        "``optimizer.step()``, exact whatever the loop does next), or ``clipping=True`` to clip.",
        _flag_check("overlap_optimizer"),
    )
    speculative_step: bool = option(
        False,
        "take each unit's Adam step on the host as its gradient of the step's last backward lands, before the "
        "step is asked for, as if the global norm will not exceed the clip, writing only the new compute-dtype "
        "weights, into a spare copy per unit (2 B/param in bf16). When the step finds the clip coefficient is 1 "
        "(nothing clipped) and neither the gradient nor the hyper-parameters changed since, the next forward "
        "uploads those weights without waiting for the step, which then writes the masters and moments behind "
        "it; otherwise they are discarded and the unit steps as without this option. The same weights, bit for "
        "bit, either way. For steps that wait for the gradient's norm (clipping) or for ``optimizer.step()`` "
        "(``overlap_optimizer=False``); needs a compute copy: precision bf16-mixed or bf16-true, host_layout "
        '"default", no nvme_dir, and the engine\'s Adam (torch.optim.AdamW or Adam) (engine/host/host_steps.py).',
        _flag_check("speculative_step"),
        flag={"action": argparse.BooleanOptionalAction},
    )
    offload_inputs: OffloadInputs = option(
        "auto",
        "where each block's input, saved for its backward, waits. ``True``: in pinned host memory (copied back one "
        "block ahead in backward), so device memory no longer grows with depth, at the cost of one more transfer "
        'of the hidden states each way (long context). ``False``: on the device. ``"auto"`` (default): decided '
        "at the start of each forward pass, offloading when the inputs would take more than half of the device "
        'memory free at that moment (on a CPU device: never). ``engine.stats["offloaded_passes"]`` counts the '
        "passes that offloaded.",
        check_offload_inputs,
        flag={"action": argparse.BooleanOptionalAction},
    )
    recompute: Recompute = option(
        "auto",
        "``True``: every block is run again, with grad, in backward (the least device memory). ``False``: every "
        "block keeps its graph from the forward (its activations and its slot stay on the device until its "
        'backward; the slot pool grows as needed), so each block is computed once. ``"auto"`` (default): per '
        "forward pass, the last blocks keep their graphs while their measured activations fit in half of the "
        "free device memory and two slots stay free for streaming; on a device with no memory measure (the "
        'CPU) every block is recomputed. ``engine.stats["kept_calls"]`` counts the calls that kept their graph '
        "(engine/device/recompute.py).",
        check_recompute,
        flag={"type": _recompute_word, "metavar": "{auto,true,false}"},
    )
    keep_attention: bool = option(
        False,
        "keep each recomputed block call's attention output and log-sum-exp from its forward (about as many bytes as "
        "the block's input: beside it in pinned host memory when inputs are offloaded, else on the device) and hand "
        "them to its recompute in backward, which then runs no attention forward: the same tensors attention's "
        "backward gets in ordinary training, checked at each recompute (its query, key and value must be the "
        "forward's). Works on ``F.scaled_dot_product_attention`` calls that torch runs as a fused kernel (flash, "
        "memory-efficient, cuDNN); other attention is recomputed. With ``compile_blocks`` the attention call runs "
        "eagerly between compiled pieces of the block. Not with ``offload_inputs_dtype`` (its recompute starts from "
        "a rounded input) (engine/device/kept_attention.py).",
        _flag_check("keep_attention"),
        flag={"action": argparse.BooleanOptionalAction},
    )
    offload_inputs_dtype: OffloadInputsDtype = option(
        None,
        "how offloaded block inputs are stored on the host (and cross the link): ``None`` (default) exactly; "
        '``"bf16"`` (32-true runs) as bfloat16, half the bytes; ``"fp8"`` as float8_e4m3fn with one fp32 '
        "scale per token, 1 + 4/hidden_size bytes per element (a quarter of fp32, half of bf16). Lossy: backward "
        "recomputes each block from the rounded input (see the user guide for the measured cost). Encoded and "
        "decoded on the device (engine/device/input_codec.py). Does nothing to inputs kept on the device "
        '(``offload_inputs=False``, or "auto" deciding not to offload).',
        check_offload_inputs_dtype,
        flag={"choices": OFFLOAD_INPUTS_DTYPES},
    )
    host_layout: HostLayout = option(
        "default",
        '``"default"`` keeps a pinned compute-dtype copy of every weight and a gradient slab per unit (16 B/param '
        'in bf16); ``"lean"`` casts weights into a small ring of pinned staging buffers just before each upload '
        "and lands gradients through a ring where the step consumes them at once (12 B/param plus buffers in "
        "flight; with clipping a per-unit gradient stays, 2 B/param in bf16).",
        check_host_layout,
        flag={"choices": (*HOST_LAYOUTS, "auto")},
    )
    nvme_dir: str | None = option(
        None,
        "a local directory for the Adam moments (8 B/param off host memory), read ahead and written behind per "
        "unit by the host worker; scratch only (checkpoints stay the durable copy). With several ranks each "
        "writes its own shards' files there.",
        check_nvme_dir,
        flag={"metavar": "DIR"},
    )
    host_threads: int | None = option(
        None,
        "threads of the host optimizer (the native Adam kernel and torch's ops on the host worker thread); "
        "default: the cores this process may use minus one, kept for the thread that launches the GPU's kernels. "
        "Spread over the NUMA nodes when there are several (:mod:`megatrain_lightning.optim.threads`). With "
        "several ranks on a machine, each rank's default is its own share of the machine's CPUs (split node by "
        "node) minus one. Results do not depend on it.",
        check_host_threads,
    )
    compile_blocks: bool = option(
        False,
        "run each block's forward, and its recompute in backward, through ``torch.compile`` (one compiled "
        "function per block class, shared by all its blocks; see "
        ":class:`~megatrain_lightning.engine.device.block_fn.CompiledBlock`): once per run in grad mode (forward "
        "and recompute) and once without (validation), more for other sequence lengths. Equal to eager training "
        "within round-off, not bit for bit. A block that cannot compile as one graph raises at its first call, "
        "naming its class.",
        _flag_check("compile_blocks"),
    )
    piece: int | None = option(
        None,
        "elements per piece of the lean layout's rings and the NVMe tier; None picks a size (engine/host/ring.py).",
        check_piece,
    )
    pin_memory: bool | None = option(
        None, "page-lock the DMA buffers; None: on a CUDA device.", _optional_flag("pin_memory")
    )
    preserve_rng_state: bool = option(
        True,
        "replay the forward's RNG state in the recompute (dropout), as ``torch.utils.checkpoint`` does.",
        _flag_check("preserve_rng_state"),
    )
    training: bool = option(
        True,
        "allocate what training needs (moments, gradient buffers); False for evaluation only.",
        _flag_check("training"),
        role="run",
    )
    accumulating: bool = option(
        False,
        "gradients will be summed over micro-batches: the fp32 accumulator counts in the host-memory check.",
        _flag_check("accumulating"),
        role="loop",
    )
    clipping: bool = option(
        False,
        "gradients will be clipped to a global norm (``fabric.clip_gradients`` with ``max_norm=`` or "
        "``clip_val=`` before each step): nothing steps during backward, the norms are taken as the gradients "
        "go down, and the lean layout keeps a gradient per unit until the step.",
        _flag_check("clipping"),
        role="loop",
    )
    blocks: BlocksOption = option(
        None,
        'the ``nn.ModuleList``s of blocks to stream: a dotted name (``"model.layers"``), a list of names (one per '
        "stack), or a callable model -> ModuleList (or a list of them). Default: the list holding the most "
        "parameters, if it holds at least a fifth of them (otherwise setup refuses and names the lists it "
        'found), and every other list outside it holding at least 4% (an encoder, a vision tower; see "How '
        'blocks are found" in the user guide and engine/discover.py). Setup logs the stacks, their lengths and '
        "shares.",
        check_blocks,
    )
    group: Any = option(
        None,
        "the ``torch.distributed`` process group of the data-parallel ranks (None: this process alone). With "
        "more than one rank every unit's host state is partitioned among them (engine/ranks.py).",
        role="run",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            declared = f.metadata.get("option")
            if declared is not None and declared.check is not None:
                declared.check(getattr(self, f.name))
        # the checks across options
        check_offload_inputs_dtype(self.offload_inputs_dtype, self.precision)
        check_keep_attention(self.keep_attention, self.offload_inputs_dtype)
        check_speculative_step(self.speculative_step, self.precision, self.host_layout, self.nvme_dir)

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    @property
    def torch_device(self) -> torch.device:
        return check_device(self.device)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Declared:
    """One field of :class:`EngineConfig` as its clients derive a parameter, a flag or a doc line from it."""

    name: str
    default: Any
    type: Any
    option: Option

    @property
    def help(self) -> str:
        return self.option.help


def declared(*roles: str) -> list[Declared]:
    """:class:`EngineConfig`'s fields in their order, each with its type and :class:`Option`; of `roles` only
    when given. Clients build their parameters from this list (it reads the class at call time)."""
    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        opt = f.metadata.get("option")
        if opt is not None and (not roles or opt.role in roles):
            out.append(Declared(f.name, f.default, hints[f.name], opt))
    return out


def check_options(options: Mapping[str, Any], extra: Mapping[str, Callable[[Any], Any]] | None = None) -> None:
    """The declared options among `options`, each by its own check (a one-line ValueError), and the `extra`
    checks of a client's own options: by the strategies' constructors, and by the megatrain command before
    jsonargparse would build the strategy. Across options (offload_inputs_dtype against the precision) the
    check comes when the config is built."""
    checks = {d.name: d.option.check for d in declared() if d.option.check is not None}
    checks.update(extra or {})
    for key, check in checks.items():
        if key in options:
            check(options[key])


def parameters(*roles: str) -> list[typing.Any]:
    """``inspect.Parameter``s (keyword-only, typed, with their defaults) of the declared options of `roles`:
    what a strategy's ``__init__`` signature shows for them (jsonargparse builds ``init_args`` from it)."""
    import inspect

    kind = inspect.Parameter.KEYWORD_ONLY
    return [inspect.Parameter(d.name, kind, default=d.default, annotation=d.type) for d in declared(*roles)]


def options_doc(*roles: str, indent: int = 8) -> str:
    """Google-style ``name: help`` lines of the declared options of `roles`, for a client's ``Args:`` section."""
    pad = " " * indent
    lines = []
    for d in declared(*roles):
        lines.append(textwrap.fill(f"{d.name}: {d.help}", 116, initial_indent=pad, subsequent_indent=pad + "    "))
    return "\n".join(lines)
