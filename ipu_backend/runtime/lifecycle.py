"""The life cycle every executor shares, whatever it compiles: a training or inference step
(:class:`~ipu_backend.runtime.executor.PoplarExecutor`) or a manual-optimization step
(:class:`~ipu_backend.runtime.manual.ManualStepExecutor`).

Once: the options are frozen (the executor keeps its own frozen copy and reads them as
:class:`~ipu_backend.runtime.settings.RunSettings`), the seed is drawn, the executable cache set
up, and the module's weight store joined. Per input signature: the program is built and, ahead
of its first call, compiled (its phases shown and logged: ``compile_progress.py``), its memory
checked and the recorder told. Per call: the arguments placed, the program run, the state it
returns kept on the device, the queued host work run while it computes, and the outputs brought
to the host in PopTorch's shapes.
"""

import contextlib
import copy
import dataclasses
import logging
import time
import warnings
from typing import NamedTuple

import jax
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler import (attribute_writes, containers, decomposition_cache, optimizer_reads, python_reads,
                                  runtime_checks)
from ipu_backend.compiler.capture import refuse_backward_hooks
from ipu_backend.errors import Error
from ipu_backend.runtime import (
    compile_progress,
    executable_cache,
    float_exceptions,
    host_idle,
    host_optimizer,
    memory,
    perf_counters,
    processes,
    program_cache,
    synthetic_data,
)
from ipu_backend.runtime.devices import replica_mesh
from ipu_backend.runtime.optimizers import notice_subclass
from ipu_backend.runtime.outputs import output_to_host
from ipu_backend.runtime.packing import Packing
from ipu_backend.runtime.random_state import seed_key
from ipu_backend.runtime.recording import NullRecorder, ProgramFacts, StageFacts
from ipu_backend.runtime.schedule import Schedule
from ipu_backend.runtime.settings import RunSettings
from ipu_backend.runtime.step import OutputLayout, master_copy
from ipu_backend.runtime.weights import release, weight_store
from ipu_backend.runtime.xla_compile import compile_jitted, executables_from, matmul_autotuning, substituted

logger = logging.getLogger("ipu_backend")

RECAPTURE_WARNING_LIMIT = 8
"""Captures again for changed Python attributes after which an executor warns that one keeps
changing (torch.compile's recompile limit)."""

NO_EXECUTABLE = "Model has not been compiled or has been destroyed."
"""PopTorch's error for a query that needs a compiled model."""


class CompiledStep:
    """One compiled call and what the host needs to use it."""

    def __init__(self, call, program, layout: OutputLayout, output_dtypes: list, log_dtypes: dict,
                 rules: tuple = (), multi_ipu: bool = False, events: tuple | None = None,
                 packing: Packing = Packing()):
        self.call, self.program, self.layout = call, program, layout
        self.packing = packing
        """How the call takes and returns the parameters (a loop's layers stacked: packing.py)."""
        self.output_dtypes, self.log_dtypes = output_dtypes, log_dtypes
        self.rules = rules
        """The optimizer rules of the program's optimizers (none for inference)."""
        self.multi_ipu = multi_ipu
        """A model split over IPUs: ``call`` is a :class:`~ipu_backend.runtime.multi_ipu.MultiIpuProgram`,
        which places weights and inputs on each stage's IPUs itself and was compiled (and its
        memory checked) when built; otherwise ``call`` is jitted, compiled ahead of its first call."""
        self.events = events
        """A manual-optimization step's backward passes and optimizer steps, in order."""
        self.executable = None
        self.usage = None
        """The memory estimate of each IPU, made when it was compiled."""
        self.facts: ProgramFacts | None = None
        """What this executor's recorder was told of it, once it had it compiled."""
        self.shared_key = None
        """Its key among the process's programs (:data:`~ipu_backend.runtime.program_cache.SHARED`),
        or None when it is not shared (its capture has no identity)."""
        self.started = time.perf_counter()
        self.seconds = None               # from capture to executable (compilationTime)
        self.inputs = None                # the shapes and dtypes it was compiled for (save)
        self.loaded = False
        """A model split over IPUs whose stage programs all came from the executable cache."""

    @property
    def rule(self):
        return self.rules[0] if self.rules else None

    def reused(self, program, rules: tuple, started: float) -> "CompiledStep":
        """This compiled program as another executor uses it: with that executor's own capture
        ``program`` (of equal identity: its Python reads are that executor's module's) and
        optimizer ``rules`` (equal in structure, bound to its own optimizers), timed from its
        capture."""
        view = copy.copy(self)
        view.program, view.rules, view.started, view.facts, view.seconds = program, rules, started, None, None
        return view


class ProgramKey(NamedTuple):
    """What selects one of an executor's compiled programs; :meth:`changes` names what differs."""

    settings: tuple
    param_groups: tuple | None
    torch_settings: object
    inputs: tuple

    def changes(self, other: "ProgramKey") -> str:
        return " and ".join(_KEY_PARTS[field] for field in self._fields if getattr(self, field) != getattr(other, field))


_KEY_PARTS = {"settings": "the executor's settings", "param_groups": "the optimizer's param groups",
              "torch_settings": "torch's float32 precision or cudnn.benchmark settings",
              "inputs": "the inputs' shapes, dtypes or other values"}
"""How a recompilation warning names each part of a :class:`ProgramKey`."""


def input_signature(args: tuple) -> tuple:
    """The shapes and dtypes of ``args`` (and any non-tensor values), with their structure: a
    flat tuple of tensors, the usual call, is told apart without building a pytree spec."""
    if all(type(x) is torch.Tensor for x in args):
        return tuple((x.shape, x.dtype) for x in args)
    containers.register(args)
    leaves, spec = torch_pytree.tree_flatten(args)
    return (spec,) + tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", x)
                           for x in leaves)


def first_micro_batch(args: tuple, schedule: Schedule) -> tuple:
    """The first micro-batch of a combined batch: what a program is captured on. A part of a
    combined batch is a copy, not a view of it: torch.export replays each view input's view
    from its base, work a capture on plain tensors does not do."""
    def first(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.ndim == 0 and schedule.factor == 1:
            return x                  # a call of one micro-batch takes a scalar whole, as PopTorch
        if x.ndim == 0:
            raise Error(
                f"a 0-d (scalar) input cannot be split into the call's {schedule.factor} micro-batches "
                "(Options.deviceIterations x replicationFactor x Training.gradientAccumulation); give it "
                "a batch dimension")
        if x.shape[0] == 0 or x.numel() == 0:
            raise Error(f"inputs must have a non-empty batch dimension; got shape {tuple(x.shape)}")
        if x.shape[0] % schedule.factor:
            replicas = (f"Options.replicationFactor({schedule.local_replicas})" if schedule.input_group_size == 1
                        else f"(Options.replicationFactor({schedule.local_replicas}) / "
                             f"Options.inputReplicaGrouping.input_group_size({schedule.input_group_size}))")
            raise Error(
                f"Invalid batch dimension: the input's batch dimension ({x.shape[0]}) must be a "
                f"multiple of Options.deviceIterations({schedule.device_iterations}) * {replicas} * "
                f"Options.Training.gradientAccumulation({schedule.accumulation}) = "
                f"{schedule.factor}; resize the batch (or use poptorch.DataLoader, which "
                "builds combined batches of the right size, with drop_last=True, its default, where "
                "the dataset does not divide into them)")
        count = x.shape[0] // schedule.factor
        return x if count == x.shape[0] else x[:count].clone()

    return torch_pytree.tree_map(first, args)


def optimizer_state(rule, optimizer: torch.optim.Optimizer, params: dict):
    """The optimizer's state on the device: the one torch holds (after ``load_state_dict`` or
    eager steps), else fresh."""
    has_torch_state = any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"])
    return rule.state_from_torch(optimizer, params) if has_torch_state else rule.init(params)


def optimizer_state_for(rule, state, old_rule, optimizer: torch.optim.Optimizer, params: dict, master_names=None):
    """The device's optimizer state for ``rule``: ``state`` (laid out for ``old_rule``) as it is,
    carried over when the optimizer's param groups changed since, or made when there is none
    (with the float32 master copies of ``master_names`` under master weights)."""
    if state is None:
        made = optimizer_state(rule, optimizer, params)
        return made if master_names is None else {"rule": made, "master": master_copy({n: params[n] for n in master_names})}
    if rule is old_rule or rule.structure == old_rule.structure:
        return state
    return carried_optimizer_state(old_rule, state, rule, params, master_names)


def carried_optimizer_state(old_rule, state, rule, params: dict, master_names=None):
    """The device state ``state`` of ``old_rule`` for ``rule``, a rule of the same torch optimizer
    after its param groups changed: each parameter keeps its state, a new one starts fresh
    (``OptimizerRule.carried_over``). With master weights (``master_names``: the parameters
    whose float32 copies the state holds), each keeps its master copy too."""
    if master_names is None:
        return rule.carried_over(old_rule.members_state(state), params)
    kept = state["master"]
    master = {name: kept[name] if name in kept and kept[name].shape == fresh.shape else fresh
              for name, fresh in master_copy({name: params[name] for name in master_names}).items()}
    return {"rule": rule.carried_over(old_rule.members_state(state["rule"]), params), "master": master}


def _copy_back_inputs(result, args: tuple, indices: tuple):
    """The model's outputs, after writing the new values of the inputs it updated in place into
    the caller's tensors (as PopTorch does)."""
    outputs, new_values = result
    leaves = torch_pytree.tree_leaves(args)
    with torch.no_grad():
        for index, value in zip(indices, new_values):
            leaves[index].copy_(value)
    return outputs


def schedule_for(settings: RunSettings, training: bool) -> Schedule:
    """How one host call of a model with these settings is split."""
    mode = settings.output_mode or ("final" if training else "all")
    _check_input_groups(settings)
    if not settings.broadcast_buffers and settings.processes > 1:
        raise Error("Options.broadcastBuffers(False) with several processes (Options.Distributed) is not "
                    "emulated: per-replica buffers are kept in one process")
    return Schedule(
        device_iterations=settings.device_iterations,
        accumulation=settings.gradient_accumulation if training else 1,
        replicas=settings.replication_factor * settings.processes,
        processes=settings.processes,
        mean_reduction=settings.mean_reduction,
        output_mode=mode,
        output_period=settings.output_period,
        dynamic_loss_scaling=training and settings.auto_loss_scaling,
        stochastic_rounding=settings.stochastic_rounding,
        master_weights=training and settings.master_weights,
        input_group_size=settings.input_group_size,
        input_groups_orthogonal=settings.input_groups_orthogonal,
        per_replica_buffers=not settings.broadcast_buffers)


def _check_input_groups(settings: RunSettings) -> None:
    """Input groups must divide the replicas, all in one process."""
    size = settings.input_group_size
    if size == 1:
        return
    if settings.replication_factor % size:
        raise Error(f"Options.inputReplicaGrouping's input_group_size ({size}) must be a factor of "
                    f"replication_factor ({settings.replication_factor}): change one of them")
    if settings.processes > 1:
        raise Error("Options.inputReplicaGrouping with several processes (Options.Distributed) is not "
                    "emulated: groups of replicas sharing input data run in one process")


class Executor:
    """The life cycle (see the module docstring); a kind of executor builds its programs
    (:meth:`_build`) and keeps what a call returns beyond the weights (:meth:`_keep`).

    ``options`` is an ``ipu_backend.Options``: the executor keeps a frozen copy
    (``for_model(optimizer)``) and reads its ``runtime_settings()``. ``recorder`` gets the
    executor's events (:mod:`~ipu_backend.runtime.recording`).
    """

    def __init__(self, model: torch.nn.Module, options, training: bool, step_method: str | None, recorder,
                 optimizer=None):
        if optimizer is not None:
            notice_subclass(optimizer)
        self._options = options.for_model(optimizer, training)
        self._settings: RunSettings = self._options.runtime_settings()
        self._user_model = model
        self._training = training
        self._step_method = step_method
        self._check_settings()
        self.last_logs: dict = {}
        """``self.log`` values of the last call (step methods), per the output mode."""
        self.last_program = None
        """The compiled Program that ran in the last call (its ``logs``, output shapes)."""
        self._store = weight_store(model)
        self._compiled = program_cache.ProgramCache()
        """This executor's compiled programs, by input signature (the latest ones)."""
        self._recaptures = 0
        """How often a changed Python attribute made this executor capture its program again."""
        self._check_processes()
        seed = self._settings.random_seed
        if seed is None:
            with torch.random.fork_rng(devices=[]):     # as in PopTorch, the script's draws stay as they were
                seed = int(torch.randint(0, 2**31 - 1, ()))
        if self._settings.processes > 1:
            seed = int(processes.from_first_process(np.int32(seed)))
        self._seed = seed
        """Options.randomSeed, else drawn from torch's generator without advancing it; over several
        processes, process 0's."""
        self._synthetic = synthetic_data.for_settings(self._settings.synthetic_data, seed)
        """The inputs made on the device under ``Options.enableSyntheticData`` (None: the caller's)."""
        self._key = None
        self._calls_made = 0
        self._started = False
        """Whether a call (or ``compile``) has run: the first starts from the module's host state."""
        self._opt_states_on_host = True
        """Whether the torch optimizers' ``state`` holds what the device's optimizer state holds."""
        self._state_rules = ()
        """The rules the device's optimizer states are laid out for, one per torch optimizer."""
        self._schedule_value = self._make_schedule()
        self._mesh_value = None
        if training:
            self._store.on_host_sync.append(self._optimizer_states_to_host)
            self._store.on_host_load.append(self._host_weights_loaded)
        self._executable_cache = executable_cache.for_setting(self._settings.executable_cache_dir)
        """Where this executor's programs are kept on disk (None: they are not)."""
        self._profiler = recorder if recorder is not None else NullRecorder()
        """Where the executor reports its compilations and calls."""
        self._store.executors.add(self)

    @property
    def options(self):
        return self._options

    def copyWeightsToHost(self) -> None:  # noqa: N802  (PopTorch's name)
        self._store.sync_to_host()

    def destroy(self) -> None:
        """Release the device: weights reach the host, and the module gets its own class back once
        no other executor uses them."""
        release(self._user_model, self)
        self._profiler.close()
        self._compiled.clear()

    def _reads_changed(self, compiled: "CompiledStep") -> bool:
        """Whether a plain Python attribute that ``compiled`` was captured with (``self.alpha``
        read by a step or forward) has another value now, so that the program must be captured
        again: a program never runs with a stale value baked in."""
        changes = python_reads.changed(compiled.program.python_reads)
        if not changes:
            return False
        self._recaptures += 1
        described = ", ".join(python_reads.described(read, value) for read, value in changes)
        what = self._step_method or "model"
        logger.info("capturing the %s again: %s changed since it was captured", what, described)
        if self._recaptures == RECAPTURE_WARNING_LIMIT:
            warnings.warn(f"the {what} was captured and compiled again {self._recaptures} times because "
                          f"Python attributes it reads keep changing (now {described}): each change "
                          "compiles a new program. Keep a value that changes as a tensor (a buffer, "
                          "register_buffer) or pass it as an input, so that one program serves",
                          stacklevel=4)
        return True

    # --- for each kind ---------------------------------------------------------------------
    def _check_settings(self) -> None:
        """Refuse settings this kind cannot honour (before anything else is set up)."""
        synthetic_data.check_mode(self._settings.synthetic_data, self._settings.processes)

    def _check_processes(self) -> None:
        """Several processes (``Options.Distributed``) must be the ones JAX connects."""
        count, index = self._settings.processes, self._settings.process_index
        if count > 1 and (processes.process_count(), jax.process_index()) != (count, index):
            raise Error(f"Options.Distributed makes this process {index} of {count}, but JAX connects "
                        f"{processes.process_count()} process(es): start the processes with ipu-run, or call "
                        "ipu_backend.distributed.init() at the start of each")

    def _make_schedule(self) -> Schedule:
        return schedule_for(self._settings, self._training)

    def _torch_optimizers(self) -> list:
        """The torch optimizers whose state the device holds, in the order of the rules."""
        return []

    def _device_optimizer_states(self) -> tuple | None:
        """Each optimizer's rule state on the device (None before the first training call)."""
        return None

    def _keep(self, compiled: CompiledStep, state: dict) -> None:
        """Keep what a call returned besides the weights (optimizer state, loss scale...)."""

    def _host_weights_loaded(self, names: set) -> None:
        """Host writes to the weights ``names`` reached the device (see ``weights.py``)."""

    # --- the shared steps ------------------------------------------------------------------
    def _schedule(self) -> Schedule:
        return self._schedule_value

    def _mesh(self):
        """The replica mesh, made once (the options are frozen)."""
        if self._mesh_value is None:
            self._mesh_value = replica_mesh(self._schedule_value.replicas, self._schedule_value.processes)
        return self._mesh_value

    def _base_key(self):
        """Options.randomSeed when set, else a seed drawn from torch's generator (so
        torch.manual_seed makes runs repeatable); made once, on the replica mesh. A program folds
        in the call's index (:meth:`_next_call_index`)."""
        if self._key is None:
            key = jax.random.key_data(seed_key(self._seed))
            self._key = jax.random.wrap_key_data(processes.replicated(key, self._mesh()))
        return self._key

    def _next_call_index(self) -> int:
        self._calls_made += 1
        return self._calls_made

    def _ensure_executable(self, compiled: CompiledStep, call_args: tuple, optimizer_offloaded: bool = False) -> None:
        """Compile ahead of the first call, once (a saved executable may stand in:
        ``xla_compile.executables_from``), check the memory, and, the first time this executor
        uses it, tell the recorder and say how long capture and compilation took (its phases shown
        and logged: ``compile_progress``)."""
        if compiled.facts is not None:
            return
        spec, check = self._settings.memory()
        how = "reused" if compiled.executable is not None else "compiled"
        if compiled.multi_ipu:
            compiled.executable, compiled.usage = compiled.call, compiled.call.memory
            how = "loaded" if compiled.loaded else how
        elif how == "reused":
            self._keep_on_disk(compiled)
        else:
            executable, how = self._executable(compiled, call_args)
            usage = memory.single_ipu_usage(executable, call_args[0], self._schedule().replicas // self._mesh().size,
                                            optimizer_offloaded=optimizer_offloaded)
            memory.check(usage, spec, check)
            compiled.executable, compiled.usage = executable, usage
        if compiled.shared_key is not None:
            program_cache.SHARED[compiled.shared_key] = compiled
        compiled.seconds = time.perf_counter() - compiled.started
        compiled.facts = self._facts(compiled, compiled.usage, spec)
        self._profiler.compiled(compiled.facts, call_args)
        compile_progress.finish(how)

    def _executable(self, compiled: CompiledStep, call_args: tuple):
        """``(executable, how)``: the XLA executable of a single-IPU program, ``"loaded"`` from this
        executor's executable cache, else ``"compiled"`` (and written to the cache)."""
        cache, key = self._executable_cache, self._entry_key(compiled.shared_key)
        if key is not None:
            entry = cache.load(key, list(self._mesh().devices.flat))
            if entry is not None:
                executable, layout = entry
                compiled.layout.restore(layout)
                return executable, "loaded"
        executable = compile_jitted(compiled.call, *call_args)
        if key is not None:
            cache.store(key, executable, compiled.layout.state())
        return executable, "compiled"

    @contextlib.contextmanager
    def _capturing(self):
        """The block a capture runs in: a training executor refuses module backward hooks (its
        program never runs torch's backward), captures take and keep their decompositions to
        core ATen in this executor's executable cache (``compiler.decomposition_cache``), and the
        step's reads of its optimizers' hyper-parameters are noted: the block gets the list
        holding their guards once it ends (``compiler.optimizer_reads``, see :meth:`_guarded`)."""
        if self._training:
            refuse_backward_hooks(self._user_model)
        cache = self._executable_cache
        with (decomposition_cache.kept_in(None if cache is None else executable_cache.Decompositions(cache)),
              optimizer_reads.recorded(self._torch_optimizers()) as reads):
            yield reads

    def _guarded(self, program, reads: list):
        """``program`` guarded by ``reads`` too (what :meth:`_capturing` noted); refused when a
        call runs the captured code several times and it changes a value it reads
        (``attribute_writes``)."""
        program = dataclasses.replace(program, python_reads=program.python_reads + tuple(reads))
        schedule = self._schedule()
        attribute_writes.refuse_read_and_changed(program.assignments, program.python_reads,
                                                 schedule.device_iterations * schedule.accumulation,
                                                 self._step_method or "model", self._step_method is not None)
        return program

    def _entry_key(self, shared_key: tuple | None) -> str | None:
        """The key in this executor's executable cache of the program with ``shared_key`` (None:
        not cached: no cache, a program without identity, a saved program standing in, several
        processes)."""
        if (self._executable_cache is None or shared_key is None or substituted()
                or self._schedule().processes > 1):
            return None
        return executable_cache.entry_key(shared_key)

    def _stage_programs_cached(self, shared_key: tuple | None):
        """A block in which a model split over IPUs has its stage programs compiled through this
        executor's executable cache (yielding the :class:`~executable_cache.StagePrograms`
        source), or compiled as usual (yielding None) when it is not cached."""
        key = self._entry_key(shared_key)
        if key is None:
            return contextlib.nullcontext()
        return executables_from(executable_cache.StagePrograms(self._executable_cache, key))

    def _keep_on_disk(self, compiled: CompiledStep) -> None:
        """Write a program another executor compiled into this executor's cache, if not there."""
        key = self._entry_key(compiled.shared_key)
        if key is not None and not self._executable_cache.holds(key):
            self._executable_cache.store(key, compiled.executable, compiled.layout.state())

    @contextlib.contextmanager
    def _compilation(self):
        """A block in which this executor may compile: its phases shown (unless
        ``Options.showCompilationProgressBar(False)``) and logged (``compile_progress``), with
        the XLA options its settings ask for (``xla_compile``)."""
        with (compile_progress.compilation(self._kind(None), self._settings.show_compilation_progress),
              matmul_autotuning(self._settings.autotune_matmuls)):
            yield

    def _kind(self, compiled: CompiledStep | None) -> str:
        """What the executor's programs compute, as the log names them."""
        return "training" if self._training else "inference"

    def _facts(self, compiled: CompiledStep, usage: list, spec) -> ProgramFacts:
        """What a recorder is told of ``compiled``."""
        call = compiled.call
        if compiled.multi_ipu:
            execution, ipus, stages = call.execution, call.part.num_ipus, call.stage_facts()
        else:
            nodes = tuple(compiled.program.graph_module.graph.nodes)
            execution, ipus, stages = self._execution(), 1, (StageFacts(0, 0, nodes, {"step": compiled.executable}),)
        return ProgramFacts(training=self._training, schedule=self._schedule(), execution=execution,
                            ipus_per_replica=ipus, stages=stages, memory=usage, ipu_spec=spec,
                            compile_started=compiled.started, manual_passes=self._passes(compiled))

    def _execution(self) -> str:
        raise NotImplementedError

    def _passes(self, compiled: CompiledStep) -> tuple[str, ...] | None:
        return None

    def _run(self, compiled: CompiledStep, call_args: tuple, args: tuple):
        """The call itself and its tail: run, keep the state on the device, run the host work
        queued for the device time, bring the outputs to the host (and the new values of inputs
        the model updates in place into ``args``), and mark the times of each part."""
        if self._settings.floating_point_exceptions and self._synthetic is None:
            float_exceptions.check_inputs(args)
        runtime_checks.forget_recorded()
        started = perf_counters.now()
        self._profiler.inputs_on_device(call_args)
        state, arrays, logs = compiled.executable(*call_args)
        launched = perf_counters.now()
        self._profiler.computed(state, arrays, logs)
        self._keep(compiled, state)
        self._opt_states_on_host = not self._training
        self._store.update(state["params"], state["buffers"], compiled.packing, self,
                           changed=self._training or bool(compiled.program.mutated_buffers))
        if self._settings.floating_point_exceptions:
            float_exceptions.check(state, arrays, logs)
        self.last_program = compiled.program
        host_idle.run_queued()
        jax.block_until_ready(arrays)
        runtime_checks.raise_recorded()
        for assignment in compiled.program.assignments:       # what the model's Python left on it
            assignment.apply()
        ready = perf_counters.now()
        to_host = output_to_host if self._synthetic is None else synthetic_data.unwritten_output
        self.last_logs = {name: to_host(value, compiled.log_dtypes[name]) for name, value in logs.items()}
        outputs = [to_host(a, d) for a, d in zip(arrays, compiled.output_dtypes)]
        self._last_marks = perf_counters.CallMarks(len(args), started, launched, ready, perf_counters.now())
        self._profiler.finished(compiled.facts, call_args)
        result = compiled.layout.join(outputs)
        if compiled.program.mutated_inputs:         # under synthetic data the caller's tensors stay as they are
            result = (_copy_back_inputs(result, args, compiled.program.mutated_inputs) if self._synthetic is None
                      else result[0])
        return result

    def _optimizer_states_to_host(self) -> None:
        """The optimizer state on the device, written into the torch optimizers (when the host
        reads the weights, or an optimizer's ``state_dict``), unless it is there already."""
        with self._store.lock:
            states = self._device_optimizer_states()
            if states is None or self._opt_states_on_host:
                return
            for rule, state, optimizer in zip(self._state_rules, jax.device_get(states), self._torch_optimizers()):
                # plain tensors even when asked under inference_mode: their versions tell host writes
                with host_optimizer.writing_device_state(optimizer), torch.inference_mode(False):
                    rule.state_to_torch(state, optimizer)
            self._opt_states_on_host = True

    def _start(self, packing: Packing = Packing()) -> None:
        """Before a call (or ``compile``): a new executor starts from the module's current host
        weights and buffers, host writes included, its parameters laid out as ``packing`` says
        (stacked on the host: no conversion on the device); a later call takes the host writes
        made since the last one (see ``weights.py``). As in PopTorch, an
        inference call after another executor's training calls first makes the implicit copy of
        their weights to the host (that executor's ``copyWeightsToHost``)."""
        if not self._training:
            with self._store.lock:
                writer = self._store.last_writer()
                if self._store.host_stale and writer is not None and writer is not self and writer._training:
                    self._store.implicit_copy()
        if self._training:
            for optimizer in self._torch_optimizers():
                host_optimizer.take_host_writes(optimizer)
        if not self._started:
            self._store.check_buffer_names(self._settings.updatable_named_buffers)
            self._started = True
            self._store.load_from_host(packing)
        else:
            self._store.load_host_writes()
