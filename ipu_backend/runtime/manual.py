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
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX, totals_of
from ipu_backend.errors import Error
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.lifecycle import CompiledStep, Executor, first_micro_batch, input_signature, optimizer_state
from ipu_backend.runtime.module_modes import capture_modes
from ipu_backend.runtime.algorithms import optimizer_rule
from ipu_backend.runtime.outputs import inputs_to_device
from ipu_backend.runtime.random_state import restore_random_state
from ipu_backend.runtime.recording import BACKWARD, MANUAL, UPDATE
from ipu_backend.runtime.schedule import Schedule
from ipu_backend.runtime.step import (
    OutputLayout,
    call_key,
    call_outputs,
    from_replica_zero,
    initial_scaler,
    iteration_keys,
    loop_scan,
    next_scaler,
    per_device,
    replica_keys,
    replica_sum,
)

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


class StepEvents:
    """What a manual training step does, recorded while it is captured."""

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]):
        self._module = module
        self._parameters = list(torch.nn.Module.named_parameters(module))
        names = {id(p): n for n, p in self._parameters}
        self.groups = tuple(tuple(names[id(p)] for g in opt.param_groups for p in g["params"])
                            for opt in optimizers)
        self.events: list = []
        self.losses: list = []
        self._versions = None
        self._replaced: dict = {}

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
        self._intercept = intercept
        self._step_schedulers = step_schedulers
        self._scaler = initial_scaler() if self._settings.auto_loss_scaling else None
        self._opt_states = None
        self.last_events: tuple = ()

    def _check_settings(self) -> None:
        if self._settings.processes > 1:
            raise Error("manual optimization runs in one process: its replicas cannot be spread over "
                        f"{self._settings.processes} processes (Options.Distributed, Trainer(num_nodes=...))")
        if self._settings.gradient_accumulation != 1:
            raise Error("gradient accumulation is not available with manual optimization: accumulate "
                        "in the training step (several manual_backward calls before a step)")

    def __call__(self, *args):
        with self._store.lock:
            return self._call(args)

    def _call(self, args: tuple):
        self._profiler.started()
        compiled = self._compile(tuple(args))
        schedule = self._schedule()
        mesh = self._mesh()
        inputs = inputs_to_device(args, schedule, mesh)
        self._start()
        params, buffers = self._store.device_state()
        hypers = self._hyperparameters(compiled, schedule.device_iterations)
        if self._opt_states is None:
            self._opt_states = tuple(optimizer_state(rule, opt, params)
                                     for rule, opt in zip(compiled.rules, self._optimizers))
        index = self._next_call_index()
        state = jax.device_put({"params": params, "buffers": buffers, "opt": self._opt_states,
                                "scaler": self._scaler}, NamedSharding(mesh, P()))
        call_args = (state, inputs, hypers, self._base_key(), np.uint32(index))
        self._ensure_executable(compiled, call_args)
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
    def _make_schedule(self) -> Schedule:
        settings = self._settings
        return Schedule(device_iterations=settings.device_iterations, accumulation=1,
                        replicas=settings.replication_factor, output_mode=settings.output_mode or "final",
                        output_period=settings.output_period)

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
        return self._opt_states

    def _keep(self, compiled: CompiledStep, state: dict) -> None:
        self._opt_states, self._scaler = state["opt"], state["scaler"]
        self.last_events = compiled.events

    # --- internals -------------------------------------------------------------------------
    def _hyperparameters(self, compiled: CompiledStep, iterations: int):
        """Each optimizer's hyper-parameters for each training step of the call (stacked on a
        leading axis), the schedulers the step steps stepped on the host in between."""
        per_step = []
        for _ in range(iterations):
            per_step.append(tuple(rule.hyperparameters(opt) for rule, opt in zip(compiled.rules, self._optimizers)))
            if self._step_schedulers is not None:
                self._step_schedulers(compiled.events)
        return jax.tree.map(lambda *values: np.stack(values), *per_step)

    def _compile(self, args: tuple) -> CompiledStep:
        signature = (float32_precision.program_key(),) + input_signature(args)
        compiled = self._compiled.get(signature)
        if compiled is None:
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
            with capture_modes(model, True, self._step_method):
                return compile_module(model, micro if versions is None else (*micro, versions),
                                      method=_STEP_ATTRIBUTE, loop_repeated_layers=self._options.loop_repeated_layers)
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
        names = {id(p): n for n, p in params.items()}
        rules = tuple(optimizer_rule(opt, names) for opt in self._optimizers)
        layout = OutputLayout()
        result_count = program.output_spec.child(0).child(0).num_leaves
        results = [n for n in program.output_leaves()[:result_count] if isinstance(n, torch.fx.Node)]
        log_dtypes = program.logged_dtypes()
        totals = totals_of(program.logs)
        log_dtypes.update({name + TOTAL_SUFFIX: log_dtypes[name] for name in totals})
        call = _manual_call(program, micro, tuple(events.events), events.groups, rules, schedule,
                            self._mesh(), layout, totals, self._scaler is not None)
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


def _manual_call(program, micro: tuple, events: tuple, groups: tuple, rules: tuple, schedule: Schedule,
                 mesh, layout: OutputLayout, totals: dict, loss_scaling: bool):
    """``call(state, inputs, hypers, key, index) -> (state, outputs, logs)``, jitted over the mesh,
    with ``hypers`` per training step (leading axis); ``key`` and ``index``: see
    :func:`~ipu_backend.runtime.step.call_key`; the logged metric states in ``totals`` also come
    reduced over every micro-batch; ``loss_scaling``: torch's GradScaler (``state["scaler"]``)."""
    leaves, spec = torch_pytree.tree_flatten(micro)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    local = schedule.replicas // mesh.size
    steps = [e for e in events if isinstance(e, Step)]

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
        keys = replica_keys(key, local, mesh.size)
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
                    return loss_value * scaler["scale"] if loss_scaling else loss_value

                targets = {n: current[n] for n in event.targets}
                first = (jax.tree.map(lambda x: x[0], inputs), keys[0])
                flat_targets, _ = jax.tree.flatten(targets)
                used = _used_inputs(lambda t, i, k: loss(t, i, k), (targets, *first))[:len(flat_targets)]
                reached = {n for n, u in zip(sorted(targets), used) if u}
                value = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(targets, inputs, keys)
                for name in sorted(reached):
                    g = replica_sum(value[name].sum(0), mesh.size) / schedule.replicas
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
                unscale = (lambda g: g / scaler["scale"]) if loss_scaling else (lambda g: g)
                full = {n: unscale(grads[n]) if n in grads else jnp.zeros_like(current[n]) for n in rule.names}
                new_params, new_state = rule.update(full, opt_states[event.optimizer], current, hypers[event.optimizer])
                state = dict(opt_states[event.optimizer])
                present = [n for n in rule.names if n in grads]
                keep = _all_finite([full[n] for n in present]) if loss_scaling else True
                for name in present:
                    current[name] = _chosen(keep, new_params[name], current[name])
                    state[name] = _chosen(keep, new_state[name], state[name])
                if loss_scaling:
                    scaler = next_scaler(scaler, keep)
                opt_states[event.optimizer] = state
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
