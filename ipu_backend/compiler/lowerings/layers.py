"""Lowerings: repeated layers (``layer_calls``). A call runs its template's program on the
layer's inputs and weights; a chain of calls (``layer_loops``) is one ``lax.scan`` over the
layers, its weights stacked, each layer with its own random key.

The loop's body keeps for the backward pass only the results of its matrix products, and
recomputes the rest (``LOOP_RESIDUALS``): each value a loop keeps is written to, and read back
from, a buffer stacked over the layers, which on XLA:CPU costs more than recomputing the
element-wise work that made it (the numbers are the same; see the performance guide)."""

import jax
import jax.numpy as jnp
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler.layer_calls import REPEATED_LAYER, TEMPLATE_KEY, Template
from ipu_backend.compiler.layer_loops import PLAN_KEY, StackedMember, layer_loop
from ipu_backend.compiler.lowering_options import lowering_options
from ipu_backend.compiler.lowerings.linalg import MATRIX_PRODUCT_NAME
from ipu_backend.compiler.registry import lowering


LOOP_RESIDUALS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(MATRIX_PRODUCT_NAME))
"""What a loop's body keeps for the backward pass: matrix products, whether XLA's (``dot``) or the
CPU's own (``lowerings/linalg.py``, named ``MATRIX_PRODUCT_NAME``)."""


def run_template(template: Template, inputs, state, key) -> list:
    """One layer: its output tensors, then the new values of the buffers it updates."""
    call, program = template.call, template.program
    values = dict(zip(call.state_names, state))
    params = {spec.name: values[spec.name] for spec in program.params}
    buffers = {spec.name: values[spec.name] for spec in program.buffers}
    outputs, new_buffers, _ = program.logged_fn(params, buffers, call.arguments(inputs), key)
    arrays = [leaf for leaf in torch_pytree.tree_leaves(outputs) if isinstance(leaf, jax.Array)]
    return arrays + [new_buffers[name] for name in call.mutated]


@lowering(REPEATED_LAYER)
def repeated_layer(ctx, inputs, state, call, held):
    return run_template(ctx.node.meta[TEMPLATE_KEY], list(inputs), list(state), ctx.key())


def _columns(rows, skip=()) -> tuple[dict, dict]:
    """Per position of ``rows`` (one row per layer): the value all layers share, or the layers'
    values stacked on a new leading axis (as given, for a stack of parameters passed whole)."""
    shared, stacked = {}, {}
    for position in range(len(rows[0])):
        if position in skip:
            continue
        column = [row[position] for row in rows]
        if all(value is column[0] for value in column):
            shared[position] = column[0]
        elif _given_whole(column):
            stacked[position] = column[0].stacked
        else:
            stacked[position] = jnp.stack(column)
    return shared, stacked


def _given_whole(column) -> bool:
    return all(isinstance(value, StackedMember) and value.stacked is column[0].stacked and value.index == index
               for index, value in enumerate(column))


@lowering(layer_loop)
def repeated_layer_loop(ctx, inputs, state):
    plan = ctx.node.meta[PLAN_KEY]
    carried = dict(plan.carry)
    shared_inputs, stacked_inputs = _columns(inputs, skip=carried)
    shared_state, stacked_state = _columns(state)
    base_key = ctx.key()

    def body(carry, xs):
        (input_slices, state_slices), layer = xs
        carry_at = dict(zip(carried, carry))
        layer_inputs = [carry_at.get(p, shared_inputs.get(p, input_slices.get(p))) for p in range(len(inputs[0]))]
        layer_state = [shared_state.get(q, state_slices.get(q)) for q in range(len(state[0]))]
        outputs = run_template(plan.template, layer_inputs, layer_state, jax.random.fold_in(base_key, layer))
        return tuple(outputs[o] for o in carried.values()), tuple(outputs[o] for o in plan.stacked)

    start = tuple(inputs[0][p] for p in carried)
    with lowering_options(conv_algorithm="in_loop"):
        final, ys = jax.lax.scan(jax.checkpoint(body, policy=LOOP_RESIDUALS, prevent_cse=False), start, ((stacked_inputs, stacked_state), jnp.arange(plan.layers)))
    values = [None] * (plan.layers * plan.template.output_count)
    for output, y in zip(plan.stacked, ys):
        for layer in range(plan.layers):
            values[plan.slot(layer, output)] = y[layer]
    for output, value in zip(carried.values(), final):
        values[plan.slot(plan.layers - 1, output)] = value
    return values
