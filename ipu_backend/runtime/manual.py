"""Manual optimization compiled whole: a training step that runs backward passes and optimizer
steps itself, in Python (a LightningModule with ``automatic_optimization = False``, e.g. a GAN
with a generator and a discriminator optimizer), as one program on the emulated IPUs.

While the step is captured its calls are routed (by the caller's ``intercept``) to a
:class:`StepEvents` recorder, which notes them in order:

* ``backward(loss)``: the gradient of ``loss`` w.r.t. every parameter that requires grad at that
  moment, added to the parameters' gradients (mean over replicas, as DDP all-reduces them);
* ``zero_grad(o)``: the gradients of optimizer ``o``'s parameters cleared (``set_to_none``: absent);
* ``clip(o, value, algorithm)``: ``clip_grad_norm_``/``clip_grad_value_`` on ``o``'s gradients;
* ``step(o)``: ``o``'s update rule on the parameters that have a gradient (torch skips the others);
* ``scheduler_step(k)``: not compiled; the host replays it after each call (:attr:`last_events`).

The step is captured twice: the first capture finds the events, the second gives each optimizer
step a fresh copy of the parameters it updates (a *version*: extra inputs of the program, swapped
into the module at the step), so that code after a step reads the stepped values. The device
program then walks the events: each backward differentiates the whole program's value of its loss
w.r.t. the latest version of each parameter (XLA keeps only what that loss needs), each step turns
the gradients into the next version, and one last evaluation with every version in place gives
the step's results, ``self.log`` values and buffers. Every evaluation uses the same random key, so
a dropout mask is the same in a loss and in the results.

With ``Options.Training.auto_loss_scaling`` (Lightning's ``16-mixed``) the step runs as under
Lightning's ``MixedPrecision`` plugin and torch's ``GradScaler``: each backward differentiates its
loss times the current scale, gradients are kept scaled (so a ``clip`` in the step clips scaled
gradients, as on the CPU), each ``step`` unscales its optimizer's gradients and is skipped when
one is not finite, and the scale is then updated (halved after a skipped step, doubled after
``SCALER_GROWTH_INTERVAL`` finite ones).

The options apply as in the automatic step (``runtime/step.py``): gradients are reduced over the
replicas by their mean or sum (``accumulationAndReplicationReductionType``), in each optimizer's
``accum_type``; PopTorch's static ``loss_scaling`` (one value for every optimizer of the step)
scales each backward's loss and is divided out of its gradients at once; half-precision weights
are updated from float32 master copies (``Precision.enableMasterWeights``) and rounded back
stochastically (``Precision.enableStochasticRounding``); the optimizer state lives in host
memory between calls when ``TensorLocations.setOptimizerLocation`` puts it off chip. Options the
step cannot honour (gradient accumulation, several processes, per-replica buffers, a model split
over IPUs) are refused.

With ``device_iterations`` > 1 one call runs that many training steps; the optimizers'
hyper-parameters of each come from the host, where ``step_schedulers(events)`` (given by the
caller) steps the schedulers the step steps between them, as Lightning would after each training
step. A scheduler ``step()`` must therefore come after the step's optimizer steps.

Not emulated: ``.grad`` carried from one training step into the next (each step starts with no
gradients, as after ``zero_grad``), closures passed to ``step`` and gradient accumulation over
host batches.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import compile_module, float32_precision
from ipu_backend.errors import Error
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.compile_progress import CAPTURE, phase
from ipu_backend.runtime.lifecycle import (
    CompiledStep,
    Executor,
    first_micro_batch,
    input_signature,
    optimizer_state_for,
)
from ipu_backend.runtime.multi_ipu_builder import check_ipu_count
from ipu_backend.runtime.optimizers import notice_subclass
from ipu_backend.runtime.module_modes import capture_modes, guarding_modes
from ipu_backend.runtime.algorithms import optimizer_rule
from ipu_backend.runtime.outputs import check_index_inputs, inputs_to_device
from ipu_backend.runtime.random_state import restore_random_state
from ipu_backend.runtime.recording import BACKWARD, MANUAL, UPDATE
from ipu_backend.runtime.schedule import Schedule
from ipu_backend.runtime.stages import has_blocks
from ipu_backend.runtime.step import (
    OutputLayout,
    call_key,
    call_outputs,
    from_replica_zero,
    initial_scaler,
    iteration_keys,
    loop_scan,
    master_copy,
    next_scaler,
    optimizer_update,
    per_device,
    replica_keys,
    replica_sum,
)
from ipu_backend.runtime.xla_compile import program_settings

_STEP_ATTRIBUTE = "_ipu_manual_training_step"


@dataclass(frozen=True)
class Backward:
    loss: int                       # index among the step's backward losses
    targets: tuple[str, ...]        # parameters requiring grad at the call


@dataclass(frozen=True)
class ZeroGrad:
    optimizer: int
    set_to_none: bool = True


@dataclass(frozen=True)
class Clip:
    optimizer: int
    clipping: GradientClipping


@dataclass(frozen=True)
class Step:
    optimizer: int
    version: int                    # which copy of the parameters this step produces


@dataclass(frozen=True)
class SchedulerStep:
    scheduler: int


def optimizer_groups(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> tuple:
    """The names of each optimizer's parameters."""
    names = {id(p): n for n, p in torch.nn.Module.named_parameters(module)}
    return tuple(tuple(names[id(p)] for g in opt.param_groups for p in g["params"]) for opt in optimizers)


class StepEvents:
    """What a manual training step does, recorded while it is captured."""

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]):
        self._module = module
        self._parameters = list(torch.nn.Module.named_parameters(module))
        self.groups = optimizer_groups(module, optimizers)
        self.events: list = []
        self.losses: list = []
        self._versions = None
        self._replaced: dict = {}

    @property
    def steps_taken(self) -> int:
        """The optimizer steps the step has made so far in this capture."""
        return sum(isinstance(e, Step) for e in self.events)

    @property
    def steps_per_training_step(self) -> int | None:
        """The optimizer steps one training step makes (None in the capture that finds them)."""
        return None if self._versions is None else len(self._versions)

    def begin(self, versions) -> None:
        """Start a capture; ``versions`` (one dict of tensors per step, or None) are swapped in."""
        self.events, self.losses, self._versions, self._replaced = [], [], versions, {}

    def backward(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise Error("manual_backward needs a scalar floating-point loss tensor")
        targets = tuple(n for n, p in self._parameters if p.requires_grad)
        self.events.append(Backward(len(self.losses), targets))
        self.losses.append(loss.reshape(()))

    def zero_grad(self, optimizer: int, set_to_none: bool = True) -> None:
        self.events.append(ZeroGrad(optimizer, bool(set_to_none)))

    def clip(self, optimizer: int, value: float, algorithm: str) -> None:
        self.events.append(Clip(optimizer, GradientClipping(float(value), algorithm)))

    def step(self, optimizer: int) -> None:
        version = sum(isinstance(e, Step) for e in self.events)
        self.events.append(Step(optimizer, version))
        if self._versions is not None:
            for name, tensor in self._versions[version].items():
                self._swap(name, tensor)

    def scheduler_step(self, scheduler: int) -> None:
        self.events.append(SchedulerStep(scheduler))

    def restore(self) -> None:
        """Put the module's own parameters back after a capture."""
        for (owner, leaf), original in self._replaced.items():
            owner._parameters[leaf] = original
        self._replaced = {}

    def _swap(self, name: str, tensor: torch.Tensor) -> None:
        prefix, _, leaf = name.rpartition(".")
        owner = self._module.get_submodule(prefix)
        self._replaced.setdefault((owner, leaf), owner._parameters[leaf])
        owner._parameters[leaf] = tensor


class ManualStepExecutor(Executor):
    """Runs ``model.<step_method>(*args)``, a manual-optimization training step, compiled whole.

    ``optimizers`` are the torch optimizers the step uses (their index is the one
    ``intercept`` gives :class:`StepEvents`); ``intercept(events)`` is a context manager that
    routes the step's backward, optimizer, clipping and scheduler calls to ``events``;
    ``step_schedulers(events)`` steps, on the host, the schedulers a training step stepped (called
    once per training step the call runs, after its hyper-parameters are read).
    Each call runs ``options.device_iterations`` training steps on ``options.replication_factor``
    replicas; the weights are shared with the model's other executors.
    """

    def __init__(self, model: torch.nn.Module, options, optimizers: Sequence[torch.optim.Optimizer],
                 step_method: str, intercept: Callable, step_schedulers: Callable | None = None,
                 recorder=None):
        super().__init__(model, options, True, step_method, recorder)
        self._optimizers = list(optimizers)
        for optimizer in self._optimizers:
            notice_subclass(optimizer)
        self._intercept = intercept
        self._step_schedulers = step_schedulers
        self._scaler = None
        self._opt_states = None
        self.last_events: tuple = ()

    def _check_settings(self) -> None:
        super()._check_settings()
        if self._settings.processes > 1:
            raise Error("manual optimization runs in one process: its replicas cannot be spread over "
                        f"{self._settings.processes} processes (Options.Distributed, Trainer(num_nodes=...))")
        if self._settings.synthetic_data:
            raise Error("Options.enableSyntheticData(True) is not emulated with manual optimization "
                        "(automatic_optimization = False): remove enableSyntheticData, or use automatic optimization")
        if self._settings.gradient_accumulation != 1:
            raise Error("gradient accumulation is not available with manual optimization: accumulate "
                        "in the training step (several manual_backward calls before a step)")
        if not self._settings.broadcast_buffers:
            raise Error("Options.broadcastBuffers(False) (per-replica buffers) is not emulated with manual "
                        "optimization: replicas start each step from replica 0's buffers; leave it True")

    def __call__(self, *args):
        with self._store.lock, self._compilation():
            return self._call(args)

    def _call(self, args: tuple):
        self._profiler.started()
        compiled = self._compile(tuple(args))
        if compiled.program.index_inputs:
            check_index_inputs(args, compiled.program.index_inputs)
        schedule = self._schedule()
        mesh = self._mesh()
        inputs = inputs_to_device(args, schedule, mesh)
        self._start()
        params, buffers = self._store.device_state()
        hypers, loss_scale = self._hyperparameters(compiled, schedule.device_iterations)
        master = self._schedule().master_weights
        unmade = (None,) * len(compiled.rules)
        self._opt_states = tuple(
            optimizer_state_for(rule, state, old, optimizer, params,
                                [name for names in rule.groups for name in names] if master else None)
            for rule, state, old, optimizer in zip(compiled.rules, self._opt_states or unmade,
                                                   self._state_rules or unmade, self._optimizers))
        self._state_rules = compiled.rules
        if self._scaler is None and schedule.dynamic_loss_scaling:
            self._scaler = initial_scaler(loss_scale if loss_scale != 1.0 else None)
        index = self._next_call_index()
        state = jax.device_put({"params": params, "buffers": buffers, "opt": self._opt_states,
                                "scaler": self._scaler}, NamedSharding(mesh, P()))
        call_args = (state, inputs, hypers, self._base_key(), np.uint32(index))
        self._ensure_executable(compiled, call_args, optimizer_offloaded=not self._settings.optimizer_on_chip)
        return self._run(compiled, call_args, args)

    @property
    def rng_state(self) -> list[int]:
        """``[seed, calls made]``, as :attr:`PoplarExecutor.rng_state`."""
        return [self._seed, self._calls_made]

    @rng_state.setter
    def rng_state(self, state) -> None:
        self._seed, self._calls_made = restore_random_state(state)
        self._key = None

    def loss_scale(self) -> float | None:
        """The current loss scale (None without loss scaling)."""
        return None if self._scaler is None else float(self._scaler["scale"])

    # --- the life cycle's steps for this kind ----------------------------------------------
    def _kind(self, compiled: CompiledStep) -> str:
        return "manual training"

    def _execution(self) -> str:
        return MANUAL

    def _passes(self, compiled: CompiledStep) -> tuple[str, ...]:
        return tuple(BACKWARD if isinstance(e, Backward) else UPDATE for e in compiled.events
                     if isinstance(e, (Backward, Step)))

    def _torch_optimizers(self) -> list:
        return self._optimizers

    def _device_optimizer_states(self) -> tuple | None:
        if self._opt_states is None or not self._schedule().master_weights:
            return self._opt_states
        return tuple(state["rule"] for state in self._opt_states)

    def _keep(self, compiled: CompiledStep, state: dict) -> None:
        self._opt_states, self._scaler = state["opt"], state["scaler"]
        self.last_events = compiled.events
        if not self._settings.optimizer_on_chip:
            host_memory = NamedSharding(self._mesh(), P(), memory_kind="pinned_host")
            self._opt_states = jax.device_put(self._opt_states, host_memory)

    def _host_weights_loaded(self, names: set) -> None:
        """Float32 master copies of weights written on the host follow them."""
        if self._opt_states is None or not self._schedule().master_weights:
            return
        fresh = master_copy({n: self._store.params[n] for n in names})
        self._opt_states = tuple({"rule": state["rule"],
                                  "master": {n: fresh.get(n, v) for n, v in state["master"].items()}}
                                 for state in self._opt_states)

    # --- internals -------------------------------------------------------------------------
    def _hyperparameters(self, compiled: CompiledStep, iterations: int):
        """Each optimizer's hyper-parameters for each training step of the call (stacked on a
        leading axis), the schedulers the step steps stepped on the host in between; and the
        first step's loss scale."""
        per_step = []
        for _ in range(iterations):
            hypers = tuple(rule.hyperparameters(opt) for rule, opt in zip(compiled.rules, self._optimizers))
            scales = sorted({float(rule.loss_scale(h)) for rule, h in zip(compiled.rules, hypers)})
            if len(scales) > 1:
                raise Error(f"the optimizers of a manual-optimization step set different loss_scaling values "
                            f"({', '.join(map(str, scales))}): one backward pass scales its loss once, so give "
                            "every optimizer the same loss_scaling")
            per_step.append(hypers)
            if self._step_schedulers is not None:
                self._step_schedulers(compiled.events)
        first_scale = float(compiled.rules[0].loss_scale(per_step[0][0]))
        return jax.tree.map(lambda *values: np.stack(values), *per_step), first_scale

    def _compile(self, args: tuple) -> CompiledStep:
        groups = tuple(tuple(tuple((id(p), p.requires_grad) for p in group["params"]) for group in optimizer.param_groups)
                       for optimizer in self._optimizers)     # fine-tuning changes them between calls
        signature = (program_settings(), groups) + input_signature(args)
        compiled = self._compiled.get(signature)
        if compiled is None or self._reads_changed(compiled):
            float32_precision.note_compiled(signature[0])
            compiled = self._compiled[signature] = self._build(args)
        return compiled

    def _capture(self, micro: tuple, events: StepEvents, versions):
        model, method, intercept = self._user_model, self._step_method, self._intercept

        def step(*call_args):
            step_args = call_args if versions is None else call_args[:-1]
            events.begin(None if versions is None else call_args[-1])
            try:
                with intercept(events):
                    result = getattr(model, method)(*step_args)
            finally:
                events.restore()
            return result, list(events.losses)

        object.__setattr__(model, _STEP_ATTRIBUTE, step)
        try:
            with capture_modes(model, True, self._step_method), phase(CAPTURE), self._capturing() as optimizer_reads:
                program = compile_module(model, micro if versions is None else (*micro, versions),
                                         method=_STEP_ATTRIBUTE, loop_repeated_layers=self._settings.loop_repeated_layers)
            return guarding_modes(self._guarded(program, optimizer_reads), model, True, self._step_method)
        finally:
            object.__delattr__(model, _STEP_ATTRIBUTE)

    def _build(self, args: tuple) -> CompiledStep:
        schedule = self._schedule()
        micro = first_micro_batch(args, schedule)
        self._store.sync_to_host()
        events = StepEvents(self._user_model, self._optimizers)
        self._capture(micro, events, None)
        steps = [e for e in events.events if isinstance(e, Step)]
        if not steps:
            raise Error(f"{self._step_method} never steps an optimizer: with manual optimization it "
                        "must call manual_backward(loss) and optimizer.step()")
        last_step = max(i for i, e in enumerate(events.events) if isinstance(e, Step))
        if any(isinstance(e, SchedulerStep) for e in events.events[:last_step]):
            raise Error(f"{self._step_method} steps an LR scheduler before its last optimizer.step(): "
                        "the learning rates of a compiled step are read once per training step, so "
                        "call lr_scheduler.step() after the optimizer steps (Lightning's own order)")
        params = dict(torch.nn.Module.named_parameters(self._user_model))
        versions = tuple({n: torch.zeros_like(params[n]) for n in events.groups[s.optimizer]} for s in steps)
        program = self._capture(micro, events, versions)
        program.refuse_mutated_inputs("a manual-optimization step")
        if has_blocks(program.graph_module):
            raise Error(f"{self._step_method} is a manual-optimization step of a model split over IPUs "
                        "(BeginBlock, Block, Stage): manual optimization runs each replica on one IPU; "
                        "remove the blocks or use automatic optimization")
        check_ipu_count(schedule.replicas, self._settings.auto_round_num_ipus)
        names = {id(p): n for n, p in params.items()}
        rules = tuple(optimizer_rule(opt, names) for opt in self._optimizers)
        layout = OutputLayout()
        result_count = program.output_spec.child(0).child(0).num_leaves
        results = [n for n in program.output_leaves()[:result_count] if isinstance(n, torch.fx.Node)]
        log_dtypes = program.logged_dtypes()
        totals = program.call_totals()
        call = _manual_call(program, micro, tuple(events.events), events.groups, rules, schedule,
                            self._mesh(), layout, totals,
                            tuple(sorted(n for n, p in params.items() if p.dtype in (torch.float16, torch.bfloat16))))
        return CompiledStep(call, program, layout, [n.meta["val"].dtype for n in results], log_dtypes,
                            rules, events=tuple(events.events))


def _used_inputs(fn, args) -> list[bool]:
    """Which of ``fn``'s flattened array arguments its result depends on (data flow)."""
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    used = {v for v in jaxpr.outvars if isinstance(v, jex.core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in used for v in eqn.outvars):
            used.update(v for v in eqn.invars if isinstance(v, jex.core.Var))
    return [v in used for v in jaxpr.invars]


def _all_finite(arrays: list):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays])) if arrays else jnp.array(True)


def _chosen(keep, new, old):
    """``new`` where ``keep`` (a skipped step keeps ``old``)."""
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def _kept_state(old: dict, new: dict, present: list, keep, master_weights: bool) -> dict:
    """An optimizer's state after a step: the new state of the parameters that had a gradient
    (where ``keep``), the old state of the others (torch's step skips them); with master
    weights, their master copies likewise."""
    def kept(old_part, new_part):
        part = dict(old_part)
        for name in present:
            if name in part:
                part[name] = _chosen(keep, new_part[name], part[name])
        return part

    if not master_weights:
        return kept(old, new)
    return {"rule": kept(old["rule"], new["rule"]), "master": kept(old["master"], new["master"])}


def _manual_call(program, micro: tuple, events: tuple, groups: tuple, rules: tuple, schedule: Schedule,
                 mesh, layout: OutputLayout, totals: dict, half: tuple):
    """``call(state, inputs, hypers, key, index) -> (state, outputs, logs)``, jitted over the mesh,
    with ``hypers`` per training step (leading axis); ``key`` and ``index``: see
    :func:`~ipu_backend.runtime.step.call_key`; the logged metric states in ``totals`` also come
    reduced over every micro-batch; ``half``: the model's half-precision parameters (those the
    optimizer steps round back to their dtype). With dynamic loss scaling (``schedule``), ``state["scaler"]``
    is torch's GradScaler. The random keys are the automatic step's: each replica's from the
    iteration's key folded with 0 (its micro-batch), the rounding of the optimizer step that
    makes version ``v`` from it folded with ``1 + v`` (the automatic step's one update: 1)."""
    leaves, spec = torch_pytree.tree_flatten(micro)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    local = schedule.replicas // mesh.size
    steps = [e for e in events if isinstance(e, Step)]
    loss_scaling = schedule.dynamic_loss_scaling
    reduction = schedule.replicas if schedule.mean_reduction else 1
    accum_dtypes = {name: rule.accum_dtype for rule, names in zip(rules, groups) for name in names}

    def evaluate(params, buffers, arrays, versions, key):
        """The step's program: ``((result, losses), new_buffers, logs)``."""
        arrays = iter(arrays)
        merged = [next(arrays) if t else x for t, x in zip(is_tensor, leaves)]
        return program.logged_fn(params, buffers, (*torch_pytree.tree_unflatten(merged, spec), tuple(versions)), key)

    def with_targets(params, versions, latest, targets):
        """The program's parameter inputs with ``targets`` at each one's latest version."""
        params, versions = dict(params), [dict(v) for v in versions]
        for name, value in targets.items():
            if latest[name] is None:
                params[name] = value
            else:
                versions[latest[name]][name] = value
        return params, versions

    def iteration(carry, xs):
        params, buffers, opt_states, scaler = carry
        inputs, key, hypers = xs                                # inputs: [1, r, m, ...]
        inputs = jax.tree.map(lambda x: x[0], inputs)
        keys = replica_keys(jax.random.fold_in(key, 0), local, mesh.size)
        static_scale = 1.0 if loss_scaling else rules[0].loss_scale(hypers[0])
        current = dict(params)
        latest = dict.fromkeys(params)
        versions = [{n: params[n] for n in groups[s.optimizer]} for s in steps]
        grads: dict = {}
        opt_states = list(opt_states)
        for event in events:
            if isinstance(event, Backward):
                def loss(targets, replica_inputs, replica_key, event=event, versions=tuple(versions),
                         latest=dict(latest)):
                    p, v = with_targets(params, versions, latest, targets)
                    (_, losses), _, _ = evaluate(p, buffers, replica_inputs, v, replica_key)
                    loss_value = losses[event.loss].astype(jnp.float32)
                    return loss_value * (scaler["scale"] if loss_scaling else static_scale)

                targets = {n: current[n] for n in event.targets}
                first = (jax.tree.map(lambda x: x[0], inputs), keys[0])
                flat_targets, _ = jax.tree.flatten(targets)
                used = _used_inputs(lambda t, i, k: loss(t, i, k), (targets, *first))[:len(flat_targets)]
                reached = {n for n, u in zip(sorted(targets), used) if u}
                value = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(targets, inputs, keys)
                for name in sorted(reached):
                    summed = value[name].astype(accum_dtypes.get(name, value[name].dtype)).sum(0)
                    g = replica_sum(summed, mesh.size) / (jnp.float32(reduction) * static_scale)
                    grads[name] = grads[name] + g if name in grads else g
            elif isinstance(event, ZeroGrad):
                for name in groups[event.optimizer]:
                    if event.set_to_none:
                        grads.pop(name, None)
                    elif name in grads:
                        grads[name] = jnp.zeros_like(grads[name])
            elif isinstance(event, Clip):
                present = [n for n in groups[event.optimizer] if n in grads]
                grads.update(event.clipping(grads, present))
            elif isinstance(event, Step):
                rule = rules[event.optimizer]
                unscale = (lambda g: g * (1 / scaler["scale"])) if loss_scaling else (lambda g: g)
                full = {n: unscale(grads[n]) if n in grads else jnp.zeros_like(current[n]) for n in rule.names}
                owned = {n: current[n] for n in groups[event.optimizer]}
                new_params, new_state = optimizer_update(
                    rule, full, opt_states[event.optimizer], owned, hypers[event.optimizer],
                    jax.random.fold_in(key, 1 + event.version), schedule, half)
                present = [n for n in rule.names if n in grads]
                keep = _all_finite([full[n] for n in present]) if loss_scaling else True
                for name in present:
                    current[name] = _chosen(keep, new_params[name], current[name])
                opt_states[event.optimizer] = _kept_state(opt_states[event.optimizer], new_state, present, keep,
                                                          schedule.master_weights)
                if loss_scaling:
                    scaler = next_scaler(scaler, keep)
                versions[event.version] = {n: current[n] for n in groups[event.optimizer]}
                for name in groups[event.optimizer]:
                    latest[name] = event.version

        def final(replica_inputs, replica_key):
            (result, _), new_buffers, logs = evaluate(params, buffers, replica_inputs, versions, replica_key)
            return (layout.split(result), logs), new_buffers

        outputs, new_buffers = jax.vmap(final)(inputs, keys)
        return (current, from_replica_zero(new_buffers, local, mesh.size), tuple(opt_states), scaler), \
            jax.tree.map(lambda y: y[None], outputs)

    def device_program(state, inputs, hypers, key, index):
        keys = iteration_keys(call_key(key, index), schedule.device_iterations)
        carry = (state["params"], state["buffers"], state["opt"], state["scaler"])
        (params, buffers, opt_states, scaler), ys = loop_scan(iteration, carry, (inputs, keys, hypers))
        arrays, logs = call_outputs(*ys, schedule, totals)
        return {"params": params, "buffers": buffers, "opt": opt_states, "scaler": scaler}, arrays, logs

    sharded = per_device(device_program, mesh, in_specs=(P(), P(None, None, REPLICA), P(), P(), P()),
                         out_specs=(P(), P(REPLICA), P(REPLICA)))
    return jax.jit(sharded, donate_argnums=(0,))
