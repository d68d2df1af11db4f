"""Which variant of a step that branches in Python on a host-known input (Lightning's counters:
``compiler/host_branches.py``) each micro-batch of a call runs, and the captures that cover a
call.

The host evaluates each variant's guards on each micro-batch's values of that input before the
call; the variant whose guards hold is the micro-batch's. A call with a micro-batch that no
variant covers is captured again for it, and compiled with the larger set of variants, as
torch.compile compiles again when a guard fails.
"""

import logging
import warnings
from collections.abc import Callable

import torch

from ipu_backend.compiler import host_branches
from ipu_backend.errors import Error
from ipu_backend.runtime.schedule import Schedule

logger = logging.getLogger("ipu_backend")

VARIANT_WARNING_LIMIT = 8
"""Variants of one step after which an executor warns that its branches keep compiling new ones."""


def micro_batch_values(args: tuple, position: int, schedule: Schedule) -> tuple[list, torch.Tensor]:
    """The distinct micro-batch values of the call's host-known input ``args[position]`` (a
    combined batch) and, per micro-batch, which of them it holds."""
    values = args[position]
    if not isinstance(values, torch.Tensor):
        raise Error(f"the step's input {position}, known on the host, must be a tensor; got "
                    f"{type(values).__name__}")
    rows = values.reshape(schedule.factor, -1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    shape = (values.shape[0] // schedule.factor, *values.shape[1:])
    return [row.reshape(shape) for row in distinct], inverse


def with_choice(program, args: tuple, schedule: Schedule) -> tuple | None:
    """The inputs of a call of ``program`` (a step with variants) on ``args``: ``args``, and each
    micro-batch's variant (int32 ``[micro-batches]``) when it has several; None when the values
    of some micro-batch take branches no variant was captured with."""
    values, inverse = micro_batch_values(args, program.host_input, schedule)
    picked = [host_branches.variant_of(program.variants, row) for row in values]
    if None in picked:
        return None
    return args if len(program.variants) == 1 else (*args, torch.tensor(picked, dtype=torch.int32)[inverse])


def covering(capture: Callable, micro: tuple, args: tuple, schedule: Schedule, known: tuple, what: str):
    """The program of a capture of the step on ``micro`` (the first micro-batch of ``args``),
    ``capture(micro)``; when it branches on its host-known input, the program of every variant
    the micro-batches of ``args`` take: the ``known`` ones (if any; else the first capture) and
    one capture more for each micro-batch whose values take branches none of them takes."""
    if not known:
        first = capture(micro)
        if not first.guards:
            return first
        known = (host_branches.Variant(first, micro[first.host_input]),)
    found = list(known)
    position = found[0].program.host_input
    values, _ = micro_batch_values(args, position, schedule)
    for row in values:
        if host_branches.variant_of(tuple(found), row) is not None:
            continue
        variant = host_branches.Variant(capture((*micro[:position], row, *micro[position + 1:])), row)
        if not variant.program.guards or not variant.holds(row):
            raise Error(f"the {what} took different Python branches when captured again with the same "
                        "batch_idx, current_epoch and global_step (at "
                        f"{host_branches.diverging_line(found[0], variant)}): its branches must depend "
                        "on them alone")
        found.append(variant)
        logger.info("capturing the %s again for the other way of its Python branch at %s", what,
                    host_branches.diverging_line(found[0], variant))
        if len(found) == VARIANT_WARNING_LIMIT + 1:
            warnings.warn(f"the {what} has {len(found)} compiled variants because its Python branches on "
                          "batch_idx, current_epoch or global_step (at "
                          f"{host_branches.diverging_line(found[0], variant)}) keep going new ways: each "
                          "compiles the program again. Branch on fewer distinct values (a bool), or "
                          "compute the choice with torch.where", stacklevel=5)
    return host_branches.combined(found)
