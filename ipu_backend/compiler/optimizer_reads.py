"""Optimizer hyper-parameters a step reads in Python (``self.optimizers().param_groups[0]["lr"]``
or ``self.lr_schedulers().get_last_lr()``, to log the learning rate or scale a loss by it):
guards of the program, as the module's plain attributes are (``python_reads``).

The compiled update takes the optimizer's hyper-parameters as inputs, but a value the step itself
reads is a Python number, baked into the program at capture, which a scheduler then changes on the
host. While a step is captured, each param group of the executor's optimizers stands in as a copy
that notes the keys read, and torch's schedulers note the calls of their ``get_last_lr``; each
read becomes a guard (``python_reads.ValueRead``), and a change of its value captures the step
again.
"""

import contextlib
import functools
import sys
import weakref

import torch
from torch.optim.lr_scheduler import LRScheduler

from ipu_backend.compiler import global_reads, python_reads
from ipu_backend.errors import Error


class _Noting(dict):
    """A param group's copy noting the keys the user's code reads through it (library code, such
    as the executor reading the hyper-parameters it feeds the update, is not the step's), and
    refusing writes: the update reads the host's groups before each call, and the step's Python
    runs once, so a value set in it would be lost."""

    def __init__(self, group: dict, noted: set, attribute: str):
        super().__init__(group)
        self._noted = noted
        self._attribute = attribute

    def _refuse(self, key, *_):
        raise Error(f"the step sets {self._attribute}[{key!r}] while it is captured: its Python runs once, at "
                    "capture, and the compiled update reads the param groups from the host before each call, "
                    "so the value would be lost. Set it on the host before the step: with a scheduler "
                    "(torch.optim.lr_scheduler.LambdaLR for a warm-up), in on_train_batch_start, or in an "
                    "optimizer_step override")

    __setitem__ = __delitem__ = setdefault = pop = _refuse

    def update(self, *args, **kwargs):
        self._refuse(next(iter(dict(*args, **kwargs)), None))

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def _note(self, key) -> None:
        if not global_reads.is_library(sys._getframe(2).f_code.co_filename):
            self._noted.add(key)


def _last_lr(scheduler: weakref.ref):
    """``scheduler.get_last_lr()`` now (``python_reads.MISSING`` once the scheduler is gone)."""
    owner = scheduler()
    return python_reads.MISSING if owner is None else owner.get_last_lr()


@contextlib.contextmanager
def _scheduler_reads(reads: list):
    """While the block runs, the user's calls of any torch scheduler's ``get_last_lr`` are noted:
    a guard of each scheduler's value (plain values only, the scheduler held weakly) goes to
    ``reads`` when it ends."""
    original = LRScheduler.get_last_lr
    seen: dict = {}

    def get_last_lr(self):
        value = original(self)
        if id(self) not in seen and not global_reads.is_library(sys._getframe(1).f_code.co_filename):
            seen[id(self)] = (weakref.ref(self), python_reads.snapshot(value))
        return value

    LRScheduler.get_last_lr = get_last_lr
    try:
        yield
    finally:
        LRScheduler.get_last_lr = original
        for scheduler, frozen in seen.values():
            if frozen is not None and scheduler() is not None:
                reads.append(python_reads.ValueRead(functools.partial(_last_lr, scheduler),
                                                    f"{type(scheduler()).__name__}.get_last_lr()", frozen))


@contextlib.contextmanager
def recorded(optimizers: list[torch.optim.Optimizer | None]):
    """While the block runs, note the keys read from ``optimizers``' param groups and the calls of
    schedulers' ``get_last_lr``; the list it yields holds their guards
    (``python_reads.ValueRead``) once the block ends (plain values only: a tensor hyper-parameter is not
    a guard)."""
    reads: list = []
    swapped = []
    for optimizer in filter(None, optimizers):
        for index, group in enumerate(optimizer.param_groups):
            noted: set = set()
            optimizer.param_groups[index] = _Noting(group, noted, f"the optimizer's param_groups[{index}]")
            swapped.append((optimizer, index, group, noted))
    try:
        with _scheduler_reads(reads):
            yield reads
    finally:
        for optimizer, index, group, noted in swapped:
            optimizer.param_groups[index] = group
            for key in sorted(noted, key=str):
                frozen = python_reads.snapshot(group.get(key))
                if frozen is not None:
                    reads.append(python_reads.ValueRead(functools.partial(group.get, key, python_reads.MISSING),
                                                        f"{type(optimizer).__name__}.param_groups[{index}][{key!r}]",
                                                        frozen))
