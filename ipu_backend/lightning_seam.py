"""The Lightning face's entry into ``ipu_backend``: what ``lightning_ipu`` needs beyond the
public PopTorch API, in one place.

Lightning runs a LightningModule's step *methods* (``training_step``, ...) rather than
``forward``, passes them counters they read from the trainer (``step_arguments``), may optimize
manually, clips gradients from the Trainer's flags and reads the IPUs'
memory for its device stats. ``lightning_ipu`` imports only ``ipu_backend`` and this module; no
JAX, no runtime or compiler internals. A name here is kept stable for the Lightning face.
"""

from collections.abc import Callable, Sequence

import torch

from ipu_backend.blocks import annotated_ipu_ids
from ipu_backend.compiler.capture import step_arguments
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX, metrics_of
from ipu_backend.compiler.python_reads import MISSING, value_guard
from ipu_backend.distributed import environment as _environment
from ipu_backend.distributed import init as join_processes
from ipu_backend.distributed.collectives import all_gather, barrier, broadcast_object
from ipu_backend.hardware import MK2
from ipu_backend.options import Options
from ipu_backend.profiling import DEFAULT_DIR, recorder_for
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.compile_progress import shown_by as compilations_shown_by
from ipu_backend.runtime.devices import memory_in_use
from ipu_backend.runtime.executor import PoplarExecutor
from ipu_backend.runtime.manual import ManualStepExecutor, SchedulerStep, Step, StepEvents
from ipu_backend.runtime.weights import weight_reads_refused

__all__ = [
    "DEFAULT_REPORT_DIR", "MK2", "TOTAL_SUFFIX", "GradientClipping", "ManualStepExecutor", "PoplarExecutor",
    "MISSING", "SchedulerStep", "Step", "StepEvents", "all_gather", "annotated_ipu_ids", "barrier",
    "broadcast_object",
    "compilations_shown_by",
    "coordinator_from_environment", "ipu_run_instance", "join_processes", "manual_step_executor",
    "memory_in_use", "metrics_of", "step_arguments", "step_executor", "value_guard", "weight_reads_refused",
]

DEFAULT_REPORT_DIR = DEFAULT_DIR
"""Where ``IPUStrategy(autoreport=True)`` writes reports when given no directory."""


def ipu_run_instance() -> _environment.Instance | None:
    """This process's place (``index``, ``count``, ``local_index``...) when ``ipu-run`` started it."""
    instance = _environment.from_environment()
    return instance if instance.launched else None


def coordinator_from_environment() -> str | None:
    """The ``host:port`` of JAX's coordination service the environment names, if any."""
    return _environment.coordinator()


def step_executor(module: torch.nn.Module, options: Options, method: str, training: bool,
                  optimizer: torch.optim.Optimizer | None = None,
                  gradient_clipping: GradientClipping | None = None,
                  keep_gradients: bool = False, step_schedulers: Callable[[], None] | None = None) -> PoplarExecutor:
    """An executor of ``module.<method>`` (a Lightning step) compiled with its ``self.log`` calls as
    outputs; training with ``optimizer`` and ``gradient_clipping`` before each update, keeping
    each call's last gradients for the host when ``keep_gradients`` (``PoplarExecutor.gradients``),
    and calling ``step_schedulers`` after each of a call's optimizer steps but its last, so that
    each step runs at the hyper-parameters they set (``runtime/hyperparameters.py``).
    It writes reports when the options ask for them."""
    return PoplarExecutor(module, options, training, optimizer=optimizer, step_method=method,
                          gradient_clipping=gradient_clipping, recorder=recorder_for(options, training, method),
                          keep_gradients=keep_gradients, step_schedulers=step_schedulers)


def manual_step_executor(module: torch.nn.Module, options: Options, optimizers: Sequence[torch.optim.Optimizer],
                         method: str, intercept: Callable, step_schedulers: Callable) -> ManualStepExecutor:
    """An executor of a manual-optimization training step ``module.<method>`` compiled whole
    (see :class:`~ipu_backend.runtime.manual.ManualStepExecutor` for ``intercept`` and
    ``step_schedulers``). It writes reports when the options ask for them."""
    return ManualStepExecutor(module, options, optimizers, method, intercept, step_schedulers,
                              recorder=recorder_for(options, True, method))
