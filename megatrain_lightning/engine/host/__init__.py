"""The engine's host half: the training state in host memory, the gradients' way to it, and the steps on it.

    units.py          HostUnit: a unit's flat fp32 master, Adam moments, compute copy, gradient slab, and
                      its gradient's state (UnitGrad, changed by named transitions)
    host_steps.py     HostSide: gradients from the device into the units, accumulation, norms, the Adam steps
    worker.py         the one host thread that runs those jobs, the most urgent ready one first
    pending_reads.py  a block weight read while its background step still runs waits for that step
    ring.py           the lean layout's rings of host buffers, pieces in flight instead of a buffer per unit
    nvme.py           the NVMe tier: Adam moments in files, in host memory only while a piece steps
    pinned.py         exact-size page-locked host memory
    host_memory.py    how much host memory this process may still allocate
    materialize.py    a model built without weights: its masters filled unit by unit

Nothing here imports the engine's facade (engine.py) or the build step (build.py) that wires these parts.
"""
