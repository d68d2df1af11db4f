"""PopTorch's ``poptorch.load``: an executor rebuilt from a file written by ``save`` or
``compileAndExport`` with ``export_model=True``, its compiled program loaded, not compiled."""

from collections.abc import Callable

from ipu_backend.models import inferenceModel, trainingModel
from ipu_backend.runtime import serialization
from ipu_backend.runtime.executor import PoplarExecutor


def load(filename: str, edit_opts_fn: Callable | None = None) -> PoplarExecutor:
    """The training or inference executor saved in ``filename``, with its model, options,
    optimizer and random state; ``edit_opts_fn(options)`` may change the options first."""
    data = serialization.read(filename)
    if data["model"] is None:
        raise AssertionError(
            f"{filename} is a valid PopTorch file but was created with 'export_model=False' which "
            "means you need to re-create the PopTorch model using poptorch.inferenceModel or "
            f"poptorch.trainingModel then call poptorch_model.loadExecutable(\"{filename}\").")
    options = data["options"].clone()
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    optimizer = data["optimizer"]
    if optimizer is not None and data["optimizer_state"] is not None:
        optimizer.load_state_dict(data["optimizer_state"])
    if data["training"]:
        executor = trainingModel(data["model"], options, optimizer)
    else:
        executor = inferenceModel(data["model"], options)
    executor.loadExecutable(filename)
    if data["rng_state"] is not None:
        executor.rng_state = data["rng_state"]
    return executor
