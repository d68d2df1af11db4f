"""Multi-IPU execution: each stage of a partitioned model on its own emulated IPU, pipelined or
sharded, with the numbers of single-IPU training.

Shape: one compiled program per stage and role on the stage's devices (one device per replica:
replica ``r`` of IPU ``i`` is JAX device ``r · num_ipus + i``), driven by a host loop that
only dispatches — every computation, gradient accumulation included, happens inside the stage
programs, so the host never waits and stages on different devices overlap.

* ``forward``: a micro-batch through one stage; returns what later stages read, the stage's
  outputs, its new buffers and the *stash*: the residuals of ``jax.vjp`` that the backward pass
  needs. Residuals that depend only on the stage's weights (the weights themselves, their
  transposes) are not stashed: ``backward`` recomputes them from the weights, so a stashed
  micro-batch holds activations only.
* ``backward``: the stashed residuals and the cotangents sent back by later stages give the
  gradients, added to the stage's accumulator, and the cotangents of what the stage received.
* ``forward_backward``: the last stage runs both at once (PopART's last pipeline stage does too).
* ``update``: the stage's optimizer step on its own parameters, from its accumulated gradients.

With recomputation (``opts._Popart.set("autoRecomputation", 3)``) the stage function is wrapped
in ``jax.checkpoint`` saving only ``recomputationCheckpoint`` values: a stash then holds the
stage's inputs and checkpoints, and ``backward`` recomputes the rest.

Pipelined training follows Graphcore's schedule: with S stages a step has 2S−1 pipeline stages
(the forward of each IPU, then the backward of all but the last); micro-batch ``m`` reaches
pipeline stage ``p`` at cycle ``m + p``, so IPU ``k`` runs the forward of micro-batch ``t − k``
and the backward of micro-batch ``t − (2S − 2 − k)`` at cycle ``t`` (ramp-up, a steady state
where every IPU alternates forward and backward, ramp-down). Sharded execution runs one
micro-batch at a time through every stage and back.
"""

import copy
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.extend.core import Literal
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.blocks import RECOMPUTATION_CHECKPOINT_NAME, PipelinedExecution, ShardedExecution
from ipu_backend.compiler import capture
from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.lowerings.linalg import MATRIX_PRODUCT_NAME
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX
from ipu_backend.errors import Error
from ipu_backend.runtime import memory
from ipu_backend.runtime.clipping import GradientClipping, norm_coefficient
from ipu_backend.runtime.stages import (
    Partition,
    StagePlan,
    partition,
    run_stage,
    sources_from_export,
    sources_from_program,
)
from ipu_backend.runtime.step import (
    REPLICA,
    OutputLayout,
    Schedule,
    call_key,
    initial_scaler,
    master_copy,
    next_scaler,
    optimizer_update,
)
from ipu_backend.runtime.xla_compile import compile_lowered

_RECOMPUTE_STAGES = (3, 4)      # PopART RecomputationType.Pipeline and RecomputeAll
_RECOMPUTE_STANDARD = 1         # RecomputationType.Standard: keep matrix products, recompute the rest

_call_key = jax.jit(call_key)
"""A call's random key, made once for all its stages (one dispatch where eager ``fold_in`` costs a dozen)."""


# --- schedules ---------------------------------------------------------------------------------
def training_order(micro_batches: int, stages: int, pipelined: bool) -> list[tuple[str, int, int]]:
    """``(role, stage, micro_batch)`` in dispatch order for one optimizer step; role is ``"F"``
    (forward), ``"B"`` (backward) or ``"FB"`` (the last stage's forward and backward)."""
    last = stages - 1
    if not pipelined:
        return [event for m in range(micro_batches)
                for event in ([("F", k, m) for k in range(last)] + [("FB", last, m)] +
                              [("B", k, m) for k in reversed(range(last))])]
    order = []
    for cycle in range(micro_batches + 2 * stages - 2):
        for k in range(stages):
            m = cycle - k
            if 0 <= m < micro_batches:
                order.append(("FB" if k == last else "F", k, m))
        for k in reversed(range(last)):
            m = cycle - (2 * stages - 2 - k)
            if 0 <= m < micro_batches:
                order.append(("B", k, m))
    return order


def inference_order(micro_batches: int, stages: int, pipelined: bool) -> list[tuple[int, int]]:
    """``(stage, micro_batch)`` forwards in dispatch order."""
    if not pipelined:
        return [(k, m) for m in range(micro_batches) for k in range(stages)]
    return [(k, cycle - k) for cycle in range(micro_batches + stages - 1) for k in range(stages)
            if 0 <= cycle - k < micro_batches]


def stashed_micro_batches(stage: int, stages: int, pipelined: bool) -> int:
    """Micro-batches whose stash stage ``stage`` holds at once (its forward runs ahead of its
    backward by 2(S−1−k) cycles in a pipeline)."""
    if stage == stages - 1:
        return 0
    return 2 * (stages - 1 - stage) + 1 if pipelined else 1


# --- helpers -----------------------------------------------------------------------------------
def _aval(node: torch.fx.Node) -> jax.ShapeDtypeStruct:
    val = node.meta["val"]
    return jax.ShapeDtypeStruct(tuple(val.shape), jax_dtype(val.dtype))


def _is_float(node: torch.fx.Node) -> bool:
    return node.meta["val"].dtype.is_floating_point


def _expand(tree):
    """Per-device values → ``[1, ...]`` blocks of the replica-sharded global arrays."""
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _from_replica_zero(tree):
    """Replica 0's buffers on every replica (PopTorch's broadcastBuffers), as the single-IPU step."""
    is_zero = jax.lax.axis_index(REPLICA) == 0
    return jax.tree.map(lambda x: jax.lax.psum(jnp.where(is_zero, x, jnp.zeros_like(x)), REPLICA)
                        .astype(x.dtype), tree)


def _weight_only(jaxpr, weight_leaves: int) -> list[bool]:
    """For each output of ``jaxpr``: whether it depends only on its first ``weight_leaves`` inputs
    (and constants), not on the per-micro-batch data that follows them."""
    dependent = set(jaxpr.invars[weight_leaves:])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, Literal) or v not in dependent for v in jaxpr.outvars]


def _merge(dicts) -> dict:
    return {name: value for d in dicts for name, value in d.items()}


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def _temporaries(compiled) -> int:
    analysis = compiled.memory_analysis()
    return 0 if analysis is None else int(analysis.temp_size_in_bytes)


def _stage_rule(rule, names: set):
    """The optimizer rule restricted to one stage's parameters (its update and state for them)."""
    part = copy.copy(rule)
    part.groups = tuple(tuple(n for n in group if n in names) for group in rule.groups)
    part.names = tuple(n for n in rule.names if n in names)
    return part


@dataclass(frozen=True)
class _Settings:
    training: bool
    pipelined: bool
    schedule: Schedule
    loss_index: int | None
    recompute: int                  # 0: off, RecomputationType value otherwise
    offload: bool
    stages: int
    clipping: GradientClipping | None = None    # Lightning's gradient_clip_val
    clip_max_grad_norm: bool = False            # the optimizer's max_grad_norm is finite
    half_params: tuple[str, ...] = ()           # the model's half-precision weights (rounding keys)

    @property
    def global_norm(self) -> bool:
        """Whether the update needs the 2-norm of every stage's gradients together."""
        return self.clip_max_grad_norm or (self.clipping is not None and self.clipping.algorithm == "norm")


class _Stage:
    """One stage on its devices: its programs, traced from the partitioned graph."""

    def __init__(self, part: Partition, plan: StagePlan, devices, settings: _Settings, params, buffers,
                 input_avals: dict, static_inputs: dict, rule):
        self.part, self.plan, self.settings = part, plan, settings
        self.mesh = Mesh(np.array(devices), (REPLICA,))
        self.rep = NamedSharding(self.mesh, P())
        self.data = NamedSharding(self.mesh, P(REPLICA))
        self.batch = NamedSharding(self.mesh, P(None, None, REPLICA))
        self.opt_sharding = self.rep.with_memory_kind("pinned_host") if settings.offload else self.rep
        nodes = {n.name: n for n in part.graph_module.graph.nodes}
        self.float_received = tuple(n for n in plan.received if _is_float(nodes[n]))
        self.other_received = tuple(n for n in plan.received if not _is_float(nodes[n]))
        self.float_sent = tuple(n for n in plan.sent if _is_float(nodes[n]))
        self.other_sent = tuple(n for n in plan.sent if not _is_float(nodes[n]))
        self.received_avals = {n: _aval(nodes[n]) for n in plan.received}
        self.sent_avals = {n: _aval(nodes[n]) for n in plan.sent}
        self.has_loss = settings.training and settings.loss_index in plan.outputs
        if self.has_loss:
            self.loss_dtype = _aval(part.array_outputs[settings.loss_index]).dtype
        self.param_avals = {n: jax.ShapeDtypeStruct(params[n].shape, params[n].dtype) for n in plan.params}
        self.owned_avals = {n: self.param_avals[n] for n in plan.owned}
        self.buffer_avals = {n: jax.ShapeDtypeStruct(buffers[n].shape, buffers[n].dtype) for n in plan.buffers}
        self.input_avals = {i: input_avals[i] for i in plan.inputs if i in input_avals}
        self.static_inputs = {i: static_inputs[i] for i in plan.inputs if i in static_inputs}
        self.rule = None if rule is None else _stage_rule(rule, set(plan.owned))
        self._treedef = None
        self._indices: list[jax.Array] = []
        self.weight_only = None
        self.stash_avals = None
        self.lenders = {n: readers for n in plan.owned
                        if (readers := tuple(s.index for s in part.stages if n in s.borrowed))}
        """Tied weights this stage owns → the other stages reading them (whose gradients it adds)."""

    # --- the stage function --------------------------------------------------------------------
    def _micro(self, inputs, key, d, a):
        """This micro-batch's inputs and random key, as the single-IPU step derives them."""
        micro = {i: x[d, a, 0] for i, x in inputs.items()}
        key = jax.random.fold_in(key, d)
        if self.settings.training:
            key = jax.random.fold_in(key, a)
        return micro, jax.random.fold_in(key, jax.lax.axis_index(REPLICA))

    def _run(self, params, buffers, received, inputs, key):
        """The stage's graph; non-tensor arguments are constants of the program."""
        return run_stage(self.part, self.plan, params, buffers, received, {**inputs, **self.static_inputs}, key)

    def _primal(self, params, received_float, rest):
        """The differentiated part: ``(values sent on that are floats, loss)``, the rest as aux."""
        buffers, received_other, inputs, key = rest
        sent, outputs, new_buffers = self._run(params, buffers, {**received_float, **received_other}, inputs, key)
        loss = outputs[self.settings.loss_index] if self.has_loss else ()
        return ({n: sent[n] for n in self.float_sent}, loss), \
            ({n: sent[n] for n in self.other_sent}, outputs, new_buffers)

    def _vjp(self, params, received_float, rest):
        fn = self._primal
        recompute = self.settings.recompute
        if recompute in _RECOMPUTE_STAGES:
            fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(
                RECOMPUTATION_CHECKPOINT_NAME))
        elif recompute == _RECOMPUTE_STANDARD:
            fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(RECOMPUTATION_CHECKPOINT_NAME,
                                                              MATRIX_PRODUCT_NAME)))
        return jax.vjp(lambda p, r: fn(p, r, rest), params, received_float, has_aux=True)

    def _residuals(self, params, data):
        _, vjp_fn, _ = self._vjp(params, *data)
        leaves, self._treedef = jax.tree.flatten(vjp_fn)
        return leaves

    def _data_avals(self):
        received_float = {n: self.received_avals[n] for n in self.float_received}
        received_other = {n: self.received_avals[n] for n in self.other_received}
        inputs = {i: jax.ShapeDtypeStruct(a.shape[3:], a.dtype) for i, a in self.input_avals.items()}
        key = jax.eval_shape(lambda: jax.random.key(0))
        return received_float, (self.buffer_avals, received_other, inputs, key)

    def analyse_residuals(self) -> None:
        """Which residuals depend on the weights only (recomputed, not stashed)."""
        closed = jax.make_jaxpr(self._residuals)(self.param_avals, self._data_avals())
        self.weight_only = _weight_only(closed.jaxpr, len(jax.tree.leaves(self.param_avals)))
        self.stash_avals = [v.aval for v, w in zip(closed.jaxpr.outvars, self.weight_only) if not w]

    def _rebuild_vjp(self, params, stash):
        """The vjp function from the stash and the weight-only residuals recomputed."""
        dummy = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct)
                             and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a,
                             self._data_avals())
        received_float, (buffers, received_other, inputs, _) = dummy
        full = self._residuals(params, (received_float, (buffers, received_other, inputs, jax.random.key(0))))
        stashed = iter(stash)
        leaves = [leaf if weight else next(stashed) for leaf, weight in zip(full, self.weight_only)]
        return jax.tree.unflatten(self._treedef, leaves)

    def _loss_cotangent(self, scale):
        return jnp.asarray(scale, self.loss_dtype) if self.has_loss else ()

    # --- program bodies (per device, inside shard_map) -------------------------------------------
    def _forward_body(self, params, buffers, received, inputs, key, d, a):
        micro, key = self._micro(inputs, key, d, a)
        received = _squeeze(received)
        received_float = {n: received[n] for n in self.float_received}
        rest = (buffers, {n: received[n] for n in self.other_received}, micro, key)
        (sent_float, _), vjp_fn, (sent_other, outputs, new_buffers) = self._vjp(params, received_float, rest)
        leaves = jax.tree.leaves(vjp_fn)
        stash = [leaf for leaf, weight in zip(leaves, self.weight_only) if not weight]
        return (_expand({**sent_float, **sent_other}), _expand(outputs), self._replica_zero(new_buffers),
                _expand(stash))

    def _backward_body(self, acc, params, stash, cotangents, scale):
        vjp_fn = self._rebuild_vjp(params, _squeeze(stash))
        cotangents = {n: sum(_squeeze(cts)) for n, cts in cotangents.items()}
        grads, received_cts = vjp_fn(({n: cotangents[n] for n in self.float_sent},
                                      self._loss_cotangent(scale)))
        return self._accumulate(acc, grads), _expand(received_cts)

    def _forward_backward_body(self, acc, params, buffers, received, inputs, key, d, a, scale):
        micro, key = self._micro(inputs, key, d, a)
        received = _squeeze(received)
        received_float = {n: received[n] for n in self.float_received}
        rest = (buffers, {n: received[n] for n in self.other_received}, micro, key)
        _, vjp_fn, (_, outputs, new_buffers) = self._vjp(params, received_float, rest)
        grads, received_cts = vjp_fn(({}, self._loss_cotangent(scale)))
        return (self._accumulate(acc, grads), _expand(outputs), self._replica_zero(new_buffers),
                _expand(received_cts))

    def _infer_body(self, params, buffers, received, inputs, key, d):
        micro, key = self._micro(inputs, key, d, 0)
        sent, outputs, new_buffers = self._run(params, buffers, _squeeze(received), micro, key)
        return _expand(sent), _expand(outputs), self._replica_zero(new_buffers)

    def _gradients(self, acc, lent, loss_scale, names):
        """The step's gradients of the unscaled loss for ``names``: a tied weight's from every
        stage reading it (``lent``: the other stages' accumulators), summed over replicas,
        averaged as asked."""
        schedule = self.settings.schedule
        scale_sum = schedule.accumulation * schedule.replicas if schedule.mean_reduction else 1
        return {n: jax.lax.psum((acc[n] + sum(lent.get(n, ())))[0], REPLICA) / (scale_sum * loss_scale)
                for n in names}

    def _value_clipped(self, grads):
        clipping = self.settings.clipping
        if clipping is None or clipping.algorithm != "value":
            return grads
        return clipping(grads, self.rule.names)

    def _norm_body(self, acc, lent, scaler):
        """The squared 2-norm of the gradients this stage updates (after clipping by value):
        every stage's together give the global norm that clipping by norm needs."""
        grads = self._value_clipped(self._gradients(acc, lent, scaler["scale"], self.plan.owned))
        return sum((jnp.sum(jnp.square(grads[n].astype(jnp.float32))) for n in self.rule.names),
                   jnp.zeros((), jnp.float32))

    def _clipped(self, grads, norms, hyper):
        """Gradient clipping as on one IPU (Lightning's first, then the optimizer's
        max_grad_norm), by the norm over every stage's gradients."""
        grads = self._value_clipped(grads)
        if not self.settings.global_norm:
            return grads
        total = jnp.sqrt(sum(norms))
        factor = jnp.ones((), jnp.float32)
        clipping = self.settings.clipping
        if clipping is not None and clipping.algorithm == "norm":
            factor = norm_coefficient(clipping.value, total)
        if self.settings.clip_max_grad_norm:
            factor = factor * norm_coefficient(hyper["max_grad_norm"], total * factor)
        return {n: (g * factor).astype(g.dtype) if n in self.rule.names else g for n, g in grads.items()}

    def _update_body(self, params, opt, acc, hyper, key, d, scaler, finites, norms, lent):
        """The optimizer step of the parameters this stage owns. Clipping by norm has been done
        (over every stage) when the rule sees the gradients, so its own max_grad_norm is off;
        the random key is the single-IPU step's (stochastic rounding). With dynamic loss scaling,
        every stage skips the step when any stage's gradients overflowed."""
        schedule = self.settings.schedule
        grads = self._clipped(self._gradients(acc, lent, scaler["scale"], self.plan.owned), norms, hyper)
        key = jax.random.fold_in(jax.random.fold_in(key, d), schedule.accumulation)
        new_params, new_opt = optimizer_update(self.rule, grads, opt, params, {**hyper, "max_grad_norm": jnp.inf},
                                               key, schedule, self.settings.half_params)
        if schedule.dynamic_loss_scaling:
            finite = jnp.all(jnp.stack(finites))
            new_params, new_opt = jax.tree.map(lambda n, o: jnp.where(finite, n, o), (new_params, new_opt),
                                               (params, opt))
            scaler = next_scaler(scaler, finite)
        return new_params, new_opt, jax.tree.map(jnp.zeros_like, acc), scaler

    def _finite_body(self, acc, scaler):
        """Whether this stage's gradients are finite (dynamic loss scaling)."""
        grads = self._gradients(acc, {}, scaler["scale"], acc)
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads.values()] or [jnp.bool_(True)]))

    def _accumulate(self, acc, grads):
        return {n: acc[n] + grads[n].astype(acc[n].dtype)[None] for n in acc}

    def _replica_zero(self, buffers):
        return _from_replica_zero(buffers) if self.settings.schedule.replicas > 1 else buffers

    # --- compiled programs -----------------------------------------------------------------------
    def _global(self, avals: dict, sharding) -> dict:
        replicas = self.settings.schedule.replicas
        return {k: jax.ShapeDtypeStruct((replicas, *a.shape), a.dtype, sharding=sharding)
                for k, a in avals.items()}

    def _on(self, avals, sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), avals)

    def _spmd(self, body, in_specs, out_specs, donate, args, out_shardings=None):
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False)
        jitted = jax.jit(mapped, donate_argnums=donate) if out_shardings is None else \
            jax.jit(mapped, donate_argnums=donate, out_shardings=out_shardings)
        return compile_lowered(jitted.lower(*args))

    def compile(self, hyper_avals) -> dict:
        """Compile this stage's programs; returns each one's temporaries (bytes)."""
        params = self._on(self.param_avals, self.rep)
        buffers = self._on(self.buffer_avals, self.rep)
        received = self._global(self.received_avals, self.data)
        inputs = {i: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.batch)
                  for i, a in self.input_avals.items()}
        key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=self.rep)
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.rep)
        scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.rep)
        self.programs = {}
        if not self.settings.training:
            self.programs["infer"] = self._spmd(
                self._infer_body, (P(), P(), P(REPLICA), P(None, None, REPLICA), P(), P()),
                (P(REPLICA), P(REPLICA), P()), (1,), (params, buffers, received, inputs, key, index))
            return {name: _temporaries(p) for name, p in self.programs.items()}
        hyper = self._on(hyper_avals, self.rep)
        acc = self._on(self.zero_accumulator_avals(), self.data)
        last = self.plan.index == self.settings.stages - 1
        if last:
            self.programs["forward_backward"] = self._spmd(
                self._forward_backward_body,
                (P(REPLICA), P(), P(), P(REPLICA), P(None, None, REPLICA), P(), P(), P(), P()),
                (P(REPLICA), P(REPLICA), P(), P(REPLICA)), (0, 2),
                (acc, params, buffers, received, inputs, key, index, index, scale))
        else:
            self.analyse_residuals()
            stash = [jax.ShapeDtypeStruct((self.settings.schedule.replicas, *a.shape), a.dtype,
                                          sharding=self.data) for a in self.stash_avals]
            cotangents = {n: [jax.ShapeDtypeStruct((self.settings.schedule.replicas, *self.sent_avals[n].shape),
                                                   self.sent_avals[n].dtype, sharding=self.data)] * len(
                self.part.consumers[n]) for n in self.float_sent}
            self.programs["forward"] = self._spmd(
                self._forward_body, (P(), P(), P(REPLICA), P(None, None, REPLICA), P(), P(), P()),
                (P(REPLICA), P(REPLICA), P(), P(REPLICA)), (1,),
                (params, buffers, received, inputs, key, index, index))
            self.programs["backward"] = self._spmd(
                self._backward_body, (P(REPLICA), P(), P(REPLICA), P(REPLICA), P()),
                (P(REPLICA), P(REPLICA)), (0,), (acc, params, stash, cotangents, scale))
        owned = self._on(self.owned_avals, self.rep)
        opt = self._on(self.opt_avals(), self.opt_sharding)
        dynamic = self.settings.schedule.dynamic_loss_scaling
        scaler = self._on(jax.eval_shape(initial_scaler) if dynamic else {"scale": scale}, self.rep)
        stages = self.settings.stages
        finites = [jax.ShapeDtypeStruct((), jnp.bool_, sharding=self.rep)] * (stages if dynamic else 0)
        norms = [jax.ShapeDtypeStruct((), jnp.float32, sharding=self.rep)] * (
            stages if self.settings.global_norm else 0)
        lent = {n: [acc[n]] * len(lenders) for n, lenders in self.lenders.items()}
        if dynamic:
            self.programs["finite"] = self._spmd(self._finite_body, (P(REPLICA), P()), P(), (), (acc, scaler))
        if self.settings.global_norm:
            self.programs["norm"] = self._spmd(self._norm_body, (P(REPLICA), P(REPLICA), P()), P(), (),
                                               (acc, lent, scaler))
        self.programs["update"] = self._update_program(
            self._update_body, (P(), P(), P(REPLICA), P(), P(), P(), P(), P(), P(), P(REPLICA)),
            (P(), P(), P(REPLICA), P()), (self.rep, self.opt_sharding, self.data, self.rep),
            (owned, opt, acc, hyper, key, index, scaler, finites, norms, lent))
        return {name: _temporaries(p) for name, p in self.programs.items()}

    def opt_avals(self) -> dict:
        """The optimizer state of the parameters this stage owns (and their float32 master
        copies, with master weights)."""
        state = jax.eval_shape(self.rule.init, self.owned_avals)
        if not self.settings.schedule.master_weights:
            return state
        return {"rule": state, "master": jax.eval_shape(master_copy, self.owned_avals)}

    def _update_program(self, body, in_specs, out_specs, out_shardings, args):
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

        def update(params, opt, *rest):
            if self.settings.offload:        # streamed in for the update, back to the host after
                opt = jax.device_put(opt, jax.memory.Space.Device)
            return mapped(params, opt, *rest)

        return compile_lowered(jax.jit(update, donate_argnums=(0, 1, 2), out_shardings=out_shardings).lower(*args))

    def index(self, i: int) -> jax.Array:
        """Iteration or micro-batch index ``i`` on this stage's devices, transferred once and kept:
        the schedule loop then dispatches without a host-to-device copy."""
        while len(self._indices) <= i:
            self._indices.append(jax.device_put(np.int32(len(self._indices)), self.rep))
        return self._indices[i]

    def zero_accumulator_avals(self) -> dict:
        """Gradient accumulators: one per parameter and replica, in the optimizer's accum_type."""
        return {n: jax.ShapeDtypeStruct((self.settings.schedule.replicas, *a.shape), self.rule.accum_dtype)
                for n, a in self.param_avals.items()}

    def zero_accumulator(self) -> dict:
        return jax.device_put({n: np.zeros(a.shape, a.dtype) for n, a in self.zero_accumulator_avals().items()},
                              self.data)

    def stash_bytes(self) -> int:
        """Bytes one stashed micro-batch takes on one replica's IPU."""
        return 0 if self.stash_avals is None else _bytes(self.stash_avals)


class MultiIpuProgram:
    """What the executor runs for a model split over IPUs, in place of its single-IPU step:
    called with the executor's arguments, ``(state, inputs, hyper, key, index)`` in training and
    ``(state, inputs, key, index)`` in inference, it returns ``(state, outputs, logs)``.

    Its stage programs are compiled when it is built, so ``lower(...).compile()`` (the executor's
    ahead-of-time protocol, as ``jax.jit``'s) returns it unchanged.
    """

    def __init__(self, part: Partition, stages: list[_Stage], settings: _Settings, layout, output_dtypes,
                 rule, usage, tensor_leaves: list[int], log_names: tuple[str, ...], metric_states: dict):
        self.part, self.stages, self.settings = part, stages, settings
        self.layout, self.output_dtypes, self.rule = layout, output_dtypes, rule
        self.memory = usage
        """Per-IPU memory estimate (:class:`~ipu_backend.runtime.memory.IpuMemory`, one replica)."""
        self._tensor_leaves = tensor_leaves
        self._log_names = log_names
        self._metric_states = metric_states
        self._owner = {}
        for stage in stages:
            self._owner.update((n, stage) for n in stage.plan.owned + stage.plan.buffers)
        self.placement = {n: stage.plan.ipu for stage in stages for n in stage.plan.owned}
        """Parameter name → IPU (of the stage updating it, for a tied weight)."""

    def lower(self, *args) -> "MultiIpuProgram":
        return self

    def compile(self, compiler_options=None) -> "MultiIpuProgram":
        """Itself: its stage programs were compiled, with the runtime's options, when it was built."""
        return self

    def __call__(self, state, inputs, *rest):
        *rest, key, index = rest
        rest = (*rest, _call_key(key, index))
        state = self.place(state)
        if self.settings.training:
            state, arrays = self._train(state, inputs, *rest)
        else:
            state, arrays = self._infer(state, inputs, *rest)
        results = len(arrays) - len(self._log_names)
        logs = dict(zip(self._log_names, arrays[results:]))
        return state, arrays[:results], {**logs, **self._totals(logs)}

    # --- state ---------------------------------------------------------------------------------
    def _stage_of(self, name: str) -> "_Stage":
        return self._owner.get(name, self.stages[0])

    def place(self, state: dict) -> dict:
        """Each weight, buffer and optimizer state on its stage's devices (a no-op when it is)."""
        shardings = {"params": {n: self._stage_of(n).rep for n in state["params"]},
                     "buffers": {n: self._stage_of(n).rep for n in state["buffers"]}}
        if "opt" in state:
            shardings["opt"] = jax.tree.map(lambda n: self._stage_of(n).opt_sharding, self._opt_names(state["opt"]))
            shardings["scaler"] = None
        return jax.device_put(state, shardings)

    def _opt_names(self, opt: dict):
        """The optimizer state's structure down to parameter names (state of a parameter, or its
        master copy, goes where the parameter goes)."""
        if self.settings.schedule.master_weights:
            return {"rule": {n: n for n in opt["rule"]}, "master": {n: n for n in opt["master"]}}
        return {n: n for n in opt}

    def _stage_opt(self, opt: dict, stage: "_Stage") -> dict:
        def pick(tree):
            return {n: tree[n] for n in stage.plan.owned if n in tree}

        if self.settings.schedule.master_weights:
            return {"rule": pick(opt["rule"]), "master": pick(opt["master"])}
        return pick(opt)

    def _merged_opt(self, opts: list) -> dict:
        if self.settings.schedule.master_weights:
            return {"rule": _merge(o["rule"] for o in opts), "master": _merge(o["master"] for o in opts)}
        return _merge(opts)

    def _stage_params(self, state: dict) -> list[dict]:
        """Each stage's parameters on its devices: a tied weight's copy too."""
        return [{n: state["params"][n] if n not in s.plan.borrowed else jax.device_put(state["params"][n], s.rep)
                 for n in s.plan.params} for s in self.stages]

    def _owned_params(self, params: list[dict]) -> dict:
        return _merge({n: p[n] for n in s.plan.owned} for s, p in zip(self.stages, params))

    def _user_inputs(self, inputs: list) -> list[dict]:
        """The executor's tensor inputs (``[D, A, R, m, ...]`` each) on the stages reading them."""
        arrays = dict(zip(self._tensor_leaves, inputs))
        return [{i: jax.device_put(arrays[i], stage.batch) for i in stage.input_avals} for stage in self.stages]

    # --- outputs -------------------------------------------------------------------------------
    def _totals(self, logs: dict) -> dict:
        """Logged metric states reduced over the call's micro-batches (``[R, D, A, ...]``, all of
        them returned: see :func:`_check_metric_states`) to ``[R, 1, 1, ...]``."""
        return {name + TOTAL_SUFFIX: _HOST_REDUCE[how](logs[name], axis=(1, 2), keepdims=True)
                for name, how in self._metric_states.items()}

    def _wanted(self, d: int, m: int, micro_batches: int) -> bool:
        mode = self.settings.schedule.output_mode
        last_micro = m == micro_batches - 1
        if mode in ("all", "sum"):
            return True
        if mode == "every_n":
            return last_micro and (d + 1) % self.settings.schedule.output_period == 0
        return last_micro and d == self.settings.schedule.device_iterations - 1

    def _gather_outputs(self, collected: dict) -> list[np.ndarray]:
        """``[R, D', A', ...]`` per array output from ``{(d, m): {output index: [R, ...]}}``."""
        host = jax.device_get(collected)
        rows = sorted({d for d, _ in host})
        columns = sorted({m for _, m in host})
        arrays = []
        for index in range(len(self.part.array_outputs)):
            stacked = np.stack([np.stack([host[d, m][index] for m in columns]) for d in rows])
            if self.settings.schedule.output_mode == "sum":
                stacked = stacked.sum(axis=(0, 1), keepdims=True, dtype=stacked.dtype)
            arrays.append(np.moveaxis(stacked, 2, 0))
        return arrays

    # --- training ----------------------------------------------------------------------------
    def _train(self, state, inputs, hyper, key):
        schedule, stages = self.settings.schedule, self.stages
        params = self._stage_params(state)
        buffers = [{n: state["buffers"][n] for n in s.plan.buffers} for s in stages]
        opt = [self._stage_opt(state["opt"], s) for s in stages]
        user = self._user_inputs(inputs)
        keys = [jax.device_put(key, s.rep) for s in stages]
        hypers = [jax.device_put(hyper, s.rep) for s in stages]
        dynamic = schedule.dynamic_loss_scaling
        scalers = [jax.device_put(state["scaler"] if dynamic else {"scale": self.rule.loss_scale(hyper)}, s.rep)
                   for s in stages]
        accs = [s.zero_accumulator() for s in stages]
        order = training_order(schedule.accumulation, len(stages), self.settings.pipelined)
        collected = {}
        for d in range(schedule.device_iterations):
            received = defaultdict(dict)                          # (stage, micro) -> name -> value
            cotangents = defaultdict(lambda: defaultdict(list))   # (stage, micro) -> name -> [ct]
            stash = {}
            for role, k, m in order:
                program = stages[k].programs
                if role == "F":
                    sent, outputs, buffers[k], stash[k, m] = program["forward"](
                        params[k], buffers[k], received.pop((k, m), {}), user[k], keys[k],
                        stages[k].index(d), stages[k].index(m))
                    self._send(sent, m, received)
                elif role == "FB":
                    accs[k], outputs, buffers[k], received_cts = program["forward_backward"](
                        accs[k], params[k], buffers[k], received.pop((k, m), {}), user[k], keys[k],
                        stages[k].index(d), stages[k].index(m), scalers[k]["scale"])
                    self._send_back(received_cts, m, cotangents)
                else:
                    accs[k], received_cts = program["backward"](
                        accs[k], params[k], stash.pop((k, m)), dict(cotangents.pop((k, m), {})),
                        scalers[k]["scale"])
                    self._send_back(received_cts, m, cotangents)
                    continue
                if outputs and self._wanted(d, m, schedule.accumulation):
                    collected.setdefault((d, m), {}).update(outputs)
            self._update(params, opt, accs, hypers, keys, scalers, d)
        new_state = {"params": self._owned_params(params), "buffers": _merge(buffers),
                     "opt": self._merged_opt(opt), "scaler": scalers[0] if dynamic else state["scaler"]}
        return new_state, self._gather_outputs(collected)

    def _update(self, params, opt, accs, hypers, keys, scalers, d: int) -> None:
        """Every stage's optimizer step, in place of the lists it is given. A stage owning a tied
        weight receives the other stages' gradients of it first and sends them the new value after;
        the stages exchange what their updates need of each other (whether all gradients are
        finite, their squared norms) as scalars."""
        stages = self.stages
        lent = [{n: [jax.device_put(accs[j][n], s.data) for j in lenders] for n, lenders in s.lenders.items()}
                for s in stages]
        finites = [s.programs["finite"](accs[k], scalers[k]) for k, s in enumerate(stages) if "finite" in s.programs]
        norms = [s.programs["norm"](accs[k], lent[k], scalers[k]) for k, s in enumerate(stages)
                 if "norm" in s.programs]
        for k, stage in enumerate(stages):
            owned, opt[k], accs[k], scalers[k] = stage.programs["update"](
                {n: params[k][n] for n in stage.plan.owned}, opt[k], accs[k], hypers[k], keys[k],
                stage.index(d), scalers[k], [jax.device_put(f, stage.rep) for f in finites],
                [jax.device_put(norm, stage.rep) for norm in norms], lent[k])
            params[k].update(owned)
        for k, stage in enumerate(stages):
            for n in stage.plan.borrowed:
                params[k][n] = jax.device_put(params[self._owner[n].plan.index][n], stage.rep)

    def _send(self, sent: dict, m: int, received) -> None:
        for name, value in sent.items():
            for reader in self.part.consumers[name]:
                received[reader, m][name] = jax.device_put(value, self.stages[reader].data)

    def _send_back(self, received_cts: dict, m: int, cotangents) -> None:
        for name, ct in received_cts.items():
            producer = self.part.producer[name]
            cotangents[producer, m][name].append(jax.device_put(ct, self.stages[producer].data))

    # --- inference ---------------------------------------------------------------------------
    def _infer(self, state, inputs, key):
        schedule, stages = self.settings.schedule, self.stages
        params = self._stage_params(state)
        buffers = [{n: state["buffers"][n] for n in s.plan.buffers} for s in stages]
        user = self._user_inputs(inputs)
        keys = [jax.device_put(key, s.rep) for s in stages]
        received = defaultdict(dict)
        collected = {}
        for k, d in inference_order(schedule.device_iterations, len(stages), self.settings.pipelined):
            sent, outputs, buffers[k] = stages[k].programs["infer"](
                params[k], buffers[k], received.pop((k, d), {}), user[k], keys[k], stages[k].index(d))
            self._send(sent, d, received)
            if outputs and self._wanted(d, 0, 1):
                collected.setdefault((d, 0), {}).update(outputs)
        return {"params": self._owned_params(params), "buffers": _merge(buffers)}, self._gather_outputs(collected)


_HOST_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def multi_ipu_program(executor) -> MultiIpuProgram | None:
    """The multi-IPU program an executor last compiled (its placement and memory figures), or
    None for a single-IPU model or before the first compilation."""
    compiled = next(reversed(executor._compiled.values()), None) if executor._compiled else None
    call = getattr(compiled, "call", None)
    return call if isinstance(call, MultiIpuProgram) else None


# --- building ----------------------------------------------------------------------------------
def check_ipu_count(num_ipus: int, auto_round: bool) -> int:
    """PopTorch reserves a power of two IPUs: the count to reserve (rounded when allowed)."""
    rounded = 1 << max(0, num_ipus - 1).bit_length()
    if rounded == num_ipus:
        return num_ipus
    common = ", because PopTorch must reserve a power of 2 or maximum of 64 IPUs per process"
    if not auto_round:
        raise Error(f"The model specifies the use of {num_ipus} IPUs, however PopTorch must reserve a "
                    f"minimum of {rounded} in order to allow the model to run{common}. Please "
                    "reconfigure your model to use a different number of IPUs or set "
                    "poptorch.Options().autoRoundNumIPUs(True).")
    warnings.warn(f"Reserving {rounded} IPUs when the model specifies the use of only {num_ipus}"
                  f"{common}. {rounded - num_ipus} will be reserved but not used.", stacklevel=4)
    return rounded


def _strategy(options) -> PipelinedExecution:
    strategy = options.execution_strategy
    if strategy is None:
        return PipelinedExecution()
    if not isinstance(strategy, PipelinedExecution):
        raise Error(f"execution strategy {strategy!r} is not emulated; use poptorch.PipelinedExecution "
                    "or poptorch.ShardedExecution")
    return strategy


def _check_stage_counts(part: Partition, schedule: Schedule, training: bool, pipelined: bool) -> None:
    if not pipelined:
        return
    forward = part.forward_stages
    if training and schedule.accumulation < 2 * forward - 1:
        raise Error(f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
                    f"the number of pipeline stages ({2 * forward - 1}) when using "
                    f"poptorch.PipelinedExecution (it is {schedule.accumulation}). Please note that a "
                    f"model with {forward} pipeline stages in PopTorch will have an additional "
                    f"{forward - 1} stages when training.")
    if not training and schedule.device_iterations < forward:
        raise Error(f"poptorch.Options().deviceIterations must be greater than or equal to the number "
                    f"of pipeline stages ({forward}) when using PopTorch.PipelinedExecution (it is "
                    f"{schedule.device_iterations}).")


def _check_metric_states(program, schedule: Schedule) -> None:
    """Metric states are reduced on the host from every micro-batch's outputs, so all must return."""
    metrics = sorted({c.state.metric for c in program.logs if c.state is not None})
    if metrics and schedule.output_mode != "all":
        raise Error(f"the step updates torchmetrics objects ({', '.join(metrics)}) in a model split "
                    "over IPUs, whose states are gathered from every micro-batch: use "
                    "Options().outputMode(OutputMode.All), or update the metrics in a step that "
                    "returns all outputs (validation/test), or use their functional forms")


def _devices(num_ipus: int, replicas: int) -> list:
    devices = jax.devices()
    if num_ipus * replicas > len(devices):
        raise Error(f"the model needs {num_ipus} IPUs × {replicas} replicas = {num_ipus * replicas} emulated "
                    f"IPUs, but JAX has {len(devices)} device(s): set IPU_BACKEND_CPU_DEVICES="
                    f"{num_ipus * replicas} (or more) before the first JAX computation")
    return devices


def _recomputation(options) -> int:
    value = options._Popart.options.get("autoRecomputation", 0)
    return int(getattr(value, "value", value))


def build_for(executor, micro: tuple, schedule: Schedule, program) -> MultiIpuProgram | None:
    """The executor's multi-IPU program for a model with blocks (see :func:`build`)."""
    from ipu_backend.runtime.executor import find_loss
    from ipu_backend.runtime.optimizers import optimizer_rule

    model, training = executor._user_model, executor._training
    rule = hyper = loss_index = None
    if training:
        rule = optimizer_rule(executor._optimizer, {id(p): n for n, p in torch.nn.Module.named_parameters(model)})
        hyper = rule.hyperparameters(executor._optimizer)
        loss_index = find_loss(program, step_method=executor._step_method is not None)
    return build(model, program, micro, schedule, executor._options, training, rule, hyper, loss_index,
                 executor._step_method, executor._gradient_clipping)


def _export(model, micro: tuple, training: bool, method: str | None):
    target = model if method is None else capture.StepCall(model, method)
    was_training = model.training
    model.train(training)
    try:
        return capture.export(target, micro)
    finally:
        model.train(was_training)


def build(model: torch.nn.Module, program, micro: tuple, schedule: Schedule, options, training: bool,
          rule=None, hyper=None, loss_index: int | None = None,
          method: str | None = None, clipping: GradientClipping | None = None) -> MultiIpuProgram | None:
    """The multi-IPU program of ``program``, the capture of ``model`` (or of its step ``method``)
    on the micro-batch ``micro``, or None when its blocks all run on IPU 0 in one stage (the
    single-IPU step then serves). Training needs the optimizer's ``rule``, its current
    ``hyper``-parameters (for their shapes), the index of the loss among the array results and
    the gradient ``clipping`` (Lightning's) applied before each update, if any."""
    strategy = _strategy(options)
    prefix = "" if method is None else "module."
    sources = sources_from_program(program, prefix)
    graph_module = program.graph_module
    if sources is None:          # lifted constants: their values come from a capture of our own
        exported = _export(model, micro, training, method)
        sources, graph_module = sources_from_export(exported, prefix), exported.graph_module
    part = partition(graph_module, sources, program.mutated_buffers, program.output_spec, strategy)
    if len(part.stages) == 1 and part.stages[0].ipu == 0:
        return None
    pipelined = not isinstance(strategy, ShardedExecution)
    _check_metric_states(program, schedule)
    _check_stage_counts(part, schedule, training, pipelined)
    check_ipu_count(part.num_ipus * schedule.replicas, options.auto_round_num_ipus)
    devices = _devices(part.num_ipus, schedule.replicas)
    settings = _Settings(training=training, pipelined=pipelined, schedule=schedule, loss_index=loss_index,
                         recompute=_recomputation(options) if training else 0,
                         offload=training and not options.TensorLocations.optimizer_on_chip,
                         stages=len(part.stages), clipping=clipping if training else None,
                         clip_max_grad_norm=training and math.isfinite(float(hyper["max_grad_norm"])),
                         half_params=tuple(sorted(n for n, p in torch.nn.Module.named_parameters(model)
                                                  if p.dtype in (torch.float16, torch.bfloat16))))

    leaves = torch_pytree.tree_leaves(tuple(micro))
    input_avals = {i: jax.ShapeDtypeStruct((schedule.device_iterations, schedule.accumulation,
                                            schedule.replicas, *leaf.shape), jax_dtype(leaf.dtype))
                   for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    static_inputs = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), jax_dtype(p.dtype))
              for n, p in torch.nn.Module.named_parameters(model)}
    buffers = {n: jax.ShapeDtypeStruct(tuple(b.shape), jax_dtype(b.dtype))
               for n, b in torch.nn.Module.named_buffers(model)}
    stages = [_Stage(part, plan, [devices[r * part.num_ipus + plan.ipu] for r in range(schedule.replicas)],
                     settings, params, buffers, input_avals, static_inputs, rule)
              for plan in part.stages]
    hyper_avals = None if hyper is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), hyper)
    usage = []
    for stage in stages:
        temporaries = stage.compile(hyper_avals)
        usage.append(memory.StageMemory(
            stage=stage.plan.index, ipu=stage.plan.ipu,
            weights=_bytes(stage.param_avals) + _bytes(stage.buffer_avals),
            optimizer=_bytes(stage.opt_avals()) if training else 0,
            accumulators=_bytes(stage.zero_accumulator_avals()) if training else 0,
            stash_per_micro_batch=stage.stash_bytes(),
            stashed_micro_batches=stashed_micro_batches(stage.plan.index, len(stages), pipelined) if training else 0,
            temporaries=max(temporaries.values(), default=0), optimizer_offloaded=settings.offload))
    usage = memory.estimate(usage)
    memory.check(usage, *memory.in_force(options))
    # A step method's outputs are (result, logged values): the layout is the result's.
    result_spec = part.out_spec if method is None else part.out_spec.child(0)
    layout = OutputLayout()
    layout.split(torch_pytree.tree_unflatten(
        [jnp.zeros(()) if isinstance(leaf, torch.fx.Node) else leaf
         for leaf in part.output_leaves[:result_spec.num_leaves]], result_spec))
    log_names = tuple(c.name for c in program.logs if c.is_tensor)
    dtypes = [node.meta["val"].dtype for node in part.array_outputs]
    metric_states = {c.name: c.state.reduction for c in program.logs if c.state is not None}
    return MultiIpuProgram(part, stages, settings, layout, dtypes, rule, usage,
                           sorted(input_avals), log_names, metric_states)
