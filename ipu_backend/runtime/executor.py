"""PopTorch's executor (``PoplarExecutor``): one compiled step per input signature, weights on
the emulated IPUs, the user's module kept in sync."""

import inspect
import logging
import time
import warnings
import weakref

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import compile_module, containers
from ipu_backend.compiler.custom_ops import IDENTITY_LOSS
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX, totals_of
from ipu_backend.enums import MeanReductionStrategy, OutputMode, ReductionType
from ipu_backend.errors import Error
from ipu_backend.runtime import compilation_cache, compile_hooks, host_idle, memory, perf_counters, serialization
from ipu_backend.runtime.memory import single_ipu_usage
from ipu_backend.runtime.devices import replica_mesh
from ipu_backend.runtime.module_repr import module_repr
from ipu_backend.runtime.multi_ipu import MultiIpuProgram
from ipu_backend.runtime.multi_ipu_builder import SplitSettings, build
from ipu_backend.runtime.optimizers import needs_running_mean, optimizer_rule
from ipu_backend.runtime.outputs import host_inputs, inputs_to_device, output_to_host
from ipu_backend.runtime.recording import SINGLE_IPU, NullRecorder, ProgramFacts, StageFacts
from ipu_backend.runtime.stages import has_blocks
from ipu_backend.runtime.step import OutputLayout, Schedule, inference_call, initial_scaler, master_copy, training_call
from ipu_backend.runtime.weights import release, weight_store
from ipu_backend.runtime.xla_compile import compile_lowered

logger = logging.getLogger("ipu_backend")

_PROGRAMS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
"""Compiled programs per module, shared by its executors: the same model, options, input
signature and optimizer structure never compile twice in a process."""

_OUTPUT_MODES = {OutputMode.All: "all", OutputMode.Final: "final", OutputMode.Sum: "sum",
                 OutputMode.EveryN: "every_n"}

NO_EXECUTABLE = "Model has not been compiled or has been destroyed."
"""PopTorch's error for a query that needs a compiled model."""


class _Compiled:
    """One compiled call and what the host needs to use it."""

    def __init__(self, call, program, layout, output_dtypes, log_dtypes, rule=None, multi_ipu=False):
        self.call, self.program, self.layout = call, program, layout
        self.output_dtypes, self.log_dtypes, self.rule = output_dtypes, log_dtypes, rule
        self.multi_ipu = multi_ipu
        """A model split over IPUs: its program places weights and inputs on each stage's IPUs
        itself (one copy, from wherever they are), and checked its memory when built."""
        self.executable = None            # XLA executable, compiled ahead of the first call
        self.facts = None                 # what recorders are told of it, once compiled
        self.started = time.perf_counter()
        self.seconds = None               # from capture to executable (compilationTime)
        self.inputs = None                # the shapes and dtypes it was compiled for (save)


def _signature(args: tuple) -> tuple:
    """The shapes and dtypes of ``args`` (and any non-tensor values), with their structure: a
    flat tuple of tensors, the usual call, is told apart without building a pytree spec."""
    if all(type(x) is torch.Tensor for x in args):
        return tuple((x.shape, x.dtype) for x in args)
    containers.register(args)
    leaves, spec = torch_pytree.tree_flatten(args)
    return (spec,) + tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", x)
                           for x in leaves)


def _plain(value):
    """A param-group value as something ``==`` compares by content (tensors as lists)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _param_group_values(optimizer) -> tuple:
    """Everything an optimizer rule reads from ``optimizer``: its kind, and each param group's
    parameters and values. Equal values give equal hyper-parameters and the same rule match."""
    return (type(optimizer),) + tuple(
        (tuple(id(p) for p in group["params"]),
         tuple((k, _plain(v)) for k, v in group.items() if k != "params"))
        for group in optimizer.param_groups)


def _output_nodes(program):
    """The graph nodes (or constants) of the user outputs, flattened in pytree order."""
    output = next(n for n in program.graph_module.graph.nodes if n.op == "output")
    return list(output.args[0][program.num_mutations:])


def _result_nodes(program) -> list:
    """Array-valued result nodes, without the logged values a step method adds at the end."""
    nodes = [n for n in _output_nodes(program) if isinstance(n, torch.fx.Node)]
    logged = sum(call.is_tensor for call in program.logs)
    return nodes[:len(nodes) - logged] if logged else nodes


def _step_result_loss(program, nodes):
    """A Lightning step's loss: the returned tensor, or the ``"loss"`` entry of a returned dict."""
    spec = program.output_spec.child(0)     # a step method's outputs are (result, logs)
    leaves = list(_output_nodes(program))[:spec.num_leaves]
    result = torch_pytree.tree_unflatten(leaves, spec)
    loss = result.get("loss") if isinstance(result, dict) else result
    return loss if isinstance(loss, torch.fx.Node) and loss in nodes else None


def find_loss(program, step_method: bool = False) -> int:
    """Index, among the array results, of the loss: the output of ``identity_loss`` if the model
    uses it; for a step method, the returned tensor or its ``"loss"`` entry; otherwise the only
    scalar float output (PopTorch's rule for returned losses)."""
    nodes = _result_nodes(program)
    marked = [n for n in program.graph_module.graph.nodes if n.target is IDENTITY_LOSS]
    if len(marked) > 1:
        raise Error(f"the model has {len(marked)} independent losses (identity_loss at "
                    f"{', '.join(program.source_locations.get(n.name) or '?' for n in marked)}); "
                    "combine them into one, e.g. identity_loss(loss_a + loss_b, reduction='none')")
    if marked:
        if marked[0] not in nodes:
            raise Error("the identity_loss result must be returned by the model's forward "
                        f"(it is computed at {program.source_locations.get(marked[0].name)})")
        return nodes.index(marked[0])
    if step_method:
        loss = _step_result_loss(program, nodes)
        if loss is None:
            raise Error("training_step must return the loss: a scalar tensor or a dict with a "
                        "'loss' entry (manual optimization is not supported by this executor)")
        return nodes.index(loss)
    scalars = [i for i, n in enumerate(nodes)
               if n.meta["val"].ndim == 0 and n.meta["val"].is_floating_point()]
    if len(scalars) == 1:
        return scalars[0]
    if not scalars:
        raise Error("a training model must return its loss: return a scalar loss from forward "
                    "(for example `return output, loss`) or mark it with poptorch.identity_loss")
    raise Error(f"the model returns {len(scalars)} scalar outputs, so which one is the loss is "
                "ambiguous: mark the loss with poptorch.identity_loss(loss, reduction='none')")


def _copy_back_inputs(result, args: tuple, indices: tuple):
    """The model's outputs, after writing the new values of the inputs it updated in place into
    the caller's tensors (as PopTorch does)."""
    outputs, new_values = result
    leaves = torch_pytree.tree_leaves(args)
    with torch.no_grad():
        for index, value in zip(indices, new_values):
            leaves[index].copy_(value)
    return outputs


def _forward_with_constants(program, args: tuple):
    """The program as ``forward(params, buffers, tensor_leaves, key)``: non-tensor arguments
    (baked into the compiled program, and part of its cache key) are put back in place."""
    leaves, spec = torch_pytree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]

    def forward(params, buffers, arrays, key):
        arrays = iter(arrays)
        merged = [next(arrays) if t else x for t, x in zip(is_tensor, leaves)]
        return program.logged_fn(params, buffers, torch_pytree.tree_unflatten(merged, spec), key)

    return forward


def _with_mean_strategy(options, optimizer):
    """``options`` frozen, with ``MeanReductionStrategy.Running`` where PopTorch chooses it for
    ``optimizer`` (float16 gradient accumulators); ``options`` must be an unfrozen copy."""
    if optimizer is not None and needs_running_mean(optimizer):
        options.Training.setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running)
    options._freeze()
    return options


class PoplarExecutor(perf_counters.ExecutionCounters):
    """What ``trainingModel``/``inferenceModel`` return: call it like the model."""

    def __init__(self, model: torch.nn.Module, options, training: bool, optimizer=None,
                 step_method: str | None = None, gradient_clipping=None, recorder=None):
        options._freeze()
        if training and optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        self._options = _with_mean_strategy(options.clone(), optimizer if training else None)
        self._training = training
        if not self._options.broadcast_buffers:
            raise Error("Options.broadcastBuffers(False) (per-replica buffers) is not emulated: "
                        "replicas start each step from replica 0's buffers; leave it True")
        if not training and self._options.Training.gradient_accumulation != 1:
            raise Error("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
                        "it as its default value (1) when running a poptorch.inferenceModel().")
        self._user_model = model
        self._step_method = step_method
        self.last_logs: dict = {}
        """``self.log`` values of the last call (step methods), per the output mode."""
        self.last_program = None
        """The compiled Program that ran in the last call (its ``logs``, output shapes)."""
        self._gradient_clipping = gradient_clipping
        """A ``runtime.clipping.GradientClipping`` applied before each optimizer update, or None."""
        self._optimizer = optimizer
        self._store = weight_store(model)
        self._store.executors.add(self)
        self._compiled: dict = {}
        self._last_signature = None
        self._opt_state = None
        self._scaler = None
        self._resident = None
        """The state the last call returned, already on the mesh: passed back without a copy."""
        self._matched = None
        """``(rule, param-group values)`` last found to match: not checked again until they change."""
        self._hyper = None
        """``(rule, param-group values, hyper-parameters on the mesh)`` of the last call."""
        self._attached = True
        self._destroyed = False
        self._calls_made = 0
        seed = self._options.random_seed
        self._seed = int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed
        self._key = None
        self._options_key = repr(sorted(self._options.toDict().items()))
        self._schedule_value = self._make_schedule()
        self._mesh_value = None
        if training:
            self._store.on_host_sync.append(self._optimizer_state_to_host)
        compilation_cache.configure(self._options.executable_cache_dir)
        self._profiler = recorder if recorder is not None else NullRecorder()
        """Where the executor reports its compilations and calls (:mod:`~ipu_backend.runtime.recording`)."""

    # --- PopTorch's public surface -------------------------------------------------------
    @property
    def options(self):
        return self._options

    @property
    def model(self) -> torch.nn.Module:
        return self._user_model

    def __getattr__(self, name):
        """Attributes of the wrapped model, as PopTorch's executor exposes them."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._user_model, name)

    def __call__(self, *args, **kwargs):
        args = self._bind(args, kwargs)
        self._profiler.started()
        groups = self._param_groups()
        compiled = self._compile(args, groups)
        if not self._attached:
            self.attachToDevice()
        call_args = self._call_arguments(compiled, args, groups,
                                         place_inputs=compiled.executable is None or self._profiler.times_inputs)
        self._ensure_executable(compiled, call_args)
        started = perf_counters.now()
        self._profiler.inputs_on_device(call_args)
        state, arrays, logs = compiled.executable(*call_args)
        launched = perf_counters.now()
        self._profiler.computed(state, arrays, logs)
        if self._training:
            self._opt_state, self._scaler = state["opt"], state["scaler"]
        self._store.update(state["params"], state["buffers"])
        self._resident = None if compiled.multi_ipu else state
        if self._offloads_optimizer_state(compiled):
            host_memory = NamedSharding(self._mesh(), P(), memory_kind="pinned_host")
            self._opt_state = jax.device_put(self._opt_state, host_memory)
        self.last_program = compiled.program
        host_idle.run_queued()
        jax.block_until_ready(arrays)
        ready = perf_counters.now()
        self.last_logs = {name: output_to_host(value, compiled.log_dtypes[name]) for name, value in logs.items()}
        outputs = [output_to_host(a, d) for a, d in zip(arrays, compiled.output_dtypes)]
        self._last_marks = perf_counters.CallMarks(len(args), started, launched, ready, perf_counters.now())
        self._profiler.finished(compiled.facts, call_args)
        result = compiled.layout.join(outputs)
        if compiled.program.mutated_inputs:
            result = _copy_back_inputs(result, args, compiled.program.mutated_inputs)
        return result

    def compile(self, *args, **kwargs) -> None:
        """Compile for these inputs without running (PopTorch's ``compile``)."""
        args = self._bind(args, kwargs)
        self._profiler.started()
        groups = self._param_groups()
        compiled = self._compile(args, groups)
        self._ensure_executable(compiled, self._call_arguments(compiled, args, groups, advance=False))

    def isCompiled(self) -> bool:
        return any(c.executable is not None for c in self._compiled.values())

    # --- compiled programs in files (runtime/serialization.py) ------------------------------------
    def save(self, filename: str, export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save the compiled program (of the last call, or the last compiled) to ``filename``;
        with ``export_model``, also the model and optimizer, for :func:`ipu_backend.load`."""
        compiled = self._timed_program()
        if compiled is None:
            raise Error(NO_EXECUTABLE)
        if compiled.multi_ipu:
            raise Error("saving a model split over several IPUs is not supported yet: save a "
                        "single-IPU model, or compile this one in each process")
        filename = serialization.destination(filename)
        self.copyWeightsToHost()
        lowered = self._lowered(compiled, serialization.example_inputs(compiled.inputs))
        data = {"training": self._training, "options": self._options, "inputs": compiled.inputs,
                "executable": serialization.executable_bytes(compiled.executable),
                "fingerprint": serialization.fingerprint(lowered), "model": None, "optimizer": None,
                "optimizer_state": None, "rng_state": self.rng_state if save_rng_state else None}
        if export_model:
            data.update(model=self._user_model, optimizer=self._optimizer,
                        optimizer_state=None if self._optimizer is None else self._optimizer.state_dict())
        serialization.write(filename, data)

    def compileAndExport(self, filename: str, *args, export_model: bool = True, **kwargs) -> None:  # noqa: N802
        """``compile(*args, **kwargs)``, then ``save(filename, export_model)``."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def loadExecutable(self, filename: str) -> None:  # noqa: N802
        """Use the program saved in ``filename`` (by ``save``/``compileAndExport`` of this
        model, options and optimizer) instead of compiling it."""
        data = serialization.read(filename)
        if data["training"] != self._training:
            kind = "training" if data["training"] else "inference"
            raise Error(f"{filename} was saved from a poptorch.{kind}Model; load it into one")
        args = serialization.example_inputs(data["inputs"])
        self._profiler.started()
        groups = self._param_groups()
        compiled = self._compile(args, groups)
        if compiled.multi_ipu:
            raise Error(f"{filename} holds a single-IPU program, but this model is split over IPUs")
        self._ensure_executable(compiled, self._call_arguments(compiled, args, groups, advance=False),
                                lambda lowered: serialization.load_executable(
                                    data, lowered, filename, list(self._mesh().devices.flat)))

    def _lowered(self, compiled: _Compiled, args: tuple):
        """The program of ``compiled`` lowered for the call arguments of ``args`` (as compiled)."""
        return compiled.call.lower(*self._call_arguments(compiled, args, self._param_groups(), advance=False))

    def __repr__(self) -> str:
        """The model's ``repr``, with its ``BeginBlock`` annotations (PopTorch's ``module_repr``)."""
        return module_repr(self._user_model)

    def copyWeightsToHost(self) -> None:
        self._store.sync_to_host()

    def copyWeightsToHostIfNeeded(self) -> bool:  # noqa: N802
        """Copy the device's weights into the module if they changed since the last copy;
        whether they did."""
        stale = self._store.host_stale
        self._store.sync_to_host()
        return stale

    def copyNamedBuffersToDevice(self) -> None:  # noqa: N802
        """Copy the buffers named by ``Options.updatableNamedBuffers`` from the module to the
        device (the other weights stay as the device has them)."""
        if not self.isCompiled():
            raise Error(NO_EXECUTABLE)
        names = self._options.updatable_named_buffers
        if not names:
            raise Error("No named buffers marked as updatable via updatableNamedBuffers option")
        self._store.load_buffers_from_host(names)

    @property
    def rng_state(self) -> list[int]:
        """The seed and state of the compiled model's random numbers, ``[seed, calls made]``:
        assigning a saved value back makes the next calls draw the same random numbers again."""
        if not self.isCompiled():
            raise Error(NO_EXECUTABLE)
        return [self._seed, self._calls_made]

    @rng_state.setter
    def rng_state(self, state: list[int]) -> None:
        if not self.isCompiled():
            raise Error(NO_EXECUTABLE)
        if (not isinstance(state, (list, tuple)) or len(state) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in state)):
            raise Error(f"rng_state must be [seed, calls made] as rng_state returns it, got {state!r}")
        self._seed, self._calls_made = int(state[0]), int(state[1])
        self._key = None

    def copyWeightsToDevice(self) -> None:
        self._store.load_from_host()
        if self._opt_state is not None and self._schedule().master_weights:
            self._opt_state = {**self._opt_state, "master": master_copy(self._store.params)}

    def load_state_dict(self, state_dict, strict: bool = True):
        """The wrapped model's ``load_state_dict``, then its weights go to the device (as PopTorch
        does), so the next call runs with the loaded values."""
        self.copyWeightsToHost()
        result = torch.nn.Module.load_state_dict(self._user_model, state_dict, strict)
        self.copyWeightsToDevice()
        return result

    def setOptimizer(self, optimizer) -> None:
        """Use ``optimizer``'s hyper-parameters from the next call on; they are program inputs,
        so this never recompiles unless the optimizer's kind or parameter groups change."""
        if not self._training:
            raise Error("setOptimizer is only available on a trainingModel")
        strategy = self._options.Training.mean_reduction_strategy
        if needs_running_mean(optimizer) and strategy != MeanReductionStrategy.Running:
            if self.isCompiled():
                raise ValueError("Invalid optimizer: the new optimizer would require changing "
                                 "options.Training.meanAccumulationAndReplicationReductionStrategy to "
                                 "poptorch.MeanReductionStrategy.Running but the executable is already "
                                 "compiled.")
            self._options = _with_mean_strategy(self._options.clone(), optimizer)
            self._options_key = repr(sorted(self._options.toDict().items()))
        old = self._optimizer
        self._optimizer = optimizer
        compiled = next(iter(self._compiled.values()), None)
        if type(old) is not type(optimizer) or (compiled is not None and not compiled.rule.matches(optimizer)):
            self._compiled.clear()
            self._opt_state = None

    def attachToDevice(self) -> None:
        if self._attached:
            raise Error("Device is already attached")
        self._attached = True

    def detachFromDevice(self) -> None:
        if not self._attached:
            raise Error("Device is not attached")
        self.copyWeightsToHost()
        self._attached = False

    def isAttachedToDevice(self) -> bool:
        return self._attached

    def ipuPlacement(self) -> dict[str, int]:  # noqa: N802
        """Parameter name → the IPU holding it (IPU 0 for every parameter of a single-IPU model)."""
        compiled = next(iter(self._compiled.values()), None)
        placement = getattr(getattr(compiled, "call", None), "placement", {})
        return {name: placement.get(name, 0) for name, _ in torch.nn.Module.named_parameters(self._user_model)}

    def destroy(self) -> None:
        """Release the device: weights reach the host and the module gets its own class back."""
        release(self._user_model)
        self._profiler.close()
        self._compiled.clear()
        self._destroyed = True

    # --- internals -------------------------------------------------------------------------
    def _bind(self, args, kwargs) -> tuple:
        if self._destroyed:
            raise Error("this model was destroyed; create a new trainingModel/inferenceModel")
        if not kwargs:
            return tuple(args)
        bound = inspect.signature(self._user_model.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.args)

    def _schedule(self) -> Schedule:
        return self._schedule_value

    def _mesh(self):
        """The replica mesh, made once (the options are frozen)."""
        if self._mesh_value is None:
            self._mesh_value = replica_mesh(self._schedule_value.replicas)
        return self._mesh_value

    def _make_schedule(self) -> Schedule:
        opts = self._options
        mode = opts.output_mode
        if mode == OutputMode.Default:
            mode = OutputMode.Final if self._training else OutputMode.All
        return Schedule(
            device_iterations=opts.device_iterations,
            accumulation=opts.Training.gradient_accumulation if self._training else 1,
            replicas=opts.replication_factor,
            mean_reduction=opts.Training.accumulation_and_replication_reduction_type != ReductionType.Sum,
            output_mode=_OUTPUT_MODES[mode],
            output_period=opts.output_return_period or 1,
            dynamic_loss_scaling=self._training and opts.Training.auto_loss_scaling,
            stochastic_rounding=opts.Precision.stochastic_rounding,
            master_weights=self._training and opts.Precision.master_weights)

    def _micro_batch(self, args: tuple, schedule: Schedule) -> tuple:
        def first(x):
            if not isinstance(x, torch.Tensor):
                return x
            if x.ndim == 0 or x.shape[0] == 0 or x.numel() == 0:
                raise Error(f"inputs must have a non-empty batch dimension; got shape {tuple(x.shape)}")
            if x.shape[0] % schedule.factor:
                raise Error(
                    f"Invalid batch dimension: the input's batch dimension ({x.shape[0]}) must be a "
                    f"multiple of Options.deviceIterations({schedule.device_iterations}) * "
                    f"Options.replicationFactor({schedule.replicas}) * "
                    f"Options.Training.gradientAccumulation({schedule.accumulation}) = "
                    f"{schedule.factor}; resize the batch (or use poptorch.DataLoader, which "
                    "builds combined batches of the right size)")
            return x[: x.shape[0] // schedule.factor]

        return torch_pytree.tree_map(first, args)

    def _param_groups(self) -> tuple | None:
        """:func:`_param_group_values` of the optimizer (None without one), read once a call."""
        return None if self._optimizer is None else _param_group_values(self._optimizer)

    def _cache_key(self, args: tuple, groups: tuple | None) -> tuple:
        structure = None if groups is None else (groups[0],) + tuple(group[0] for group in groups[1:])
        return (self._training, self._step_method, self._options_key, structure, self._gradient_clipping,
                _signature(args))

    def _compile(self, args: tuple, groups: tuple | None) -> _Compiled:
        signature = self._cache_key(args, groups)
        compiled = self._compiled.get(signature) or _PROGRAMS.setdefault(self._user_model, {}).get(signature)
        if compiled is not None and (compiled.rule is None or self._rule_matches(compiled.rule, groups)):
            self._compiled[signature] = compiled
            return compiled
        if self._last_signature is not None:
            warnings.warn("the inputs' shapes or dtypes changed since the last call: compiling "
                          "again for the new ones (each distinct signature is compiled once)",
                          stacklevel=3)
        self._last_signature = signature
        schedule = self._schedule()
        micro = self._micro_batch(args, schedule)
        started = time.perf_counter()
        compiled = self._build(micro, schedule)
        compiled.started, compiled.inputs = started, serialization.input_specs(args)
        self._compiled[signature] = _PROGRAMS[self._user_model][signature] = compiled
        return compiled

    def _call_arguments(self, compiled: _Compiled, args: tuple, groups: tuple | None,
                        advance: bool = True, place_inputs: bool = True) -> tuple:
        """What the compiled call takes: device state, the combined batch (on the mesh if
        ``place_inputs``, else host arrays that the compiled call copies itself), the optimizer's
        current hyper-parameters (training), the executor's random key and the call's index (the
        program folds them into this call's key)."""
        schedule = self._schedule()
        mesh = None if compiled.multi_ipu else self._mesh()
        inputs = inputs_to_device(args, schedule, mesh) if place_inputs else host_inputs(args, schedule)
        key = self._base_key()
        index = np.uint32(self._next_call_index() if advance else 0)
        params, buffers = self._store.device_state()
        state = {"params": params, "buffers": buffers}
        if self._training:
            hyper = self._hyperparameters(compiled.rule, mesh, groups)
            state.update(opt=self._optimizer_state(compiled.rule, params),
                         scaler=self._scaler_state(compiled.rule, hyper))
        if mesh is not None and not self._is_resident(state):
            state = jax.device_put(state, NamedSharding(mesh, P()))
        return (state, inputs, hyper, key, index) if self._training else (state, inputs, key, index)

    def _offloads_optimizer_state(self, compiled: _Compiled) -> bool:
        """``setOptimizerLocation(...useOnChipStorage(False))`` on one IPU: between calls the
        optimizer state lives in host memory; the next call streams it in (split models do this
        per stage in runtime/stage_program.py)."""
        return (self._training and not compiled.multi_ipu
                and not self._options.TensorLocations.optimizer_on_chip)

    def _is_resident(self, state: dict) -> bool:
        """Whether ``state`` is what the last call left on the mesh (nothing replaced it since)."""
        last = self._resident
        return last is not None and all(value is last.get(name) for name, value in state.items())

    def _rule_matches(self, rule, values: tuple) -> bool:
        """``rule.matches(optimizer)``, checked again only when the param groups (``values``,
        :meth:`_param_groups`) changed."""
        if self._matched is not None and self._matched[0] is rule and self._matched[1] == values:
            return True
        if not rule.matches(self._optimizer):
            return False
        self._matched = (rule, values)
        return True

    def _hyperparameters(self, rule, mesh, values: tuple):
        """The optimizer's hyper-parameters on the mesh, rebuilt only when its param groups
        (``values``) changed (``setOptimizer``, a learning-rate scheduler, a value set by hand)."""
        cached = self._hyper
        if cached is None or cached[0] is not rule or cached[1] != values:
            hyper = rule.hyperparameters(self._optimizer)
            if mesh is not None:
                hyper = jax.device_put(hyper, NamedSharding(mesh, P()))
            self._hyper = cached = (rule, values, hyper)
        return cached[2]

    def _ensure_executable(self, compiled: _Compiled, call_args: tuple, load=None) -> None:
        """Lower and compile ahead of time, once (or ``load(lowered)`` a saved executable), check
        the memory and say how long capture and compilation took. A multi-IPU program was
        compiled and checked when it was built."""
        if compiled.executable is not None:
            return
        spec, check = memory.in_force(self._options)
        if compiled.multi_ipu:
            executable, usage = compiled.call, compiled.call.memory
        else:
            executable = (load or compile_lowered)(compiled.call.lower(*call_args))
            usage = single_ipu_usage(executable, call_args[0], self._schedule().replicas // self._mesh().size,
                                     optimizer_offloaded=self._offloads_optimizer_state(compiled))
            memory.check(usage, spec, check)
        compiled.executable = executable
        compiled.seconds = time.perf_counter() - compiled.started
        compiled.facts = self._facts(compiled, usage, spec)
        self._profiler.compiled(compiled.facts, call_args)
        logger.info("compiled the %s program in %.2f s", "training" if self._training else "inference",
                    time.perf_counter() - compiled.started)

    def _facts(self, compiled: _Compiled, usage: list, spec) -> ProgramFacts:
        """What a recorder is told of ``compiled``."""
        call = compiled.call
        if compiled.multi_ipu:
            execution, ipus, stages = call.execution, call.part.num_ipus, call.stage_facts()
        else:
            nodes = tuple(compiled.program.graph_module.graph.nodes)
            execution, ipus, stages = SINGLE_IPU, 1, (StageFacts(0, 0, nodes, {"step": compiled.executable}),)
        return ProgramFacts(training=self._training, schedule=self._schedule(), execution=execution,
                            ipus_per_replica=ipus, stages=stages, memory=usage, ipu_spec=spec,
                            compile_started=compiled.started)

    def _build(self, micro: tuple, schedule: Schedule) -> _Compiled:
        model = self._user_model
        was_training = model.training
        model.train(self._training)
        self._store.sync_to_host()
        compile_hooks.run(compile_hooks.PRE_COMPILE)
        try:
            program = compile_module(model, micro, method=self._step_method)
        finally:
            model.train(was_training)
            compile_hooks.run(compile_hooks.POST_COMPILE)
        layout = OutputLayout()
        mesh = replica_mesh(schedule.replicas)
        forward = _forward_with_constants(program, micro)
        nodes = [n for n in _output_nodes(program) if isinstance(n, torch.fx.Node)]
        results = _result_nodes(program)
        dtypes = [n.meta["val"].dtype for n in results]
        if program.mutated_inputs:
            if schedule.factor != 1:
                program.refuse_mutated_inputs(
                    "a call of several micro-batches (deviceIterations × replicationFactor × "
                    "gradientAccumulation > 1)")
            leaves = torch_pytree.tree_leaves(micro)
            dtypes += [leaves[i].dtype for i in program.mutated_inputs]
        log_names = [call.name for call in program.logs if call.is_tensor]
        log_dtypes = {name: n.meta["val"].dtype for name, n in zip(log_names, nodes[len(results):])}
        totals = totals_of(program.logs)
        log_dtypes.update({name + TOTAL_SUFFIX: log_dtypes[name] for name in totals})
        rule = loss_index = None
        if self._training:
            rule = optimizer_rule(self._optimizer, {id(p): n for n, p in
                                                    torch.nn.Module.named_parameters(model)})
            loss_index = find_loss(program, step_method=self._step_method is not None)
        if has_blocks(program.graph_module):        # split over IPUs
            multi = self._multi_ipu_program(micro, schedule, program, rule, loss_index)
            if multi is not None:
                return _Compiled(multi, program, multi.layout, dtypes, log_dtypes, multi.rule, multi_ipu=True)
        if self._training:
            if self._gradient_clipping is not None:
                rule = self._gradient_clipping.wrap(rule)
            call = training_call(forward, loss_index, rule, schedule, mesh, layout, totals)
            return _Compiled(call, program, layout, dtypes, log_dtypes, rule)
        return _Compiled(inference_call(forward, schedule, mesh, layout, totals), program, layout, dtypes,
                         log_dtypes)

    def _multi_ipu_program(self, micro: tuple, schedule: Schedule, program, rule, loss_index):
        """The program of a model with blocks split over IPUs (None when it all runs on IPU 0)."""
        opts = self._options
        spec, check = memory.in_force(opts)
        recomputation = opts._Popart.options.get("autoRecomputation", 0)
        split = SplitSettings(strategy=opts.execution_strategy, auto_round_num_ipus=opts.auto_round_num_ipus,
                              recomputation=int(getattr(recomputation, "value", recomputation)),
                              optimizer_on_chip=opts.TensorLocations.optimizer_on_chip,
                              ipu_spec=spec, memory_check=check)
        hyper = None if rule is None else rule.hyperparameters(self._optimizer)
        return build(self._user_model, program, micro, schedule, split, self._training, rule, hyper, loss_index,
                     self._step_method, self._gradient_clipping)

    def _optimizer_state(self, rule, params):
        if self._opt_state is None:
            has_torch_state = any(self._optimizer.state.get(p) for g in self._optimizer.param_groups
                                  for p in g["params"])
            self._opt_state = (rule.state_from_torch(self._optimizer, params) if has_torch_state
                               else rule.init(params))
            if self._schedule().master_weights:
                self._opt_state = {"rule": self._opt_state, "master": master_copy(params)}
        return self._opt_state

    def _scaler_state(self, rule, hyper):
        """Dynamic loss scaling state, starting from the optimizer's loss_scaling when it sets one."""
        if self._scaler is None and self._schedule().dynamic_loss_scaling:
            initial = float(rule.loss_scale(hyper))
            self._scaler = initial_scaler(initial if initial != 1.0 else None)
        return self._scaler

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (None unless automatic loss scaling is on)."""
        return None if self._scaler is None else float(self._scaler["scale"])

    def _optimizer_state_to_host(self) -> None:
        compiled = next(iter(self._compiled.values()), None)
        if self._opt_state is not None and compiled is not None:
            state = self._opt_state["rule"] if self._schedule().master_weights else self._opt_state
            compiled.rule.state_to_torch(jax.device_get(state), self._optimizer)

    def _base_key(self):
        """Options.randomSeed when set, else a seed drawn from torch's generator (so
        torch.manual_seed makes runs repeatable); made once, on the replica mesh."""
        if self._key is None:
            key = jax.random.key(self._seed)
            self._key = jax.device_put(key, NamedSharding(self._mesh(), P()))
        return self._key

    def _next_call_index(self) -> int:
        self._calls_made += 1
        return self._calls_made


def multi_ipu_program(executor: PoplarExecutor) -> MultiIpuProgram | None:
    """The multi-IPU program an executor last compiled (its placement and memory figures), or
    None for a single-IPU model or before the first compilation."""
    compiled = next(reversed(executor._compiled.values()), None) if executor._compiled else None
    call = getattr(compiled, "call", None)
    return call if isinstance(call, MultiIpuProgram) else None
