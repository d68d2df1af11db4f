"""``IPUStrategy``: Lightning's loops driving compiled steps on emulated IPUs.

Like Lightning's XLA strategy it is thin: each step hook (``training_step``, ``validation_step``,
``test_step``, ``predict_step``) calls an ``ipu_backend`` executor that compiled the
LightningModule's method of the same name, once, with its ``self.log`` calls as program outputs.
The executors of one run share the module's weights on the IPUs; the module (``state_dict``,
checkpoints, callbacks) shows them whenever it is read.

**One Lightning batch is one host call**: a combined batch of ``device_iterations x
gradient_accumulation x replicas`` micro-batches of the dataloader's ``batch_size`` (see
``_data.py``), on which the IPUs run ``device_iterations`` optimizer steps. So ``batch_idx``, the
progress bar, ``limit_*_batches`` and ``val_check_interval`` count host calls (a fraction rounded
in calls to other batches than on the CPU is warned of, ``_batch_limits.py``), while
``trainer.global_step``, ``max_steps``, ``trainer.estimated_stepping_batches`` and the step
loggers record count optimizer steps (``device_iterations`` per batch; ``max_steps`` must be a
multiple of it). With the defaults (``device_iterations=1``, no accumulation) a batch is one
optimizer step on ``replicas x batch_size`` samples, as with DDP on that many devices.
``accumulate_grad_batches`` becomes the options' gradient accumulation: the loop sees one batch
per optimizer step. Hyper-parameters (learning rate, ...) are program inputs: a scheduler with
``interval="step"`` is stepped between the optimizer steps of a call, each step running at the
rate it set, as on the CPU (a ``frequency`` above 1 or a monitored one steps once per batch,
warned of). Validation, test and predict evaluate every sample: the short last batch of
an epoch runs padded, its padding dropped from every result (``_short_batches.py``).

What a step returns is combined over the micro-batches of the call as ``_outputs.py``
describes. ``self.log`` values are reduced with their ``reduce_fx`` (the mean by default) over
the replicas; in training each micro-batch returned is logged in turn, and a value logged with
``on_epoch=True`` is returned for every micro-batch, so the epoch's aggregate covers them all and
the step's value is the last one's, as on the CPU.

torchmetrics ``Metric`` objects held by the module may be called (``self.acc(preds, y)``) or
updated in a step and logged (``self.log("acc", self.acc)``): their states are outputs of the
compiled step, reduced with their ``dist_reduce_fx`` over replicas and micro-batches and merged
into the metric on the host after each call (``_metrics.py``), so ``on_step``/``on_epoch``
values, ``compute()`` and ``reset()`` behave as on the CPU. Metrics with list states
(``dist_reduce_fx="cat"``), a ``"mean"`` reduction or ``full_state_update=True`` are refused with
a message; argument checks (``validate_args``) are skipped inside the step.

Manual optimization (``automatic_optimization = False``, any number of optimizers) is compiled
whole (``ipu_backend.lightning_seam.manual_step_executor``): the step's ``manual_backward``, ``zero_grad``,
``clip_gradients`` and ``optimizer.step()`` calls become one program, every ``optimizer.step()``
counts in ``global_step`` as on the CPU, schedulers the step steps are stepped on the host
between its training steps (each of a call's ``device_iterations`` steps gets its own learning
rates), and ``16-mixed`` scales the losses as Lightning's ``MixedPrecision`` plugin does.

What a step reads stays current: ``batch_idx``, ``self.current_epoch`` and ``self.global_step``
are inputs of the program with the CPU's values in every micro-batch (``_counters.py``), and the
executors capture a step again when a plain attribute it read has changed. A Python ``if`` on
the counters is decided on the host for each micro-batch (``ipu_backend``'s host branches: the
strategy tells the executor that the counters, its first argument, are known on the host).
Limits of a traced step: batches stay
on the host (``on_before_batch_transfer`` works, ``transfer_batch_to_device`` and
``on_after_batch_transfer`` overrides are refused); and callbacks reading ``.grad`` see none,
since gradients live on the IPUs.

Options: user ``training_opts``/``inference_opts`` are used as given; otherwise they come from
the Trainer (``devices`` -> replication factor, ``accumulate_grad_batches`` -> gradient
accumulation), ``device_iterations`` and the global seed (``seed_everything``, else torch's
initial seed), and ``16-mixed`` precision turns on dynamic loss scaling.
"""

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.tuner.lr_finder import _LRCallback
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

import ipu_backend
from ipu_backend import lightning_seam as seam
from lightning_ipu import _appends, _batch_limits, _compile_progress, _counters, _data, _gradient_hooks
from lightning_ipu import _loop_progress, _metrics, _outputs, _processes, _short_batches, _skipped_backward

from .precision import IPUPrecision

_HOST_TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")
_MISSING = object()

RANDOM_STATE_KEY = "ipu_random_state"
"""Checkpoint entry holding each compiled step's random state (``rng_state``: seed and calls
made), so a resumed run draws the random numbers (dropout masks) of the uninterrupted one."""


def _as_options(value: Any, name: str) -> ipu_backend.Options | None:
    if value is None or isinstance(value, ipu_backend.Options):
        return value
    if isinstance(value, Mapping):
        return ipu_backend.Options.from_dict(value)
    raise MisconfigurationException(f"IPUStrategy({name}=...) must be an ipu_backend.Options or a mapping "
                                    f"of its keyword arguments; got {type(value).__name__}")


def _default_seed() -> int:
    """``seed_everything``'s seed, else torch's initial seed: the device's random numbers then
    follow the same seeding as the host's."""
    return int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))


def _check_replicas(replicas: int, auto_round: bool, where: str) -> None:
    if replicas & (replicas - 1) and not auto_round:
        raise MisconfigurationException(
            f"{where}: {replicas} IPUs is not a power of two, which IPUs are reserved in. Use 1, 2, "
            "4, 8, ... devices, or ask for rounding with Options(auto_round_num_ipus=True) in the "
            "strategy's training_opts/inference_opts (the extra IPUs are reserved and idle)")


class IPUStrategy(ParallelStrategy):
    """Train, validate, test and predict on emulated IPUs (see the module docstring).

    Args:
        accelerator: the IPU accelerator (set by the Trainer from ``accelerator="ipu"``).
        device_iterations: optimizer steps (or inference batches) per host call.
        autoreport: write compile and execution reports (``Options.enableProfiling``) into
            ``<autoreport_dir>/<stage>/`` for each stage's model: ``training``, ``validation``,
            ``test``, ``predict`` (``autoreport_dir`` defaults to ``./ipu_reports``; see docs/reports.md).
        training_opts: ``ipu_backend.Options`` for training, or a mapping of its keyword
            arguments; overrides the defaults taken from the Trainer.
        inference_opts: the same for validation, test and predict.
        precision_plugin: an :class:`~lightning_ipu.IPUPrecision` (else the Trainer's
            ``precision`` flag picks one).
        checkpoint_io: how checkpoints are written (Lightning's default: ``torch.save``).
    """

    strategy_name = "ipu_strategy"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        device_iterations: int = 1,
        autoreport: bool = False,
        autoreport_dir: str | None = None,
        training_opts: ipu_backend.Options | None = None,
        inference_opts: ipu_backend.Options | None = None,
        precision_plugin: Precision | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if isinstance(device_iterations, bool) or not isinstance(device_iterations, int) or device_iterations < 1:
            raise MisconfigurationException(
                f"IPUStrategy(device_iterations={device_iterations!r}) must be a positive int")
        self.device_iterations = device_iterations
        self.autoreport = autoreport
        self.autoreport_dir = autoreport_dir
        self._user_training_opts = _as_options(training_opts, "training_opts")
        self._user_inference_opts = _as_options(inference_opts, "inference_opts")
        self._training_opts: ipu_backend.Options | None = None
        self._inference_opts: ipu_backend.Options | None = None
        self._executors: dict[str, seam.PoplarExecutor] = {}
        self.poptorch_models: dict[RunningStage, seam.PoplarExecutor] = {}
        """The executor of each stage the current ``Trainer`` call runs (the Lightning IPU
        plugin's attribute): validation and sanity checking share one."""
        self._manual_events: seam.StepEvents | None = None
        self._gradient_clipping: seam.GradientClipping | None = None
        self._shown_gradients: _gradient_hooks.ShownGradients | None = None
        self._keep_last_gradients = False
        """Whether training calls keep their gradients for an epoch without backward."""
        self._last_gradients_pending = False
        """Whether the last training call's kept gradients stand in the CPU's ``.grad`` now: set
        by each training call, released by a validation (as Lightning zeroes ``.grad``)."""
        self._trainer = None
        self._accumulate_grad_batches: int | None = None
        self._shifted_batch_start: int | None = None
        self._hyperparameters_at_batch_start = self._hyperparameters_after_step = None
        """``_hyperparameters_now()`` when the training batch began, and after its optimizer step."""
        self._in_optimizer_step = False
        """Whether Lightning's optimizer.step() is running (automatic optimization's closure runs there)."""
        self._num_nodes = 1
        self._rank, self._processes = 0, 1
        self._compilations_shown = contextlib.ExitStack()
        """From ``setup`` to ``teardown``: compilations show their phases through the Trainer's
        progress bar (``_compile_progress.py``)."""
        self._restored_random_states: dict[str, list[int]] = {}
        """Random states read from the checkpoint being resumed, for the steps not compiled yet."""

    # --- processes: one per node, each driving `devices` replicas ----------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        """The host: batches, outputs and the module's copy of the weights live there."""
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """Several processes (``num_nodes``): Lightning then gives each its shard of the data."""
        return self._processes > 1

    @property
    @override
    def world_size(self) -> int:
        """The processes, one per node (not the replicas: a process drives ``devices`` of them)."""
        return self._processes

    @property
    @override
    def global_rank(self) -> int:
        return self._rank

    @property
    @override
    def local_rank(self) -> int:
        instance = _processes.launched_by_ipu_run()
        return instance.local_index if instance is not None else 0

    @property
    @override
    def node_rank(self) -> int:
        return self._rank

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """A DistributedSampler's share: one per process (its replicas then split its batches)."""
        return {"num_replicas": self._processes, "rank": self._rank}

    def set_world_ranks(self) -> None:
        """Called by the Trainer once ``devices`` is known: this process's rank among the
        ``num_nodes`` processes (from ipu-run or Lightning's cluster environment), and the number
        of replicas validated."""
        self._rank, self._processes = self._place()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self._rank)
            self.cluster_environment.set_world_size(self._processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self._rank
        options = self._user_training_opts or self._user_inference_opts
        _check_replicas(len(self.parallel_devices), options is not None and options.auto_round_num_ipus,
                        f"Trainer(accelerator='ipu', devices={len(self.parallel_devices)})")

    def _place(self) -> tuple[int, int]:
        """(rank, processes) as the launcher tells them; one process per node."""
        instance, environment = _processes.launched_by_ipu_run(), self.cluster_environment
        if instance is not None:
            rank, processes = instance.index, instance.count
            devices = len(self.parallel_devices)
            if devices not in (instance.local_replicas, instance.local_replicas * instance.ipus_per_replica):
                raise MisconfigurationException(
                    f"`Trainer(accelerator='ipu', devices={devices})` but ipu-run gives each instance "
                    f"{instance.local_replicas} replica(s) (--num-replicas {instance.total_replicas} over "
                    f"--num-instances {instance.count}): make them agree")
        elif environment is None or not environment.creates_processes_externally:
            rank, processes = 0, 1
        elif isinstance(environment, LightningEnvironment):      # NODE_RANK/LOCAL_RANK set by hand
            rank, processes = environment.node_rank(), self._num_nodes
        else:                                                    # torchrun, SLURM, ...
            rank, processes = environment.global_rank(), environment.world_size()
        if processes != self._num_nodes:
            raise MisconfigurationException(
                f"`Trainer(accelerator='ipu', num_nodes={self._num_nodes})` runs one process per node, each "
                f"driving `devices` replicas, but {processes} process(es) were started. Start one per node: "
                f"ipu-run --num-instances {self._num_nodes}, torchrun --nnodes {self._num_nodes} "
                "--nproc-per-node 1, or srun --ntasks-per-node 1")
        return rank, processes

    @override
    def setup_environment(self) -> None:
        """Connect to the other processes (jax.distributed) before anything runs on the IPUs."""
        environment = self.cluster_environment
        if self._processes > 1:
            _processes.connect(self._rank, self._processes, environment.main_address, environment.main_port)
        super().setup_environment()

    @override
    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """``tensor`` reduced over the processes (``self.log`` values are reduced already:
        see ``_log``)."""
        if self._processes == 1 or not isinstance(tensor, torch.Tensor):
            return tensor
        return _processes.reduce(tensor, reduce_op)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._processes > 1:
            _processes.barrier(name or "lightning_ipu")

    @override
    def broadcast(self, obj, src: int = 0):
        return obj if self._processes == 1 else _processes.broadcast(obj, src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor if self._processes == 1 else _processes.all_gather(tensor)

    @override
    def model_to_device(self) -> None:
        """Weights reach the IPUs with the first compiled call."""

    # --- options -----------------------------------------------------------------------------
    @property
    def training_opts(self) -> ipu_backend.Options | None:
        """The training options in use (after setup), else the ones given."""
        return self._training_opts or self._user_training_opts

    @property
    def inference_opts(self) -> ipu_backend.Options | None:
        """The validation/test/predict options in use (after setup), else the ones given."""
        return self._inference_opts or self._user_inference_opts

    @property
    def replicas(self) -> int:
        options = self._training_opts or self._inference_opts
        if options is not None:
            return options.replication_factor
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def replication_factor(self) -> int:
        """The running stage's replication factor (the Lightning IPU plugin's attribute); before
        set-up, the given training options', else the inference options', else ``devices``."""
        trainer = self._trainer
        if trainer is None or not self.poptorch_models:
            options = self._user_training_opts or self._user_inference_opts
            if options is not None:
                return options.replication_factor
            return len(self.parallel_devices) if self.parallel_devices else 1
        training = trainer.state.stage == RunningStage.TRAINING or (
            trainer.state.stage is None and trainer.state.fn == TrainerFn.FITTING)
        return (self._training_opts if training else self._inference_opts).replication_factor

    def _resolve_options(self, given: ipu_backend.Options | None, trainer, training: bool) -> ipu_backend.Options:
        replicas = len(self.parallel_devices) if self.parallel_devices else 1
        accumulation = trainer.accumulate_grad_batches if training else 1
        if given is not None:
            options = given.clone()
            self._warn_if_overridden(options, replicas, accumulation, training)
        else:
            precision = self.precision_plugin
            options = ipu_backend.Options(
                device_iterations=self.device_iterations, replication_factor=replicas,
                gradient_accumulation=accumulation,
                auto_loss_scaling=training and isinstance(precision, IPUPrecision) and precision.loss_scaling)
        if (options.Distributed.processId, options.Distributed.numProcesses) != (self._rank, self._processes):
            options.Distributed.configureProcessId(self._rank, self._processes)
        if options.random_seed is None:
            with torch.random.fork_rng(devices=[]):       # Options.randomSeed also seeds torch
                options.randomSeed(_default_seed())
        if self.autoreport and options.profiling_dir is None:
            options.enableProfiling(self.autoreport_dir or os.path.join(os.getcwd(), seam.DEFAULT_REPORT_DIR))
        _check_replicas(options.replication_factor, options.auto_round_num_ipus,
                        f"IPUStrategy {'training' if training else 'inference'} options")
        return options

    def _warn_if_overridden(self, options, replicas: int, accumulation: int, training: bool) -> None:
        """Warn about Trainer flags the user's options overrule. ``devices`` may count replicas or,
        for a model split over IPUs with ``BeginBlock``, every IPU (replicas x IPUs per replica)."""
        which = "training_opts" if training else "inference_opts"
        overridden = []
        ipus = options.replication_factor * _ipus_per_replica(self.lightning_module)
        if replicas != 1 and replicas not in (options.replication_factor, ipus):
            overridden.append(f"devices={replicas} (replication_factor={options.replication_factor})")
        if training and accumulation != 1 and options.Training.gradient_accumulation != accumulation:
            overridden.append(f"accumulate_grad_batches={accumulation} "
                              f"(gradient_accumulation={options.Training.gradient_accumulation})")
        if self.device_iterations != 1 and options.device_iterations != self.device_iterations:
            overridden.append(f"device_iterations={self.device_iterations} "
                              f"(device_iterations={options.device_iterations})")
        if overridden:
            warnings.warn(f"IPUStrategy({which}=...) decides over {', '.join(overridden)}", stacklevel=4)

    # --- set-up and tear-down ----------------------------------------------------------------
    @override
    def setup(self, trainer) -> None:
        module = self.lightning_module
        self._trainer = trainer
        self._check_hooks(module, trainer)
        if not isinstance(self.precision_plugin, IPUPrecision):
            raise MisconfigurationException(f"IPUStrategy needs an IPUPrecision plugin; got "
                                            f"{type(self.precision_plugin).__name__}")
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._training_opts = self._resolve_options(self._user_training_opts, trainer, training=True)
            self._accumulate_grad_batches = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = 1       # the IPUs accumulate inside each host call
        self._inference_opts = self._resolve_options(self._user_inference_opts, trainer, training=False)
        self.parallel_devices = [self.root_device] * self.replicas
        self._executors = {}
        with _loop_progress.counted_as_on_the_cpu(trainer, self._training_opts.device_iterations if fitting else 1,
                                                  self._accumulate_grad_batches if fitting else 1):
            super().setup(trainer)
        if fitting:
            self._check_training(trainer)
        self.poptorch_models = {stage: self._executor(method) for stage, method in _stage_methods(trainer)}
        self._compilations_shown.enter_context(seam.compilations_shown_by(_compile_progress.display(trainer)))

    def _check_hooks(self, module, trainer) -> None:
        for owner in (module, trainer.datamodule):
            for hook in _HOST_TRANSFER_HOOKS:
                if owner is not None and is_overridden(hook, owner):
                    raise MisconfigurationException(
                        f"Overriding `{hook}` is not supported with IPUs ({type(owner).__name__}."
                        f"{hook}): Lightning does not move batches to a device here: each host call "
                        "hands the combined batch to the "
                        "compiled step, which places the micro-batches on the replicas itself. Do "
                        "that work in on_before_batch_transfer (on the host, before the call) or in "
                        "the step")
        if is_overridden("backward", module):
            warnings.warn(f"{type(module).__name__}.backward is overridden but not called: on IPUs "
                          "the backward pass is part of the compiled training step", stacklevel=3)
        if is_overridden("optimizer_zero_grad", module) and module.automatic_optimization:
            warnings.warn(f"{type(module).__name__}.optimizer_zero_grad is overridden but changes nothing: "
                          "on IPUs each optimizer step starts from zero gradients inside the compiled step, "
                          "so gradients kept over batches are not summed; accumulate them with "
                          "Trainer(accumulate_grad_batches=...)", stacklevel=3)

    def _check_training(self, trainer) -> None:
        if any(isinstance(optimizer, torch.optim.LBFGS) for optimizer in self.optimizers):
            raise MisconfigurationException("LBFGS re-evaluates the loss inside step(), which a "
                                            "compiled IPU training step cannot do; use another optimizer")
        iterations = self._training_opts.device_iterations
        if iterations > 1 and trainer.max_steps > 0 and trainer.max_steps % iterations and not trainer.fast_dev_run:
            raise MisconfigurationException(
                f"Trainer(max_steps={trainer.max_steps}) is not a multiple of device_iterations="
                f"{iterations}: each batch runs {iterations} optimizer steps on the IPUs, so training "
                f"could only stop after {-(-trainer.max_steps // iterations) * iterations}")
        if iterations > 1:
            _refuse_averaging_inside_calls(trainer, iterations)
        if iterations > 1 and trainer.log_every_n_steps % iterations and iterations % trainer.log_every_n_steps:
            warnings.warn(f"log_every_n_steps={trainer.log_every_n_steps} counts optimizer steps, which "
                          f"advance by device_iterations={iterations} per batch: metrics are logged when "
                          "the count reaches a multiple of it; use a multiple or divisor of "
                          f"{iterations}", stacklevel=3)
        for callback in trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_train_steps", 0)
            if iterations > 1 and every and every % iterations:
                warnings.warn(f"{type(callback).__name__}(every_n_train_steps={every}) counts optimizer steps, which "
                              f"advance by device_iterations={iterations} per batch: it saves only at multiples of "
                              f"{math.lcm(every, iterations)}; use a multiple of {iterations}", stacklevel=3)
        per_batch = [config for config in self.lr_scheduler_configs
                     if config.interval == "step" and config not in self._schedulers_per_optimizer_step()]
        if iterations > 1 and per_batch and self.lightning_module.automatic_optimization:
            config = per_batch[0]
            kind = "monitor" if config.reduce_on_plateau else f"frequency={config.frequency}"
            warnings.warn(f"{type(config.scheduler).__name__} (interval='step', {kind}) is stepped once per "
                          f"batch: the batch's device_iterations={iterations} optimizer steps all run at the "
                          "learning rate it set, so a schedule counted in optimizer steps runs "
                          f"{iterations} times slower than on the CPU. Count its steps in batches, or step "
                          "it in a manual-optimization step, where each optimizer step gets its own rate",
                          stacklevel=3)
        self._gradient_clipping = None
        clip_val = trainer.gradient_clip_val
        if clip_val is not None and clip_val > 0:
            algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm").value
            self._gradient_clipping = seam.GradientClipping(float(clip_val), algorithm)
        self.precision_plugin.gradient_clipping = None if self._gradient_clipping is None else (
            self._gradient_clipping.value, self._gradient_clipping.algorithm)
        module = self.lightning_module
        hooks = _gradient_hooks.hooks_read_gradients(module, trainer.callbacks) if module.automatic_optimization else []
        self._shown_gradients = _gradient_hooks.ShownGradients(hooks) if hooks else None
        self.precision_plugin.shown_gradients = self._shown_gradients
        self._keep_last_gradients = _skipped_backward.may_skip_backward(trainer, module)
        if self._keep_last_gradients:
            _skipped_backward.check_precision(self.precision_plugin.precision)

    @override
    def teardown(self) -> None:
        self._compilations_shown.close()
        for executor in self._executors.values():
            executor.destroy()
        self._executors = {}
        self.poptorch_models = {}
        self._restored_random_states = {}
        if self._accumulate_grad_batches is not None:
            self._trainer.accumulate_grad_batches = self._accumulate_grad_batches
            self._accumulate_grad_batches = None
        super().teardown()

    # --- data --------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Combined batches for the running stage's options (see ``_data.py``)."""
        stage = self.lightning_module.trainer.state.stage
        options = self._training_opts if stage == RunningStage.TRAINING else self._inference_opts
        loader = _data.to_ipu_dataloader(dataloader, options, stage.dataloader_prefix)
        _batch_limits.warn_if_fraction_splits_calls(self.lightning_module.trainer, stage.dataloader_prefix,
                                                    dataloader, sized_len(loader),
                                                    _data.micro_batches_per_call(options))
        return loader

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Batches stay on the host: the compiled call splits them over the replicas. In the
        ``-true`` precisions their float tensors are cast to the half dtype here too, as the
        Lightning IPU plugin does (also for a batch a hook made after ``convert_input``)."""
        if self._shifted_batch_start is None and self._trainer is not None and self._trainer.training:
            self._shifted_batch_start = self._training_opts.device_iterations - 1
            _loop_progress.shift_batches_that_stepped(self._trainer, self._shifted_batch_start)
            now = self._hyperparameters_now()
            self._refuse_hyperparameters_set_once_per_batch(self._hyperparameters_after_step, now,
                                                            "after its optimizer step")
            self._hyperparameters_at_batch_start = now
        return self.precision_plugin.convert_input(batch)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After the callbacks' ``on_train_batch_start``: the count ``batch_to_device`` moved for
        them goes back (see ``_loop_progress.shift_batches_that_stepped``). Refuses the learning-rate
        finder (``Tuner.lr_find``, which runs inside the fit) where a batch is several optimizer steps."""
        iterations = self._training_opts.device_iterations
        if iterations > 1 and any(isinstance(callback, _LRCallback) for callback in self._trainer.callbacks):
            raise MisconfigurationException(
                f"Tuner.lr_find records one loss per batch, but each batch runs device_iterations={iterations} "
                "optimizer steps at rising learning rates here: the finder would pair each loss with another "
                "rate than the CPU's. Find the rate with IPUStrategy(device_iterations=1), then fit with more")
        if self._shifted_batch_start is not None:
            _loop_progress.shift_batches_that_stepped(self._trainer, -self._shifted_batch_start)
            self._shifted_batch_start = None

    @override
    def on_validation_start(self) -> None:
        """A validation inside the fit follows ``on_validation_model_zero_grad``, which released
        the CPU's ``.grad``: the last training call's gradients no longer stand there."""
        super().on_validation_start()
        if self._trainer.state.fn == TrainerFn.FITTING:
            self._last_gradients_pending = False

    # --- steps -------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if _skipped_backward.skips_backward(self._trainer):
            return self._forward_only_training_step(args, kwargs)
        if self._trainer.accumulate_grad_batches != 1 and self.lightning_module.automatic_optimization:
            raise MisconfigurationException(
                f"accumulate_grad_batches changed to {self._trainer.accumulate_grad_batches} during the fit (a "
                "GradientAccumulationScheduler?): the IPUs accumulate inside each host call, over the "
                f"gradient_accumulation={self._training_opts.Training.gradient_accumulation} micro-batches fixed "
                "when the fit started. Set Trainer(accumulate_grad_batches=...) once, or fit in stages")
        if self.lightning_module.automatic_optimization and not self._in_optimizer_step:
            raise MisconfigurationException(
                "the training step's closure ran without optimizer.step() (an optimizer_step override that "
                "calls optimizer_closure() but skips the step?): on IPUs the closure runs the whole compiled "
                "step, update included, so the weights would change where the CPU's do not. Return None "
                "from training_step to skip a batch, or call optimizer.step(closure=optimizer_closure)")
        with self.precision_plugin.train_step_context():
            output = self._run("training_step", args, kwargs)
        iterations = self._training_opts.device_iterations
        if self.lightning_module.automatic_optimization:
            output = _outputs.divided_loss(output, self._training_opts.Training.gradient_accumulation)
            _loop_progress.count_extra_optimizer_steps(self._trainer, iterations - 1, iterations - 1)
            if self._shown_gradients is not None:
                self._shown_gradients.arrived(self._executors["training_step"].gradients())
            self._last_gradients_pending = self._keep_last_gradients
        else:
            self._after_manual_step(self._executors["training_step"].last_events, iterations)
        return output

    def _forward_only_training_step(self, args: tuple, kwargs: dict) -> Any:
        """A training step of an epoch without backward (``_skipped_backward.py``)."""
        key = "training_step (forward only)"
        if key not in self._executors:
            self._executors[key] = seam.step_executor(
                self.lightning_module, _skipped_backward.forward_only_options(self._training_opts),
                "training_step", False)
        with self.precision_plugin.train_step_context():
            output = self._run("training_step", args, kwargs, self._executors[key])
        if self._last_gradients_pending or not self._keep_last_gradients:     # (refused when not kept)
            _skipped_backward.leave_last_gradients(self.lightning_module, self._executors["training_step"].gradients())
            self._last_gradients_pending = False
        self.precision_plugin.clip_on_host(self.optimizers[0])
        return output

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """The IPUs' step runs in the closure, but the step of an epoch without backward is
        Lightning's own, on the host (``_skipped_backward.py``)."""
        if _skipped_backward.skips_backward(self._trainer):
            return self.precision_plugin.host_optimizer_step(optimizer, model or self.lightning_module, closure)
        self._refuse_hyperparameters_set_once_per_batch(self._hyperparameters_at_batch_start,
                                                        self._hyperparameters_now(), "before its step")
        self._in_optimizer_step = True
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            self._in_optimizer_step = False
            self._hyperparameters_after_step = self._hyperparameters_now()

    def _hyperparameters_now(self) -> tuple[list[dict], tuple] | None:
        """The optimizers' numeric param-group values; the schedulers' step counts and the epoch,
        whose changes explain theirs (a scheduler's, a callback's at an epoch's start). None where
        a batch is one optimizer step, or steps are the user's (manual optimization): not checked."""
        if self._training_opts.device_iterations == 1 or not self.lightning_module.automatic_optimization:
            return None
        return (_hyperparameters(self.optimizers),
                (self._trainer.current_epoch,
                 *(getattr(config.scheduler, "last_epoch", None) for config in self.lr_scheduler_configs)))

    def _refuse_hyperparameters_set_once_per_batch(self, since: tuple | None, now: tuple | None,
                                                   when: str) -> None:
        """Refuse a hyper-parameter the user's hooks set between ``since`` and ``now``
        (:meth:`_hyperparameters_now`: a warm-up in ``on_train_batch_start`` or ``optimizer_step``,
        a change within an epoch that no scheduler made) where a batch runs several optimizer steps:
        it takes effect once for all of them."""
        if since is None or now is None:
            return
        (before, explained), (after, explained_now) = since, now
        if after == before or explained_now != explained or len(after) != len(before):
            return
        changed = next(f"param_groups[{index}][{key!r}] ({old[key]} -> {new.get(key)})"
                       for index, (old, new) in enumerate(zip(before, after))
                       for key in old if old[key] != new.get(key))
        iterations = self._training_opts.device_iterations
        raise MisconfigurationException(
            f"the optimizer's {changed} was set {when} by the training hooks (on_train_batch_start, "
            f"optimizer_step), once per batch of device_iterations={iterations} optimizer steps, where the CPU "
            "sets it between each. Use an LR scheduler with interval='step' (stepped between a call's steps, "
            "as on the CPU) or device_iterations=1")

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run("predict_step", args, kwargs)

    def _run(self, method: str, args: tuple, kwargs: dict, executor: seam.PoplarExecutor | None = None) -> Any:
        if kwargs:
            raise MisconfigurationException(f"IPUStrategy.{method} takes the step's arguments "
                                            f"positionally; got keywords {sorted(kwargs)}")
        executor = executor or self._executor(method)
        factor = _data.micro_batches_per_call(executor.options)
        if method != "training_step":
            micro = self._loader_micro_batch_size(args)
            if micro is not None and _short_batches.batch_size(args[0]) < micro * factor:
                return self._run_short(method, args, micro, factor)
        call_args, adapt = self._with_counters(method, args, executor.options)
        with seam.step_arguments(adapt, host_known=0):
            self._restore_random_state(method, executor, call_args)
            try:
                result = executor(*call_args)
            except StopIteration as error:   # would silently end Lightning's loop
                raise RuntimeError(f"the compiled {method} raised StopIteration") from error
        program = executor.last_program
        logged = executor.last_logs if self._processes == 1 else _processes.gathered(executor.last_logs)
        metrics = _metrics.update(self.lightning_module, program, logged, executor.options.device_iterations)
        replicas = (self._processes, executor.options.replication_factor) if method == "training_step" else None
        self._log(program, logged, metrics, replicas=replicas)
        _appends.extend(self.lightning_module, program, executor.last_logs)
        return _outputs.combine_outputs(result, program, _micro_batch_size(args[0], factor))

    def _run_short(self, method: str, args: tuple, micro: int, factor: int) -> Any:
        """The step on the short last batch of an evaluation epoch (see ``_short_batches.py``)."""
        executor = self._every_micro_batch_executor(method)
        pieces_run, kept, kept_logs, per_sample, result = _short_batches.pieces(args[0], micro, factor), [], [], None, None
        done = 0                                   # micro-batches the pieces before ran
        batch_sizes = {}                           # each real micro-batch's explicit self.log batch_size
        for piece in pieces_run:
            piece_args, adapt = self._with_counters(method, (piece.batch, *args[1:]), executor.options,
                                                    done // executor.options.replication_factor)
            done += piece.real
            with warnings.catch_warnings(), seam.step_arguments(adapt, host_known=0):
                # the short micro-batch's size compiles once more
                warnings.filterwarnings("ignore", message="the inputs' shapes or dtypes .*changed")
                self._restore_random_state(method, executor, piece_args)
                result = executor(*piece_args)
            program = executor.last_program
            shapes = program.result_shapes()
            per_sample = per_sample or _short_batches.per_sample_leaves(shapes, piece)
            kept.append(_short_batches.kept_result(result, shapes, per_sample, piece, factor))
            kept_logs.append(_short_batches.kept_logs(executor.last_logs, piece, factor))
            metrics = _metrics.update(self.lightning_module, program, kept_logs[-1], piece.real)
            _appends.extend(self.lightning_module, program, kept_logs[-1])
            for call in program.logs:
                if "batch_size" in call.kwargs:
                    batch_sizes.setdefault(call.name, []).extend([call.kwargs["batch_size"]] * piece.real)
        self._log(program, _short_batches.merged_logs(kept_logs), metrics,
                  _short_batches.micro_batch_weights(pieces_run), batch_sizes=batch_sizes)
        return _short_batches.merged_result(result, kept, per_sample, pieces_run)

    def _every_micro_batch_executor(self, method: str) -> seam.PoplarExecutor:
        """The step's executor returning every micro-batch's results (``OutputMode.All``): its own
        executor unless its options select others."""
        executor = self._executor(method)
        if executor.options.output_mode in (ipu_backend.OutputMode.All, ipu_backend.OutputMode.Default):
            return executor
        key = f"{method} (every micro-batch)"
        if key not in self._executors:
            options = executor.options.clone().outputMode(ipu_backend.OutputMode.All)
            self._executors[key] = seam.step_executor(self.lightning_module, options, method, False)
        return self._executors[key]

    def _loader_micro_batch_size(self, args: tuple) -> int | None:
        """The micro-batch size of the evaluation dataloader that gave this batch (None when it
        has no fixed batch size)."""
        trainer = self._trainer
        stage = trainer.state.stage
        if stage == RunningStage.TESTING:
            loaders = trainer.test_dataloaders
        elif stage == RunningStage.PREDICTING:
            loaders = trainer.predict_dataloaders
        else:
            loaders = trainer.val_dataloaders
        if isinstance(loaders, (list, tuple)):
            index = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            loaders = loaders[index]
        combined = getattr(loaders, "combinedBatchSize", None)
        return None if combined is None else combined // _data.micro_batches_per_call(loaders.options)

    def _executor(self, method: str) -> seam.PoplarExecutor:
        executor = self._executors.get(method)
        if executor is None and method == "training_step" and not self.lightning_module.automatic_optimization:
            executor = self._executors[method] = seam.manual_step_executor(
                self.lightning_module, self._training_opts, self.optimizers, method,
                self._manual_calls_recorded, self._step_schedulers)
        if executor is None:
            training = method == "training_step"
            executor = seam.step_executor(
                self.lightning_module, self._training_opts if training else self._inference_opts, method,
                training, optimizer=self.optimizers[0] if training else None,
                gradient_clipping=self._gradient_clipping if training else None,
                keep_gradients=training and (self._shown_gradients is not None or self._keep_last_gradients),
                step_schedulers=self._step_schedulers_between_optimizer_steps if training and any(
                    self._schedulers_per_optimizer_step()) else None)
            self._executors[method] = executor
        return executor

    def _restore_random_state(self, method: str, executor, args: tuple) -> None:
        """A resumed run's random state for ``method``'s steps, set before its first call (a
        step executor's ``rng_state``, as PopTorch's, needs the model compiled first)."""
        state = self._restored_random_states.pop(method, None)
        if state is None:
            return
        if isinstance(executor, seam.PoplarExecutor):
            executor.compile(*args)
        executor.rng_state = state

    # --- manual optimization ----------------------------------------------------------------
    @contextlib.contextmanager
    def _manual_calls_recorded(self, events):
        """While a manual training step is captured, its ``manual_backward``, optimizer
        ``zero_grad``/``step``, ``clip_gradients`` and scheduler ``step`` calls go to ``events``."""
        module = self.lightning_module
        saved = []

        def patch(owner, name, value):
            saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            owner.__dict__[name] = value

        def index_of(optimizer) -> int:
            for index, candidates in enumerate(zip(self._lightning_optimizers, self.optimizers)):
                if any(optimizer is c for c in candidates):
                    return index
            raise MisconfigurationException("clip_gradients got an optimizer that configure_optimizers "
                                            "did not return")

        def step(index, closure=None, **kwargs):
            if closure is not None:
                raise MisconfigurationException(
                    "optimizer.step(closure=...) in a manual training step cannot be compiled for IPUs: "
                    "call self.manual_backward(loss) and then optimizer.step()")
            events.step(index)

        def clip_gradients(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            if gradient_clip_val is not None and gradient_clip_val > 0:
                algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm").value
                events.clip(index_of(optimizer), gradient_clip_val, algorithm)

        for index, optimizers in enumerate(zip(self._lightning_optimizers, self.optimizers)):
            for optimizer in optimizers:
                patch(optimizer, "step", functools.partial(step, index))
                patch(optimizer, "zero_grad", lambda set_to_none=True, index=index: events.zero_grad(index, set_to_none))
        patch(module, "manual_backward", lambda loss, *args, **kwargs: events.backward(loss))
        patch(module, "clip_gradients", clip_gradients)
        for index, config in enumerate(self.lr_scheduler_configs):
            patch(config.scheduler, "step", lambda *args, index=index, **kwargs: events.scheduler_step(index))
        self._manual_events = events
        try:
            yield
        finally:
            self._manual_events = None
            for owner, name, value in reversed(saved):
                if value is _MISSING:
                    del owner.__dict__[name]
                else:
                    owner.__dict__[name] = value

    def _after_manual_step(self, events: tuple, iterations: int) -> None:
        """What Lightning would have seen: each ``optimizer.step()`` counted (``global_step``)."""
        steps = sum(isinstance(event, seam.Step) for event in events)
        _loop_progress.count_extra_optimizer_steps(self._trainer, steps * iterations, iterations - 1)

    def _step_schedulers(self, events: tuple) -> None:
        """The schedulers one manual training step stepped, stepped on the host (the executor
        calls this after reading each training step's learning rates)."""
        for optimizer in self.optimizers:
            optimizer._opt_called = True       # stepped on the IPUs (see IPUPrecision.optimizer_step)
        for event in events:
            if isinstance(event, seam.SchedulerStep):
                self.lr_scheduler_configs[event.scheduler].scheduler.step()

    def _schedulers_per_optimizer_step(self) -> list:
        """The ``interval="step"`` schedulers of automatic optimization that the training executor
        steps between a call's optimizer steps, as Lightning steps them on the CPU: those stepped
        after every optimizer step (``frequency=1``, not monitoring a metric)."""
        return [config for config in self.lr_scheduler_configs
                if config.interval == "step" and config.frequency == 1 and not config.reduce_on_plateau]

    def _step_schedulers_between_optimizer_steps(self) -> None:
        """Step them through the module's ``lr_scheduler_step`` hook, as Lightning does after the
        call's last optimizer step (the executor calls this after each of the others)."""
        for config in self._schedulers_per_optimizer_step():
            self.lightning_module.lr_scheduler_step(config.scheduler, None)

    def _with_counters(self, method: str, args: tuple, options, skipped: int = 0) -> tuple[tuple, Any]:
        """The executor's arguments for a step called with ``args`` (``batch, [batch_idx, ...]``)
        and the adapter that gives the captured step its own (see ``_counters.py``): Lightning's
        counters per micro-batch first, ``batch_idx`` taken out (it is one of them). ``skipped``:
        the CPU batches of this host batch that earlier calls ran (a short batch run in pieces)."""
        takes_batch_idx = len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool)
        counters = _counters.per_micro_batch(
            args[1] if takes_batch_idx else 0, self._trainer.global_step, self._trainer.current_epoch,
            options.device_iterations, options.Training.gradient_accumulation, options.replication_factor,
            self._trainer.is_last_batch, method == "training_step", skipped)
        if method != "training_step":
            steps = _counters.evaluation_steps
        elif self.lightning_module.automatic_optimization:
            steps = _counters.automatic_steps
        else:
            steps = self._manual_steps
        rest = args[2:] if takes_batch_idx else args[1:]
        return (counters, args[0], *rest), _counters.adapter(takes_batch_idx, steps)

    def _manual_steps(self) -> tuple[int, int]:
        """``(optimizer steps per training step, steps made so far)`` of the manual training step
        being captured (0 per training step while the capture that finds them runs)."""
        events = self._manual_events
        return events.steps_per_training_step or 0, events.steps_taken

    def _log(self, program, logged: dict, metrics: dict, weights: torch.Tensor | None = None,
             replicas: tuple[int, int] | None = None, batch_sizes: dict | None = None) -> None:
        """Hand each ``self.log`` of the compiled step to Lightning, with its concrete value (a
        torchmetrics object as itself, its state brought up to date by ``_metrics.update``);
        ``weights``: the size of each micro-batch the logged values come from, when they differ.
        Given the ``(processes, replicas per process)`` the values come from (training), each
        process's in input order (micro-batch, replica), a value is logged once per
        micro-batch returned, in order, its value reduced over the replicas: as the CPU's loop
        logs each batch, an ``on_epoch`` value is aggregated over every micro-batch, and the step
        value is the last one's. With several processes the values come from every process's
        replicas already, so Lightning is not asked to reduce them again (``sync_dist``). In
        evaluation a value logged with an explicit ``batch_size`` is logged once per micro-batch and
        replica, each weighing the ``batch_size`` given there (``batch_sizes``: each micro-batch's,
        where programs of several sizes ran), as the CPU logs each batch."""
        module = self.lightning_module
        synced = {"sync_dist": False} if self._processes > 1 else {}
        for call in program.logs:
            if call.state is not None or call.appended is not None:
                continue
            if call.metric is not None:
                module.log(call.name, metrics[call.metric], **{**call.kwargs, **synced})
                continue
            if replicas is None and "batch_size" in call.kwargs:
                values = logged[call.name].reshape(-1)
                sizes = (batch_sizes or {}).get(call.name) or [call.kwargs["batch_size"]] * len(values)
                for value, size in zip(values, sizes, strict=True):
                    module.log(call.name, value, **{**call.kwargs, "batch_size": size, **synced})
                continue
            reduce_fx = call.kwargs.get("reduce_fx", "mean")
            values = logged[call.name].reshape(1, -1) if replicas is None else _outputs.per_micro_batch(
                logged[call.name], *replicas)
            for value in values:
                module.log(call.name, _outputs.reduce_logged(call.name, value, reduce_fx, weights),
                           **{**call.kwargs, **synced})

    # --- checkpoints -------------------------------------------------------------------------
    def _weights_to_host(self) -> None:
        for executor in self._executors.values():
            executor.copyWeightsToHost()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._weights_to_host()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """The checkpoint with each compiled step's random state (:data:`RANDOM_STATE_KEY`); a step
        not compiled yet (a checkpoint before the first batch: the tuner's) draws from its start."""
        started = {method: executor.rng_state for method, executor in self._executors.items()
                   if not isinstance(executor, seam.PoplarExecutor) or executor.isCompiled()}
        checkpoint[RANDOM_STATE_KEY] = {**self._restored_random_states, **started}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint; its random states continue in the steps compiled from now on."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored_random_states = dict(checkpoint.get(RANDOM_STATE_KEY, {}))
        return checkpoint

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer's state as the IPUs have it (momentum, Adam moments, step counts)."""
        self._weights_to_host()
        return super().optimizer_state(optimizer)


def _stage_methods(trainer) -> list[tuple[RunningStage, str]]:
    """The stages a ``Trainer`` call runs, with the step method each one compiles."""
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        stages = [(RunningStage.TRAINING, "training_step")]
        if trainer.enable_validation:
            stages.append((RunningStage.VALIDATING, "validation_step"))
            if trainer.num_sanity_val_steps > 0:
                stages.append((RunningStage.SANITY_CHECKING, "validation_step"))
        return stages
    return {TrainerFn.VALIDATING: [(RunningStage.VALIDATING, "validation_step")],
            TrainerFn.TESTING: [(RunningStage.TESTING, "test_step")],
            TrainerFn.PREDICTING: [(RunningStage.PREDICTING, "predict_step")]}.get(fn, [])


def _refuse_averaging_inside_calls(trainer, iterations: int) -> None:
    """Refuse a ``WeightAveraging`` callback (EMA, SWA) that would average the weights after an
    optimizer step inside a host call: the host sees them only after each call's last step."""
    horizon = trainer.max_steps if trainer.max_steps > 0 else _AVERAGING_HORIZON
    for callback in trainer.callbacks:
        if not isinstance(callback, WeightAveraging):
            continue
        inside = next((step for step in range(horizon)
                       if (step + 1) % iterations and callback.should_update(step_idx=step)), None)
        if inside is not None:
            raise MisconfigurationException(
                f"{type(callback).__name__} averages the weights after optimizer step {inside + 1}, inside a "
                f"batch of device_iterations={iterations} optimizer steps: the host sees the weights once per "
                "batch, after its last step, so the average would leave the others out. Average per epoch "
                "(update_every_n_steps=0, update_starting_at_epoch=...), make should_update true only where "
                f"(step_idx + 1) % {iterations} == 0, or run one optimizer step per batch")


_AVERAGING_HORIZON = 100_000
"""Optimizer steps whose ``should_update`` is asked when ``max_steps`` does not bound the fit."""


def _hyperparameters(optimizers) -> list[dict]:
    """Each param group's numeric values (learning rate, momentum, ...) of ``optimizers``."""
    return [{key: value for key, value in group.items() if isinstance(value, (int, float))}
            for optimizer in optimizers for group in optimizer.param_groups]


def _ipus_per_replica(module: torch.nn.Module) -> int:
    """The IPUs that ``BeginBlock(..., ipu_id=...)`` annotations of ``module`` place layers on."""
    return max(seam.annotated_ipu_ids(module), default=0) + 1


def _micro_batch_size(batch: Any, factor: int) -> int | None:
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or tensors[0].ndim == 0:
        return None
    return tensors[0].shape[0] // factor
