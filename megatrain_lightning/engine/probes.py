"""What the engine reads from, and drives on, the machine under it.

The defaults measure and drive the real machine. Code that runs the engine somewhere other than on the
device it models passes stand-ins: the planner's fake-tensor measurement (no host-memory limit), the
schedule model (recording streams, a recording host worker, the device-memory figures of a GPU it does
not have), and tests (a copy-stream double that reorders copies, small memory readings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Probes:
    host_available_bytes: Callable[[], int] | None = None
    """Host memory available for the engine's buffers; None: read from the OS (engine/host/units.py)."""
    device_free_bytes: Callable[[], int | None] | None = None
    """Device memory free now (None: no measure); None: read from the device (device_memory.py)."""
    step_transient_bytes: Callable[[], int | None] | None = None
    """Device memory the first step needed beyond the persistent buffers; None: measured (device_memory.py)."""
    streams: Callable[[torch.device], Any] | None = None
    """Builds the engine's streams for a device; None: engine/device/streams.py's ``Streams``."""
    worker: Callable[[Any], Any] | None = None
    """Wraps the host worker (engine/host/worker.py) the engine submits its host jobs to; None: used as it is."""
