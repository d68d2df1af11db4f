"""Lightning's count of optimizer steps, kept true when one host call runs several.

One host call runs ``device_iterations`` optimizer steps, but Lightning's loop counts one per
batch: the extra steps are added to the loop's optimizer-step progress (``trainer.global_step``)
and to the batches that stepped (where the step loggers record), which the callbacks'
``on_train_batch_start`` see at the call's last step; while the optimizers are configured, the
trainer counts as on the CPU. These are Lightning internals, checked against the Lightning
version by ``_lightning_hooks.check_version``.
"""

import contextlib


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
def counted_as_on_the_cpu(trainer, iterations: int, accumulation: int):
    """While the block runs (``configure_optimizers``), the trainer counts as on the CPU:
    ``accumulate_grad_batches`` is the user's ``accumulation`` (the loop sees 1 otherwise, the IPUs
    accumulating inside each call), and ``estimated_stepping_batches``, which sizes a schedule
    stepped after every optimizer step, counts optimizer steps, ``iterations`` per host call where
    Lightning's count would give calls. The trainer is an instance of a subclass for the block."""
    if iterations == 1 and accumulation == 1:
        yield
        return
    original, loop_accumulation = type(trainer), trainer.accumulate_grad_batches

    class CountingOptimizerSteps(original):
        @property
        def estimated_stepping_batches(self) -> int | float:
            if self.max_epochs == -1:
                return float("inf") if self.max_steps == -1 else self.max_steps
            if self.train_dataloader is None:
                self.fit_loop.setup_data()
            calls = self.num_training_batches
            if calls == float("inf"):
                return self.max_steps
            steps = calls * iterations * max(self.max_epochs, 1)
            return steps if self.max_steps == -1 else min(steps, self.max_steps)

    trainer.__class__, trainer.accumulate_grad_batches = CountingOptimizerSteps, accumulation
    try:
        yield
    finally:
        trainer.__class__, trainer.accumulate_grad_batches = original, loop_accumulation


def shift_batches_that_stepped(trainer, batches: int) -> None:
    """Move the count of batches that stepped by ``batches``: by a call's ``device_iterations``
    less one while the callbacks' ``on_train_batch_start`` run, so that what logs there
    (``LearningRateMonitor``) sees, as the step loggers do after the call, its last optimizer
    step, back by as much after them."""
    trainer.fit_loop.epoch_loop._batches_that_stepped += batches
