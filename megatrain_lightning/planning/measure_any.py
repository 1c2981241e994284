"""The device memory of one training step of any model, measured on fake tensors through the engine.

``measure.py`` runs the project's Llama; :func:`measure_model_step` runs whatever a zero-argument `build`
returns (a Hugging Face model built from its config, or a user's module) the same way: the model is built
under ``FakeTensorMode`` (shapes, dtypes and storage sizes, no memory), the engine adopts it while
:class:`~megatrain_lightning.planning.measure.DeviceBytes` counts, and one step runs: the forward under the
engine's autocast, the loss's backward, the host worker's flush. What is counted and how the host buffers
are told apart is measure.py's (its module docstring), including the modelled flash-attention workspace.

The batch is what the model's family trains on, on the device, ``micro_batch`` rows of ``seq_len`` tokens:

- ``causal``: ``input_ids`` and ``labels`` (the model's own loss).
- ``seq2seq`` (encoder-decoder, e.g. T5): also ``decoder_input_ids``, ``seq_len`` tokens on each side.
- ``vlm`` (image-text-to-text): one image per row, ``pixel_values`` of the vision tower's size, and its
  image tokens at the start of ``input_ids`` (:data:`IMAGE_TOKENS` names the families whose count is known).
- ``module`` (a user's module that is not a Hugging Face model): ``model(input_ids)``, with ``labels=`` or
  ``targets=`` the same ids when its forward takes one; the loss is what it returns when that is a scalar,
  its ``loss``, or else the sum of the tensor it returns.

Values the fake tensors do not have: the fake mode carries a ``ShapeEnv``, so a value read from a tensor
(``.item()``) is a symbol. A check on it (``torch._check``: Llava's "image tokens match the image features")
is taken as passing; a Python branch or a shape that depends on it stops the measurement with a ValueError
naming the op (plan with ``--no-measure`` for the stacks and host memory). The engine's own test whether a
block's buffers changed compares values too; on fake tensors a buffer counts as unchanged unless it was
replaced or its version counter moved (a buffer updated in place without either, like BatchNorm's
statistics on CUDA, is not a thing of these families).

Mixture-of-experts routing: transformers 5 runs experts with ``grouped_mm`` by default (tokens sorted by
expert, one grouped matmul over offsets: what a GPU runs), whose shapes do not depend on the routing, so the
measured step holds tokens x top_k rows as training does. An eager expert loop over ``nonzero`` has shapes
that depend on the routing; such a model stops with the ValueError above.

State-space layers (Mamba, Jamba) run transformers' reference PyTorch path here, not the ``mamba_ssm`` CUDA
kernels: its scan loops over tokens (time per token) and keeps more for backward than the fused kernel.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_lightning.engine.config import EngineConfig, compute_dtype
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.planning.measure import (
    DeviceBytes,
    Measured,
    flash_workspace,
    observe_host_allocations,
    release_quietly,
)

Family = Literal["causal", "seq2seq", "vlm", "module"]


def llava_image_tokens(config: Any) -> int:
    """Llava: a token per patch of the vision tower's image; "full" keeps CLIP's class token too."""
    vision = config.vision_config
    full = getattr(config, "vision_feature_select_strategy", "default") == "full"
    return (vision.image_size // vision.patch_size) ** 2 + (1 if full else 0)


IMAGE_TOKENS: dict[str, Callable[[Any], int]] = {"llava": llava_image_tokens}
"""Image tokens per image for the vision-language families whose inputs the measurement builds (model_type)."""


def check_measurable(config: Any, family: Family, seq_len: int) -> None:
    """A one-line ValueError, before anything is built, for a batch the measurement cannot make."""
    if family != "vlm":
        return
    kind = config.model_type
    if kind not in IMAGE_TOKENS:
        raise ValueError(
            f"measuring a step of the vision-language model_type={kind!r} needs its image inputs, which the planner "
            f"builds for {', '.join(sorted(IMAGE_TOKENS))}; plan it with --no-measure (stacks and host memory)"
        )
    tokens = IMAGE_TOKENS[kind](config)
    if tokens >= seq_len:
        raise ValueError(f"seq_len={seq_len}: one image of {kind} takes {tokens} tokens; plan a longer sequence")


def measure_model_step(
    build: Callable[[], nn.Module],
    family: Family,
    seq_len: int,
    micro_batch: int = 1,
    precision: str = "bf16-mixed",
    num_slots: int = 2,
    offload_inputs: bool | str = False,
    recompute: bool | str = True,
    capacity: int | None = None,
    offload_inputs_dtype: str | None = None,
    row_chunk: int | None = None,
) -> tuple[Measured, int]:
    """(device bytes of one training step of the model `build` returns, host bytes of the block inputs it
    offloaded); with `recompute` other than True and the device bytes the engine may take (`capacity`), the
    step after a first one, as measure.py's ``measure_step``. `row_chunk`: block calls of that many rows at a
    time (engine/device/rows.py)."""
    dtype = compute_dtype(precision)
    t0 = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        model = build()  # host memory: built before counting starts
        counter = DeviceBytes(flash_workspace if dtype == torch.bfloat16 else None)
        with counter, observe_host_allocations(counter.host_buffer), _BuffersUnchanged():
            options = EngineConfig(
                device="cpu",
                precision=precision,
                num_slots=num_slots,
                offload_inputs=offload_inputs,
                offload_inputs_dtype=offload_inputs_dtype,
                pin_memory=False,
                recompute=recompute,
                row_chunk=row_chunk,
            )
            free = None if capacity is None else (lambda: capacity - counter.live)
            engine = Engine(model, options, Probes(host_available_bytes=lambda: 1 << 62, device_free_bytes=free))
            try:
                persistent = counter.live
                forward, backward = _step(model, family, engine, counter, micro_batch, seq_len)
                kept = engine.stats["kept_calls"]
                if recompute is not True and capacity is not None:  # the first step measured, this one keeps
                    engine.zero_grad()
                    forward, backward = _step(model, family, engine, counter, micro_batch, seq_len)
                    kept = engine.stats["kept_calls"] - kept
                offloaded = engine.saved_inputs.host_bytes()
            finally:
                release_quietly(engine)
    measured = Measured(
        peak=max(forward, backward),
        persistent=persistent,
        forward_peak=forward,
        backward_peak=backward,
        workspace=counter.workspace,
        seconds=time.perf_counter() - t0,
        kept_calls=kept,
    )
    return measured, offloaded


def _step(
    model: nn.Module, family: Family, engine: Engine, counter: DeviceBytes, micro_batch: int, seq_len: int
) -> tuple[int, int]:
    """(forward peak, backward peak) of one step; the batch is made on the device, as in training."""
    counter.reset_peak()
    args, kwargs = fake_batch(model, family, micro_batch, seq_len)
    try:
        with engine.autocast():
            loss = loss_of(model(*args, **kwargs))
        forward = counter.reset_peak()
        loss.backward()
    except (DataDependentOutputException, GuardOnDataDependentSymNode) as err:
        raise ValueError(
            f"{type(model).__name__} reads tensor values to decide a shape or a branch ({_first_line(err)}), which "
            "one step on fake tensors cannot follow; plan it with --no-measure (stacks and host memory)"
        ) from None
    engine.flush()
    return forward, counter.reset_peak()


def fake_batch(model: nn.Module, family: Family, micro_batch: int, seq_len: int) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) of the model's training call for `family` (module docstring)."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.int64)
    if family == "module":
        takes = inspect.signature(model.forward).parameters
        target = next((k for k in ("labels", "targets") if k in takes), None)
        return (ids,), ({target: ids} if target else {})
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if family == "seq2seq":
        batch["decoder_input_ids"] = ids
    if family == "vlm":
        config = model.config
        vision = config.vision_config
        tokens = IMAGE_TOKENS[config.model_type](config)
        image = getattr(config, "image_token_id", None)
        ids[:, 1 : 1 + tokens] = getattr(config, "image_token_index", None) if image is None else image
        size = vision.image_size
        batch["pixel_values"] = torch.zeros(micro_batch, vision.num_channels, size, size)
    return (), batch


def loss_of(out: Any) -> torch.Tensor:
    """The scalar to differentiate: the output when it is one, its ``loss``, else the sum of its tensor."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if isinstance(loss, (tuple, list)) and loss and isinstance(loss[0], torch.Tensor):
        loss = loss[0]
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"the model returned a {type(out).__name__}, not a loss: return a scalar tensor, an object with .loss, "
            "or the logits (their sum is differentiated)"
        )
    return loss if loss.dim() == 0 else loss.float().sum()


class _BuffersUnchanged(TorchDispatchMode):
    """``torch.equal`` of fake tensors has no answer: the engine's test whether a block's buffer changed
    (engine/device/block_state.py) then relies on the buffer's identity and version counter (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.equal.default:
            return True
        return func(*args, **(kwargs or {}))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
