"""The optimizer's hyper-parameters a training call takes.

They are inputs of the compiled program, so a scheduler changes them without recompiling. A
PopTorch call reads them once for its ``device_iterations`` optimizer steps. Where the caller
steps schedulers between optimizer steps (Lightning's ``interval="step"``, as on the CPU), the
call reads them once per device iteration, the schedulers stepped on the host in between, and
the program takes them stacked on a leading axis, one row per iteration.
"""

from collections.abc import Callable

import jax
import numpy as np

from ipu_backend.compiler import python_reads
from ipu_backend.errors import Error
from ipu_backend.runtime import processes


class HyperParameters:
    """What a training executor passes its program for the optimizer: read once a call and kept
    while the param groups are unchanged, or once per device iteration with ``step_schedulers``
    (called after each of a call's optimizer steps but its last) in between."""

    def __init__(self, step_schedulers: Callable[[], None] | None = None):
        self.step_schedulers = step_schedulers
        self._matched = None
        """``(rule, param-group values)`` last found to match: not checked again until they change."""
        self._read = None
        """``(rule, param-group values, hyper-parameters on the mesh)`` of the last call."""

    def matches(self, rule, optimizer, values: tuple) -> bool:
        """``rule.matches(optimizer)``, checked again only when the param groups (``values``) changed."""
        if self._matched is not None and self._matched[0] is rule and self._matched[1] == values:
            return True
        if not rule.matches(optimizer):
            return False
        self._matched = (rule, values)
        return True

    def for_call(self, rule, optimizer, mesh, values: tuple, iterations: int | None, advance: bool = True,
                 check: Callable[[], None] = lambda: None):
        """The hyper-parameters on the mesh: one set, rebuilt only when the param groups
        (``values``) changed (``setOptimizer``, a scheduler, a value set by hand); or, with
        ``iterations``, one row per device iteration, the schedulers stepped between rows only
        for a call that runs (``advance``): compiling must not move them. ``check`` runs after
        each of those steps (it refuses what the program holds constant and the step changed)."""
        if iterations is None:
            cached = self._read
            if cached is None or cached[0] is not rule or cached[1] != values:
                self._read = cached = (rule, values, _placed(rule.hyperparameters(optimizer), mesh))
            return cached[2]
        self._read = None
        rows = []
        for iteration in range(iterations):
            if iteration and advance:
                self.step_schedulers()
                check()
            rows.append(rule.hyperparameters(optimizer))
        return _placed(jax.tree.map(lambda *row: np.stack(row), *rows), mesh)


def refuse_reads_changed(program, step_method: str | None) -> None:
    """Refuse a value ``program`` was captured with (a learning rate the step reads) that the
    schedulers stepped between a call's optimizer steps changed: later steps would see the old one."""
    changes = python_reads.changed(program.python_reads)
    if changes:
        described = ", ".join(python_reads.described(read, value) for read, value in changes)
        raise Error(f"the {step_method or 'model'} reads {described}, which the schedulers stepped between "
                    "the optimizer steps of one call change: each step would see the value of the call's "
                    "first. Read it on the host (Lightning's LearningRateMonitor, on_train_batch_end) or run "
                    "one optimizer step per call (device_iterations=1)")


def row(hyper, schedule, iteration: int):
    """Device iteration ``iteration``'s hyper-parameters of a call's (``hyper`` as the program takes it)."""
    return jax.tree.map(lambda h: h[iteration], hyper) if schedule.hyperparameters_per_iteration else hyper


def _placed(hyper, mesh):
    return hyper if mesh is None else processes.replicated(hyper, mesh)
