"""The engine's device half: each block's call streamed through a weight slot, forward and backward.

    streamer.py      BlockStreamer: a block's call bound to a slot, loaded, prefetched, recomputed in backward
    streams.py       the compute and copy streams, their events, and the SlotPool of device weight slots
    uploads.py       Uploader: host -> device copies of a unit's weights, whole or piece by piece (the stager)
    block_fn.py      BlockRunner and the per-block autograd node; compiled block calls
    block_state.py   what a block call takes, returns and changes, as its recompute needs it
    sinks.py         lists and dicts a block adds tensors to (an auxiliary-loss sink)
    replay.py        random generators replayed in the recompute; reentrant checkpoints; whole-model compile
    rows.py          RowChunks: a call of many rows run chunk by chunk (row_chunk)
    recompute.py     KeepPolicy: which calls keep their graph instead of being recomputed
    saved_inputs.py  block inputs saved for backward, on the device or in pinned host memory
    input_codec.py   how an offloaded input is stored: exactly, as bf16, or as fp8 with a scale per token
    grad_sums.py     DeviceGradSums: block gradients summed on the device across micro-batches

Nothing here imports the engine's facade (engine.py) or the build step (build.py) that wires these parts.
"""
