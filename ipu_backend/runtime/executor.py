"""PopTorch's executor (``PoplarExecutor``): one compiled step per input signature, weights on
the emulated IPUs, the user's module kept in sync."""

import dataclasses
import inspect
import time
import warnings
from collections.abc import Callable

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import compile_module, float32_precision
from ipu_backend.compiler.capture import host_known_input
from ipu_backend.compiler.lowering_options import current_options
from ipu_backend.errors import Error
from ipu_backend.runtime import compile_hooks, host_optimizer, perf_counters, processes, program_cache
from ipu_backend.runtime import replica_groups, serialization, variants
from ipu_backend.runtime.compile_progress import CAPTURE, phase
from ipu_backend.runtime.hyperparameters import HyperParameters, refuse_reads_changed, row
from ipu_backend.runtime.lifecycle import (
    NO_EXECUTABLE,
    CompiledStep,
    Executor,
    ProgramKey,
    first_micro_batch,
    input_signature,
    optimizer_state_for,
)
from ipu_backend.runtime.module_modes import capture_modes, guarding_modes
from ipu_backend.runtime.module_repr import module_repr
from ipu_backend.runtime.multi_ipu_builder import build, check_ipu_count
from ipu_backend.runtime.optimizers import needs_running_mean, notice_subclass
from ipu_backend.runtime.outputs import check_index_inputs, host_inputs, inputs_to_device
from ipu_backend.runtime.packing import Packing, kept_gradients
from ipu_backend.runtime.random_state import restore_random_state
from ipu_backend.runtime.recording import SINGLE_IPU
from ipu_backend.runtime.schedule import OUTPUT_MODE_NAMES, Schedule
from ipu_backend.runtime.stages import has_blocks
from ipu_backend.runtime.replica_buffers import ReplicaBuffers
from ipu_backend.runtime.step import OutputLayout, forward_with_constants, inference_call, initial_scaler
from ipu_backend.runtime.step import master_copy, training_call
from ipu_backend.runtime.update_rules import packed_rule, rule_and_loss
from ipu_backend.runtime.weights import claim_for_training, refuse_second_training_wrapper
from ipu_backend.runtime.xla_compile import compile_lowered, executables_from, program_settings


class PoplarExecutor(Executor, perf_counters.ExecutionCounters):
    """What ``trainingModel``/``inferenceModel`` return: call it like the model."""

    def __init__(self, model: torch.nn.Module, options, training: bool, optimizer=None,
                 step_method: str | None = None, gradient_clipping=None, recorder=None, keep_gradients: bool = False,
                 step_schedulers: Callable[[], None] | None = None):
        if training and optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapper = training and step_method is None         # a trainingModel: one per module at a time
        if wrapper:
            refuse_second_training_wrapper(model)
        self._hypers = HyperParameters(step_schedulers if training else None)
        """The optimizer's hyper-parameters of each call (``runtime/hyperparameters.py``)."""
        super().__init__(model, options, training, step_method, recorder, optimizer if training else None)
        self._made_with = (model, options, training, optimizer, step_method, gradient_clipping, self._profiler,
                           keep_gradients, step_schedulers)
        self._gradient_clipping = gradient_clipping
        """A ``runtime.clipping.GradientClipping`` applied before each optimizer update, or None."""
        self._keep_gradients, self._gradients = keep_gradients, None
        """Whether a training call keeps its last optimizer step's gradients (:meth:`gradients`)."""
        self._optimizer = optimizer
        self._last_signature = None
        self._opt_state = None
        self._scaler = None
        self._resident = None
        """The state the last call returned, already on the mesh: passed back without a copy."""
        self._attached = True
        self._destroyed = False
        self._weight_groupings = {}
        """Parameter name -> its ``replicaGrouping`` (``runtime/replica_groups.py``)."""
        self._replica_buffers = ReplicaBuffers()
        """Each replica's buffers under ``broadcastBuffers(False)`` (``runtime/replica_buffers.py``)."""
        if training:
            host_optimizer.watch(optimizer, self, PoplarExecutor._optimizer_states_to_host,
                                 PoplarExecutor._optimizer_state_loaded)
        if wrapper:
            claim_for_training(model, self)

    def _make_schedule(self) -> Schedule:
        schedule = super()._make_schedule()
        per_iteration = self._hypers.step_schedulers is not None and schedule.device_iterations > 1
        return dataclasses.replace(schedule, hyperparameters_per_iteration=per_iteration)

    def _check_settings(self) -> None:
        super()._check_settings()
        if not self._training and self._settings.gradient_accumulation != 1:
            staging = self._settings.staging
            pipelined = staging is None or (staging.pipelined and staging.phased is None)
            raise Error("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
                        "it as its default value (1) when running a poptorch.inferenceModel()."
                        + (" Use poptorch.Options().deviceIterations to process a sufficient number "
                           "of batches each run for pipelined execution instead." if pipelined else ""))

    # --- PopTorch's public surface -------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._user_model

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save(poptorch_model)``) as the wrapped model with the device's
        weights, as PopTorch's wrapped models are: loading gives the user's module."""
        return self._user_model.__reduce_ex__(protocol)

    def __getattr__(self, name):
        """Attributes of the wrapped model, as PopTorch's executor exposes them (a parameter
        with its ``replicaGrouping``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._user_model, name)
        if isinstance(value, torch.nn.Parameter):
            return replica_groups.GroupableParameter(value, name, self._weight_groupings)
        return value

    def __call__(self, *args, **kwargs):
        with self._store.lock:
            return self._call(args, kwargs)

    def _call(self, args, kwargs):
        args, keywords = self._bind(args, kwargs)
        self._profiler.started()
        groups = self._param_groups()
        with self._compilation():
            compiled, inputs = self._compile(args, groups, keywords)
            if compiled.program.index_inputs and self._synthetic is None:      # else never read
                check_index_inputs(args, compiled.program.index_inputs)
            if not self._attached:
                self.attachToDevice()
            call_args = self._call_arguments(compiled, inputs, groups,
                                             place_inputs=compiled.executable is None or self._profiler.times_inputs)
            self._ensure_executable(compiled, call_args, self._offloads_optimizer_state(compiled))
        return self._run(compiled, call_args, args)

    def compile(self, *args, **kwargs) -> None:
        """Compile for these inputs without running (PopTorch's ``compile``)."""
        with self._store.lock:
            args, keywords = self._bind(args, kwargs)
            self._profiler.started()
            groups = self._param_groups()
            with self._compilation():
                compiled, inputs = self._compile(args, groups, keywords)
                self._ensure_executable(compiled, self._call_arguments(compiled, inputs, groups, advance=False),
                                        self._offloads_optimizer_state(compiled))

    def isCompiled(self) -> bool:  # noqa: N802
        return any(c.executable is not None for c in self._compiled.values())

    # --- compiled programs in files (runtime/serialization.py) ------------------------------------
    def save(self, filename: str, export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save the compiled program (of the last call, or the last compiled) to ``filename``;
        with ``export_model``, also the model and optimizer, for :func:`ipu_backend.load`."""
        compiled = self._timed_program()
        if compiled is None:
            raise Error(NO_EXECUTABLE)
        filename = serialization.destination(filename)
        self.copyWeightsToHost()
        data = {"training": self._training, "options": self._options, "inputs": compiled.inputs,
                "programs": self._recorded_programs(compiled), "model": None, "optimizer": None,
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
        with executables_from(serialization.Loading(data, filename)) as loading, self._compilation():
            compiled, inputs = self._compile(args, groups)       # a split model compiles its stages here
            self._ensure_executable(compiled, self._call_arguments(compiled, inputs, groups, advance=False),
                                    self._offloads_optimizer_state(compiled))
        loading.check_complete()

    def _recorded_programs(self, compiled: CompiledStep) -> list[dict]:
        """What ``save`` writes of ``compiled``'s executables: the program is built again (not
        compiled) for the shapes it was compiled for, each program noted as the runtime asks for
        its executable."""
        args = serialization.example_inputs(compiled.inputs)
        if not compiled.multi_ipu:
            with executables_from(serialization.Recording([compiled.executable])) as recording:
                compile_lowered(compiled.call.lower(
                    *self._call_arguments(compiled, args, self._param_groups(), advance=False)))
            return recording.programs
        executables = [p for stage in compiled.call.stages for p in stage.programs.values()]
        rule, loss_index, _ = self._rule_and_loss(compiled.program)
        schedule = self._schedule()
        with executables_from(serialization.Recording(executables)) as recording:
            self._split_program(first_micro_batch(args, schedule), schedule, compiled.program, rule, loss_index)
        return recording.programs

    def __repr__(self) -> str:
        """The model's ``repr``, with its ``BeginBlock`` annotations (PopTorch's ``module_repr``)."""
        return module_repr(self._user_model)

    def copyWeightsToHost(self) -> None:  # noqa: N802
        self._refuse_if_destroyed()
        super().copyWeightsToHost()

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
        names = self._settings.updatable_named_buffers
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
        self._seed, self._calls_made = restore_random_state(state)
        self._key = None

    def copyWeightsToDevice(self) -> None:  # noqa: N802
        self._refuse_if_destroyed()
        with self._store.lock:
            compiled = next(iter(self._compiled.values()), None)
            self._store.load_from_host(Packing() if compiled is None else compiled.packing)
            if self._opt_state is not None and self._schedule().master_weights:
                self._opt_state = {**self._opt_state, "master": master_copy(self._store.params)}

    def load_state_dict(self, state_dict, strict: bool = True):
        """The wrapped model's ``load_state_dict``, then its weights go to the device (as PopTorch
        does), so the next call runs with the loaded values."""
        self.copyWeightsToHost()
        result = torch.nn.Module.load_state_dict(self._user_model, state_dict, strict)
        self.copyWeightsToDevice()
        return result

    def setOptimizer(self, optimizer) -> None:  # noqa: N802
        """Use ``optimizer``'s hyper-parameters from the next call on; they are program inputs,
        so this never recompiles unless the optimizer's kind or parameter groups change."""
        if not self._training:
            raise Error("setOptimizer is only available on a trainingModel")
        if needs_running_mean(optimizer) and not self._settings.running_mean:
            if self.isCompiled():
                raise ValueError("Invalid optimizer: the new optimizer would require changing "
                                 "options.Training.meanAccumulationAndReplicationReductionStrategy to "
                                 "poptorch.MeanReductionStrategy.Running but the executable is already "
                                 "compiled.")
            self._options = self._options.for_model(optimizer)
            self._settings = self._options.runtime_settings()
        old = self._optimizer
        if optimizer is not old:
            self._optimizer_states_to_host()
            host_optimizer.release(old)
            notice_subclass(optimizer)
            host_optimizer.watch(optimizer, self, PoplarExecutor._optimizer_states_to_host,
                                 PoplarExecutor._optimizer_state_loaded)
        self._optimizer = optimizer
        compiled = next(iter(self._compiled.values()), None)
        if type(old) is not type(optimizer) or (compiled is not None and not compiled.rule.matches(optimizer)):
            self._optimizer_states_to_host()    # a state the new rule lacks stays there, as in torch
            self._compiled.clear()
            self._opt_state = None

    def attachToDevice(self) -> None:  # noqa: N802
        if self._attached:
            raise Error("Device is already attached")
        self._attached = True

    def detachFromDevice(self) -> None:  # noqa: N802
        if not self._attached:
            raise Error("Device is not attached")
        self.copyWeightsToHost()
        self._attached = False

    def isAttachedToDevice(self) -> bool:  # noqa: N802
        return self._attached

    def ipuPlacement(self) -> dict[str, int]:  # noqa: N802
        """Parameter name → the IPU holding it (IPU 0 for every parameter of a single-IPU model)."""
        compiled = next(iter(self._compiled.values()), None)
        placement = getattr(getattr(compiled, "call", None), "placement", {})
        return {name: placement.get(name, 0) for name, _ in torch.nn.Module.named_parameters(self._user_model)}

    def destroy(self) -> None:
        """Release the device (see :meth:`Executor.destroy`) and the optimizer."""
        super().destroy()
        if self._optimizer is not None:
            host_optimizer.release(self._optimizer)
        self._destroyed = True

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (None unless automatic loss scaling is on)."""
        return None if self._scaler is None else float(self._scaler["scale"])

    # --- the life cycle's steps for this kind ----------------------------------------------
    def _execution(self) -> str:
        return SINGLE_IPU

    def _torch_optimizers(self) -> list:
        return [self._optimizer]

    def _optimizer_state_loaded(self) -> None:
        """The torch optimizer's state was loaded on the host: the next call starts from it."""
        with self._store.lock:
            self._opt_state = None
            self._opt_states_on_host = True

    def _host_weights_loaded(self, names: set) -> None:
        """Float32 master copies of weights written on the host follow them."""
        if self._opt_state is not None and self._schedule().master_weights:
            master = self._opt_state["master"]
            fresh = master_copy({n: self._store.params[n] for n in names if n in master})
            self._opt_state = {**self._opt_state, "master": {**master, **fresh}}

    def _device_optimizer_states(self) -> tuple | None:
        if self._opt_state is None:
            return None
        return (self._opt_state["rule"] if self._schedule().master_weights else self._opt_state,)

    def _keep(self, compiled: CompiledStep, state: dict) -> None:
        if "grads" in state:
            self._gradients = (state.pop("grads"), compiled.packing)
        if self._training:
            self._opt_state, self._scaler = state["opt"], state["scaler"]
        self._resident = None if compiled.multi_ipu else state
        if self._schedule().per_replica_buffers and not compiled.multi_ipu:
            rows = state["buffers"]
            state["buffers"] = self._replica_buffers.kept(rows)      # the store keeps replica 0's
            self._resident = {**state, "buffers": rows}
        if self._offloads_optimizer_state(compiled):
            host_memory = NamedSharding(self._mesh(), P(), memory_kind="pinned_host")
            self._opt_state = jax.device_put(self._opt_state, host_memory)

    def gradients(self) -> dict[str, torch.Tensor]:
        """With ``keep_gradients``: the last training call's last optimizer step's gradients, as
        its update took them (averaged over micro-batches and replicas, unscaled, not yet clipped),
        by parameter name; empty before the first call."""
        return {} if self._gradients is None else kept_gradients(*self._gradients, self._user_model)

    # --- internals -------------------------------------------------------------------------
    def _refuse_if_destroyed(self) -> None:
        if self._destroyed:
            raise Error(NO_EXECUTABLE)

    def _bind(self, args, kwargs) -> tuple[tuple, tuple]:
        """The call's arguments as Python binds them to ``forward``: ``(inputs, keywords)``, the
        inputs being the positional arguments (parameters given by keyword included, defaults
        filled in) followed by the values of the ``keywords`` (keyword-only and ``**kwargs``
        arguments), which the program receives by keyword."""
        if self._destroyed:         # PopTorch compiles a destroyed model again when it is called
            self.__init__(*self._made_with)
        if not kwargs:
            return tuple(args), ()
        try:
            bound = inspect.signature(self._user_model.forward).bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self._user_model).__name__}.forward(): {error}") from None
        bound.apply_defaults()
        return tuple(bound.args) + tuple(bound.kwargs.values()), tuple(bound.kwargs)

    def _param_groups(self) -> tuple | None:
        """``host_optimizer.param_group_values`` of the optimizer (None without one), read once a call."""
        return None if self._optimizer is None else host_optimizer.param_group_values(self._optimizer, self._user_model)

    def _cache_key(self, args: tuple, groups: tuple | None, keywords: tuple) -> tuple:
        structure = None if groups is None else (groups[0],) + tuple(group[0] for group in groups[1:])
        settings = (self._training, self._step_method, self._settings.key, self._gradient_clipping,
                    self._keep_gradients, tuple(self._weight_groupings.items()),
                    self._schedule().hyperparameters_per_iteration)
        return ProgramKey(settings, structure, program_settings(), (input_signature(args), keywords))

    def _compile(self, args: tuple, groups: tuple | None, keywords: tuple = ()) -> tuple[CompiledStep, tuple]:
        """The compiled step for ``args`` and the inputs its call takes: ``args``, and when the
        step branches in Python on a host-known input, each micro-batch's variant
        (``runtime/variants.py``); a call whose micro-batches take new branches compiles again."""
        signature = self._cache_key(args, groups, keywords)
        compiled = self._compiled.get(signature)
        stale = compiled is not None and self._reads_changed(compiled)
        known = ()
        if compiled is not None and not stale and (
                compiled.rule is None or self._hypers.matches(compiled.rule, self._optimizer, groups)):
            if not compiled.program.variants:
                return compiled, args
            inputs = variants.with_choice(compiled.program, args, self._schedule())
            if inputs is not None:
                return compiled, inputs
            known = compiled.program.variants
        elif self._last_signature is not None and not stale:
            warnings.warn(f"{signature.changes(self._last_signature)} changed since the last call: compiling "
                          "again for the new ones (each distinct signature is compiled once)", stacklevel=3)
        self._last_signature = signature
        float32_precision.note_compiled(signature.torch_settings)
        schedule = self._schedule()
        started = time.perf_counter()
        program = variants.covering(lambda micro: self._capture(micro, keywords), first_micro_batch(args, schedule),
                                    args, schedule, known, self._step_method or "model")
        inputs = variants.with_choice(program, args, schedule) if program.variants else args
        compiled = self._build(program, first_micro_batch(inputs, schedule), schedule, started, keywords)
        compiled.inputs = serialization.input_specs(inputs)
        self._compiled[signature] = compiled
        return compiled, inputs

    def _call_arguments(self, compiled: CompiledStep, args: tuple, groups: tuple | None,
                        advance: bool = True, place_inputs: bool = True) -> tuple:
        """What the compiled call takes: device state, the combined batch (on the mesh if
        ``place_inputs``, else host arrays that the compiled call copies itself; made on the device
        under synthetic data), the optimizer's current hyper-parameters (training), the executor's
        random key and the call's index (the program folds them into this call's key)."""
        schedule = self._schedule()
        mesh = None if compiled.multi_ipu else self._mesh()
        place_inputs = place_inputs or schedule.processes > 1    # a program over processes takes global arrays
        inputs = (self._synthetic.inputs(compiled.program, args, schedule, mesh) if self._synthetic else
                  inputs_to_device(args, schedule, mesh) if place_inputs else host_inputs(args, schedule))
        key = self._base_key()
        index = np.uint32(self._next_call_index() if advance else 0)
        self._start(compiled.packing)
        params, buffers = self._store.device_state(compiled.packing)
        if schedule.per_replica_buffers and not compiled.multi_ipu:
            buffers = self._replica_buffers.for_call(buffers, schedule.replicas, mesh)
        state = {"params": params, "buffers": buffers}
        if self._training:
            iterations = schedule.device_iterations if schedule.hyperparameters_per_iteration else None
            hyper = self._hypers.for_call(compiled.rule, self._optimizer, mesh, groups, iterations, advance,
                                          lambda: refuse_reads_changed(compiled.program, self._step_method))
            state.update(opt=self._optimizer_state(compiled.rule, params),
                         scaler=self._scaler_state(compiled.rule, row(hyper, schedule, 0)))
        if mesh is not None and not self._is_resident(state):
            rows = state.pop("buffers") if schedule.per_replica_buffers else None   # already sharded
            state = processes.replicated(state, mesh, first_process=True)
            if rows is not None:
                state["buffers"] = rows
        return (state, inputs, hyper, key, index) if self._training else (state, inputs, key, index)

    def _offloads_optimizer_state(self, compiled: CompiledStep) -> bool:
        """``setOptimizerLocation(...useOnChipStorage(False))`` on one IPU: between calls the
        optimizer state lives in host memory; the next call streams it in (split models do this
        per stage in runtime/stage_program.py)."""
        return self._training and not compiled.multi_ipu and not self._settings.optimizer_on_chip

    def _is_resident(self, state: dict) -> bool:
        """Whether ``state`` is what the last call left on the mesh (nothing replaced it since)."""
        last = self._resident
        return last is not None and all(value is last.get(name) for name, value in state.items())

    def _build(self, program, micro: tuple, schedule: Schedule, started: float, keywords: tuple = ()) -> CompiledStep:
        """The compiled program of ``program`` (a capture of the model on ``micro``): one the
        process already compiled for an equal capture (same identity, options, optimizer structure
        and inputs), else a new one."""
        rule, loss_index, without_gradient = self._rule_and_loss(program)
        shared_key = None if program.identity is None else (
            program.identity, self._training, self._step_method, self._settings.key,
            self._schedule().hyperparameters_per_iteration,
            None if rule is None else rule.structure, self._gradient_clipping, self._keep_gradients,
            program_settings(),
            input_signature(micro), keywords, current_options(), tuple(self._weight_groupings.items()))
        shared = None if shared_key is None else program_cache.SHARED.get(shared_key)
        if shared is not None:
            rules = () if rule is None else (rule,) if shared.multi_ipu else (self._packed_rule(program, without_gradient)[1],)
            return shared.reused(program, rules, started)
        compiled = self._compiled_step(program, micro, schedule, rule, loss_index, without_gradient, shared_key)
        compiled.started, compiled.shared_key = started, shared_key
        return compiled

    def _capture(self, micro: tuple, keywords: tuple):
        """The model (or its step method) captured on ``micro`` in this executor's mode."""
        model = self._user_model
        self._store.sync_to_host()
        compile_hooks.run(compile_hooks.PRE_COMPILE)
        try:
            with capture_modes(model, self._training, self._step_method), phase(CAPTURE), \
                    self._capturing() as optimizer_reads, replica_groups.one_group_each(model, self._replica_rows()):
                program = compile_module(model, micro, method=self._step_method, keywords=keywords,
                                         loop_repeated_layers=self._settings.loop_repeated_layers,
                                         host_input=None if self._step_method is None else host_known_input())
            return guarding_modes(self._guarded(program, optimizer_reads), model, self._training, self._step_method)
        finally:
            compile_hooks.run(compile_hooks.POST_COMPILE)

    def _compiled_step(self, program, micro: tuple, schedule: Schedule, rule, loss_index,
                       without_gradient: frozenset, shared_key: tuple | None = None) -> CompiledStep:
        """The device program of ``program`` (not yet compiled, unless split over IPUs: then
        compiled, its stage programs through the executable cache under ``shared_key``)."""
        layout = OutputLayout()
        mesh = self._mesh()
        forward = forward_with_constants(program, micro)
        dtypes = [n.meta["val"].dtype for n in program.result_arrays()]
        if program.mutated_inputs:
            if schedule.factor != 1 and schedule.output_mode != "all":
                program.refuse_mutated_inputs(
                    f"a call of several micro-batches with OutputMode.{OUTPUT_MODE_NAMES[schedule.output_mode]} "
                    "(it returns some micro-batches' results; OutputMode.All returns them all)")
            leaves = torch_pytree.tree_leaves(micro)
            dtypes += [leaves[i].dtype for i in program.mutated_inputs]
        log_dtypes = program.logged_dtypes()
        totals = program.call_totals()
        if has_blocks(program.graph_module) and schedule.processes > 1:
            raise Error("a model split over IPUs (BeginBlock, Block, Stage) runs in one process: several "
                        "processes (Options.Distributed) replicate single-IPU models only")
        views = replica_groups.replica_views(self._replica_rows())
        if has_blocks(program.graph_module) and (views is not None or schedule.per_replica_buffers):
            raise Error("a model split over IPUs (BeginBlock, Block, Stage) cannot group weights over "
                        "replicas (replicaGrouping) or keep per-replica buffers (broadcastBuffers(False)): "
                        "they run on single-IPU models")
        if has_blocks(program.graph_module) and program.variants:
            raise Error("a model split over IPUs (BeginBlock, Block, Stage) cannot branch in Python on "
                        f"batch_idx, current_epoch or global_step (at {program.guards[0].location}): "
                        "choose the value with torch.where instead")
        if has_blocks(program.graph_module) and self._keep_gradients:
            raise Error("a model split over IPUs (BeginBlock, Block, Stage) keeps each stage's gradients on its own "
                        "IPU: the host cannot read them (.grad in Lightning's on_after_backward or "
                        "on_before_optimizer_step hooks); read them on a single-IPU model")
        if has_blocks(program.graph_module):        # split over IPUs
            with self._stage_programs_cached(shared_key) as stage_programs:
                multi = self._split_program(micro, schedule, program, rule, loss_index)
            if multi is not None:
                compiled = CompiledStep(multi, program, multi.layout, dtypes, log_dtypes, (multi.rule,), multi_ipu=True)
                compiled.loaded = stage_programs is not None and stage_programs.compiled == 0 and stage_programs.loaded > 0
                return compiled
        check_ipu_count(schedule.replicas, self._settings.auto_round_num_ipus)
        if not self._training:
            return CompiledStep(inference_call(forward, schedule, mesh, layout, totals, views), program, layout, dtypes,
                                log_dtypes, packing=Packing(program.stacks))
        packing, rule = self._packed_rule(program, without_gradient)
        call = training_call(forward, loss_index, rule, schedule, mesh, layout, totals, views, self._keep_gradients)
        return CompiledStep(call, program, layout, dtypes, log_dtypes, (rule,), packing=packing)

    def _packed_rule(self, program, without_gradient: frozenset) -> tuple:
        return packed_rule(program, self._user_model, self._optimizer, without_gradient, self._gradient_clipping)

    def _rule_and_loss(self, program) -> tuple:
        """``update_rules.rule_and_loss`` of a training program; (None, None, empty) for inference."""
        if not self._training:
            return None, None, frozenset()
        return rule_and_loss(program, self._user_model, self._optimizer, self._step_method)

    def _replica_rows(self) -> dict:
        """Each grouped weight's row for each replica (``replica_groups.replica_rows``)."""
        return replica_groups.replica_rows(self._weight_groupings, self._user_model, self._schedule().replicas)

    def _split_program(self, micro: tuple, schedule: Schedule, program, rule, loss_index):
        """The program of a model with blocks split over IPUs (None when it all runs on IPU 0)."""
        hyper = None if rule is None else rule.hyperparameters(self._optimizer)
        return build(self._user_model, program, micro, schedule, self._settings, self._training, rule, hyper,
                     loss_index, self._step_method, self._gradient_clipping)

    def _optimizer_state(self, rule, params):
        self._opt_state = optimizer_state_for(rule, self._opt_state, self._state_rules[0] if self._state_rules else None,
                                              self._optimizer, params, params if self._schedule().master_weights else None)
        self._state_rules = (rule,)
        return self._opt_state

    def _scaler_state(self, rule, hyper):
        """Dynamic loss scaling state, starting from the optimizer's loss_scaling when it sets one."""
        if self._scaler is None and self._schedule().dynamic_loss_scaling:
            initial = float(rule.loss_scale(hyper))
            self._scaler = initial_scaler(initial if initial != 1.0 else None)
        return self._scaler
