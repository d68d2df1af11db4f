"""The ``training`` flags a module is captured with.

Every submodule keeps its own flag, as torch runs it: a BatchNorm put in ``eval()`` before
``trainingModel`` uses its running statistics and leaves them alone (PopTorch's behaviour too).
A Lightning step is captured as Lightning left the flags (``train`` for fitting, with the
submodules' own modes; ``eval`` for validation, test and predict, after the
``on_*_model_eval`` hooks). Only ``inferenceModel`` switches the whole module to ``eval()``
while it is captured; afterwards every flag is what it was.
"""

import contextlib

import torch


@contextlib.contextmanager
def capture_modes(model: torch.nn.Module, training: bool, step_method: str | None):
    """Within: ``model`` in the modes its program is captured with; after: its own flags."""
    flags = [(module, module.training) for module in model.modules()]
    if not training and step_method is None:
        model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
