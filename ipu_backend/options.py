"""PopTorch's ``Options``: how a model is compiled and run on emulated IPUs.

Three equivalent ways to build one:

* PopTorch's methods, chained: ``Options().deviceIterations(4).replicationFactor(2)``;
* typed keywords, which jsonargparse and the Lightning CLI build from YAML ``init_args``:
  ``Options(device_iterations=4, replication_factor=2)``;
* a dict: ``Options.from_dict({"device_iterations": 4})``, the inverse of :meth:`Options.toDict`.

Every PopTorch setting is one of three kinds:

* **emulated**: read back as an attribute (``opts.device_iterations``,
  ``opts.Training.gradient_accumulation``) by the runtime, which honours them (or refuses, naming
  the option, a value it cannot honour);
* **inert**: about hardware, compilation, memory placement or logging, with no meaning on emulated
  IPUs (``useIpuModel``, ``logDir``, ``_Popart.set``, ...). Accepted so that PopTorch scripts run
  unchanged, checked as PopTorch checks them, recorded (``opts.toDict()["recorded"]``, and read
  back by PopTorch's attribute name, e.g. ``opts.log_dir``), and otherwise without effect;
* **not emulated**: settings that would change the numbers a program computes raise
  :class:`ipu_backend.Error` naming the option, rather than being silently ignored.

As in PopTorch, the environment variable ``POPTORCH_DEFAULT_OPTIONS`` holds a JSON object of
setters (see :meth:`Options.from_json`) applied to every new ``Options``.

Options are frozen once a model or a :class:`ipu_backend.DataLoader` uses them: any setter then
raises :class:`FrozenOptionsError` with PopTorch's message. :meth:`Options.clone` (like
``copy.deepcopy``) gives an unfrozen copy.

The option groups (``opts.Training``...) live in ``option_groups.py``, the checks of the values
options accept (and PopTorch's error types) in ``option_values.py``.
"""


import copy
import enum
import inspect
import json
import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Self

import torch

from ipu_backend import enums
from ipu_backend.blocks import PipelinedExecution, ShardedExecution, Stage
from ipu_backend.distributed import environment as distributed_environment
from ipu_backend.enums import (
    CommGroupType,
    ConnectionType,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
    SyncPattern,
)
from ipu_backend.errors import Error
from ipu_backend.hardware import DEFAULT_CHECK, MK2, IpuSpec
from ipu_backend.option_groups import (
    _LOCATION_KINDS,
    TensorLocationSettings,
    _DistributedOptions,
    _emulated,
    _JitOptions,
    _OptionGroup,
    _PopartOptions,
    _PrecisionOptions,
    _SharedState,
    _TensorLocationOptions,
    _TrainingOptions,
    _unless_frozen,
)
from ipu_backend.option_values import (
    ConfigFileError,
    FailedCheck,
    FrozenOptionsError,
    InvalidArgument,
    WrongArgumentType,
    _bool,
    _int_at_least,
    _ipu_spec,
    _memory_check,
    _path_or_none,
    _plain,
    _str,
    parse_member,
)
from ipu_backend.runtime.optimizers import needs_running_mean
from ipu_backend.runtime.settings import AUTO_CACHE_DIR, UNSUPPORTED_STAGING, RunSettings, Staging

__all__ = ["ConfigFileError", "FailedCheck", "FrozenOptionsError", "InvalidArgument", "Options",
           "TensorLocationSettings", "WrongArgumentType", "in_force", "parse_member"]


_OUTSIDE_THE_PROGRAM = frozenset({"random_seed", "profiling_dir", "executable_cache_dir",
                                  "show_compilation_progress_bar", "log_cycle_count",
                                  "updatable_named_buffers", "floating_point_exceptions"})
"""Settings that do not change a compiled program: the seed is one of its inputs; the others say
where files go and what the host shows, measures or checks around it."""


def _program_settings(settings: dict) -> list:
    """``toDict()``'s settings that a compiled program depends on, sorted (the recorded inert
    ones included, but for those outside the program)."""
    recorded = {k: v for k, v in settings.get("recorded", {}).items() if k not in _OUTSIDE_THE_PROGRAM}
    kept = {k: v for k, v in settings.items() if k not in _OUTSIDE_THE_PROGRAM and k != "recorded"}
    return sorted({**kept, "recorded": sorted(recorded.items())}.items())


_DEFAULT_SOURCE_LOCATION_EXCLUDES = ["install/poptorch", "site-packages/torch",
                                     "site-packages/poptorch"]


class Options(_OptionGroup):
    """How a model is compiled and run, as PopTorch's ``poptorch.Options`` (see the module
    docstring). The keyword arguments set the emulated options; strings are enum member names in
    any case (``output_mode="everyN"``); ``partials_type`` is ``"float"`` or ``"half"``.
    """

    _INERT = {
        "log_dir": ".",
        "max_repeat_logs": 4,
        "model_name": None,
        "use_model": False,
        "connection_type": ConnectionType.Always.name,
        "sync_pattern": SyncPattern.Full.name,
        "ipu_id": None,
        "ipu_version": None,
        "anchored_tensors": {},
        "available_memory_proportion": {},
        "enable_stable_norm": False,
        "log_cycle_count": False,
        "module_namescope": True,
        "updatable_named_buffers": [],
        "source_location_excludes": _DEFAULT_SOURCE_LOCATION_EXCLUDES,
        "show_compilation_progress_bar": True,
        "relax_optimizer_attributes_checks": False,
    }

    def __init__(
            self,
            *,
            device_iterations: int = 1,
            replication_factor: int = 1,
            gradient_accumulation: int = 1,
            reduction_type: str | ReductionType = "mean",
            mean_reduction_strategy: str | MeanReductionStrategy = "post",
            output_mode: str | OutputMode = "default",
            output_return_period: int | None = None,
            random_seed: int | None = None,
            auto_loss_scaling: bool = False,
            stochastic_rounding: bool = False,
            master_weights: bool = False,
            partials_type: str = "float",
            floating_point_exceptions: bool = False,
            optimizer_on_chip: bool = True,
            weights_on_chip: bool = True,
            activations_on_chip: bool = True,
            accumulators_on_chip: bool = True,
            executable_cache_dir: str | None = AUTO_CACHE_DIR,
            auto_round_num_ipus: bool = False,
            broadcast_buffers: bool = True,
            profiling_dir: str | None = None,
            ipu_spec: IpuSpec = MK2,
            memory_check: str = DEFAULT_CHECK,
            loop_repeated_layers: bool = True,
            autotune_matmuls: bool = False,
            input_group_size: int = 1,
            input_group_type: str | CommGroupType = CommGroupType.Consecutive,
    ) -> None:
        shared = _SharedState()
        super().__init__(shared, execution_strategy=None, random_seed=None, profiling_dir=None)
        self._training = _TrainingOptions(shared)
        self._precision = _PrecisionOptions(shared)
        self._tensor_locations = _TensorLocationOptions(shared)
        instance = distributed_environment.from_environment()
        self._distributed = _DistributedOptions(shared, process_id=instance.index, num_processes=instance.count)
        self._jit = _JitOptions(shared)
        self._popart = _PopartOptions(shared)

        self.deviceIterations(device_iterations)
        self.replicationFactor(replication_factor)
        self.Training.gradientAccumulation(gradient_accumulation)
        self.Training.accumulationAndReplicationReductionType(reduction_type)
        self.Training.setMeanAccumulationAndReplicationReductionStrategy(mean_reduction_strategy)
        self.Training.setAutomaticLossScaling(auto_loss_scaling)
        self.outputMode(parse_member(OutputMode, output_mode, "output_mode"),
                        output_return_period)
        if random_seed is not None:
            self.randomSeed(random_seed)
        self.Precision.enableStochasticRounding(stochastic_rounding)
        self.Precision.enableMasterWeights(master_weights)
        self.Precision.setPartialsType(partials_type)
        self.Precision.enableFloatingPointExceptions(floating_point_exceptions)
        on_chip = {"optimizer": optimizer_on_chip, "weight": weights_on_chip,
                   "activation": activations_on_chip, "accumulator": accumulators_on_chip}
        for kind, use in on_chip.items():
            self.TensorLocations._set_location(
                kind, TensorLocationSettings().useOnChipStorage(_bool(use, _LOCATION_KINDS[kind])))
        self.enableExecutableCaching(executable_cache_dir)
        self.autoRoundNumIPUs(auto_round_num_ipus)
        self.broadcastBuffers(broadcast_buffers)
        if profiling_dir is not None:
            self.enableProfiling(profiling_dir)
        self.setIpuSpec(ipu_spec)
        self.setMemoryCheck(memory_check)
        self.loopRepeatedLayers(loop_repeated_layers)
        self.autotuneMatmuls(autotune_matmuls)
        self.inputReplicaGrouping(input_group_size, input_group_type)
        self._apply_environment()

    def _apply_environment(self) -> None:
        """PopTorch's ``POPTORCH_DEFAULT_OPTIONS``: a :meth:`from_json` string applied to every
        new ``Options`` after its arguments."""
        self.from_json(os.environ.get("POPTORCH_DEFAULT_OPTIONS", "{}"))

    # Option groups, as PopTorch's properties.

    @property
    def Training(self) -> _TrainingOptions:
        """Training options (gradient accumulation, reduction, loss scaling)."""
        return self._training

    @property
    def Precision(self) -> _PrecisionOptions:
        """Numerical precision options (stochastic rounding, partials type)."""
        return self._precision

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Where tensors are stored."""
        return self._tensor_locations

    @property
    def Distributed(self) -> _DistributedOptions:
        """Multi-process options: this process's index and the number of processes."""
        return self._distributed

    @property
    def Jit(self) -> _JitOptions:
        """PopTorch's JIT options (inert)."""
        return self._jit

    @property
    def _Popart(self) -> _PopartOptions:
        """PopART session options (inert)."""
        return self._popart

    # Emulated settings, read back as in PopTorch.

    device_iterations = _emulated(
        "device_iterations", "Batches each replica processes per call of the model.", "deviceIterations")
    replication_factor = _emulated("replication_factor", "Number of model replicas.", "replicationFactor")
    output_mode = _emulated("output_mode", "Which results a run returns (an OutputMode).", "outputMode")
    output_return_period = _emulated(
        "output_return_period", "N of OutputMode.EveryN; None for the other modes.")
    random_seed = _emulated("random_seed", "Seed of the device's random numbers, or None.", "randomSeed")
    execution_strategy = _emulated(
        "execution_strategy",
        "How the model is split over IPUs, or None for the default (pipelined by block).",
        "setExecutionStrategy")
    executable_cache_dir = _emulated(
        "executable_cache_dir",
        "Directory caching compiled programs, ``\"auto\"`` (``$IPU_BACKEND_CACHE_DIR``, else the user's "
        "cache directory) or None (no caching).", "enableExecutableCaching")
    auto_round_num_ipus = _emulated(
        "auto_round_num_ipus", "Whether the number of IPUs is rounded up to a power of 2.", "autoRoundNumIPUs")
    broadcast_buffers = _emulated(
        "broadcast_buffers", "Whether buffers are broadcast from replica 0 to all replicas.", "broadcastBuffers")
    profiling_dir = _emulated(
        "profiling_dir", "Directory receiving profiling reports, or None when profiling is off.")
    ipu_spec = _emulated("ipu_spec", "The IpuSpec of each emulated IPU (Mk2 by default).", "setIpuSpec")
    memory_check = _emulated(
        "memory_check", "What a model too large for its IPUs gets: 'error', 'warn' or 'off'.", "setMemoryCheck")
    loop_repeated_layers = _emulated(
        "loop_repeated_layers", "Whether runs of identical layers compile once, as one loop.",
        "loopRepeatedLayers")
    autotune_matmuls = _emulated(
        "autotune_matmuls", "Whether XLA tunes Triton kernels for the matrix products on GPUs.",
        "autotuneMatmuls")
    input_group_size = _emulated("input_group_size", "Replicas in each group sharing input data.")
    input_group_type = _emulated(
        "input_group_type", "How replicas are placed in input groups (a CommGroupType).")

    # PopTorch's setters for emulated settings.

    @_unless_frozen
    def deviceIterations(self, device_iterations: int) -> Self:
        """Run this many batches per replica in each call of the model (default 1)."""
        self._values["device_iterations"] = _int_at_least(
            device_iterations, "device_iterations", 1)
        return self

    @_unless_frozen
    def replicationFactor(self, replication_factor: int) -> Self:
        """Replicate the model this many times, each replica on its own IPUs (default 1)."""
        self._values["replication_factor"] = _int_at_least(
            replication_factor, "replication_factor", 1)
        return self

    @_unless_frozen
    def outputMode(self, output_mode: OutputMode,
                   output_return_period: int | None = None) -> Self:
        """Which results a run returns; ``OutputMode.EveryN`` needs ``output_return_period``
        (ignored by the other modes, as in PopTorch)."""
        mode = parse_member(OutputMode, output_mode, "output_mode")
        if mode is OutputMode.EveryN:
            if (isinstance(output_return_period, bool) or not isinstance(output_return_period, int)
                    or output_return_period <= 0):
                raise InvalidArgument("EveryN anchor must have output_return_period set to valid "
                                      f"positive integer, got {output_return_period!r}")
        else:
            output_return_period = None
        self._values["output_mode"] = mode
        self._values["output_return_period"] = output_return_period
        return self

    def defaultOutputMode(self) -> bool:
        """Whether the output mode is still ``OutputMode.Default``."""
        return self.output_mode is OutputMode.Default

    @_unless_frozen
    def randomSeed(self, random_seed: int) -> Self:
        """Seed the device's random numbers; as in PopTorch, also seeds torch
        (``torch.manual_seed``). Shuffling DataLoaders built with these options follow it too."""
        _int_at_least(random_seed, "random_seed", 0)
        if random_seed >= 2**64:
            raise InvalidArgument(f"random_seed must be below 2**64, got {random_seed}")
        torch.manual_seed(random_seed)
        self._values["random_seed"] = random_seed
        return self

    @property
    def _execution_strategy(self) -> Any:
        """The strategy in effect, as PopTorch reads it back: the one set, else the default
        ``PipelinedExecution()`` (stages follow the blocks' IPUs)."""
        from ipu_backend.blocks import PipelinedExecution
        return self._values["execution_strategy"] or PipelinedExecution()

    @_unless_frozen
    def setExecutionStrategy(self, strategy: Any) -> Self:
        """How the model's blocks are spread over IPUs (e.g. ``PipelinedExecution``)."""
        self._values["execution_strategy"] = strategy
        return self

    @_unless_frozen
    def enableExecutableCaching(self, path: str | None) -> Self:
        """Cache this executor's compiled programs in directory ``path``; None turns caching off.
        Without this call they are cached in ``$IPU_BACKEND_CACHE_DIR`` (``off``: not cached), else
        PopTorch's ``$POPTORCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/ipu_backend`` or
        ``~/.cache/ipu_backend`` (``path="auto"`` restores this)."""
        self._values["executable_cache_dir"] = _path_or_none(path, "path")
        return self

    @_unless_frozen
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Self:
        """Round the number of IPUs up to a power of 2 instead of raising an error."""
        self._values["auto_round_num_ipus"] = _bool(auto_round_num_ipus, "auto_round_num_ipus")
        return self

    @_unless_frozen
    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Self:
        """Broadcast buffers (e.g. batch norm statistics) from replica 0 to all replicas."""
        self._values["broadcast_buffers"] = _bool(broadcast_buffers, "broadcast_buffers")
        return self

    @_unless_frozen
    def enableProfiling(self, profile_dir: str | None = None) -> Self:
        """Write profiling reports to ``profile_dir`` (default: the current directory)."""
        self._values["profiling_dir"] = _path_or_none(profile_dir, "profile_dir") or "."
        return self

    @_unless_frozen
    def setIpuSpec(self, ipu_spec: IpuSpec) -> Self:
        """Beyond PopTorch: the memory and tiles of each emulated IPU (``IpuSpec()``, a Mk2 GC200,
        by default), against which every compiled model's per-IPU memory is checked. Also
        settable on ``PipelinedExecution(ipu_spec=...)``; set differently in both, compiling a
        model raises an error."""
        self._values["ipu_spec"] = _ipu_spec(ipu_spec)
        return self

    @_unless_frozen
    def setMemoryCheck(self, memory_check: str) -> Self:
        """Beyond PopTorch: what compiling a model that does not fit its IPUs' memory does —
        ``"error"`` (the default: ``poptorch.OutOfMemoryError`` listing each IPU's usage),
        ``"warn"`` (the same message as a warning, and the model runs) or ``"off"``."""
        self._values["memory_check"] = _memory_check(memory_check)
        return self

    @_unless_frozen
    def loopRepeatedLayers(self, enabled: bool = True) -> Self:
        """Beyond PopTorch: runs of structurally identical layers (the blocks of an
        ``nn.Sequential`` or ``nn.ModuleList``, ``nn.TransformerEncoder``'s layers) are captured
        once and compiled as one loop over their weights (on by default), so that compile time
        does not grow with depth; the numbers are the same either way. ``False`` compiles every
        layer inline."""
        self._values["loop_repeated_layers"] = _bool(enabled, "loop_repeated_layers")
        return self

    @_unless_frozen
    def autotuneMatmuls(self, enabled: bool = True) -> Self:
        """Beyond PopTorch: on NVIDIA GPUs, XLA generates Triton kernels for the matrix products
        and times candidates of each while compiling (as ``torch.compile``'s
        ``mode="max-autotune"`` does): products run faster, first calls take many times longer.
        Off by default: the products are cuBLAS's, as torch eager's are. It also has XLA time
        cuDNN's algorithms for convolutions, as ``torch.backends.cudnn.benchmark`` (which asks
        for that alone) does in torch and here: the fastest can be less exact in float32 than
        the ones cuDNN's heuristics choose by default. No effect on CPUs."""
        self._values["autotune_matmuls"] = _bool(enabled, "autotune_matmuls")
        return self

    # Where the data of a call comes from.

    @_unless_frozen
    def enableSyntheticData(self, enabled: bool) -> Self:
        """PopART's ``syntheticDataMode`` (2 when ``enabled``): no host I/O; each input is random
        normal data made on the device (integer inputs zeros), and the caller gets zeros for the
        outputs (``runtime/synthetic_data.py``). For measuring a model as if its data cost nothing."""
        self._Popart.set("syntheticDataMode", 2 if _bool(enabled, "enabled") else 0)
        return self

    @_unless_frozen
    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: CommGroupType) -> Self:
        """Replicas in groups of ``input_group_size`` (arranged as ``input_group_type`` says) see
        the same input data: a call's combined batch holds one share per group."""
        group_type = parse_member(CommGroupType, input_group_type, "input_group_type")
        if group_type is CommGroupType.NoGrouping:
            input_group_size, group_type = 1, CommGroupType.Consecutive
        elif group_type is CommGroupType.All:
            raise InvalidArgument("input_group_type cannot be All")
        _int_at_least(input_group_size, "input_group_size", 1)
        if input_group_size > self.replication_factor:
            raise InvalidArgument("input_group_size cannot be larger than replication_factor")
        if self.replication_factor % input_group_size:
            raise InvalidArgument("input_group_size must be a factor of replication_factor")
        self._values["input_group_size"] = input_group_size
        self._values["input_group_type"] = group_type
        return self

    # Inert PopTorch settings: checked, recorded, no effect on emulated IPUs.

    @_unless_frozen
    def useIpuModel(self, use_model: bool) -> Self:
        """Inert: every IPU here is emulated."""
        self._record("use_model", _bool(use_model, "use_model"))
        return self

    @_unless_frozen
    def connectionType(self, connection_type: ConnectionType) -> Self:
        """Inert: emulated IPUs need no attaching."""
        self._record("connection_type",
                     parse_member(ConnectionType, connection_type, "connection_type").name)
        return self

    @_unless_frozen
    def syncPattern(self, sync_pattern: SyncPattern) -> Self:
        """Inert: emulated IPUs synchronise by data dependencies only."""
        self._record("sync_pattern", parse_member(SyncPattern, sync_pattern, "sync_pattern").name)
        return self

    @_unless_frozen
    def useIpuId(self, ipu_id: int) -> Self:
        """Inert: emulated IPUs have no hardware ids."""
        self._record("ipu_id", _int_at_least(ipu_id, "ipu_id", 0))
        return self

    @_unless_frozen
    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Self:
        """Inert: programs are always compiled for, and run on, emulated IPUs."""
        self._record("ipu_version", _int_at_least(ipu_version, "ipu_version", 1))
        return self.connectionType(ConnectionType.Never)

    @_unless_frozen
    def anchorTensor(self, short_name: str, long_name: str,
                     output_mode: OutputMode | None = None,
                     output_return_period: int | None = 1) -> Self:
        """Inert: PopART tensor names do not exist here."""
        mode = None if output_mode is None else parse_member(OutputMode, output_mode,
                                                             "output_mode")
        period = output_return_period if mode is OutputMode.EveryN else 1
        anchors = {**self.anchored_tensors,
                   _str(short_name, "short_name"): [_str(long_name, "long_name"),
                                                    None if mode is None else mode.name, period]}
        self._record("anchored_tensors", anchors)
        return self

    @_unless_frozen
    def setAvailableMemoryProportion(self, available_memory_proportion: Mapping[str, float]
                                     ) -> Self:
        """Inert: temporary memory per IPU, as ``{"IPU0": 0.5}``."""
        proportions = {}
        for key, proportion in available_memory_proportion.items():
            if not (isinstance(key, str) and key.startswith("IPU") and key[3:].isdigit()):
                raise InvalidArgument('Available memory proportions are expected to be in a '
                                      'dictionary of {"IPU0": 0.5} where the 0 in IPU is the '
                                      f"index of the IPU. Invalid key: {key}")
            proportions[int(key[3:])] = proportion
        self._record("available_memory_proportion", proportions)
        return self

    @_unless_frozen
    def logDir(self, log_dir: str) -> Self:
        """Inert: nothing is logged to files."""
        self._record("log_dir", _path_or_none(log_dir, "log_dir"))
        return self

    @_unless_frozen
    def maxRepeatLogs(self, max_lines: int | None) -> Self:
        """Inert: repeated log lines are not suppressed."""
        self._record("max_repeat_logs",
                     None if max_lines is None else _int_at_least(max_lines, "max_lines", 0))
        return self

    @_unless_frozen
    def modelName(self, name: str) -> Self:
        """Inert: the model's name in PopTorch's reports."""
        self._record("model_name", _str(name, "name"))
        return self

    @_unless_frozen
    def enableStableNorm(self, enabled: bool) -> Self:
        """Inert: normalisations always compute as torch does."""
        self._record("enable_stable_norm", _bool(enabled, "enabled"))
        return self

    @_unless_frozen
    def logCycleCount(self, log_cycle_count: bool) -> Self:
        """Inert: emulated IPUs have no cycle counter."""
        self._record("log_cycle_count", _bool(log_cycle_count, "log_cycle_count"))
        return self

    @_unless_frozen
    def disableModuleNamescope(self) -> Self:
        """Inert: PopART operator names do not exist here."""
        self._record("module_namescope", False)
        return self

    @_unless_frozen
    def updatableNamedBuffers(self, buffers: list[str]) -> Self:
        """Inert: buffers are always copied to the device whole."""
        self._record("updatable_named_buffers", [_str(b, "buffer name") for b in buffers])
        return self

    @_unless_frozen
    def sourceLocationExcludes(self, excludes: list[str]) -> Self:
        """Inert: error messages always point at the user's own source line."""
        self._record("source_location_excludes", [_str(e, "exclude") for e in excludes])
        return self

    @_unless_frozen
    def appendToLocationExcludes(self, *excludes: str) -> Self:
        """Inert: see :meth:`sourceLocationExcludes`."""
        return self.sourceLocationExcludes(self.source_location_excludes + list(excludes))

    @_unless_frozen
    def showCompilationProgressBar(self, show: bool = True) -> Self:
        """Whether a compilation shows its phases and elapsed time on the terminal (standard
        error, when it is one); the environment variable ``IPU_BACKEND_COMPILATION_PROGRESS=0``
        turns the display off everywhere."""
        self._record("show_compilation_progress_bar", _bool(show, "show"))
        return self

    @_unless_frozen
    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Self:
        """Inert: recorded for the optimizer wrappers."""
        self._record("relax_optimizer_attributes_checks", _bool(relax, "relax"))
        return self

    # Bulk setting, as in PopTorch.

    @_unless_frozen
    def from_json(self, string: str) -> Self:
        """Call the setters named in a JSON object: ``{"Training.gradientAccumulation": 4}``.

        A list value is passed as positional arguments, and a string ``"Enum.Member"`` naming a
        PopTorch enum member as that member, as in PopTorch.
        """
        for path, value in json.loads(string).items():
            setter = self
            for name in path.split("."):
                if not hasattr(setter, name):
                    raise InvalidArgument(f"Unknown option {path!r} in JSON options")
                setter = getattr(setter, name)
            args = value if isinstance(value, list) else [value]
            setter(*(_enum_from_string(arg) for arg in args))
        return self

    @_unless_frozen
    def loadFromFile(self, filepath: str) -> Self:
        """Run a file of setter calls, one per line, written without the ``options.`` prefix
        (``deviceIterations(4)``); ``#`` starts a comment and ``poptorch`` names what the setters
        take: ``poptorch.enums`` and its enums, ``TensorLocationSettings``, the execution
        strategies (``PipelinedExecution``, ``ShardedExecution``, ``Stage``, ``AutoStage``) and
        ``IpuSpec``.

        As in PopTorch, each line runs as Python: load only files you trust.
        """
        with open(filepath) as file:
            lines = [line.strip() for line in file]
        source = "\n".join("" if not line or line.startswith("#") else "options." + line
                           for line in lines)
        try:
            code = compile(source, filepath, "exec")
        except SyntaxError as err:
            raise ConfigFileError(
                f"{type(err).__name__} at line {err.lineno} of {os.path.basename(filepath)}: "
                f"{err.msg}\n> {(err.text or '').strip()}") from None
        exec(code, {"__builtins__": {}, "poptorch": _CONFIG_NAMESPACE, "options": self})
        return self

    # Copies, comparison and serialisation.

    def _freeze(self) -> None:
        """Refuse every further change: called when a model or DataLoader starts using them."""
        self._shared.frozen = True

    def clone(self) -> "Options":
        """An unfrozen deep copy."""
        return copy.deepcopy(self)

    def for_model(self, optimizer: torch.optim.Optimizer | None = None,
                  training: bool | None = None) -> "Options":
        """The options a model keeps (beyond PopTorch): these are frozen, as a model now uses
        them, and the model gets a frozen copy of its own, with ``MeanReductionStrategy.Running``
        where PopTorch chooses it for the model's ``optimizer`` (float16 gradient accumulators)
        and, given ``training``, the output mode ``Default`` resolves to (``Final`` for training,
        ``All`` for inference), which PopTorch's executors read back."""
        self._freeze()
        kept = self.clone()
        if training is not None and kept.defaultOutputMode():
            kept.outputMode(OutputMode.Final if training else OutputMode.All)
        if optimizer is not None and needs_running_mean(optimizer):
            kept.Training.setMeanAccumulationAndReplicationReductionStrategy(MeanReductionStrategy.Running)
        kept._freeze()
        return kept

    def runtime_settings(self) -> RunSettings:
        """These options as the runtime reads them, as plain frozen data (beyond PopTorch)."""
        training, precision = self.Training, self.Precision
        mode = self.output_mode
        recomputation = self._Popart.options.get("autoRecomputation", 0)
        return RunSettings(
            device_iterations=self.device_iterations, replication_factor=self.replication_factor,
            processes=self.Distributed.numProcesses, process_index=self.Distributed.processId,
            gradient_accumulation=training.gradient_accumulation,
            mean_reduction=training.accumulation_and_replication_reduction_type != ReductionType.Sum,
            running_mean=training.mean_reduction_strategy == MeanReductionStrategy.Running,
            output_mode=None if mode is OutputMode.Default else _OUTPUT_MODES[mode],
            output_period=self.output_return_period or 1, auto_loss_scaling=training.auto_loss_scaling,
            stochastic_rounding=precision.stochastic_rounding, master_weights=precision.master_weights,
            floating_point_exceptions=precision.floating_point_exceptions,
            optimizer_on_chip=self.TensorLocations.optimizer_on_chip, broadcast_buffers=self.broadcast_buffers,
            random_seed=self.random_seed, executable_cache_dir=self.executable_cache_dir,
            auto_round_num_ipus=self.auto_round_num_ipus,
            recomputation=int(getattr(recomputation, "value", recomputation)),
            ipu_spec=self.ipu_spec, memory_check=self.memory_check, staging=_staging(self.execution_strategy),
            loop_repeated_layers=self.loop_repeated_layers, autotune_matmuls=self.autotune_matmuls,
            updatable_named_buffers=tuple(self.updatable_named_buffers), log_cycle_count=self.log_cycle_count,
            show_compilation_progress=self.show_compilation_progress_bar,
            synthetic_data=int(self._Popart.options.get("syntheticDataMode", 0)),
            input_group_size=self.input_group_size,
            input_groups_orthogonal=self.input_group_type is CommGroupType.Orthogonal,
            key=repr((_program_settings(self.toDict()), self.Distributed.numProcesses)))

    def _groups(self) -> tuple[_OptionGroup, ...]:
        return (self, self._training, self._precision, self._tensor_locations)

    def toDict(self) -> dict[str, Any]:
        """All settings as a plain dict: the constructor's keywords (enums by member name,
        ``partials_type`` as ``"float"`` / ``"half"``), ``execution_strategy`` and ``recorded``
        (inert settings that differ from PopTorch's defaults). :meth:`from_dict` inverts it."""
        values = {k: v for group in self._groups() for k, v in group._values.items()}
        settings = {key: _plain(values[key]) for key in _KEYWORDS}
        settings["execution_strategy"] = values["execution_strategy"]
        settings["recorded"] = copy.deepcopy(self._shared.recorded)
        return settings

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> "Options":
        """Options from the constructor's keywords, optionally with ``execution_strategy`` and
        ``recorded`` as :meth:`toDict` gives them."""
        settings = dict(settings)
        strategy = settings.pop("execution_strategy", None)
        recorded = settings.pop("recorded", None) or {}
        unknown = sorted(set(settings) - set(_KEYWORDS))
        if unknown:
            raise InvalidArgument(f"Unknown option(s) {unknown}; the options are "
                                  f"{', '.join(_KEYWORDS)}, execution_strategy and recorded")
        unknown = sorted(set(recorded) - set(_ALL_INERT))
        if unknown:
            raise InvalidArgument(f"Unknown recorded option(s) {unknown}; they are "
                                  f"{', '.join(_ALL_INERT)}")
        options = cls(**settings)
        options.setExecutionStrategy(strategy)
        for name, value in recorded.items():
            if value != _ALL_INERT[name]:
                options._shared.recorded[name] = copy.deepcopy(value)
        return options

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.toDict() == other.toDict()

    __hash__ = None

    def __repr__(self) -> str:
        settings = self.toDict()
        shown = [f"{key}={value!r}" for key, value in settings.items()
                 if value != _DEFAULTS[key]]
        return f"{type(self).__name__}({', '.join(shown)})"


_OUTPUT_MODES = {OutputMode.All: "all", OutputMode.Final: "final", OutputMode.Sum: "sum",
                 OutputMode.EveryN: "every_n"}


def _staging(strategy: Any) -> Staging | None:
    """The execution strategy as the runtime reads it (None when none is set)."""
    if strategy is None:
        return None
    if isinstance(strategy, PipelinedExecution):
        return strategy.staging()
    return Staging(kind=UNSUPPORTED_STAGING, description=repr(strategy))


def in_force(options: "Options") -> tuple[IpuSpec, str]:
    """The IPU spec and memory check that apply to a model compiled with ``options``.

    Both are set through ``Options`` (``setIpuSpec`` / ``setMemoryCheck``, or the ``ipu_spec`` /
    ``memory_check`` keywords) or, for a model split over IPUs, on its ``PipelinedExecution`` /
    ``ShardedExecution``. A setting left at its default in one place gives way to the other;
    set to different values in both, it is an error (which one was meant is not knowable).
    """
    return options.runtime_settings().memory()


def _enum_from_string(value: Any) -> Any:
    """``"OutputMode.All"`` as ``OutputMode.All``; any other value unchanged (PopTorch's JSON
    convention)."""
    if not isinstance(value, str) or value.count(".") != 1:
        return value
    enum_name, member_name = value.split(".")
    enum_type = getattr(enums, enum_name, None)
    if isinstance(enum_type, type) and issubclass(enum_type, enum.Enum):
        return enum_type.__members__.get(member_name, value)
    return value


_KEYWORDS = tuple(inspect.signature(Options).parameters)
_ALL_INERT = {name: default
              for group in (Options, _TrainingOptions, _PrecisionOptions, _TensorLocationOptions,
                            _PopartOptions)
              for name, default in group._INERT.items()}
class _DefaultOptions(Options):
    """Options as the constructor makes them, whatever ``POPTORCH_DEFAULT_OPTIONS`` says."""

    def _apply_environment(self) -> None:
        pass


_DEFAULTS = _DefaultOptions().toDict()
"""What ``repr`` leaves out."""
_CONFIG_NAMESPACE = SimpleNamespace(
    enums=enums, **{name: member for name, member in vars(enums).items()
                    if isinstance(member, type) and member.__module__ == enums.__name__},
    TensorLocationSettings=TensorLocationSettings, PipelinedExecution=PipelinedExecution,
    ShardedExecution=ShardedExecution, Stage=Stage, IpuSpec=IpuSpec)
"""What ``poptorch`` names in a file given to :meth:`Options.loadFromFile`."""
