"""Sizing a run before it starts: the memory planner and what checks it.

- ``planner.py``: host, drive and GPU bytes of a run of this project's Llama, by formula (``megatrain plan``,
  a Ray trial's resource request); ``plan_any.py``: the same for any other model, counted from the engine's
  units.
- ``measure.py``, ``measure_any.py``: one training step on fake tensors, the device bytes the formulas are
  checked against (they import the engine, so the planner imports them only when asked to measure).
- ``flops.py``: model FLOPs, the one definition MFU and the schedule model use.
- ``device_memory.py``: free device memory and a step's transient, read by the engine's "auto" choices
  (slots, tiles, input offload) and by the planner, so both settle on the same numbers.

Nothing is imported here: the engine imports ``device_memory`` alone without loading the planner.
"""
