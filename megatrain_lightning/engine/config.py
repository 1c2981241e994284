"""The engine's options: one dataclass, validated once, and one ``check_*`` per option.

Every place that takes one of these options from a user (the Trainer and Fabric strategies, the planner,
the ``megatrain`` command, a sweep's YAML) calls the same check, so a bad value gets the same one-line
error naming it and the fix wherever it enters. :class:`EngineConfig` runs them all in ``__post_init__``.

It imports nothing of the engine: the planner, the command line and the sweeps import it alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from megatrain_lightning.engine.recompute import Recompute, check_recompute
from megatrain_lightning.optim.threads import resolve_host_threads

Precision = Literal["32-true", "bf16-mixed", "bf16-true"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
HostLayout = Literal["default", "lean"]
HOST_LAYOUTS: tuple[str, ...] = get_args(HostLayout)
NumSlots = int | Literal["auto"]
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


_OPTION_CHECKS: dict[str, Callable[[Any], Any]] = {
    "compile_blocks": lambda v: check_flag("compile_blocks", v),
    "overlap_optimizer": lambda v: check_flag("overlap_optimizer", v),
    "blocks": check_blocks,
    "checkpoint_format": check_checkpoint_format,
    "num_slots": check_num_slots,
    "offload_inputs": check_offload_inputs,
    "recompute": check_recompute,
    "offload_inputs_dtype": check_offload_inputs_dtype,
    "host_layout": check_host_layout,
    "nvme_dir": check_nvme_dir,
    "host_threads": check_host_threads,
}


def check_options(options: Mapping[str, Any]) -> None:
    """The strategies' options among `options`, each checked (a one-line ValueError): by MegatrainStrategy's
    constructor, and by the megatrain command before jsonargparse would build the strategy."""
    for key, check in _OPTION_CHECKS.items():
        if key in options:
            check(options[key])


@dataclass(frozen=True)
class EngineConfig:
    """How the engine streams a model. Validated on construction; every field has a working default."""

    device: torch.device | str | None = None
    """The compute device; None: the current CUDA device when there is one, else the CPU."""
    precision: Precision = "bf16-mixed"
    """``32-true`` streams fp32 weights; ``bf16-mixed`` and ``bf16-true`` stream bf16 copies of the fp32
    masters, ``bf16-mixed`` with the forward under autocast (:meth:`Engine.autocast`)."""
    num_slots: NumSlots = "auto"
    """Device weight slots (>= 2: one computing, one loading). "auto": 2, then after the first optimizer
    step as many more as the device memory that step left free allows (at most one per block)."""
    overlap_optimizer: bool = True
    """Step each unit on the host as soon as its gradient of the step's last backward lands (not when a
    global-norm clip needs every gradient first)."""
    offload_inputs: OffloadInputs = "auto"
    """Where saved block inputs wait for backward: True host (pinned), False device, "auto" decided per
    forward pass from the device memory free."""
    recompute: Recompute = "auto"
    """Recompute each block in backward (True), keep every block's graph from the forward (False), or keep
    the last blocks' graphs while they fit in free device memory ("auto"; engine/recompute.py)."""
    offload_inputs_dtype: OffloadInputsDtype = None
    """How offloaded block inputs are stored on the host (engine/input_codec.py). None: exactly, as they are;
    "bf16" (fp32 runs): as bfloat16, half the bytes; "fp8": float8_e4m3fn with one fp32 scale per token. Lossy
    but for None; nothing changes while the inputs stay on the device."""
    host_layout: HostLayout = "default"
    """``default``: a pinned compute copy and a gradient slab per unit (16 B/param in bf16); ``lean``: rings
    of staging and gradient buffers instead (12 B/param plus buffers in flight)."""
    nvme_dir: str | None = None
    """A local directory for the Adam moments (scratch files; 8 B/param off host memory)."""
    host_threads: int | None = None
    """Threads of the host optimizer; None: the cores this process may use minus one."""
    compile_blocks: bool = False
    """Run each block's forward and recompute through ``torch.compile`` (one per block class)."""
    piece: int | None = None
    """Elements per piece of the lean layout's rings and the NVMe tier; None picks a size (engine/ring.py)."""
    pin_memory: bool | None = None
    """Page-lock the DMA buffers; None: on a CUDA device."""
    preserve_rng_state: bool = True
    """Replay the forward's RNG state in the recompute (dropout), as ``torch.utils.checkpoint`` does."""
    training: bool = True
    """Allocate what training needs (moments, gradient buffers); False for evaluation only."""
    accumulating: bool = False
    """Gradients will be summed over micro-batches: the fp32 accumulator counts in the host-memory check."""
    clipping: bool = False
    """Gradients will be clipped to a global norm: the lean layout keeps a gradient per unit until the step."""
    blocks: str | tuple[str, ...] | Callable | None = None
    """The nn.ModuleList to stream: a dotted module name, a callable model -> ModuleList, or None to find it
    (engine/discover.py)."""
    group: Any = None
    """The ``torch.distributed`` process group of the data-parallel ranks (None: this process alone). With
    more than one rank every unit's host state is partitioned among them (engine/partition.py)."""

    def __post_init__(self) -> None:
        check_device(self.device)
        check_precision(self.precision)
        check_num_slots(self.num_slots)
        check_offload_inputs(self.offload_inputs)
        check_recompute(self.recompute)
        check_offload_inputs_dtype(self.offload_inputs_dtype, self.precision)
        check_host_layout(self.host_layout)
        check_host_threads(self.host_threads)
        check_piece(self.piece)
        check_blocks(self.blocks)
        check_nvme_dir(self.nvme_dir)
        for name in (
            "overlap_optimizer",
            "compile_blocks",
            "preserve_rng_state",
            "training",
            "accumulating",
            "clipping",
        ):
            check_flag(name, getattr(self, name))
        if self.pin_memory is not None:
            check_flag("pin_memory", self.pin_memory)

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    @property
    def torch_device(self) -> torch.device:
        return check_device(self.device)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)
