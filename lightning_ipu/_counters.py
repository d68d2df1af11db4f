"""Lightning's counters in a compiled step: ``batch_idx``, ``self.current_epoch`` and
``self.global_step`` are inputs of the program, with the values Lightning on the CPU gives them.

One host call runs ``device_iterations x gradient_accumulation x replicas`` micro-batches, in
the combined batch's order (iteration, accumulation micro-batch, replica). On the CPU, with the
same samples per optimizer step (a batch of ``replicas x batch_size``, the same accumulation),
the replicas' micro-batches of one iteration and accumulation step form one batch: its
``batch_idx`` is ``(call x device_iterations + iteration) x gradient_accumulation +
micro-batch``, and ``global_step`` is the optimizer steps done before it. So each call passes,
per micro-batch, that batch index, the call's first ``global_step``, the iteration, the epoch
and whether its batch is the epoch's last; while the step is captured, ``batch_idx`` is the
micro-batch's index and the module's trainer answers ``current_epoch``, ``global_step`` and
``is_last_batch`` from them (all 0-d tensors). With manual optimization ``global_step`` counts
every ``optimizer.step()``, those the step has made so far included, as on the CPU.

A value read here is never baked into the program, so it is current in every step. The host
knows each micro-batch's counters before the call, so a Python ``if`` on them (``if batch_idx %
2 == 0``) is decided there, per micro-batch (``ipu_backend.compiler.host_branches``). Any other
plain value the step reads off its trainer (``self.trainer.sanity_checking``) is baked in, and a
guard of the program: a change captures the step again.
"""

import contextlib
import functools
import weakref
from collections.abc import Callable

import torch

from ipu_backend import lightning_seam as seam

_BATCH, _FIRST_STEP, _ITERATION, _EPOCH, _LAST = range(5)


def per_micro_batch(batch_idx: int, global_step: int, epoch: int, iterations: int, accumulation: int,
                    replicas: int, last_batch: bool, training: bool, skipped: int = 0) -> torch.Tensor:
    """``[micro-batches, 5]`` int64: each micro-batch's CPU batch index, the call's first global
    step, its iteration, the epoch, and whether its batch is the epoch's last training batch
    (``trainer.is_last_batch``, ``last_batch`` for the call: in training only its last
    micro-batches' batch is; an evaluation step sees the training loop's value). ``skipped``: the
    CPU batches of the host batch that came before the call (the short last batch of an
    evaluation epoch runs in pieces)."""
    position = torch.arange(iterations * accumulation, dtype=torch.int64).repeat_interleave(replicas)
    counters = torch.empty(position.shape[0], 5, dtype=torch.int64)
    counters[:, _BATCH] = batch_idx * iterations * accumulation + skipped + position
    counters[:, _FIRST_STEP] = global_step
    counters[:, _ITERATION] = position // accumulation
    counters[:, _EPOCH] = epoch
    in_last_batch = position == iterations * accumulation - 1 if training else torch.ones_like(position)
    counters[:, _LAST] = in_last_batch * last_batch
    return counters


def evaluation_steps() -> tuple[int, int]:
    """A validation, test or predict step: ``global_step`` stays as training left it."""
    return 0, 0


def automatic_steps() -> tuple[int, int]:
    """Automatic optimization: one optimizer step per training step, made after it."""
    return 1, 0


class _CountingTrainer:
    """The trainer as a captured step sees it: ``current_epoch``, ``global_step`` and
    ``is_last_batch`` come from the program's inputs; everything else is the trainer's own, and
    each plain value read is noted in ``guards`` (by name)."""

    def __init__(self, trainer, counters: torch.Tensor, steps: Callable[[], tuple[int, int]], guards: dict):
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_counters", counters)
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_guards", guards)

    @property
    def current_epoch(self) -> torch.Tensor:
        return self._counters[0, _EPOCH]

    @property
    def is_last_batch(self) -> torch.Tensor:
        return self._counters[0, _LAST] == 1

    @property
    def global_step(self) -> torch.Tensor:
        per_iteration, taken = self._steps()
        counters = self._counters[0]
        return counters[_FIRST_STEP] + counters[_ITERATION] * per_iteration + taken

    def __getattr__(self, name):
        value = getattr(self._trainer, name)
        if name not in self._guards:
            guard = seam.value_guard(functools.partial(_read, weakref.ref(self._trainer), name), f"trainer.{name}",
                                     value)
            if guard is not None:
                self._guards[name] = guard
        return value

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


def _read(trainer: weakref.ref, name: str):
    """``trainer.<name>`` now (``seam.MISSING`` once the trainer is gone)."""
    owner = trainer()
    return seam.MISSING if owner is None else getattr(owner, name, seam.MISSING)


@contextlib.contextmanager
def _trainer_answering(module: torch.nn.Module, counters: torch.Tensor, steps):
    """``module`` and its LightningModule children read their trainer's counters from
    ``counters`` while the block runs; the list it yields holds, once it ends, the guards of the
    other plain values they read off it."""
    owners = [m for m in module.modules() if m.__dict__.get("_trainer") is not None]
    saved = [m.__dict__["_trainer"] for m in owners]
    guards: dict = {}
    read: list = []
    for owner, trainer in zip(owners, saved):
        owner.__dict__["_trainer"] = _CountingTrainer(trainer, counters, steps, guards)
    try:
        yield read
    finally:
        for owner, trainer in zip(owners, saved):
            owner.__dict__["_trainer"] = trainer
        read.extend(guards.values())
