"""Lowerings: control flow. ``torch.cond`` becomes ``lax.cond`` over the traced branch graphs."""

import jax
import jax.numpy as jnp
import torch

from ipu_backend.compiler.registry import lowering


@lowering(torch.ops.higher_order.cond)
def cond(ctx, pred, true_graph, false_graph, operands):
    operands = tuple(operands)
    branches = [
        lambda ops, graph=graph, index=index: tuple(ctx.run_subgraph(graph, ops, index))
        for index, graph in enumerate((false_graph, true_graph))
    ]
    return jax.lax.cond(jnp.asarray(pred, dtype=bool).reshape(()), branches[1], branches[0], operands)
