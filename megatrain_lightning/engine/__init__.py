"""The engine's public face: what its clients (the Trainer and Fabric strategies, the planner, the command line,
the sweeps) use of it, and the errors it raises. Everything else in engine/ is its own parts.

    Engine(model, EngineConfig(...))     the engine; EngineConfig declares every option (engine/config.py)
    HostAdamW, GenericHostOptimizer      the host optimizers engine.optimizer() returns; check_optimizer
    HostMemoryError, NvmeTierError,      refusals that come before the engine allocates: the user's to fix
    PinnedMemoryError
    HostLimit, tightest_host_limit,      the host memory a run may use on this machine and the optimizer's
    optimizer_backend                    kernel (`megatrain env`)
"""

from megatrain_lightning.engine.config import (
    HOST_LAYOUTS,
    OFFLOAD_INPUTS_DTYPES,
    PRECISIONS,
    Declared,
    EngineConfig,
    Option,
    check_checkpoint_format,
    check_device,
    check_host_layout,
    check_keep_attention,
    check_num_slots,
    check_nvme_dir,
    check_offload_inputs,
    check_offload_inputs_dtype,
    check_options,
    check_precision,
    compute_dtype,
    declared,
    forward_context,
    int_or_auto,
    options_doc,
    parameters,
)
from megatrain_lightning.engine.device.rows import check_row_chunk
from megatrain_lightning.engine.discover import BlocksOption
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.generic_optim import GenericHostOptimizer
from megatrain_lightning.engine.host import materialize
from megatrain_lightning.engine.host.host_memory import HostLimit, tightest_host_limit
from megatrain_lightning.engine.host.materialize import empty_init
from megatrain_lightning.engine.host.nvme import PREFIX as NVME_SCRATCH_PREFIX
from megatrain_lightning.engine.host.nvme import NvmeTierError
from megatrain_lightning.engine.host.pinned import PinnedMemoryError
from megatrain_lightning.engine.host.units import HostMemoryError, HostUnit
from megatrain_lightning.engine.optimizer import HostAdamW, check_optimizer, optimizer_backend
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.optim.threads import usable_cpus

__all__ = [
    "HOST_LAYOUTS",
    "NVME_SCRATCH_PREFIX",
    "OFFLOAD_INPUTS_DTYPES",
    "PRECISIONS",
    "BlocksOption",
    "Declared",
    "Engine",
    "EngineConfig",
    "GenericHostOptimizer",
    "HostAdamW",
    "HostLimit",
    "HostMemoryError",
    "HostUnit",
    "NvmeTierError",
    "Option",
    "PinnedMemoryError",
    "Probes",
    "check_checkpoint_format",
    "check_device",
    "check_host_layout",
    "check_num_slots",
    "check_nvme_dir",
    "check_offload_inputs",
    "check_keep_attention",
    "check_offload_inputs_dtype",
    "check_optimizer",
    "check_options",
    "check_precision",
    "check_row_chunk",
    "compute_dtype",
    "declared",
    "empty_init",
    "forward_context",
    "int_or_auto",
    "materialize",
    "optimizer_backend",
    "options_doc",
    "parameters",
    "tightest_host_limit",
    "usable_cpus",
]
