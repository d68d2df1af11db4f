"""ipu_backend.options.Options: PopTorch's method form, read-back, validation, freezing, the
typed keyword form (and jsonargparse building it from YAML), serialisation."""

import copy
import pickle

import jsonargparse
import pytest
import torch

import ipu_backend

from ipu_backend import Error, PipelinedExecution, ShardedExecution
from ipu_backend.enums import (
    CommGroupType,
    ConnectionType,
    DataLoaderMode,
    MeanReductionStrategy,
    OutputMode,
    ReductionType,
    SyncPattern,
)
from ipu_backend.options import (
    ConfigFileError,
    FailedCheck,
    FrozenOptionsError,
    InvalidArgument,
    Options,
    TensorLocationSettings,
    WrongArgumentType,
)
from ipu_backend.option_groups import _DistributedOptions


def test_defaults_read_back_as_poptorch():
    opts = Options()
    assert opts.device_iterations == 1
    assert opts.replication_factor == 1
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type is ReductionType.Mean
    assert opts.Training.mean_reduction_strategy is MeanReductionStrategy.Post
    assert opts.Training.auto_loss_scaling is False
    assert opts.output_mode is OutputMode.Default and opts.defaultOutputMode()
    assert opts.output_return_period is None
    assert opts.random_seed is None
    assert opts.execution_strategy is None
    assert opts.Precision.stochastic_rounding is False
    assert opts.Precision.partials_type is torch.float32
    tensor_locations = opts.TensorLocations
    assert tensor_locations.optimizer_on_chip and tensor_locations.weights_on_chip
    assert tensor_locations.activations_on_chip and tensor_locations.accumulators_on_chip
    assert opts.executable_cache_dir == "auto"
    assert opts.auto_round_num_ipus is False
    assert opts.broadcast_buffers is True
    assert opts.profiling_dir is None
    assert opts.loop_repeated_layers is True
    assert opts.Distributed.numProcesses == 1 and opts.Distributed.processId == 0


def test_method_form_chains_and_reads_back():
    strategy = object()
    opts = Options()
    assert opts.deviceIterations(4).replicationFactor(2).randomSeed(5) is opts
    training = opts.Training
    assert training.gradientAccumulation(8).accumulationAndReplicationReductionType(
        ReductionType.Sum).setAutomaticLossScaling(True) is training
    precision = opts.Precision
    assert precision.enableStochasticRounding(True).setPartialsType(torch.half) is precision
    locations = opts.TensorLocations
    assert locations.setOptimizerLocation(
        TensorLocationSettings().useOnChipStorage(False)).setWeightLocation(
        TensorLocationSettings().useOnChipStorage(False)) is locations
    assert (opts.outputMode(OutputMode.EveryN, 3).setExecutionStrategy(strategy)
            .enableExecutableCaching("/tmp/cache").autoRoundNumIPUs(True).broadcastBuffers(False)
            .enableProfiling("/tmp/profile")) is opts

    assert (opts.device_iterations, opts.replication_factor, opts.random_seed) == (4, 2, 5)
    assert training.gradient_accumulation == 8
    assert training.accumulation_and_replication_reduction_type is ReductionType.Sum
    assert training.auto_loss_scaling is True
    assert precision.stochastic_rounding is True and precision.partials_type is torch.float16
    assert not locations.optimizer_on_chip and not locations.weights_on_chip
    assert locations.activations_on_chip and locations.accumulators_on_chip
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 3)
    assert opts.execution_strategy is strategy
    assert opts.executable_cache_dir == "/tmp/cache"
    assert opts.auto_round_num_ipus is True and opts.broadcast_buffers is False
    assert opts.profiling_dir == "/tmp/profile"
    assert Options().enableProfiling().profiling_dir == "."
    assert Options().enableExecutableCaching("/c").enableExecutableCaching("auto") == Options()
    assert Options().enableExecutableCaching(None).executable_cache_dir is None
    assert Options(executable_cache_dir=None) == Options().enableExecutableCaching(None) != Options()


def test_keywords_equal_method_form_and_strings_are_case_insensitive():
    by_keywords = Options(device_iterations=4, replication_factor=2, gradient_accumulation=3,
                          reduction_type="SUM", mean_reduction_strategy="running",
                          output_mode="everyn", output_return_period=2, random_seed=1,
                          auto_loss_scaling=True, stochastic_rounding=True, partials_type="Half",
                          optimizer_on_chip=False, executable_cache_dir="cache",
                          auto_round_num_ipus=True, broadcast_buffers=False, profiling_dir="p")
    by_methods = Options().deviceIterations(4).replicationFactor(2).randomSeed(1)
    by_methods.Training.gradientAccumulation(3).accumulationAndReplicationReductionType(
        ReductionType.Sum).setMeanAccumulationAndReplicationReductionStrategy(
        MeanReductionStrategy.Running).setAutomaticLossScaling(True)
    by_methods.outputMode(OutputMode.EveryN, 2).enableExecutableCaching("cache")
    by_methods.Precision.enableStochasticRounding(True).setPartialsType(torch.float16)
    by_methods.TensorLocations.setOptimizerLocation(
        TensorLocationSettings().useOnChipStorage(False))
    by_methods.autoRoundNumIPUs(True).broadcastBuffers(False).enableProfiling("p")
    assert by_keywords == by_methods
    assert by_keywords != Options()
    assert Options(reduction_type=ReductionType.Sum) == Options(reduction_type="sum")


def test_loop_repeated_layers_in_both_forms():
    assert Options(loop_repeated_layers=False) == Options().loopRepeatedLayers(False) != Options()
    assert Options().loopRepeatedLayers(False).loopRepeatedLayers().loop_repeated_layers is True


def test_every_n_needs_a_positive_period():
    for period in (None, 0, -2, 1.5):
        with pytest.raises(InvalidArgument, match="EveryN anchor must have output_return_period"):
            Options().outputMode(OutputMode.EveryN, period)
    with pytest.raises(ValueError, match="output_return_period"):
        Options(output_mode="EveryN")
    opts = Options().outputMode(OutputMode.All, 5)  # ignored outside EveryN, as in PopTorch
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.All, None)


@pytest.mark.parametrize("setter", [
    lambda o, v: o.deviceIterations(v),
    lambda o, v: o.replicationFactor(v),
    lambda o, v: o.Training.gradientAccumulation(v),
    lambda o, v: Options(device_iterations=v),
    lambda o, v: Options(replication_factor=v),
    lambda o, v: Options(gradient_accumulation=v),
])
def test_counts_must_be_positive_ints(setter):
    for bad in (0, -1):
        with pytest.raises(InvalidArgument, match="must be >= 1"):
            setter(Options(), bad)
    for bad in (2.0, "2", True, None):
        with pytest.raises(WrongArgumentType, match="must be an int"):
            setter(Options(), bad)


def test_enum_arguments_are_checked_and_errors_list_allowed_values():
    with pytest.raises(InvalidArgument, match=r"one of Sum, Mean .* got <ReductionType.NoRed"):
        Options().Training.accumulationAndReplicationReductionType(ReductionType.NoReduction)
    with pytest.raises(InvalidArgument, match=r"reduction_type must be one of Sum, Mean"):
        Options(reduction_type="average")
    with pytest.raises(InvalidArgument, match=r"Final, EveryN, All, Sum, Default.*'every'"):
        Options(output_mode="every")
    with pytest.raises(InvalidArgument, match="output_mode"):
        Options().outputMode(2)  # an int is not a member, even of an IntEnum
    with pytest.raises(InvalidArgument, match="torch.float or torch.half"):
        Options().Precision.setPartialsType(torch.bfloat16)
    with pytest.raises(InvalidArgument, match="'float' / 'half'"):
        Options(partials_type="double")


def test_wrong_types_are_refused():
    with pytest.raises(WrongArgumentType, match="auto_loss_scaling must be a bool"):
        Options().Training.setAutomaticLossScaling(1)
    with pytest.raises(WrongArgumentType, match="broadcast_buffers must be a bool"):
        Options(broadcast_buffers="yes")
    with pytest.raises(WrongArgumentType, match="path"):
        Options().enableExecutableCaching(3)
    with pytest.raises(WrongArgumentType, match="loop_repeated_layers must be a bool"):
        Options().loopRepeatedLayers("no")
    with pytest.raises(WrongArgumentType, match="TensorLocationSettings"):
        Options().TensorLocations.setWeightLocation({"onChip": 0})
    with pytest.raises(TypeError, match="unexpected keyword"):
        Options(device_iteration=2)
    with pytest.raises(AttributeError):
        Options().deviceIteration = 2  # no attribute can be created by a typo


def test_errors_are_ipu_backend_errors_of_poptorchs_builtin_type():
    assert issubclass(InvalidArgument, Error) and issubclass(InvalidArgument, ValueError)
    assert issubclass(WrongArgumentType, Error) and issubclass(WrongArgumentType, TypeError)
    assert issubclass(FrozenOptionsError, Error)
    assert issubclass(FrozenOptionsError, AttributeError)
    assert issubclass(FailedCheck, Error) and issubclass(FailedCheck, AssertionError)


def test_poptorch_default_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"deviceIterations": 3, "Training.gradientAccumulation": 2, '
                                                   '"connectionType": "ConnectionType.OnDemand"}')
    opts = Options(replication_factor=2)
    assert (opts.device_iterations, opts.Training.gradient_accumulation, opts.replication_factor) == (3, 2, 2)
    assert opts.connection_type == "OnDemand"
    expected = Options(device_iterations=3, gradient_accumulation=2, replication_factor=2)
    monkeypatch.delenv("POPTORCH_DEFAULT_OPTIONS")
    assert opts == expected.connectionType(ConnectionType.OnDemand) and repr(opts) == repr(expected)
    assert repr(Options()) == "Options()"
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"deviceIteration": 3}')
    with pytest.raises(InvalidArgument, match="Unknown option 'deviceIteration'"):
        Options()


def test_random_seed_seeds_torch_as_poptorch():
    Options().randomSeed(123)
    first = torch.rand(3)
    Options(random_seed=123)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(InvalidArgument):
        Options(random_seed=-1)


_INERT_CALLS = [
    (lambda o: o.useIpuModel(True), "use_model", True),
    (lambda o: o.logDir("/tmp/logs"), "log_dir", "/tmp/logs"),
    (lambda o: o.maxRepeatLogs(None), "max_repeat_logs", None),
    (lambda o: o.modelName("net"), "model_name", "net"),
    (lambda o: o.connectionType(ConnectionType.OnDemand), "connection_type", "OnDemand"),
    (lambda o: o.syncPattern(SyncPattern.SinglePipeline), "sync_pattern", "SinglePipeline"),
    (lambda o: o.useIpuId(3), "ipu_id", 3),
    (lambda o: o.useOfflineIpuTarget(), "connection_type", "Never"),
    (lambda o: o.anchorTensor("t", "tensor1", OutputMode.EveryN, 2), "anchored_tensors",
     {"t": ["tensor1", "EveryN", 2]}),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 0.4}), "available_memory_proportion",
     {0: 0.4}),
    (lambda o: o.enableStableNorm(True), "enable_stable_norm", True),
    (lambda o: o.logCycleCount(True), "log_cycle_count", True),
    (lambda o: o.disableModuleNamescope(), "module_namescope", False),
    (lambda o: o.updatableNamedBuffers(["bn.running_mean"]), "updatable_named_buffers",
     ["bn.running_mean"]),
    (lambda o: o.appendToLocationExcludes("mylib"), "source_location_excludes",
     ["install/poptorch", "site-packages/torch", "site-packages/poptorch", "mylib"]),
    (lambda o: o.showCompilationProgressBar(False), "show_compilation_progress_bar", False),
    (lambda o: o.relaxOptimizerAttributesChecks(), "relax_optimizer_attributes_checks", True),
    (lambda o: o.Training.setConvolutionDithering(True), "convolution_dithering", True),
    (lambda o: o.TensorLocations.numIOTiles(64), "num_io_tiles", 64),
    (lambda o: o.TensorLocations.setActivationLocation(
        TensorLocationSettings().useOnChipStorage(False).useIOTilesToLoad()),
     "activation_location", {"useIOTilesToLoad": 1}),
    (lambda o: o._Popart.set("saveInitializersToFile", "w.onnx"), "popart_options",
     {"saveInitializersToFile": "w.onnx"}),
]


@pytest.mark.parametrize("call, name, value", _INERT_CALLS)
def test_inert_settings_are_recorded_and_change_nothing_else(call, name, value):
    opts = Options()
    before = {k: v for k, v in opts.toDict().items() if k != "recorded"}
    assert call(opts) is not None
    after = opts.toDict()
    assert after["recorded"][name] == value
    if name != "activation_location":  # that call also sets the emulated activations_on_chip
        assert {k: v for k, v in after.items() if k != "recorded"} == before
    owner = next(g for g in (opts, opts.Training, opts.Precision, opts.TensorLocations,
                             opts._Popart) if name in type(g)._INERT)
    assert getattr(owner, name) == value  # read back by PopTorch's attribute name


def test_inert_settings_back_at_their_default_are_not_recorded():
    assert Options().useIpuModel(True).useIpuModel(False) == Options()
    assert Options().logDir(".").toDict()["recorded"] == {}
    assert Options().log_dir == "."
    opts = Options()._Popart.set("a", 1).setPatterns({"p": True})
    assert dict(opts.options) == {"a": 1, "patterns_level": 2, "patterns": {"p": True}}
    assert Options().Jit.traceModel(False) is not None
    assert Options().Precision.halfFloatCasting(
        "HalfUpcastToFloat").runningStatisticsAlwaysFloat(True) is not None


def test_poptorch_checks_of_inert_settings():
    with pytest.raises(FailedCheck, match="numIOTiles must be an even number"):
        Options().TensorLocations.numIOTiles(33)
    with pytest.raises(InvalidArgument, match="Invalid key: GPU0"):
        Options().setAvailableMemoryProportion({"GPU0": 0.5})
    with pytest.raises(InvalidArgument, match="traceModel\\(True\\) is no longer supported"):
        Options().Jit.traceModel(True)
    with pytest.raises(InvalidArgument, match="input_group_type cannot be All"):
        Options().replicationFactor(4).inputReplicaGrouping(2, CommGroupType.All)
    with pytest.raises(InvalidArgument, match="must be a factor of replication_factor"):
        Options().replicationFactor(4).inputReplicaGrouping(3, CommGroupType.Consecutive)


def test_synthetic_data_and_input_grouping_are_read_back_and_undone():
    synthetic = Options().enableSyntheticData(True)
    assert synthetic._Popart.options["syntheticDataMode"] == 2 and repr(synthetic) != repr(Options())
    assert synthetic.runtime_settings().synthetic_data == 2
    opts = Options().replicationFactor(4)
    assert opts.enableSyntheticData(False).inputReplicaGrouping(
        4, CommGroupType.NoGrouping).inputReplicaGrouping(1, CommGroupType.Consecutive) == opts
    assert opts.Distributed.configureProcessId(0, 1).disable() is opts.Distributed


def _every_setter_call():
    location = TensorLocationSettings()
    return [
        lambda o: o.deviceIterations(2), lambda o: o.replicationFactor(2),
        lambda o: o.randomSeed(1), lambda o: o.outputMode(OutputMode.All),
        lambda o: o.setExecutionStrategy(None), lambda o: o.enableExecutableCaching("c"),
        lambda o: o.autoRoundNumIPUs(), lambda o: o.broadcastBuffers(),
        lambda o: o.enableProfiling(),
        lambda o: o.useIpuModel(True), lambda o: o.logDir("l"), lambda o: o.from_json("{}"),
        lambda o: o.Training.gradientAccumulation(2),
        lambda o: o.Training.accumulationAndReplicationReductionType(ReductionType.Sum),
        lambda o: o.Training.setAutomaticLossScaling(True),
        lambda o: o.Precision.enableStochasticRounding(True),
        lambda o: o.Precision.setPartialsType(torch.half),
        lambda o: o.TensorLocations.setOptimizerLocation(location),
        lambda o: o.TensorLocations.numIOTiles(32),
        lambda o: o.Distributed.configureProcessId(0, 1), lambda o: o.Jit.traceModel(False),
        lambda o: o._Popart.set("a", 1),
    ]


def test_frozen_options_refuse_every_setter_with_poptorchs_message():
    opts = Options(device_iterations=3)
    opts._freeze()
    for call in _every_setter_call():
        with pytest.raises(FrozenOptionsError, match="^Can't modify frozen Options$"):
            call(opts)
    assert opts == Options(device_iterations=3)
    assert opts.device_iterations == 3  # reading is still allowed


def test_clone_and_deepcopy_are_unfrozen_and_independent():
    opts = Options(gradient_accumulation=2).useIpuModel(True)
    opts._Popart.set("k", [1])
    opts._freeze()
    for copied in (opts.clone(), copy.deepcopy(opts)):
        assert copied == opts
        for call in _every_setter_call():
            call(copied)
        copied._Popart.set("k", [2])
        assert copied != opts
    assert opts.Training.gradient_accumulation == 2 and opts._Popart.options["k"] == [1]
    with pytest.raises(FrozenOptionsError):
        opts.deviceIterations(2)


def test_to_dict_and_from_dict_round_trip():
    strategy = object()
    opts = Options(device_iterations=2, output_mode="EveryN", output_return_period=4,
                   partials_type="half", random_seed=9)
    opts.setExecutionStrategy(strategy).useIpuModel(True).Training.setConvolutionDithering(True)
    opts.TensorLocations.setWeightLocation(
        TensorLocationSettings().useOnChipStorage(False).useReplicatedTensorSharding())
    settings = opts.toDict()
    assert settings["output_mode"] == "EveryN" and settings["partials_type"] == "half"
    assert settings["weights_on_chip"] is False
    assert settings["recorded"] == {"use_model": True, "convolution_dithering": True,
                                    "weight_location": {"useReplicatedTensorSharding": 1}}
    restored = Options.from_dict(settings)
    assert restored == opts and restored.execution_strategy is strategy
    assert Options.from_dict({"replication_factor": 2}) == Options().replicationFactor(2)
    with pytest.raises(InvalidArgument, match=r"Unknown option\(s\) \['replicas'\].*"
                                              r"device_iterations, replication_factor"):
        Options.from_dict({"replicas": 2})
    with pytest.raises(InvalidArgument, match=r"Unknown recorded option\(s\) \['nope'\]"):
        Options.from_dict({"recorded": {"nope": 1}})


def test_option_groups_read_back_as_dicts_and_the_strategy_in_effect():
    opts = Options(gradient_accumulation=4, reduction_type="sum", stochastic_rounding=True)
    opts.Training.setConvolutionDithering(True)
    assert opts.Training.toDict() == {
        "gradient_accumulation": 4, "reduction_type": "Sum", "mean_reduction_strategy": "Post",
        "auto_loss_scaling": False, "convolution_dithering": True}
    assert opts.Precision.toDict() == {"stochastic_rounding": True, "master_weights": False,
                                       "partials_type": "float", "floating_point_exceptions": False}
    opts.TensorLocations.setWeightLocation(TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(8))
    assert opts.TensorLocations.location_weight == {"onChip": 0, "minElementsForOffChip": 8}
    assert opts.TensorLocations.location_optimizer == {"onChip": 1}
    default = Options()._execution_strategy
    assert isinstance(default, PipelinedExecution) and repr(default) == "PipelinedExecution(AutoStage.SameAsIpu)"
    sharded = ShardedExecution("B1", "B2")
    assert Options().setExecutionStrategy(sharded)._execution_strategy is sharded


def test_to_dict_without_strategy_is_plain_data_and_pickles():
    opts = Options(reduction_type="sum", output_mode="all").useIpuModel(True)
    settings = opts.toDict()
    assert all(isinstance(v, (int, str, bool, dict, type(None))) for v in settings.values())
    assert pickle.loads(pickle.dumps(opts)) == opts


def test_repr_shows_non_default_settings():
    assert repr(Options()) == "Options()"
    opts = Options().replicationFactor(4).useIpuModel(True)
    assert repr(opts) == "Options(replication_factor=4, recorded={'use_model': True})"


def test_tensor_location_settings():
    settings = TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(
        128).useIOTilesToStore()
    assert settings.toDict() == {"onChip": 0, "minElementsForOffChip": 128,
                                 "useIOTilesToStore": 1}
    assert settings.useOnChipStorage(None).toDict() == {"minElementsForOffChip": 128,
                                                        "useIOTilesToStore": 1}
    opts = Options(accumulators_on_chip=False)
    opts.TensorLocations.setAccumulatorLocation(TensorLocationSettings())  # unset: on chip
    assert opts.TensorLocations.accumulators_on_chip
    with pytest.raises(WrongArgumentType):
        TensorLocationSettings().useOnChipStorage("no")


def test_from_json_and_load_from_file(tmp_path):
    opts = Options().from_json('{"deviceIterations": 4, "Training.gradientAccumulation": 2,'
                               '"outputMode": ["OutputMode.EveryN", 3],'
                               '"_Popart.set": ["saveInitializersToFile", "w.onnx"]}')
    expected = Options(device_iterations=4, gradient_accumulation=2, output_mode="EveryN",
                       output_return_period=3)
    expected._Popart.set("saveInitializersToFile", "w.onnx")
    assert opts == expected
    with pytest.raises(InvalidArgument, match="Unknown option 'Training.nope'"):
        Options().from_json('{"Training.nope": 1}')

    config = tmp_path / "opts.cfg"
    config.write_text("deviceIterations(4)\n  Training.gradientAccumulation(2)\n\n"
                      "# a comment\noutputMode(poptorch.enums.OutputMode.EveryN, 3)  # inline\n"
                      "_Popart.set('saveInitializersToFile', 'w.onnx')\n")
    assert Options().loadFromFile(str(config)) == expected
    config.write_text("deviceIterations(4)\n\noutputMode(poptorch.enums.OutputMode.All\n")
    with pytest.raises(ConfigFileError, match=r"SyntaxError at line 3 of opts.cfg: .*\n"
                                              r"> outputMode\(poptorch"):
        Options().loadFromFile(str(config))


def test_jsonargparse_builds_options_from_yaml():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--opts", type=Options)
    config = parser.parse_string("""
opts:
  class_path: ipu_backend.options.Options
  init_args:
    device_iterations: 8
    replication_factor: 2
    gradient_accumulation: 4
    reduction_type: Sum
    output_mode: everyN
    output_return_period: 2
    partials_type: half
    optimizer_on_chip: false
    profiling_dir: reports
""")
    opts = parser.instantiate(config).opts
    expected = Options().deviceIterations(8).replicationFactor(2).outputMode(OutputMode.EveryN, 2)
    expected.Training.gradientAccumulation(4).accumulationAndReplicationReductionType(
        ReductionType.Sum)
    expected.Precision.setPartialsType(torch.half)
    expected.TensorLocations.setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))
    expected.enableProfiling("reports")
    assert isinstance(opts, Options) and opts == expected

    bad = parser.parse_string("opts: {class_path: ipu_backend.options.Options, "
                              "init_args: {output_mode: sometimes}}")
    with pytest.raises(InvalidArgument, match="output_mode must be one of"):
        parser.instantiate(bad)
    with pytest.raises(jsonargparse.ArgumentError, match="device_iterations"):
        parser.parse_string("opts: {class_path: ipu_backend.options.Options, "
                            "init_args: {device_iterations: two}}")


def test_enums_have_poptorchs_members_and_values():
    assert [(m.name, m.value) for m in OutputMode] == [
        ("Final", 0), ("EveryN", 1), ("All", 2), ("Sum", 3), ("Default", 4)]
    assert [(m.name, m.value) for m in ReductionType] == [
        ("Sum", 0), ("Mean", 1), ("NoReduction", 2)]
    assert [(m.name, m.value) for m in DataLoaderMode] == [
        ("Sync", 0), ("Async", 1), ("AsyncRebatched", 2)]
    assert [m.name for m in MeanReductionStrategy] == ["Running", "Post", "PostAndLoss"]


def test_settings_that_read_back_are_assigned_through_their_setters():
    opts = Options()
    opts.replication_factor = 4
    opts.device_iterations = 3
    opts.Training.gradient_accumulation = 2
    opts.Precision.stochastic_rounding = True
    assert opts == Options(replication_factor=4, device_iterations=3, gradient_accumulation=2,
                           stochastic_rounding=True)
    with pytest.raises(InvalidArgument, match="replication_factor"):
        opts.replication_factor = 0          # the setter's checks apply
    with pytest.raises(AttributeError, match="no option 'replicationfactor'"):
        opts.replicationfactor = 2
    opts._freeze()
    with pytest.raises(FrozenOptionsError):
        opts.device_iterations = 5


def test_an_option_group_can_be_given_a_subclass_as_popdist_does():
    class Wrapped(_DistributedOptions):
        pass

    opts = Options()
    opts.Distributed.__class__ = Wrapped
    assert isinstance(opts.Distributed, Wrapped) and opts.Distributed.numProcesses == 1
    assert opts.clone().Distributed.numProcesses == 1


def test_autotune_matmuls_in_both_forms():
    assert Options().autotune_matmuls is False
    assert Options(autotune_matmuls=True) == Options().autotuneMatmuls() != Options()
    assert Options().autotuneMatmuls().runtime_settings().autotune_matmuls is True
    assert Options().autotuneMatmuls().runtime_settings().key != Options().runtime_settings().key
    with pytest.raises(WrongArgumentType, match="autotune_matmuls must be a bool"):
        Options().autotuneMatmuls("no")
