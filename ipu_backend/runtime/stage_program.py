"""One stage of a model split over IPUs, on its devices: its programs, compiled from the
partitioned graph.

* ``forward``: a micro-batch through one stage; returns what later stages read, the stage's
  outputs, its new buffers and the *stash*: the residuals of ``jax.vjp`` that the backward pass
  needs. Residuals that depend only on the stage's weights (the weights themselves, their
  transposes) are not stashed: ``backward`` recomputes them from the weights, so a stashed
  micro-batch holds activations only.
* ``backward``: the stashed residuals and the cotangents sent back by later stages give the
  gradients, added to the stage's accumulator, and the cotangents of what the stage received.
* ``forward_backward``: the last stage runs both at once (PopART's last pipeline stage does too).
* ``update``: the stage's optimizer step on its own parameters, from its accumulated gradients.
* ``infer``: inference's forward.

With recomputation (``opts._Popart.set("autoRecomputation", 3)``) the stage function is wrapped
in ``jax.checkpoint`` saving only ``recomputationCheckpoint`` values: a stash then holds the
stage's inputs and checkpoints, and ``backward`` recomputes the rest.
"""

import copy
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.extend.core import Literal
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler.custom_ops import RECOMPUTATION_CHECKPOINT_NAME
from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.lowerings.linalg import MATRIX_PRODUCT_NAME
from ipu_backend.runtime.clipping import GradientClipping, norm_coefficient
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.memory import tree_bytes
from ipu_backend.runtime.schedule import Schedule
from ipu_backend.runtime.stages import Partition, StagePlan, run_stage
from ipu_backend.runtime.step import initial_scaler, master_copy, next_scaler, optimizer_update, replica_zero_everywhere
from ipu_backend.runtime.xla_compile import compile_jitted

_RECOMPUTE_STAGES = (3, 4)      # PopART RecomputationType.Pipeline and RecomputeAll
_RECOMPUTE_STANDARD = 1         # RecomputationType.Standard: keep matrix products, recompute the rest


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


def _weight_only(jaxpr, weight_leaves: int) -> list[bool]:
    """For each output of ``jaxpr``: whether it depends only on its first ``weight_leaves`` inputs
    (and constants), not on the per-micro-batch data that follows them."""
    dependent = set(jaxpr.invars[weight_leaves:])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [isinstance(v, Literal) or v not in dependent for v in jaxpr.outvars]


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
class MultiIpuSettings:
    """What every stage program of one multi-IPU program is built for."""

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


class StageProgram:
    """One stage on its devices: its programs, traced from the partitioned graph."""

    def __init__(self, part: Partition, plan: StagePlan, devices, settings: MultiIpuSettings, params, buffers,
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
        unscale = 1 / (scale_sum * loss_scale)            # a product fuses into the update (step.py)
        return {n: jax.lax.psum((acc[n] + sum(lent.get(n, ())))[0], REPLICA) * unscale for n in names}

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
        return replica_zero_everywhere(buffers) if self.settings.schedule.replicas > 1 else buffers

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
        return compile_jitted(jitted, *args)

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

        return compile_jitted(jax.jit(update, donate_argnums=(0, 1, 2), out_shardings=out_shardings), *args)

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
        return 0 if self.stash_avals is None else tree_bytes(self.stash_avals)

