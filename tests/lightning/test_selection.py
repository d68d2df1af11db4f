"""Selecting the IPU accelerator, strategy and precision from Trainer flags, and validating them.
Nothing here compiles a step."""

import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import ipu_backend
from lightning_ipu import IPUAccelerator, IPUPrecision, IPUStrategy, _lightning_hooks
from tests.lightning.helpers import QUIET


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(**QUIET, **kwargs)


def test_import_registers_the_accelerator_and_the_strategy():
    assert AcceleratorRegistry.get("ipu").__class__ is IPUAccelerator
    assert isinstance(StrategyRegistry.get("ipu_strategy"), IPUStrategy)


def test_accelerator_ipu_with_devices_gives_the_ipu_strategy_with_that_many_replicas():
    t = trainer(accelerator="ipu", devices=8)
    assert type(t.strategy) is IPUStrategy and not isinstance(t.strategy, DDPStrategy)
    assert isinstance(t.accelerator, IPUAccelerator)
    assert t.num_devices == 8 and t.strategy.replicas == 8 and t.world_size == 1
    assert type(t.precision_plugin) is IPUPrecision and t.precision_plugin.precision == "32-true"


@pytest.mark.parametrize("flags", [dict(accelerator="ipu", devices="auto"), dict(accelerator="ipu"),
                                   dict(strategy="ipu_strategy"), dict(strategy=IPUStrategy()),
                                   dict(accelerator="ipu", strategy="ipu_strategy", devices="1")])
def test_every_way_of_asking_for_ipus_gives_one_replica_by_default(flags):
    t = trainer(**flags)
    assert type(t.strategy) is IPUStrategy and isinstance(t.accelerator, IPUAccelerator)
    assert t.num_devices == 1


@pytest.mark.parametrize("flag, expected", [
    ("32-true", "32-true"), (32, "32-true"), ("16-mixed", "16-mixed"), (16, "16-mixed"),
    ("bf16-mixed", "bf16-mixed"), ("bf16", "bf16-mixed"), ("16-true", "16-true"), ("bf16-true", "bf16-true")])
def test_precision_flags_pick_the_ipu_precision_plugin(flag, expected):
    t = trainer(accelerator="ipu", devices=2, precision=flag)
    assert type(t.precision_plugin) is IPUPrecision and not isinstance(t.precision_plugin, MixedPrecision)
    assert t.precision_plugin.precision == expected
    assert t.strategy.precision_plugin is t.precision_plugin


@pytest.mark.parametrize("flag", ["64-true", "transformer-engine"])
def test_unsupported_precision_is_a_value_error_naming_the_supported_ones(flag):
    with pytest.raises(ValueError, match=r"precision must be one of '32-true', '16-mixed', 'bf16-mixed', "
                                         r"'16-true', 'bf16-true'"):
        trainer(accelerator="ipu", precision=flag)


def test_precision_plugin_given_to_the_strategy_is_used():
    t = trainer(strategy=IPUStrategy(precision_plugin=IPUPrecision("bf16-true")))
    assert t.precision_plugin.precision == "bf16-true"


def test_a_non_ipu_precision_plugin_is_refused():
    with pytest.raises(MisconfigurationException, match="MixedPrecision does not run on IPUs"):
        trainer(accelerator="ipu", plugins=[MixedPrecision("bf16-mixed", "cpu")])


@pytest.mark.parametrize("devices, message", [
    (-1, "must be positive"), (3, "3 IPUs is not a power of two"), (128, "at most 64 IPUs"),
    ("two", "a positive int"), ([0, 1], "a positive int"), (True, "a positive int")])
def test_invalid_devices_are_clear_errors(devices, message):
    with pytest.raises(MisconfigurationException, match=message):
        trainer(accelerator="ipu", devices=devices)


def test_devices_that_are_no_power_of_two_are_accepted_when_auto_rounding_is_asked_for():
    options = ipu_backend.Options(replication_factor=3, auto_round_num_ipus=True)
    t = trainer(devices=3, strategy=IPUStrategy(training_opts=options, inference_opts=options))
    assert t.num_devices == 3


@pytest.mark.parametrize("flags, message", [
    (dict(accelerator="ipu", strategy="ddp"), "accelerator='ipu' runs with lightning_ipu.IPUStrategy"),
    (dict(accelerator="cpu", strategy=IPUStrategy()), "IPUStrategy runs on the IPU accelerator"),
    (dict(accelerator="ipu", num_nodes=2), "runs one process per node.*1 process\\(es\\) were started"),
])
def test_conflicting_flags_are_clear_errors(flags, message):
    with pytest.raises(MisconfigurationException, match=message):
        trainer(**flags)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_device_iterations_must_be_a_positive_int(value):
    with pytest.raises(MisconfigurationException, match="device_iterations"):
        IPUStrategy(device_iterations=value)


def test_options_may_be_given_as_a_mapping():
    strategy = IPUStrategy(training_opts={"device_iterations": 4, "gradient_accumulation": 2})
    assert strategy.training_opts.device_iterations == 4
    assert strategy.training_opts.Training.gradient_accumulation == 2
    with pytest.raises(MisconfigurationException, match="must be an ipu_backend.Options or a mapping"):
        IPUStrategy(inference_opts=4)


def test_the_connector_hook_is_installed_once_and_checks_the_lightning_version():
    _lightning_hooks.route_ipu_flags()
    wrapped = _AcceleratorConnector._check_config_and_set_final_flags
    assert getattr(wrapped, "_lightning_ipu_routing") and not hasattr(wrapped.__wrapped__, "_lightning_ipu_routing")
    assert _lightning_hooks.check_version(pl.__version__), "the installed Lightning is a tested one"
    with pytest.warns(UserWarning, match="tested with Lightning 2.5, 2.6"):
        assert not _lightning_hooks.check_version("2.7.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(accelerator="cpu")             # other accelerators are left alone


def test_pytorch_lightning_gets_its_own_ipu_classes():
    import pytorch_lightning

    import lightning_ipu.pytorch_lightning as standalone
    t = pytorch_lightning.Trainer(accelerator="ipu", devices=2, precision="bf16-mixed", **QUIET)
    assert type(t.strategy) is standalone.IPUStrategy
    assert isinstance(t.strategy, pytorch_lightning.strategies.Strategy)
    assert isinstance(t.precision_plugin, standalone.IPUPrecision) and t.num_devices == 2
    assert standalone.IPUStrategy is not IPUStrategy
