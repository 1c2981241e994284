"""An executable schedule model of the engine's CUDA pipeline: where a training step's time goes on a GPU
that is not there.

Record (``record.py``, ``steps.py``). A few training steps of :class:`~megatrain_lightning.Engine` and this project's
``LlamaForCausalLM`` run for real, at a real size (llama-3.1-8b at 128k tokens: seconds, no memory) on
fake tensors as in ``measure.py``, in the order the strategy calls the engine (forward under autocast,
``zero_grad``, backward, ``clip_grad_norm_`` when clipping, ``optimizer_step``), the engine built with the
recorder's ``Probes`` (its streams and host worker). The recorder logs every decision the engine takes:
each copy on the H2D or D2H stream and its bytes, each event (a marker at its place in its lane), each
wait of a lane for an event, each host block on an event, a job or the device (or on a read of a device tensor, ``.cpu()``, ``.item()``: a wait for all
compute issued before it); every op the issuing thread runs as a kernel (FLOPs from
``torch.utils.flop_counter``'s registry, the CUDA flash kernels' count for the CPU attention ops, bytes
read and written, the block and phase it belongs to) or as host work when it touches a host buffer; and
every host worker job with the kernels it runs (Adam steps, accumulation, norms: element counts and bytes)
and the copy events it waits for. Because the engine's own code makes these calls, a change to its
scheduling shows up in the next recording.

Replay (``replay.py``) is a discrete-event simulation on five lanes: GPU compute, H2D, D2H, the host
worker and the issuing Python thread. A GPU op starts after its issue (each kernel or copy costs the
issuing thread a launch), after its lane's previous op and after the events its lane waits for; its time
is max(FLOPs / matmul or attention rate, bytes / HBM bandwidth) on the device profile (``profiles.py``);
a copy takes bytes / link bandwidth; a host job starts when submitted and its predecessor has ended; a
host sync blocks its thread until what it waits for has ended. ``report.py`` measures the last recorded
step from the end of the previous step's backward to the end of its own (the previous step's host Adam
overlapping this forward included) and compares it with the busiest resource's work per step.
``modelled.py`` runs the three for a model and a profile: what ``megatrain schedule`` prints.

What it leaves out:

- Kernel times are a roofline per op with one achieved rate per kind (matmul, attention, memory-bound): no
  tile quantization, no slower small GEMMs, no clock changes. The op list is the CPU's under autocast, so
  memory-bound ops and their fusion may differ from what CUDA runs.
- No contention: H2D and D2H run at full link rate at once; DMA, the host Adam and host casts do not share
  the host's DRAM bandwidth; copies do not slow kernels down through HBM.
- No CUDA launch-queue limit: the issuing thread may run any distance ahead of the GPU (a real one blocks
  about a thousand kernels ahead, which changes no GPU time while the GPU is the bottleneck). Python and
  autograd overhead besides the launch cost, the caching allocator and Lightning's own per-step work
  (logging, progress bar) are not modelled.
- Host jobs run when they are submitted during the recording, but the engine's decisions taken from
  timing (``future.done()``: prefetch a block only once its step is done) are answered by a live replay
  of what has been recorded so far on the same profile (``Recorder(profile)``), so they are the ones the
  engine would take there. The NVMe tier's reads and writes are not modelled.
- Token tiles and input offload are the planner's choices for the profile's GPU memory, not the engine's
  "auto" choices from the memory free at run time. The choices the engine takes from free memory during
  the recording (``num_slots="auto"`` after the first step, ``recompute="auto"`` at each pass's first
  block) read the profile's GPU memory less the CUDA context allowance less the device bytes live at that
  moment, counted as ``measure.py`` counts them (slots, saved inputs, kept graphs, RoPE): free memory
  shrinks as the slot pool grows and graphs are kept. What it is not: the caching allocator's
  fragmentation, and the bytes the first step needed beyond that (the "transient" ``num_slots="auto"``
  reserves four times over), which is the planner's figure.

Data parallel (``ranks.py``, ``scaling.py``): ``modelled_step(..., gpus=N, link=...)`` records one rank of
the data-parallel mode (engine/ranks.py): shard copies, collectives on the device link, host work
on the rank's shards at 1/N of the node's DRAM bandwidth; :func:`scaling` tabulates strong and weak scaling.
"""

from megatrain_lightning.schedule.modelled import ModelledStep, modelled_step
from megatrain_lightning.schedule.profiles import PROFILES, Profile, measure_host_adam, profile
from megatrain_lightning.schedule.ranks import LINKS, DataParallel
from megatrain_lightning.schedule.record import Recorder
from megatrain_lightning.schedule.replay import Timeline, replay
from megatrain_lightning.schedule.report import Summary, summarize, table
from megatrain_lightning.schedule.scaling import ScalingRow, scaling, scaling_table
from megatrain_lightning.schedule.steps import record_steps, train_steps
from megatrain_lightning.schedule.trace import Trace

__all__ = [
    "LINKS",
    "DataParallel",
    "ScalingRow",
    "scaling",
    "scaling_table",
    "ModelledStep",
    "PROFILES",
    "Profile",
    "Recorder",
    "Summary",
    "Timeline",
    "Trace",
    "measure_host_adam",
    "modelled_step",
    "profile",
    "record_steps",
    "replay",
    "summarize",
    "table",
    "train_steps",
]
