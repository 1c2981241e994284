"""``Trainer(strategy="megatrain")``: Lightning glue around the streaming engine and the host optimizer.

The strategy's hooks hand the model to the engine instead of moving it to the device, replace the optimizers
with the engine's host ones (:class:`HostAdamW`, or any torch optimizer stepping itself on the host: see
engine/generic_optim.py), tell the engine before each backward whether more micro-batches follow, and
read/write checkpoints from the host masters. With one device (``devices=1``, one node) it is a single-device
strategy: one process, no process group. With ``devices=N`` and ``num_nodes=M``, N x M > 1, it is a
data-parallel strategy launched as ``strategy="ddp"`` is (Lightning's launchers and cluster environments),
with one process group over the N x M ranks that the engine partitions the host state over.

Why one file of about 720 lines: it is one class, the hooks Lightning calls on a strategy (ranks and
launch, setup, backward, checkpoints), each a few lines that hand a phase to the engine or to the rank policy
(lightning/ranks.py: whatever depends on the number of ranks), or refuse an option in one line. Its engine
options and their docs are generated from EngineConfig's declarations (engine/config.py). Split further, each
part would be a mixin reading the others' attributes.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import fsspec
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from typing_extensions import override

from megatrain_lightning import checkpoint as mt_checkpoint
from megatrain_lightning.checkpoint import trust
from megatrain_lightning.checkpoint.options import check_storage_options
from megatrain_lightning.engine import (
    Engine,
    EngineConfig,
    GenericHostOptimizer,
    HostAdamW,
    check_checkpoint_format,
    check_options,
    declared,
    materialize,
    options_doc,
    parameters,
)
from megatrain_lightning.lightning import peers
from megatrain_lightning.lightning.averaging import AVERAGED_STATE, AveragingViews
from megatrain_lightning.lightning.convert import lightning_checkpoint
from megatrain_lightning.lightning.precision import MegatrainPrecision, for_strategy
from megatrain_lightning.lightning.ranks import (
    OneProcess,
    SeveralRanks,
    check_ray_environment,
    is_ray_environment,
    policy,
)

log = logging.getLogger("megatrain_lightning")


def check_trainer_args(
    accumulate_grad_batches: Any = 1,
    gradient_clip_val: Any = None,
    gradient_clip_algorithm: Any = None,
    val_check_interval: Any = None,
) -> None:
    """Trainer options that Lightning accepts and then fails on (accumulate_grad_batches=0 divides by zero
    at the first batch) or silently misreads (a negative clip), refused naming the valid range; the megatrain
    command and the sweep driver check them before anything is built."""
    acc = accumulate_grad_batches
    if not isinstance(acc, int) or isinstance(acc, bool) or acc < 1:
        raise ValueError(f"trainer accumulate_grad_batches={acc!r} must be an integer >= 1 (1: no accumulation)")
    clip = gradient_clip_val
    if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0):
        raise ValueError(f"trainer gradient_clip_val={clip!r} must be a number >= 0 (0 or null: no clipping)")
    if gradient_clip_algorithm is not None and str(gradient_clip_algorithm) not in ("norm", "value"):
        raise ValueError(
            f"trainer gradient_clip_algorithm={str(gradient_clip_algorithm)!r} must be 'norm' (the default) or 'value'"
        )
    interval = val_check_interval
    fraction = isinstance(interval, float)  # Lightning reads a float as a share of the epoch
    if interval is not None and not (
        isinstance(interval, (int, float)) and interval > 0 and not (fraction and interval > 1)
    ):
        raise ValueError(
            f"trainer val_check_interval={interval!r} must be above 0: an integer number of batches, or a "
            "fraction of an epoch in (0, 1]"
        )


class MegatrainStrategy(ParallelStrategy):
    """Train with parameters, fp32 masters and Adam state in host memory, on one device or data-parallel.

        Gradients leave each parameter for the host as backward produces them, so they do not sit in ``.grad``.
        Hooks that read or edit them: when the LightningModule or a callback overrides ``on_after_backward`` or
        ``on_before_optimizer_step`` (:func:`gradient_hooks`), every step lands all gradients in an fp32 host
        buffer (4 bytes/param, logged at setup) and waits for them; during those hooks each parameter is a view
        of its fp32 master and ``.grad`` a view of its gradient, and what the hooks leave there is what the
        step uses, as in ordinary training (no overlap of the optimizer with backward then). Clipping
        (``gradient_clip_val``) by norm or by value is exact; by value, the optimizer still overlaps backward
        (each gradient clamped as it lands) unless ``configure_gradient_clipping`` is overridden.
        On resume the optimizer's settings come from the checkpoint, as ``torch.optim.Optimizer.load_state_dict``
        leaves them in ordinary training.

        Data parallel: ``Trainer(devices=N, num_nodes=M)`` with N x M > 1 runs N x M ranks, launched as for
        ``strategy="ddp"``: the script started once per node (Lightning starts the node's other ranks), or by
        ``torchrun``, or as SLURM tasks; one process group over them (NCCL on GPUs, gloo on the CPU), set up by
        Lightning's ``_init_dist_connection``. Lightning gives each rank its share of every global batch
        (``DistributedSampler``), as with DDP. The engine partitions every unit's host state among the ranks
        (one copy in total) and averages gradients over them, as DDP does. No rank holds whole weights or whole
        gradients, so setup refuses what needs them: hooks that read gradients (``on_after_backward``,
        ``on_before_optimizer_step``), weight averaging callbacks, ``checkpoint_format="torch"`` and resuming
        from a single file, a ``device`` (each rank takes its own), ``sync_batchnorm``; and, since every rank
        must run the same forwards, prediction data the ranks would not share evenly. Every rank writes its
        own shards of a checkpoint and reads them back; only rank 0 deletes one. After fit every rank holds the
        whole trained model again, as after DDP, but only its shard of the Adam state: a save then is refused. A
        rank that exits (killed, out of memory) ends the others' fit at their next collective with one line,
        :class:`~megatrain_lightning.lightning.peers.RankExitedError`: which rank, and the last committed checkpoint to resume
        from. With one device and one node (the default on a machine with one GPU) there is no process group and no
        launcher.

        Under Ray Train (a ``TorchTrainer`` worker, without ``prepare_trainer``): pass Ray's cluster environment,
        ``Trainer(strategy="megatrain", plugins=[ray.train.lightning.RayLightningEnvironment()])``. Each worker is
        one rank: the ranks are Ray's workers (``ScalingConfig(num_workers=...)``), the process group is the one
        Ray set up, and each rank computes on ``ray.train.torch.get_device()`` (the Trainer's ``devices`` and
        ``num_nodes`` are not used). Without that environment a worker of a run of several would train alone, so
        ``Trainer(...)`` refuses it (``ray_jobs/train.py`` runs such workers).

        Args:
            checkpoint_format: ``"sharded"`` streams per-block shards to any fsspec URL and commits atomically
                (see :mod:`megatrain_lightning.checkpoint`); ``"torch"`` writes Lightning's usual single file,
                which ordinary strategies can also resume from (small models only: it is built in memory).
            storage_options: fsspec options (credentials, endpoint, ...) for this strategy's checkpoints: every
                save (unless ``trainer.save_checkpoint(..., storage_options=...)`` gives its own), the
                ``ckpt_path`` it resumes from and the old checkpoints it deletes. A mapping (anything else is
                refused here, without quoting it). Passed to fsspec only: never written into a checkpoint or a log
                (the ``megatrain`` command's saved config holds ``<redacted>`` for each value). None: fsspec's
                defaults (e.g. the ``AWS_*`` variables, ``AWS_PROFILE``), the way to keep credentials out of configs.
            **engine options**: every option :class:`~megatrain_lightning.engine.config.EngineConfig` declares, under
                its name and with its default (the lines below are generated from those declarations; the
                precision comes from ``Trainer(precision=...)``, clipping and accumulation from the Trainer too):
    {engine_options}
    """

    strategy_name = "megatrain"

    def __init__(
        self,
        checkpoint_format: Literal["sharded", "torch"] = "sharded",
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # The engine's options by their declarations (engine/config.py: `__signature__` below shows them);
        # the rest of kwargs is Lightning's (accelerator, parallel_devices, cluster_environment, ...).
        options = {d.name: kwargs.pop(d.name, d.default) for d in declared("option")}
        check_options({**options, "checkpoint_format": checkpoint_format}, OWN_CHECKS)  # host_threads: < 1, > cores
        storage_options = check_storage_options(storage_options)  # a mapping: fsspec takes them as keywords
        super().__init__(**kwargs)  # accelerator, parallel_devices, cluster_environment, checkpoint_io, ...
        self._device_arg = options.pop("device")
        self._num_nodes = 1  # set by Lightning from Trainer(num_nodes=...)
        self.options = options  # every other engine option, as given (host_threads None: resolved by the worker)
        for name, value in options.items():  # readable as before: strategy.host_layout, strategy.nvme_dir, ...
            setattr(self, name, value)
        self.checkpoint_format = checkpoint_format
        self.storage_options = storage_options
        self.engine: Engine | None = None
        # The engine as fit left it (closed): after fit its units still hold the masters (the model's parameters)
        # and the host moments, so a save over a sharded checkpoint writes the same format from them.
        self._released: Engine | None = None
        self._averaging: AveragingViews | None = None  # set up with the engine (averaging.py)
        self.grad_hooks: list[str] = []  # overridden hooks that see gradients (set at setup): see gradient_hooks
        # With several ranks: the checkpoints this run saved or resumed from (url -> storage options), and, once
        # a collective lost its peer, the one line that ends the run (see peer_lost)
        self._checkpoints: dict[str, Any] = {}
        self._peer_lost: peers.RankExitedError | None = None

    # -- ranks ---------------------------------------------------------------------------------------
    # Every answer that depends on the number of ranks comes from the rank policy (lightning/ranks.py): with
    # one device and one node a single-device strategy's (rank 0 of 1, no launcher, no process group,
    # collectives the identity, whatever cluster environment Lightning detected), with several DDP's.
    @property
    def _ranks(self) -> OneProcess | SeveralRanks:
        """The rank policy for the count as it is now (Lightning sets devices, nodes and the cluster environment
        after construction)."""
        return policy(self)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Ranks on this node: one per device of ``Trainer(devices=...)``."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def ranks(self) -> int:
        """N x M, the data-parallel ranks the Trainer asks for (1: this process alone); under Ray Train, the
        run's workers."""
        if is_ray_environment(self.cluster_environment):
            return self.cluster_environment.world_size()
        return self.num_nodes * self.num_processes

    @property
    def is_distributed(self) -> bool:
        """Whether Lightning gives each rank a share of the data (``DistributedSampler``) and syncs logs."""
        return self._ranks.distributed

    @property
    @override
    def global_rank(self) -> int:
        return self._ranks.global_rank()

    @property
    @override
    def local_rank(self) -> int:
        return self._ranks.local_rank()

    @property
    @override
    def node_rank(self) -> int:
        return self._ranks.node_rank()

    @property
    @override
    def world_size(self) -> int:
        return self._ranks.world_size()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.ranks, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's rank (as DDP does); nothing with one rank."""
        self._ranks.set_world_ranks()

    @override
    def _configure_launcher(self) -> None:
        """Several ranks: Lightning's script launcher (it starts this node's other ranks, unless torchrun or
        SLURM started them). One: no launcher."""
        check_ray_environment(self.cluster_environment)
        self._ranks.configure_launcher()

    def peer_lost(self) -> peers.RankExitedError:
        """The run's one line once a collective lost its peer (a rank exited): which rank, and the last
        committed checkpoint. From then on nothing collective runs here: teardown gathers no weights (the
        model's parameters stay NaN placeholders) and a save raises this line."""
        if self._peer_lost is None:
            self._peer_lost = peers.rank_exited(self.global_rank, self.world_size, self._checkpoints.items())
        return self._peer_lost

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator's device (torch.cuda.set_device)
        self._ranks.setup_environment()  # several ranks: the process group (Lightning's _init_dist_connection)

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @override
    def barrier(self, name: str | None = None) -> None:
        self._ranks.barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._ranks.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Mean (or ``reduce_op``) over the ranks; with one rank, `tensor` itself."""
        return self._ranks.reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self._ranks.all_gather(tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return self._ranks.reduce_boolean_decision(decision, all=all)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With several ranks, prediction data the ranks would not share evenly is refused: Lightning does not
        pad it (as it pads validation's), but every rank must run the same forwards, since the engine
        all-gathers each block. Collective: every rank processes its dataloaders (before any may skip)."""
        return self._ranks.process_dataloader(dataloader)

    # -- device and precision ----------------------------------------------------------------------
    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module(empty_init=True)`` builds the model without weights: parameters on the meta
        device, buffers on the host. Setup then fills the engine's fp32 masters unit by unit, from the
        checkpoint ``load_hf_weights`` named, else by each module's own init, so the model never exists in
        fp32 beside them (engine/host/materialize.py)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with materialize.empty_init(), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_arg is not None:
            return torch.device(self._device_arg)
        if is_ray_environment(self.cluster_environment):
            from ray.train.torch import get_device

            return get_device()
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank]
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    @override
    def precision_plugin(self) -> MegatrainPrecision:
        if self._precision_plugin is None:
            return MegatrainPrecision(strategy=self)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        # Lightning builds a plugin from Trainer(precision=...); keep its flag, use the engine's semantics.
        self._precision_plugin = for_strategy(plugin, MegatrainPrecision, self)

    @property
    def gradients_visible(self) -> bool:
        """Whether hooks read or edit gradients (:func:`gradient_hooks`), which then see them in ``.grad``."""
        return bool(self.grad_hooks)

    # -- setup / teardown -----------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        """Build the engine over the module (no ``model.to(device)``) and take the optimizer over."""
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.grad_hooks = gradient_hooks(trainer) if fitting else []
        self._ranks.refuse(trainer)  # several ranks: what needs whole weights or gradients in one process
        if fitting:
            self.setup_optimizers(trainer)
        if self.engine is None:
            self._released = None
            precision = self.precision_plugin.precision
            self.engine = Engine(self.lightning_module, self.engine_config(trainer, precision, fitting))
            log.info(self.engine.layout.describe(self.engine.model))
        if self.grad_hooks:
            log.info(
                "%s read or edit gradients: every optimizer step lands all gradients in an fp32 host buffer that "
                "`.grad` views during those hooks (4 bytes/param, %.2f GiB) and the host optimizer steps after "
                "backward instead of overlapping it",
                ", ".join(self.grad_hooks),
                4 * self.engine.num_parameters() / 2**30,
            )
        if fitting:
            self.optimizers = self.engine.optimizers([_unwrapped(o) for o in self.optimizers])
        self.setup_precision_plugin()
        # Weight averaging callbacks (EMA, SWA) read and write the module through the engine's host view.
        self._averaging = AveragingViews(trainer.callbacks, self.lightning_module, lambda: self.engine)

    def engine_config(self, trainer: Any, precision: str, fitting: bool) -> EngineConfig:
        """The engine's options: this strategy's, with what the Trainer says of the run."""
        clipping = bool(fitting and trainer.gradient_clip_val)
        visible = bool(fitting and self.grad_hooks)
        return EngineConfig(
            **self.options,
            device=self.root_device,
            precision=precision,
            training=fitting,
            # The fp32 accumulator counts too; gradients visible to hooks live in it.
            accumulating=fitting and (_accumulates(trainer) or visible),
            clipping=clipping,
            group=self._ranks.process_group(),
        )

    @override
    def model_to_device(self) -> None:
        """Nothing to move: the engine decides what lives on the device."""

    @override
    def teardown(self) -> None:
        """Hand back an ordinary fp32 host model (its parameters are the trained masters)."""
        if self._averaging is not None:
            self._averaging.restore()
            self._averaging = None
        if self.engine is not None:
            # (once only: a close that failed, its peer rank gone, is not tried again by Lightning's teardown
            # of the failed run)
            engine, self.engine = self.engine, None
            engine.close(gather=self._peer_lost is None)
            self._released = engine
        self._ranks.teardown()  # several ranks: the cluster environment's too; one: not this process's to touch

    # -- training hooks -------------------------------------------------------------------------
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Tell the engine whether this gradient completes an optimizer step, then run backward."""
        assert self.engine is not None
        module = self.lightning_module
        if module is None or not module.automatic_optimization or module._trainer is None:
            # Manual optimization: nothing is known about what follows; the gradients wait for the step.
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = module.trainer
        accumulate = trainer.fit_loop._should_accumulate()
        clip = bool(trainer.gradient_clip_val) and (
            "value" if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE else "norm"
        )
        if clip == "value" and not _overrides(module, LightningModule, "configure_gradient_clipping"):
            # The clip Lightning will ask for after backward, said now: units still step as they land.
            self.engine.clip_grad_value_(float(trainer.gradient_clip_val))
        with self.engine.backward(accumulate=accumulate, clip=clip, visible=bool(self.grad_hooks)):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The step; at the end of an epoch or of training, every host step is waited for: the callbacks that
        run there read the parameters directly (``ModelPruning`` computes its masks from them and makes the
        pruning permanent from them), while the blocks' steps otherwise finish in the background."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = None if self.lightning_module is None else self.lightning_module._trainer
        if self.engine is not None and trainer is not None and _loop_pauses(trainer):
            self.engine.flush()
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights load into the host masters, which exist only after setup

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The fp32 masters. With several ranks, nothing: no rank holds whole weights, and each rank's shards
        stream to the (sharded) checkpoint from the engine in :meth:`save_checkpoint`."""
        if self.engine is None:
            self._ranks.refuse_save_after_fit()  # (Lightning asks for this first when it builds a checkpoint)
            return super().lightning_module_state_dict()
        return self._ranks.module_state_dict(self.engine)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """For a sharded checkpoint only the param groups: the moments go to the checkpoint's own shards, and
        gathering them here as well would hold every moment in host memory at once (read back from the
        NVMe tier, too). Once the engine is released a save writes Lightning's single file, or a sharded
        checkpoint over one already there: the moments go here then (views of the host moments)."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps it
        host = (HostAdamW, GenericHostOptimizer)
        if self.checkpoint_format == "sharded" and self.engine is not None and isinstance(inner, host):
            return inner.state_dict(with_moments=False)
        if self.engine is None and self._released is not None and self._released.tier is not None:
            raise RuntimeError(
                "trainer.save_checkpoint after fit with nvme_dir: the Adam moments were scratch files on the NVMe "
                "tier and went with the run, so nothing was written; save before fit returns, with "
                "ModelCheckpoint(save_last=True) or trainer.save_checkpoint in a callback's on_train_end, or save "
                "the weights alone (weights_only=True)"
            )
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Sharded: stream the host buffers unit by unit; Lightning's tensors in `checkpoint` are not used.
        With several ranks every rank calls the store (each writes its own shards), not rank 0 alone.

        After fit (the engine released): over a sharded checkpoint, a sharded checkpoint again, from the
        units fit left (a single file there would leave the marker's data directory beside it, and neither
        would load); elsewhere Lightning's single file. With several ranks, refused: no rank holds the whole
        Adam state any more. Either way with the strategy's `storage_options` unless the call gives its own."""
        options = storage_options if storage_options is not None else self.storage_options
        if self.checkpoint_format == "torch":
            return self._save_single_file(checkpoint, filepath, options)
        if self._peer_lost is not None:  # (an OnExceptionCheckpoint's save, after the run failed)
            raise self._peer_lost
        engine = self.engine
        if engine is None:
            self._ranks.refuse_save_after_fit()
            engine = self._released
            if engine is None or not mt_checkpoint.is_checkpoint(str(filepath), options):
                warnings.warn(
                    f"saving {filepath} outside fit/validate/predict: the host buffers are released, so this writes "
                    "Lightning's single-file format from the ordinary model (it resumes all the same)",
                    stacklevel=2,
                )
                return self._save_single_file(checkpoint, filepath, options)
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state["megatrain_rng"] = _rng_state()
        with_optimizer = "optimizer_states" in checkpoint
        groups = None
        if with_optimizer:
            groups = [
                {k: v for k, v in g.items() if k != "params"} for g in checkpoint["optimizer_states"][0]["param_groups"]
            ]
            state["megatrain_param_groups"] = groups  # as they are (the index's JSON turns betas into a list)
        self._checkpoints[str(filepath)] = options  # (committed or not: peer_lost reads which from storage)
        # A weight average a callback put in the state dict goes to the shards as the weights (as it goes to
        # Lightning's file); the masters it replaced are in the state too, as the callback left them.
        weights = self._ranks.saved_weights(engine, checkpoint)
        mt_checkpoint.save(
            engine,
            str(filepath),
            state,
            optimizer=with_optimizer,
            param_groups=groups,
            storage_options=options,
            weights=weights,
        )

    def _save_single_file(self, checkpoint: dict[str, Any], filepath: Any, options: Any) -> None:
        """Lightning's single file; with fsspec `options` (which Lightning's own writer refuses), written the
        way it writes one (in memory, then one write inside an fsspec transaction), on rank 0."""
        if options is None:
            return super().save_checkpoint(checkpoint, filepath)
        if not self.is_global_zero:
            return None
        data = io.BytesIO()
        torch.save(checkpoint, data)
        fs, path = fsspec.core.url_to_fs(str(filepath), **options)
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.transaction, fs.open(path, "wb") as f:
            f.write(data.getbuffer())
        return None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint: its trainer state, checksummed and read by the restricted unpickler whatever
        `weights_only` says (:mod:`megatrain_lightning.checkpoint.trust`); a damaged one is explained, never
        handed to Lightning. A single file (``checkpoint_format="torch"``): Lightning's loader, with
        ``weights_only=True`` unless the caller says False (so that no stored object runs code); with several
        ranks, refused (it holds whole weights, which no rank takes)."""
        path = str(checkpoint_path)
        if not mt_checkpoint.is_checkpoint(path, self.storage_options):
            self._ranks.refuse_single_file(path)  # several ranks: no rank takes whole weights
            return self._load_single_file(checkpoint_path, weights_only)
        state, index = mt_checkpoint.store.read_checkpoint(path, self.storage_options)
        self._checkpoints[path] = self.storage_options
        state["megatrain_checkpoint"] = path
        state["megatrain_index"] = index  # the weights must come from the version this state came from
        state["state_dict"] = {}  # the weights stream from the shards in load_model_state_dict
        if AVERAGED_STATE in state or (self._averaging is not None and self._averaging.reads_state_dict):
            # WeightAveraging's on_load_checkpoint reads its average from the state dict (one copy, for a moment)
            state["state_dict"] = lightning_checkpoint(path, optimizer=False, storage_options=self.storage_options)[
                "state_dict"
            ]
        groups = state.pop("megatrain_param_groups", None) or index["param_groups"]
        if index["optimizer"]:
            state["optimizer_states"] = [{"param_groups": groups}]
        return state

    def _load_single_file(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        if weights_only is False:  # the user's explicit choice: they trust this file
            return self._read_single_file(checkpoint_path, weights_only=False)
        try:
            with trust.allowed():
                return self._read_single_file(checkpoint_path, weights_only=True)
        except pickle.UnpicklingError as err:
            name = trust.refused_global(err)
            if name is None:
                raise
            raise mt_checkpoint.CheckpointError(
                f"{trust.refusal(str(checkpoint_path), name, 'the checkpoint')}, or pass weights_only=False to trust the whole file"
            ) from None

    def _read_single_file(self, checkpoint_path: Any, weights_only: bool) -> dict[str, Any]:
        """Lightning's loader; with the strategy's fsspec options (which it does not take), the file's bytes
        read through fsspec with them and loaded as Lightning loads a file."""
        if self.storage_options is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        fs, path = fsspec.core.url_to_fs(str(checkpoint_path), **self.storage_options)
        if not fs.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {checkpoint_path}")
        raw = io.BytesIO(fs.cat_file(path))
        return torch.load(raw, map_location=lambda storage, _: storage, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 deletes (Lightning calls this on every rank), with the strategy's storage options."""
        self._checkpoints.pop(str(filepath), None)
        if not self.is_global_zero:
            return
        if mt_checkpoint.is_checkpoint(str(filepath), self.storage_options):
            mt_checkpoint.remove(str(filepath), self.storage_options)
        elif self.storage_options is not None:
            fs, path = fsspec.core.url_to_fs(str(filepath), **self.storage_options)
            if fs.exists(path):
                fs.rm(path)
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if "megatrain_checkpoint" in checkpoint:
            resuming = self.engine.has_optimizer and "optimizer_states" in checkpoint
            url, pinned = checkpoint["megatrain_checkpoint"], checkpoint.get("megatrain_index")
            mt_checkpoint.restore(
                self.engine, url, optimizer=resuming, pinned=pinned, storage_options=self.storage_options
            )
            return
        self.engine.load_master_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: the Adam state already streamed in with the weights; restore group settings (as
        ``torch.optim.Optimizer.load_state_dict`` does: the checkpoint's win) and RNG."""
        if "megatrain_checkpoint" not in checkpoint:
            return super().load_optimizer_state_dict(checkpoint)
        # (a sharded checkpoint's trainer state holds the first optimizer's groups; the store restored every
        # torch optimizer's own, engine/generic_optim.py)
        for opt, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            inner = getattr(opt, "_optimizer", opt)  # LightningOptimizer wraps it
            inner.restore_groups(saved["param_groups"])
        if "megatrain_rng" in checkpoint:
            _set_rng_state(checkpoint["megatrain_rng"])


OWN_CHECKS: dict[str, Callable[[Any], Any]] = {"checkpoint_format": check_checkpoint_format}
"""The strategy's options besides the engine's, each by its check (storage_options has its own: it is never quoted)."""


def _derive_options(cls: type) -> None:
    """`cls`'s ``__init__`` signature and ``Args:`` docs with every declared engine option (engine/config.py):
    what ``help()``, jsonargparse's ``init_args`` and the docs read, so an option declared there is taken here
    without an edit."""
    signature = inspect.signature(cls.__init__)
    own = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.name != "self" else p for p in own]
    rest = [p for p in signature.parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD]
    cls.__init__.__signature__ = signature.replace(parameters=[*own, *parameters("option"), *rest])
    cls.__doc__ = (cls.__doc__ or "").replace("{engine_options}", options_doc("option"))


_derive_options(MegatrainStrategy)


def _loop_pauses(trainer: Any) -> bool:
    """Whether the step under way is the last of its epoch or of training (epoch-end and train-end hooks follow)."""
    loop = trainer.fit_loop.epoch_loop
    last_step = trainer.max_steps != -1 and trainer.global_step + 1 >= trainer.max_steps
    return bool(loop.batch_progress.is_last_batch or last_step or trainer.should_stop)


GRAD_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def gradient_hooks(trainer: Any) -> list[str]:
    """The hooks between backward and the optimizer step that the LightningModule or a callback overrides,
    as ``Class.hook``: they may read or edit ``.grad``, so the strategy shows them every gradient there.

    A hook counts as overridden when its class defines it anew or the instance holds its own (Lightning's
    ``LambdaCallback`` sets the hooks it is given on the instance). Lightning's own callbacks override
    neither hook."""
    owners = [(trainer.lightning_module, LightningModule), *((cb, Callback) for cb in trainer.callbacks)]
    return [
        f"{type(owner).__name__}.{hook}"
        for owner, base in owners
        for hook in GRAD_HOOKS
        if _overrides(owner, base, hook)
    ]


def _overrides(owner: Any, base: type, hook: str) -> bool:
    return hook in vars(owner) or getattr(type(owner), hook) is not getattr(base, hook)


def _accumulates(trainer: Any) -> bool:
    """Whether gradients will be summed over micro-batches (the engine then allocates fp32 accumulators),
    now or in a later epoch of a GradientAccumulationScheduler."""
    factors = [trainer.accumulate_grad_batches]
    for cb in trainer.callbacks:
        if isinstance(cb, GradientAccumulationScheduler):
            factors.extend(cb.scheduling.values())
    return max(factors) > 1


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
