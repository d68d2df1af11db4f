"""The option groups of ``Options`` (``opts.Training``, ``opts.Precision``,
``opts.TensorLocations``, ``opts.Distributed``, ``opts.Jit``, ``opts._Popart``) and what every
group shares with ``Options`` itself: how a setting is kept, read back, recorded and frozen."""

import copy
import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Self

import torch

from ipu_backend import enums
from ipu_backend.enums import MeanReductionStrategy, ReductionType
from ipu_backend.option_values import (
    FailedCheck,
    FrozenOptionsError,
    InvalidArgument,
    WrongArgumentType,
    _bool,
    _int_at_least,
    _partials_type,
    _plain,
    _str,
    parse_member,
)


class _SharedState:
    """What an Options object shares with its option groups: the frozen flag and the record of
    inert settings (those whose value differs from PopTorch's default)."""

    __slots__ = ("frozen", "recorded")

    def __init__(self, recorded: dict[str, Any] | None = None) -> None:
        self.frozen = False
        self.recorded = {} if recorded is None else recorded

    def __deepcopy__(self, memo: dict) -> "_SharedState":
        """Copies are unfrozen, as PopTorch's (``clone`` and ``copy.deepcopy`` alike)."""
        return _SharedState(copy.deepcopy(self.recorded, memo))


def _unless_frozen(setter):
    """Make ``setter`` raise PopTorch's error once its options are frozen."""

    @functools.wraps(setter)
    def checked_setter(self, *args, **kwargs):
        if self._shared.frozen:
            raise FrozenOptionsError("Can't modify frozen Options")
        return setter(self, *args, **kwargs)

    return checked_setter


def _emulated(key: str, doc: str, setter: str | None = None) -> property:
    """A setting read back as an attribute; with ``setter`` (the name of its PopTorch method),
    also assigned as one (``opts.replication_factor = 4``), as PopTorch allows, through the
    method's checks."""
    fset = None if setter is None else (lambda self, value: getattr(self, setter)(value))
    return property(lambda self: self._values[key], fset, doc=doc)


class _OptionGroup:
    """One category of options (``opts.Training``, ``opts.Precision``, ...).

    ``_values`` holds its emulated settings under their ``Options`` keyword names; ``_INERT``
    names its inert settings and PopTorch's defaults for them, which read back as attributes.
    """

    _INERT: dict[str, Any] = {}

    def __init__(self, shared: _SharedState, **values: Any) -> None:
        self._shared = shared
        self._values = values

    def __setattr__(self, name: str, value: Any) -> None:
        """Private attributes, and the settings that read back as attributes; no attribute is
        created by a typo (``opts.deviceIteration = 2`` raises)."""
        if not name.startswith("_") and not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"{type(self).__name__!r} object has no option {name!r}; its "
                                 "settings are set by its methods (or by assigning an attribute "
                                 "that reads one back)")
        object.__setattr__(self, name, value)

    def _record(self, name: str, value: Any) -> None:
        if value == self._INERT[name]:
            self._shared.recorded.pop(name, None)
        else:
            self._shared.recorded[name] = value

    def toDict(self) -> dict[str, Any]:
        """This group's settings by name, as ``toDict`` reports values (PopTorch's
        ``opts.Training.toDict()``); ``Options.toDict`` gives every group's."""
        settings = {key: _plain(value) for key, value in self._values.items()}
        settings.update((name, getattr(self, name)) for name in type(self)._INERT)
        return settings

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_") and name in type(self)._INERT:
            return copy.deepcopy(self._shared.recorded.get(name, self._INERT[name]))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class _TrainingOptions(_OptionGroup):
    """Training options: ``opts.Training``."""

    _INERT = {"convolution_dithering": None}

    gradient_accumulation = _emulated(
        "gradient_accumulation",
        "Micro-batches whose gradients are accumulated before each optimizer step.",
        "gradientAccumulation")
    accumulation_and_replication_reduction_type = _emulated(
        "reduction_type",
        "How gradients are combined across accumulated micro-batches and replicas: "
        "ReductionType.Mean or ReductionType.Sum.", "accumulationAndReplicationReductionType")
    mean_reduction_strategy = _emulated(
        "mean_reduction_strategy",
        "When the mean reduction divides by the count (a MeanReductionStrategy).",
        "setMeanAccumulationAndReplicationReductionStrategy")
    meanAccumulationAndReplicationReductionStrategy = _emulated(  # noqa: N815
        "mean_reduction_strategy", "PopTorch's read-back name of ``mean_reduction_strategy``.",
        "setMeanAccumulationAndReplicationReductionStrategy")
    auto_loss_scaling = _emulated("auto_loss_scaling", "Whether automatic loss scaling is on.",
                                  "setAutomaticLossScaling")

    @_unless_frozen
    def gradientAccumulation(self, gradient_accumulation: int) -> Self:
        """Accumulate the gradients of this many micro-batches before each optimizer step."""
        self._values["gradient_accumulation"] = _int_at_least(
            gradient_accumulation, "gradient_accumulation", 1)
        return self

    @_unless_frozen
    def accumulationAndReplicationReductionType(self, reduction_type: ReductionType) -> Self:
        """Average (``Mean``, the default) or sum (``Sum``) gradients over micro-batches and
        replicas."""
        self._values["reduction_type"] = parse_member(
            ReductionType, reduction_type, "reduction_type",
            (ReductionType.Sum, ReductionType.Mean))
        return self

    @_unless_frozen
    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: MeanReductionStrategy) -> Self:
        """When a ``Mean`` reduction divides by the count (``Post`` by default)."""
        self._values["mean_reduction_strategy"] = parse_member(
            MeanReductionStrategy, mean_reduction_strategy, "mean_reduction_strategy")
        return self

    @_unless_frozen
    def setAutomaticLossScaling(self, enabled: bool) -> Self:
        """Turn automatic loss scaling on or off."""
        self._values["auto_loss_scaling"] = _bool(enabled, "auto_loss_scaling")
        return self

    @_unless_frozen
    def setConvolutionDithering(self, enabled: bool) -> Self:
        """Inert: convolution tile layout does not exist on emulated IPUs."""
        self._record("convolution_dithering", _bool(enabled, "convolution_dithering"))
        return self


class _PrecisionOptions(_OptionGroup):
    """Numerical precision options: ``opts.Precision``."""

    stochastic_rounding = _emulated(
        "stochastic_rounding", "Whether rounding to float16 is stochastic.", "enableStochasticRounding")
    master_weights = _emulated(
        "master_weights", "Whether half-precision weights keep a float32 master copy for updates.",
        "enableMasterWeights")
    partials_type = _emulated(
        "partials_type",
        "dtype of matmul and convolution partial results: torch.float (default) or torch.half.",
        "setPartialsType")
    floating_point_exceptions = _emulated(
        "floating_point_exceptions",
        "Whether a call whose results hold a NaN or an infinity raises (PopTorch's IPU traps).",
        "enableFloatingPointExceptions")

    @_unless_frozen
    def halfFloatCasting(self, half_float_casting: enums.HalfFloatCastingBehavior) -> Self:
        """Inert, as in PopTorch: float16 is always up-cast to float32 as in torch."""
        parse_member(enums.HalfFloatCastingBehavior, half_float_casting, "half_float_casting")
        return self

    @_unless_frozen
    def runningStatisticsAlwaysFloat(self, value: bool) -> Self:
        """Inert, as in PopTorch: running statistics keep the dtype torch gives them."""
        _bool(value, "runningStatisticsAlwaysFloat")
        return self

    @_unless_frozen
    def enableFloatingPointExceptions(self, enabled: bool) -> Self:
        """Raise when a call's results hold a NaN or an infinity (on, as PopTorch's IPU traps on a
        floating point exception), or let them propagate as torch does (off, the default). See
        ``runtime/float_exceptions.py`` for what is checked."""
        self._values["floating_point_exceptions"] = _bool(enabled, "floating_point_exceptions")
        return self

    @_unless_frozen
    def enableStochasticRounding(self, enabled: bool) -> Self:
        """Round to float16 stochastically (on) or to nearest (off, the default)."""
        self._values["stochastic_rounding"] = _bool(enabled, "stochastic_rounding")
        return self

    @_unless_frozen
    def enableMasterWeights(self, enabled: bool = True) -> Self:
        """Beyond PopTorch: keep a float32 master copy of float16/bfloat16 weights on the device;
        the optimizer updates the copy and the model computes with its rounding (to nearest, or
        stochastic when that is enabled), so small updates are not lost to half precision."""
        self._values["master_weights"] = _bool(enabled, "master_weights")
        return self

    @_unless_frozen
    def setPartialsType(self, dtype: torch.dtype) -> Self:
        """Keep matmul and convolution partial results in ``torch.float`` or ``torch.half``."""
        self._values["partials_type"] = _partials_type(dtype)
        return self


class TensorLocationSettings:
    """Where one class of tensors is stored, as PopTorch's settings object of the same name.

    Only ``useOnChipStorage`` is read back by the emulation (for memory accounting); the other
    settings are inert and recorded.
    """

    __slots__ = ("_settings",)

    def __init__(self) -> None:
        self._settings: dict[str, int] = {}

    def _set(self, key: str, value: int) -> Self:
        self._settings[key] = value
        return self

    def minElementsForOffChip(self, min_elements: int) -> Self:
        """Inert: tensors smaller than this are never moved off chip."""
        return self._set("minElementsForOffChip",
                         _int_at_least(min_elements, "min_elements", 0))

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> Self:
        """Inert: tensors smaller than this are never sharded across replicas."""
        return self._set("minElementsForReplicatedTensorSharding",
                         _int_at_least(min_elements, "min_elements", 0))

    def useOnChipStorage(self, use: bool | None = True) -> Self:
        """Store on chip (True) or off chip (False); None leaves the default (on chip)."""
        if use is None:
            self._settings.pop("onChip", None)
            return self
        return self._set("onChip", int(_bool(use, "use")))

    def useReplicatedTensorSharding(self, use: bool = True) -> Self:
        """Inert: shard weights and optimizer state across replicas."""
        return self._set("useReplicatedTensorSharding", int(_bool(use, "use")))

    def useIOTilesToLoad(self, use: bool = True) -> Self:
        """Inert: load through IO tiles."""
        return self._set("useIOTilesToLoad", int(_bool(use, "use")))

    def useIOTilesToStore(self, use: bool = True) -> Self:
        """Inert: store through IO tiles."""
        return self._set("useIOTilesToStore", int(_bool(use, "use")))

    def toDict(self) -> dict[str, int]:
        """The settings made so far, by PopTorch's names (booleans as 0 or 1)."""
        return dict(self._settings)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorLocationSettings):
            return NotImplemented
        return self._settings == other._settings

    __hash__ = None

    def __repr__(self) -> str:
        return f"TensorLocationSettings({self._settings})"


_LOCATION_KINDS = {  # PopTorch's tensor class -> the emulated on-chip flag for it
    "activation": "activations_on_chip",
    "weight": "weights_on_chip",
    "optimizer": "optimizer_on_chip",
    "accumulator": "accumulators_on_chip",
}


class _TensorLocationOptions(_OptionGroup):
    """Where tensors are stored: ``opts.TensorLocations``."""

    _INERT = {"num_io_tiles": None} | {f"{kind}_location": {} for kind in _LOCATION_KINDS}

    activations_on_chip = _emulated("activations_on_chip", "Whether activations stay on chip.")
    weights_on_chip = _emulated("weights_on_chip", "Whether weights stay on chip.")
    optimizer_on_chip = _emulated(
        "optimizer_on_chip", "Whether optimizer state stays on chip.")
    accumulators_on_chip = _emulated(
        "accumulators_on_chip", "Whether gradient accumulators stay on chip.")

    def _location(self, kind: str) -> dict[str, int]:
        """PopTorch's read-back of a tensor class's location: its TensorLocationSettings as a dict."""
        return {"onChip": int(self._values[_LOCATION_KINDS[kind]]), **getattr(self, f"{kind}_location")}

    location_activation = property(lambda self: self._location("activation"))
    location_weight = property(lambda self: self._location("weight"))
    location_optimizer = property(lambda self: self._location("optimizer"))
    location_accumulator = property(lambda self: self._location("accumulator"))

    @_unless_frozen
    def numIOTiles(self, num_tiles: int) -> Self:
        """Inert: tiles reserved for IO."""
        _int_at_least(num_tiles, "num_tiles", 0)
        if not (32 <= num_tiles <= 192 and num_tiles % 2 == 0):
            raise FailedCheck("numIOTiles must be an even number between 32 and 192.")
        self._record("num_io_tiles", num_tiles)
        return self

    def _set_location(self, kind: str, location: TensorLocationSettings) -> Self:
        if not isinstance(location, TensorLocationSettings):
            raise WrongArgumentType(
                f"the {kind} location must be a poptorch.TensorLocationSettings, got {location!r}")
        settings = location.toDict()
        self._values[_LOCATION_KINDS[kind]] = bool(settings.pop("onChip", 1))
        self._record(f"{kind}_location", settings)
        return self

    @_unless_frozen
    def setActivationLocation(self, location: TensorLocationSettings) -> Self:
        """Where activations are stored (replaces earlier activation settings)."""
        return self._set_location("activation", location)

    @_unless_frozen
    def setWeightLocation(self, location: TensorLocationSettings) -> Self:
        """Where weights are stored (replaces earlier weight settings)."""
        return self._set_location("weight", location)

    @_unless_frozen
    def setOptimizerLocation(self, location: TensorLocationSettings) -> Self:
        """Where optimizer state is stored (replaces earlier optimizer settings)."""
        return self._set_location("optimizer", location)

    @_unless_frozen
    def setAccumulatorLocation(self, location: TensorLocationSettings) -> Self:
        """Where gradient accumulators are stored (replaces earlier accumulator settings)."""
        return self._set_location("accumulator", location)


class _DistributedOptions(_OptionGroup):
    """Multi-process (PopRun / PopDist) options: ``opts.Distributed``.

    By default this process's place among the run's instances, as its launcher set it
    (``ipu-run``'s variables, else Open MPI's ``OMPI_COMM_WORLD_RANK``/``SIZE`` as PopTorch reads
    them). With several processes, ``replicationFactor`` counts this process's replicas: the run
    has ``numProcesses`` times as many, and each process feeds its own replicas' share of the
    combined batch.
    """

    @property
    def processId(self) -> int:
        """Index of this process among the run's processes."""
        return self._values["process_id"]

    @property
    def numProcesses(self) -> int:
        """Number of processes the run is distributed over."""
        return self._values["num_processes"]

    distributed_process_id = processId
    num_distributed_processes = numProcesses

    @_unless_frozen
    def disable(self) -> Self:
        """Run as a single process, whatever the environment says."""
        return self.configureProcessId(0, 1)

    @_unless_frozen
    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> Self:
        """Read the process id and count from these environment variables (as PopTorch)."""
        process_id = os.environ.get(_str(var_process_id, "var_process_id"), "0")
        num_processes = os.environ.get(_str(var_num_processes, "var_num_processes"), "1")
        return self.configureProcessId(int(process_id), int(num_processes))

    @_unless_frozen
    def configureProcessId(self, process_id: int, num_processes: int) -> Self:
        """Set this process's index and the number of processes (each started by the user's own
        launcher; the processes connect through ``ipu_backend.distributed.init``)."""
        _int_at_least(num_processes, "num_processes", 1)
        _int_at_least(process_id, "process_id", 0)
        if process_id >= num_processes:
            raise InvalidArgument(
                f"process_id must be below num_processes ({num_processes}), got {process_id}")
        self._values.update(process_id=process_id, num_processes=num_processes)
        return self


class _JitOptions(_OptionGroup):
    """PopTorch's JIT options: ``opts.Jit`` (models are always captured with torch.export)."""

    @_unless_frozen
    def traceModel(self, trace_model: bool) -> Self:
        """Inert with False; True is refused, as in PopTorch."""
        if _bool(trace_model, "trace_model"):
            raise InvalidArgument("options.Jit.traceModel(True) is no longer supported")
        return self


class _PopartOptions(_OptionGroup):
    """PopART session options: ``opts._Popart``. Inert: recorded, never applied."""

    _INERT = {"popart_options": {}}

    @property
    def options(self) -> Mapping[str, Any]:
        """The PopART options set so far (read-only)."""
        return MappingProxyType(self.popart_options)

    @_unless_frozen
    def set(self, key: str, value: Any) -> Self:
        """Record PopART option ``key``."""
        self._record("popart_options", {**self.popart_options, _str(key, "key"): value})
        return self

    @_unless_frozen
    def setEngineOptions(self, engine_options: Mapping[str, str]) -> Self:
        """Record Poplar engine options."""
        return self.set("engineOptions", dict(engine_options))

    @_unless_frozen
    def setPatterns(self, patterns: Mapping[str, bool], level: int = 2) -> Self:
        """Record PopART pattern overrides."""
        _int_at_least(level, "level", 0)
        return self.set("patterns_level", level).set("patterns", dict(patterns))
