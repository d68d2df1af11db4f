"""What the Lightning IPU plugin's users read from its strategy: the executor of each stage
(``poptorch_models``), the running stage's ``replication_factor``, the options in effect, and the
batches ``batch_to_device`` hands over. Nothing here trains: the runs stop once set up."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, dataset, loader


class Stop(Exception):
    """Ends a run after the strategy's set-up, before anything compiles."""


class Inspect(pl.Callback):
    def __init__(self, read):
        self.read, self.seen = read, None

    def on_fit_start(self, trainer, pl_module):
        self.seen = self.read(trainer.strategy)
        raise Stop

    on_test_start = on_fit_start


def run(read, method="fit", **flags):
    """Start ``trainer.<method>`` with these flags; what ``read(strategy)`` saw once set up."""
    callback = Inspect(read)
    trainer = pl.Trainer(callbacks=[callback], **{"accelerator": "ipu", **QUIET, **flags})
    data = (loader(dataset(), 4),) * (2 if method == "fit" else 1)
    with pytest.raises(Stop):
        getattr(trainer, method)(Regressor(), *data)
    return callback.seen, trainer


def test_poptorch_models_hold_the_executor_of_each_stage_with_the_trainers_settings():
    def read(strategy):
        models = strategy.poptorch_models
        training = models[RunningStage.TRAINING]
        return (list(models), models[RunningStage.VALIDATING] is models[RunningStage.SANITY_CHECKING],
                training._options.toDict()["device_iterations"],
                training._options.Training.toDict()["gradient_accumulation"],
                models[RunningStage.VALIDATING].options.Training.gradient_accumulation)

    seen, trainer = run(read, devices=2, accumulate_grad_batches=2, strategy=IPUStrategy(device_iterations=3))
    assert seen == ([RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.SANITY_CHECKING], True, 3, 2, 1)
    assert trainer.strategy.poptorch_models == {}, "released with the executors at teardown"
    seen, _ = run(lambda strategy: list(strategy.poptorch_models), method="test")
    assert seen == [RunningStage.TESTING]
    seen, _ = run(lambda strategy: list(strategy.poptorch_models), num_sanity_val_steps=0)
    assert seen == [RunningStage.TRAINING, RunningStage.VALIDATING]


def test_replication_factor_is_the_given_options_before_set_up_and_the_stages_after():
    training, inference = ipu_backend.Options(replication_factor=2), ipu_backend.Options(replication_factor=4)
    assert IPUStrategy().replication_factor == 1
    assert IPUStrategy(inference_opts=inference).replication_factor == 4
    strategy = IPUStrategy(training_opts=training, inference_opts=inference)
    assert strategy.replication_factor == 2

    def read(strategy):
        state = strategy.lightning_module.trainer.state
        factors = {}
        for stage in (RunningStage.TRAINING, RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            state.stage = stage
            factors[stage] = strategy.replication_factor
        return factors, strategy.training_opts.replication_factor, strategy.inference_opts.replication_factor

    seen, _ = run(read, strategy=strategy)
    assert seen == ({RunningStage.TRAINING: 2, RunningStage.VALIDATING: 4, RunningStage.SANITY_CHECKING: 4}, 2, 4)


@pytest.mark.parametrize("precision, half", [("16-true", torch.float16), ("bf16-true", torch.bfloat16),
                                             ("16-mixed", None), ("32-true", None)])
def test_batch_to_device_casts_float_tensors_in_the_true_half_precisions(precision, half):
    strategy = pl.Trainer(accelerator="ipu", precision=precision, **QUIET).strategy
    dtypes = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)
    batch = {"x": [torch.zeros(2, dtype=dtype) for dtype in dtypes]}
    moved = strategy.batch_to_device(batch)
    expected = [half if half is not None and dtype.is_floating_point else dtype for dtype in dtypes]
    assert [t.dtype for t in moved["x"]] == expected
    assert all(torch.equal(a.to(b.dtype), b) for a, b in zip(batch["x"], moved["x"]))
