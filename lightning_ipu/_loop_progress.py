"""Lightning's count of optimizer steps, kept true when one host call runs several.

One host call runs ``device_iterations`` optimizer steps, but Lightning's loop counts one per
batch: the extra steps are added to the loop's optimizer-step progress (``trainer.global_step``)
and to the batches that stepped (where the step loggers record). These are Lightning internals,
checked against the Lightning version by ``_lightning_hooks.check_version``.
"""


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
