"""The step program: device iterations, gradient accumulation, replication and the optimizer
update, as one pure function compiled once.

Batches arrive in PopTorch's combined layout, split as ``[device_iterations,
gradient_accumulation, replicas, micro_batch, ...]`` (PopART's order). Replicas are sharded over a
1-D device mesh (several replicas per device vmap when there are fewer devices); device iterations
and accumulation are ``lax.scan`` loops inside the program, never host loops.
"""

from collections.abc import Callable

import jax
import jax.extend as jex
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler.lowering_options import lowering_options
from ipu_backend.compiler.list_appends import EVERY_MICRO_BATCH
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.rounding import stochastic_round
from ipu_backend.runtime.schedule import Schedule


def loop_scan(body, carry, xs):
    """``lax.scan`` with ``body`` lowered for a loop: convolutions traced in it use
    ``conv_algorithm="in_loop"``, which XLA:CPU keeps fast inside a loop. A call's device
    iterations always run in one, a single iteration too: a convolutional step runs faster in a
    loop of one than at the program's top level (docs/performance.md)."""
    with lowering_options(conv_algorithm="in_loop"):
        return jax.lax.scan(body, carry, xs)


def _loop(body, carry, xs, length):
    """A loop inside a device iteration (gradient accumulation): :func:`loop_scan` when there is
    more than one step, else one direct call, already inside the device iterations' loop."""
    if length > 1:
        return loop_scan(body, carry, xs)
    carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


def _select_outputs(ys, schedule: Schedule):
    """Per-micro-batch outputs ``[D, A, r, ...]`` reduced as the output mode asks."""
    mode = schedule.output_mode
    if mode == "all":
        return ys
    if mode == "sum":
        return jax.tree.map(lambda y: y.sum(axis=(0, 1), keepdims=True), ys)
    if mode == "every_n":      # every micro-batch of every n-th iteration, as PopART's anchors
        n = schedule.output_period
        return jax.tree.map(lambda y: y[n - 1::n], ys)
    return jax.tree.map(lambda y: y[-1:, -1:], ys)


_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


def _totals(logs: dict, totals: dict) -> dict:
    """Logged metric states reduced over every micro-batch of the call, whatever the output mode
    keeps: ``[D, A, r, ...]`` -> ``[1, 1, r, ...]`` (the host reduces over the replicas)."""
    return {name + TOTAL_SUFFIX: _REDUCE[how](logs[name], axis=(0, 1), keepdims=True)
            for name, how in totals.items() if how in _REDUCE}


def call_outputs(arrays, logs: dict, schedule: Schedule, totals: dict) -> tuple:
    """A call's per-micro-batch outputs and logs ``[D, A, r, ...]`` as the program returns them:
    selected by the output mode, with the metric ``totals`` over every micro-batch added (and
    the logs ``totals`` wants for every micro-batch kept whole), and moved to ``[r, D', A', ...]``
    so the replica axis is gathered first."""
    reduced = _totals(logs, totals)
    whole = {name: value for name, value in logs.items() if totals.get(name) == EVERY_MICRO_BATCH}
    selected = {name: value for name, value in logs.items() if name not in whole}
    arrays, logs = _select_outputs((arrays, selected), schedule)
    return jax.tree.map(lambda y: jnp.moveaxis(y, 2, 0), (arrays, {**logs, **whole, **reduced}))


def _identity(how: str, dtype):
    """The start of a running ``how`` ("sum" | "max" | "min") reduction in ``dtype``."""
    if how == "sum":
        return 0
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if how == "max" else jnp.inf
    if dtype == jnp.bool_:
        return how == "min"
    info = jnp.iinfo(dtype)
    return info.min if how == "max" else info.max


def _running_start(how: str, aval):
    """A running ``how`` reduction of steps shaped ``aval`` (``[A, r, ...]``) over their first
    axis: its start (``[1, r, ...]``; sums of narrow floats accumulate in float32, as ``jnp.sum``
    computes them) and the dtype of the result."""
    reduced = jax.eval_shape(lambda y: _REDUCE[how](y, axis=0, keepdims=True), aval)
    dtype = reduced.dtype
    if how == "sum" and jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.promote_types(dtype, jnp.float32)
    return jnp.full(reduced.shape, _identity(how, dtype), dtype), reduced.dtype


def _combine(how: str, running, step):
    """``running`` with one more step (``[A, r, ...]``, reduced over its first axis)."""
    if how == "sum":
        return running + jnp.sum(step, axis=0, keepdims=True, dtype=running.dtype)
    return (jnp.maximum if how == "max" else jnp.minimum)(running, _REDUCE[how](step, axis=0, keepdims=True))


PEEL_MAX_EQUATIONS = 300
"""Final mode peels the last device iteration off the loop (:func:`_final_iteration_outputs`)
when a step has at most this many JAX equations. A step that small spends its time mostly on
per-kernel overhead, of which the kernels computing only outputs are a visible share, and
compiling it twice costs little; a bigger step gains nothing measurable and compiles a second
copy of itself (the figures are in docs/performance.md)."""


def device_loop(iteration, carry, xs, schedule: Schedule, totals: dict):
    """The call's device iterations, ``iteration(carry, xs) -> (carry, (arrays, logs))`` with
    outputs ``[A, r, ...]``, and its outputs as :func:`call_outputs` gives them. In Final and Sum
    modes the loop keeps only what the call returns (the last outputs, or their running sum, and
    the metric totals) instead of stacking every iteration's: on XLA:CPU each stacked output is
    one more write per iteration, and it holds D copies. Logs wanted for every micro-batch
    (appended tensors) are stacked, as in the other modes."""
    if (schedule.device_iterations == 1 or schedule.output_mode not in ("final", "sum")
            or EVERY_MICRO_BATCH in totals.values()):
        carry, ys = loop_scan(iteration, carry, xs)
        return carry, call_outputs(*ys, schedule, totals)
    final = schedule.output_mode == "final"
    step, (_, shapes) = jax.make_jaxpr(iteration, return_shape=True)(carry, jax.tree.map(lambda x: x[0], xs))
    running, total_dtypes = _unzip({n: _running_start(how, shapes[1][n]) for n, how in totals.items()}, totals)

    def with_totals(loop_carry, x):
        """One iteration, its metric totals added to the running ones."""
        inner, running = loop_carry
        inner, ys = iteration(inner, x)
        return (inner, {n: _combine(how, running[n], ys[1][n]) for n, how in totals.items()}), ys

    if final and _equation_count(step.jaxpr) <= PEEL_MAX_EQUATIONS:
        (carry, running), (arrays, logs) = _final_iteration_outputs(with_totals, (carry, running), xs,
                                                                    schedule.device_iterations)
    else:
        if final:
            kept = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        else:
            kept, kept_dtypes = _unzip(jax.tree.map(lambda a: _running_start("sum", a), shapes), shapes)

        def keeping(loop_carry, x):
            inner, kept = loop_carry
            inner, ys = with_totals(inner, x)
            return (inner, ys if final else jax.tree.map(lambda k, y: _combine("sum", k, y), kept, ys)), None

        ((carry, running), kept), _ = loop_scan(keeping, ((carry, running), kept), xs)
        if final:
            arrays, logs = jax.tree.map(lambda y: y[None, -1:], kept)
        else:
            arrays, logs = jax.tree.map(lambda y, d: y[None].astype(d), kept, kept_dtypes)
    reduced = {n + TOTAL_SUFFIX: running[n][None].astype(total_dtypes[n]) for n in totals}
    return carry, jax.tree.map(lambda y: jnp.moveaxis(y, 2, 0), (arrays, {**logs, **reduced}))


def _equation_count(jaxpr) -> int:
    """The equations of ``jaxpr``, those of the jaxprs inside it (loops, custom gradients...)
    included."""
    return sum(1 + sum(_equation_count(inner) for value in eqn.params.values() for inner in _jaxprs(value))
               for eqn in jaxpr.eqns)


def _jaxprs(value):
    """The jaxprs an equation's parameter holds."""
    if isinstance(value, jex.core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jex.core.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [inner for item in value for inner in _jaxprs(item)]
    return []


def _final_iteration_outputs(iteration, carry, xs, length: int):
    """Final mode for a small step: the first ``length - 1`` iterations in a loop that reads none
    of their outputs, so XLA drops what computes only them, then the last iteration in a loop of
    one, which returns its outputs ``[1, 1, r, ...]``. The first loop indexes the inputs itself:
    a slice of all but the last iteration's would be a copy of them."""
    def without_outputs(loop_carry, d):
        x = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, d, keepdims=False), xs)
        return iteration(loop_carry, x)[0], None

    carry, _ = loop_scan(without_outputs, carry, jnp.arange(length - 1))
    carry, ys = loop_scan(iteration, carry, jax.tree.map(lambda x: x[-1:], xs))
    return carry, jax.tree.map(lambda y: y[:, -1:], ys)


def _unzip(pairs, like):
    """A tree of ``(a, b)`` pairs shaped as ``like`` → the tree of ``a`` and the tree of ``b``."""
    structure = jax.tree.structure(like)
    leaves = structure.flatten_up_to(pairs)
    return (structure.unflatten([a for a, _ in leaves]), structure.unflatten([b for _, b in leaves]))


_ARRAY = object()
"""Marks an array leaf in ``OutputLayout.static`` (None is a leaf value of its own)."""


def forward_with_constants(program, args: tuple):
    """The program as ``forward(params, buffers, tensor_leaves, key)``: non-tensor arguments
    (baked into the compiled program, and part of its cache key) are put back in place."""
    leaves, spec = torch_pytree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]

    def forward(params, buffers, arrays, key):
        arrays = iter(arrays)
        merged = [next(arrays) if t else x for t, x in zip(is_tensor, leaves)]
        return program.logged_fn(params, buffers, torch_pytree.tree_unflatten(merged, spec), key)

    return forward


class OutputLayout:
    """Records, while tracing, which output leaves are arrays so the host can rebuild the rest."""

    def __init__(self):
        self.spec = None
        self.static = None

    def split(self, outputs):
        leaves, self.spec = torch_pytree.tree_flatten(outputs)
        self.static = [_ARRAY if isinstance(leaf, jax.Array) else leaf for leaf in leaves]
        return [leaf for leaf in leaves if isinstance(leaf, jax.Array)]

    def state(self) -> tuple:
        """What tracing recorded, as plain data (kept with a cached executable)."""
        return self.spec, [(True, None) if leaf is _ARRAY else (False, leaf) for leaf in self.static]

    def restore(self, state: tuple) -> None:
        """Take the record :meth:`state` gave, as if the program had been traced."""
        self.spec, static = state
        self.static = [_ARRAY if is_array else leaf for is_array, leaf in static]

    def join(self, arrays):
        arrays = iter(arrays)
        leaves = [next(arrays) if s is _ARRAY else s for s in self.static]
        return torch_pytree.tree_unflatten(leaves, self.spec)


def call_key(key, index):
    """A call's random key: the executor's ``key`` folded with the call's ``index`` (inside the
    program, so a call dispatches nothing else)."""
    return jax.random.fold_in(key, index)


def iteration_keys(key, iterations: int):
    """The key of each of a call's ``iterations`` device iterations, from the call's ``key``."""
    return jax.vmap(lambda d: jax.random.fold_in(key, d))(jnp.arange(iterations))


def replica_ids(local_replicas, devices: int):
    """The indices of this device's ``local_replicas`` replicas among all replicas."""
    first = 0 if devices == 1 else jax.lax.axis_index(REPLICA) * local_replicas
    return first + jnp.arange(local_replicas)


def replica_keys(key, local_replicas, devices: int):
    """The key of each of this device's ``local_replicas`` replicas, from the call's ``key``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(replica_ids(local_replicas, devices))


def _with_views(forward: Callable, views: Callable | None) -> Callable:
    """``forward`` of one replica, ``forward(params, buffers, inputs, key, replica)``: the weights
    as that replica reads them (``views(params, replica)``, see ``runtime/replica_groups.py``)."""
    if views is None:
        return lambda params, buffers, inputs, key, replica: forward(params, buffers, inputs, key)
    return lambda params, buffers, inputs, key, replica: forward(views(params, replica), buffers, inputs, key)


def per_device(program: Callable, mesh, in_specs: tuple, out_specs: tuple) -> Callable:
    """``program`` run on each device of the replica mesh (``shard_map``: arrays split by
    ``in_specs``, results joined by ``out_specs``); on a one-device mesh, ``program`` itself, which
    JAX traces without shard_map's per-device machinery."""
    if mesh.size == 1:
        return program
    return jax.shard_map(program, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def replica_sum(tree, devices: int):
    """Sum over the devices of the replica mesh; on a one-device mesh the value itself (XLA:CPU
    keeps a one-device all-reduce as a step of its own in every device iteration)."""
    return tree if devices == 1 else jax.lax.psum(tree, REPLICA)


def replica_zero_everywhere(tree):
    """Replica 0's value on every device of the replica axis (PopTorch's broadcastBuffers)."""
    is_zero = jax.lax.axis_index(REPLICA) == 0
    return jax.tree.map(
        lambda x: jax.lax.psum(jnp.where(is_zero, x, jnp.zeros_like(x)), REPLICA).astype(x.dtype), tree)


def from_replica_zero(tree, local_replicas, devices: int):
    """Replica 0's value (the first of this device's ``local_replicas``) on every device."""
    first = jax.tree.map(lambda x: x[0], tree)
    return first if devices == 1 else replica_zero_everywhere(first)


def next_buffers(new_buffers, schedule: Schedule, local_replicas, devices: int):
    """The buffers every replica starts its next micro-batch from: replica 0's (PopTorch's
    ``broadcastBuffers``, the default), or each replica's own (``[r, ...]``) without broadcast."""
    if schedule.per_replica_buffers:
        return new_buffers
    return from_replica_zero(new_buffers, local_replicas, devices)


def _buffers_axis(schedule: Schedule):
    """How the replicas of a device read the buffers: all the same (None), or each its own row."""
    return 0 if schedule.per_replica_buffers else None


def _state_spec(schedule: Schedule, training: bool):
    """The state's sharding over the replica mesh: replicated, but per-replica buffers, whose rows
    are the replicas'."""
    if not schedule.per_replica_buffers:
        return P()
    spec = {"params": P(), "buffers": P(REPLICA)}
    return {**spec, "opt": P(), "scaler": P()} if training else spec


SCALER_GROWTH_INTERVAL = 2000
SCALER_INITIAL = 2.0 ** 16


def initial_scaler(initial_scale: float | None = None) -> dict:
    """Dynamic loss scaling state, with torch.amp.GradScaler's defaults."""
    return {"scale": jnp.asarray(initial_scale or SCALER_INITIAL, jnp.float32),
            "good_steps": jnp.zeros((), jnp.int32)}


def next_scaler(scaler: dict, finite) -> dict:
    """Dynamic loss scaling after one step (torch's ``GradScaler.update``): halve the scale after
    an overflow, double it after ``SCALER_GROWTH_INTERVAL`` finite steps in a row."""
    good = jnp.where(finite, scaler["good_steps"] + 1, 0)
    grow = good >= SCALER_GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, scaler["scale"] * 2, scaler["scale"]), scaler["scale"] / 2)
    return {"scale": scale, "good_steps": jnp.where(grow, 0, good)}


def _apply_if_finite(grads, scaler, new, old):
    """Skip a step whose gradients overflowed; the scale follows :func:`next_scaler`."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old), next_scaler(scaler, finite)


def optimizer_update(rule, grads, opt_state, params, hyper, key, schedule: Schedule, rounded: tuple | None = None):
    """The optimizer step. Half-precision weights are updated in float32 — from their master
    copy (kept in the optimizer state) when master weights are on — and rounded back to their
    dtype, stochastically when asked. ``key`` is split over ``rounded``, the names of the whole
    model's half-precision weights (those of ``params`` by default), so a stage updating some of
    them rounds each as the single-IPU step does."""
    if not (schedule.master_weights or schedule.stochastic_rounding):
        return rule.update(grads, opt_state, params, hyper)
    half = sorted(n for n, p in params.items() if p.dtype in (jnp.float16, jnp.bfloat16))
    rounded = half if rounded is None else sorted(rounded)
    if schedule.master_weights:
        rule_state, wide = opt_state["rule"], {**params, **opt_state["master"]}
    else:
        rule_state, wide = opt_state, {**params, **{n: params[n].astype(jnp.float32) for n in half}}
    new_wide, rule_state = rule.update(grads, rule_state, wide, hyper)
    keys = dict(zip(rounded, jax.random.split(key, max(1, len(rounded)))))
    narrow = {n: stochastic_round(new_wide[n], params[n].dtype, keys[n]) if schedule.stochastic_rounding
              else new_wide[n].astype(params[n].dtype) for n in half}
    new_params = {**new_wide, **narrow}
    if schedule.master_weights:
        return new_params, {"rule": rule_state, "master": {n: new_wide[n] for n in half}}
    return new_params, rule_state


def master_copy(params: dict) -> dict:
    """The float32 master copies of a model's half-precision weights."""
    return {n: p.astype(jnp.float32) for n, p in params.items() if p.dtype in (jnp.float16, jnp.bfloat16)}


def training_call(forward: Callable, loss_index: int, rule, schedule: Schedule, mesh,
                  layout: OutputLayout, totals: dict | None = None, views: Callable | None = None,
                  keep_gradients: bool = False) -> Callable:
    """``call(state, inputs, hyper, key, index) -> (state, outputs, logs)``, jitted over the mesh
    (``key`` and ``index``: see :func:`call_key`).

    ``forward(params, buffers, inputs, key) -> (outputs, new_buffers, logs)`` is one micro-batch
    of the model (a Program's ``logged_fn``); ``state`` is ``{"params", "buffers", "opt", "scaler"}`` (``scaler``: dynamic loss scaling,
    see :func:`initial_scaler`, or None); ``inputs`` the positional arguments, each array
    split by :func:`split_batch`; outputs are ``[r, D', A', ...]`` per device, gathered on the replica
    axis, and selected by the output mode. ``totals`` (``Program.call_totals``) adds those logs
    reduced over every micro-batch, or keeps them for every one (see :func:`call_outputs`); ``views`` gives each replica
    its weights (see :func:`_with_views`). ``keep_gradients`` adds ``"grads"`` to the returned
    state: the last optimizer step's gradients as its update took them (averaged, unscaled, not
    yet clipped), for host code that reads ``.grad`` (Lightning's gradient hooks).
    """
    local = schedule.replicas // mesh.size
    replica_forward = _with_views(forward, views)
    scale_sum = 1 if not schedule.mean_reduction else schedule.accumulation * schedule.replicas

    def zero_gradients(params):
        """A zero gradient for each parameter the optimizer updates, in its accumulation dtype."""
        return {name: jnp.zeros(params[name].shape, rule.accum_dtype) for name in rule.names}

    def micro_step(params, buffers, inputs, key, replica, loss_scale):
        """Gradients for the parameters the optimizer updates (``rule.names``) only."""
        def scaled_loss(trained):
            outputs, new_buffers, logs = replica_forward({**params, **trained}, buffers, inputs, key, replica)
            arrays = layout.split(outputs)
            return arrays[loss_index] * loss_scale, (arrays, new_buffers, logs)

        trained = {name: params[name] for name in rule.names}
        (_, aux), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trained)
        return grads, aux

    def replica_step(params, buffers, inputs, keys, loss_scale):
        """All local replicas on one micro-batch each, from the same weights: vmapped, or a plain
        call when a device holds one replica (XLA:CPU keeps its fast convolution layouts then)."""
        replicas = replica_ids(local, mesh.size)
        if local == 1:
            first = jax.tree.map(lambda x: x[0], (inputs, keys, replicas))
            own = jax.tree.map(lambda x: x[0], buffers) if schedule.per_replica_buffers else buffers
            result = micro_step(params, own, *first, loss_scale)
            return jax.tree.map(lambda y: y[None], result)
        return jax.vmap(micro_step, in_axes=(None, _buffers_axis(schedule), 0, 0, 0, None))(
            params, buffers, inputs, keys, replicas, loss_scale)

    def iteration(carry, xs):
        params, buffers, opt_state, scaler, carried, _ = carry
        inputs, key, *row = xs                             # inputs: [A, r, m, ...]
        hyper = row[0] if row else carried                 # this iteration's, when given per iteration
        loss_scale = scaler["scale"] if schedule.dynamic_loss_scaling else rule.loss_scale(hyper)

        def accumulate(acc, micro):
            grads_sum, buffers = acc
            micro_inputs, index = micro
            keys = replica_keys(jax.random.fold_in(key, index), local, mesh.size)
            grads, (arrays, new_buffers, logs) = replica_step(params, buffers, micro_inputs, keys, loss_scale)
            grads_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype).sum(0), grads_sum, grads)
            return (grads_sum, next_buffers(new_buffers, schedule, local, mesh.size)), (arrays, logs)

        indices = jnp.arange(schedule.accumulation)
        (grads_sum, buffers), ys = _loop(accumulate, (zero_gradients(params), buffers), (inputs, indices),
                                         schedule.accumulation)
        # times the reciprocal, which XLA fuses into each update reading the gradient, where a
        # quotient gets a kernel and a buffer per parameter; exact for powers of two
        unscale = 1 / (scale_sum * loss_scale)
        grads = jax.tree.map(lambda g: g * unscale, replica_sum(grads_sum, mesh.size))
        new_params, new_opt_state = optimizer_update(rule, grads, opt_state, params, hyper,
                                            jax.random.fold_in(key, schedule.accumulation), schedule)
        if schedule.dynamic_loss_scaling:
            (new_params, new_opt_state), scaler = _apply_if_finite(
                grads, scaler, (new_params, new_opt_state), (params, opt_state))
        kept = {name: g.astype(rule.accum_dtype) for name, g in grads.items()} if keep_gradients else None
        return (new_params, buffers, new_opt_state, scaler, carried, kept), ys

    def device_program(state, inputs, hyper, key, index):
        keys = iteration_keys(call_key(key, index), schedule.device_iterations)
        params = state["params"]
        kept = zero_gradients(params) if keep_gradients else None
        per_iteration = schedule.hyperparameters_per_iteration
        carry = (params, state["buffers"], state["opt"], state["scaler"], None if per_iteration else hyper, kept)
        xs = (inputs, keys, hyper) if per_iteration else (inputs, keys)
        (params, buffers, opt_state, scaler, _, kept), (arrays, logs) = device_loop(
            iteration, carry, xs, schedule, totals or {})
        new_state = {"params": params, "buffers": buffers, "opt": opt_state, "scaler": scaler}
        return ({**new_state, "grads": kept} if keep_gradients else new_state), arrays, logs

    state_spec = _state_spec(schedule, training=True)
    sharded = per_device(device_program, mesh, in_specs=(state_spec, P(None, None, REPLICA), P(), P(), P()),
                         out_specs=(state_spec, P(REPLICA), P(REPLICA)))
    return jax.jit(sharded, donate_argnums=(0,))


def inference_call(forward: Callable, schedule: Schedule, mesh, layout: OutputLayout,
                   totals: dict | None = None, views: Callable | None = None) -> Callable:
    """``call(state, inputs, key, index) -> (state, outputs, logs)``: D iterations of the forward on R
    replicas (``totals`` and ``views`` as for :func:`training_call`)."""
    local = schedule.replicas // mesh.size
    one_replica = _with_views(forward, views)

    def device_program(state, inputs, key, index):
        params = state["params"]

        def replica_forward(buffers, micro_inputs, replica_key, replica):
            outputs, new_buffers, logs = one_replica(params, buffers, micro_inputs, replica_key, replica)
            return (layout.split(outputs), logs), new_buffers

        def iteration(buffers, xs):
            micro_inputs, key = xs                       # micro_inputs: [1, r, m, ...]
            arrays, new_buffers = jax.vmap(replica_forward, in_axes=(_buffers_axis(schedule), 0, 0, 0))(
                buffers, jax.tree.map(lambda x: x[0], micro_inputs), replica_keys(key, local, mesh.size),
                replica_ids(local, mesh.size))
            return next_buffers(new_buffers, schedule, local, mesh.size), jax.tree.map(lambda y: y[None], arrays)

        keys = iteration_keys(call_key(key, index), schedule.device_iterations)
        buffers, (arrays, logs) = device_loop(iteration, state["buffers"], (inputs, keys), schedule,
                                              totals or {})
        return {"params": params, "buffers": buffers}, arrays, logs

    state_spec = _state_spec(schedule, training=False)
    sharded = per_device(device_program, mesh, in_specs=(state_spec, P(None, None, REPLICA), P(), P()),
                         out_specs=(state_spec, P(REPLICA), P(REPLICA)))
    return jax.jit(sharded)
