"""Lightning's count of optimizer steps, kept true when one host call runs several.

One host call runs ``device_iterations`` optimizer steps, but Lightning's loop counts one per
batch: the extra steps are added to the loop's optimizer-step progress (``trainer.global_step``)
and to the batches that stepped (where the step loggers record), which the callbacks'
``on_train_batch_start`` see at the call's last step; while the optimizers are configured,
the estimated stepping batches count optimizer steps. These are Lightning internals, checked against the
Lightning version by ``_lightning_hooks.check_version``.
"""

import contextlib
import fractions


def count_extra_optimizer_steps(trainer, optimizer_steps: int, batches: int) -> None:
    """Add ``optimizer_steps`` to the loop's optimizer-step progress (``trainer.global_step``; the
    optimizer steps of automatic optimization, every ``optimizer.step()`` of manual optimization)
    and ``batches`` to the batches that stepped (the step loggers record at)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step
    else:
        progress = epoch_loop.manual_optimization.optim_step_progress
    for _ in range(optimizer_steps):
        progress.increment_ready()
        progress.increment_completed()
    epoch_loop._batches_that_stepped += batches


@contextlib.contextmanager
def stepping_batches_in_optimizer_steps(trainer, iterations: int):
    """``trainer.estimated_stepping_batches`` in optimizer steps inside the block, as on the CPU:
    ``configure_optimizers`` reads it to size a schedule stepped after every optimizer step. It
    divides the epochs' batches (host calls of ``iterations`` optimizer steps here) by
    ``accumulate_grad_batches``, which the block makes the exact fraction ``1/iterations``."""
    saved = trainer.accumulate_grad_batches
    if iterations > 1:
        trainer.accumulate_grad_batches = fractions.Fraction(1, iterations)
    try:
        yield
    finally:
        trainer.accumulate_grad_batches = saved


def shift_batches_that_stepped(trainer, batches: int) -> None:
    """Move the count of batches that stepped by ``batches``: by a call's ``device_iterations``
    less one while the callbacks' ``on_train_batch_start`` run, so that what logs there
    (``LearningRateMonitor``) sees, as the step loggers do after the call, its last optimizer
    step, back by as much after them."""
    trainer.fit_loop.epoch_loop._batches_that_stepped += batches
