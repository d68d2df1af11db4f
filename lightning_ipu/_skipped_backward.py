"""Training epochs Lightning runs without backward.

``StochasticWeightAveraging`` ends the fit of a module with batch norms with one more epoch over
the training data, on the averaged weights, so that the batch norms' running statistics are
those of these weights (``trainer.fit_loop._skip_backward``; the statistics reset, ``momentum``
None: a cumulative average). Lightning runs that epoch's training steps forward only, zeroes no
gradient, and at its last batch still steps the optimizer: with the gradients the last backward
left in ``.grad``, clipped again as the Trainer asks. On the CPU the averaged weights move once
more, and the same happens here.

On IPUs the epoch's training steps run as a forward-only program of the training step, in the
modes Lightning left (batch norms training), over each host call's micro-batches in turn. The
first such call puts the last training call's gradients in ``.grad`` as its update took them,
clipped as they were, what the CPU's ``.grad`` holds then, unless a validation ran in between:
Lightning releases the gradients before it (``on_validation_model_zero_grad``), and the CPU's
last step then leaves the weights alone. The last batch's step is torch's, on the host.
"""

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend


def skips_backward(trainer) -> bool:
    """Whether the running training epoch is one without backward (automatic optimization only:
    Lightning's flag does not reach a manual step)."""
    return trainer.lightning_module.automatic_optimization and trainer.fit_loop._skip_backward


def may_skip_backward(trainer, module: torch.nn.Module) -> bool:
    """Whether the fit may end with such an epoch: its training calls then keep their gradients."""
    return module.automatic_optimization and StochasticWeightAveraging.pl_module_contains_batch_norm(module) and any(
        isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks)


def check_precision(precision: str) -> None:
    """``16-mixed`` steps through Lightning's ``GradScaler`` on the CPU, which unscales the left
    gradients once more at that last step: a scale the IPUs' loss scaling does not share."""
    if precision == "16-mixed":
        raise MisconfigurationException(
            "StochasticWeightAveraging with batch norms under precision='16-mixed': Lightning ends "
            "the fit with an epoch without backward whose last optimizer step unscales the previous "
            "gradients again with the CPU's GradScaler, which IPU loss scaling does not reproduce. "
            "Use precision='bf16-mixed' or '32-true', or compute the statistics after the fit with "
            "torch.optim.swa_utils.update_bn")


def forward_only_options(training: ipu_backend.Options) -> ipu_backend.Options:
    """The training options for a program without backward: every micro-batch of a combined
    batch (accumulated ones too) one device iteration."""
    accumulation = training.Training.gradient_accumulation
    options = training.clone()
    options.deviceIterations(training.device_iterations * accumulation)
    options.Training.gradientAccumulation(1)
    if options.defaultOutputMode():      # a training call's: its last micro-batch's results
        options.outputMode(ipu_backend.OutputMode.Final)
    elif options.output_mode is ipu_backend.OutputMode.EveryN:
        options.outputMode(ipu_backend.OutputMode.EveryN, options.output_return_period * accumulation)
    return options


def leave_last_gradients(module: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    """Set the last training call's gradients as ``.grad``, where the CPU leaves them."""
    if not gradients:
        raise MisconfigurationException(
            "a training epoch without backward (trainer.fit_loop._skip_backward) steps the optimizer "
            "with the last training call's gradients, which this fit did not keep: Lightning sets "
            "the flag for StochasticWeightAveraging's batch-norm epoch only")
    for name, param in module.named_parameters():
        gradient = gradients.get(name)
        param.grad = None if gradient is None else gradient.to(param.dtype, copy=True)
