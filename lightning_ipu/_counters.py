"""Lightning's counters in a compiled step: ``batch_idx``, ``self.current_epoch`` and
``self.global_step`` are inputs of the program, with the values Lightning on the CPU gives them.

One host call runs ``device_iterations x gradient_accumulation x replicas`` micro-batches, in
the combined batch's order (iteration, accumulation micro-batch, replica). On the CPU, with the
same samples per optimizer step (a batch of ``replicas x batch_size``, the same accumulation),
the replicas' micro-batches of one iteration and accumulation step form one batch: its
``batch_idx`` is ``(call x device_iterations + iteration) x gradient_accumulation +
micro-batch``, and ``global_step`` is the optimizer steps done before it. So each call passes,
per micro-batch, that batch index, the call's first ``global_step``, the iteration and the
epoch; while the step is captured, ``batch_idx`` is the micro-batch's index and the module's
trainer answers ``current_epoch`` and ``global_step`` from them (all 0-d tensors). With manual
optimization ``global_step`` counts every ``optimizer.step()``, those the step has made so far
included, as on the CPU.

A value read here is never baked into the program, so it is current in every step. The host
knows each micro-batch's counters before the call, so a Python ``if`` on them (``if batch_idx %
2 == 0``) is decided there, per micro-batch (``ipu_backend.compiler.host_branches``).
"""

import contextlib
from collections.abc import Callable

import torch

_BATCH, _FIRST_STEP, _ITERATION, _EPOCH = range(4)


def per_micro_batch(batch_idx: int, global_step: int, epoch: int, iterations: int, accumulation: int,
                    replicas: int) -> torch.Tensor:
    """``[micro-batches, 4]`` int64: each micro-batch's CPU batch index, the call's first global
    step, its iteration and the epoch."""
    position = torch.arange(iterations * accumulation, dtype=torch.int64).repeat_interleave(replicas)
    counters = torch.empty(position.shape[0], 4, dtype=torch.int64)
    counters[:, _BATCH] = batch_idx * iterations * accumulation + position
    counters[:, _FIRST_STEP] = global_step
    counters[:, _ITERATION] = position // accumulation
    counters[:, _EPOCH] = epoch
    return counters


def evaluation_steps() -> tuple[int, int]:
    """A validation, test or predict step: ``global_step`` stays as training left it."""
    return 0, 0


def automatic_steps() -> tuple[int, int]:
    """Automatic optimization: one optimizer step per training step, made after it."""
    return 1, 0


class _CountingTrainer:
    """The trainer as a captured step sees it: ``current_epoch`` and ``global_step`` come from
    the program's inputs; everything else is the trainer's own."""

    def __init__(self, trainer, counters: torch.Tensor, steps: Callable[[], tuple[int, int]]):
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_counters", counters)
        object.__setattr__(self, "_steps", steps)

    @property
    def current_epoch(self) -> torch.Tensor:
        return self._counters[0, _EPOCH]

    @property
    def global_step(self) -> torch.Tensor:
        per_iteration, taken = self._steps()
        counters = self._counters[0]
        return counters[_FIRST_STEP] + counters[_ITERATION] * per_iteration + taken

    def __getattr__(self, name):
        return getattr(self._trainer, name)

    def __setattr__(self, name, value):
        setattr(self._trainer, name, value)


def adapter(takes_batch_idx: bool, steps: Callable[[], tuple[int, int]]):
    """What ``seam.step_arguments`` needs for a call whose arguments are ``(counters, batch,
    ...)``: the step gets ``(batch, batch_idx, ...)`` (or ``(batch, ...)``), and its module's
    trainer answers the counters. ``steps()`` gives ``(optimizer steps per training step,
    optimizer steps the step has made so far)``: ``(1, 0)`` in automatic optimization."""

    def adapt(module: torch.nn.Module, args: tuple):
        counters, batch, *rest = args
        step_args = (batch, counters[0, _BATCH], *rest) if takes_batch_idx else (batch, *rest)
        return step_args, _trainer_answering(module, counters, steps)

    return adapt


@contextlib.contextmanager
def _trainer_answering(module: torch.nn.Module, counters: torch.Tensor, steps):
    """``module`` and its LightningModule children read their trainer's counters from
    ``counters`` while the block runs."""
    owners = [m for m in module.modules() if m.__dict__.get("_trainer") is not None]
    saved = [m.__dict__["_trainer"] for m in owners]
    for owner, trainer in zip(owners, saved):
        owner.__dict__["_trainer"] = _CountingTrainer(trainer, counters, steps)
    try:
        yield
    finally:
        for owner, trainer in zip(owners, saved):
            owner.__dict__["_trainer"] = trainer
