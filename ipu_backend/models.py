"""PopTorch's entry points: wrap a torch module for training or inference on emulated IPUs."""

import torch

from ipu_backend import distributed
from ipu_backend.options import Options
from ipu_backend.profiling import recorder_for
from ipu_backend.runtime.executor import PoplarExecutor


def _join_processes(options: Options) -> None:
    """Options spanning several processes (``Options.Distributed``) need this one connected to
    the others first."""
    if options.Distributed.numProcesses > 1:
        distributed.init(num_instances=options.Distributed.numProcesses,
                         instance_index=options.Distributed.processId)


def trainingModel(model: torch.nn.Module, options=None, optimizer=None) -> PoplarExecutor:  # noqa: N802
    """A training executor: each call runs ``deviceIterations`` optimizer steps (SGD lr=0.01 when
    no optimizer is given, as PopTorch) and returns the outputs per ``Options.outputMode``.
    ``model`` may be another executor: its model is wrapped. As in PopTorch, a module has one
    training wrapper at a time: a second is refused until the first is destroyed."""
    if isinstance(model, PoplarExecutor):
        model = model.model
    options = options if options is not None else Options()
    _join_processes(options)
    return PoplarExecutor(model, options, training=True, optimizer=optimizer,
                          recorder=recorder_for(options, True, None))


def inferenceModel(model: torch.nn.Module, options=None) -> PoplarExecutor:  # noqa: N802
    """An inference executor sharing the module's device weights with any training executor.
    ``model`` may be another executor: its model is wrapped."""
    if isinstance(model, PoplarExecutor):
        model = model.model
    options = options if options is not None else Options()
    _join_processes(options)
    return PoplarExecutor(model, options, training=False, recorder=recorder_for(options, False, None))
