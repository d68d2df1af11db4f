"""The ``training`` flags a module is captured with.

Every submodule keeps its own flag, as torch runs it: a BatchNorm put in ``eval()`` before
``trainingModel`` uses its running statistics and leaves them alone (PopTorch's behaviour too).
A Lightning step is captured as Lightning left the flags (``train`` for fitting, with the
submodules' own modes; ``eval`` for validation, test and predict, after the
``on_*_model_eval`` hooks). Only ``inferenceModel`` switches the whole module to ``eval()``
while it is captured; afterwards every flag is what it was.
"""

import contextlib
import dataclasses

import torch

from ipu_backend.compiler import python_reads, transformer_modules


def _sets_modes(training: bool, step_method: str | None) -> bool:
    return not training and step_method is None


@contextlib.contextmanager
def capture_modes(model: torch.nn.Module, training: bool, step_method: str | None):
    """Within: ``model`` in the modes its program is captured with, recording gradients for a
    training program only (torch's choices that depend on it: ``transformer_modules``); after: its
    own flags."""
    flags = [(module, module.training) for module in model.modules()]
    if _sets_modes(training, step_method):
        model.eval()
    try:
        with transformer_modules.recording_gradients(training):
            yield
    finally:
        for module, flag in flags:
            module.training = flag


def guarding_modes(program, model: torch.nn.Module, training: bool, step_method: str | None):
    """``program``, captured with ``model``'s own modes, guarded by them too: a flag changed
    since (``model.eval()`` between training calls) captures the model again, as torch would
    compute in the new mode."""
    if _sets_modes(training, step_method):
        return program
    return dataclasses.replace(program, python_reads=program.python_reads + python_reads.modes(model))
