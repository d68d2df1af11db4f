"""PopTorch's entry points: wrap a torch module for training or inference on emulated IPUs."""

import torch

from ipu_backend.runtime.executor import PoplarExecutor


def trainingModel(model: torch.nn.Module, options=None, optimizer=None) -> PoplarExecutor:  # noqa: N802
    """A training executor: each call runs ``deviceIterations`` optimizer steps (SGD lr=0.01 when
    no optimizer is given, as PopTorch) and returns the outputs per ``Options.outputMode``."""
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: torch.nn.Module, options=None) -> PoplarExecutor:  # noqa: N802
    """An inference executor sharing the module's device weights with any training executor."""
    return PoplarExecutor(model, options, training=False)
