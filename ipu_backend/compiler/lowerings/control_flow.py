"""Lowerings: control flow. ``torch.cond`` becomes ``lax.cond`` over the traced branch graphs,
``poptorch.for_loop`` ``lax.fori_loop`` over its outlined body; torch's run-time data checks
(``_assert_async``) are made as the program runs."""

import jax
import jax.numpy as jnp
import torch

from ipu_backend.compiler.loops import FOR_LOOP
from ipu_backend.compiler.registry import lowering
from ipu_backend.compiler import runtime_checks
from ipu_backend.compiler.runtime_checks import report
from ipu_backend.errors import Error


@lowering(torch.ops.higher_order.cond)
def cond(ctx, pred, true_graph, false_graph, operands):
    """``lax.cond`` over the branch graphs. Each branch's run-time checks count only where it is
    the branch taken: vmapped (replicas on one device), ``lax.cond`` computes both."""
    operands, pred = tuple(operands), jnp.asarray(pred, dtype=bool).reshape(())

    def branch(graph, index, taken):
        def run(ops):
            with runtime_checks.guarded(taken):
                return tuple(ctx.run_subgraph(graph, ops, index))
        return run

    return jax.lax.cond(pred, branch(true_graph, 1, pred), branch(false_graph, 0, ~pred), operands)


@lowering(torch.ops.aten._assert_async.msg)
def assert_async(ctx, condition, message):
    """A check of the data that torch makes at run time (``F.one_hot``'s class range). Evaluated
    op by op, it raises as torch does; in a compiled program the call raises once it is over
    (``runtime_checks``)."""
    if isinstance(condition, jax.core.Tracer):
        report(~jnp.asarray(condition, bool), f"{message} (at {ctx.location()})")
    elif not bool(condition):
        raise Error(f"{message} (at {ctx.location()})")


@lowering(FOR_LOOP)
def for_loop(ctx, body, count, carried, captured):
    """``poptorch.for_loop``: the outlined body graph (``compiler/loops.py``) run ``count`` times."""
    def trip(index, values):
        return tuple(ctx.run_body(body, list(values) + list(captured), index))

    return list(jax.lax.fori_loop(0, count, trip, tuple(carried)))
