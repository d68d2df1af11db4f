"""Fractional batch limits count host calls on IPUs: where that runs other batches than the CPU,
a warning says so; where the fraction rounds alike, the run sees the CPU's samples."""

import warnings

import lightning.pytorch as pl
import pytest

import ipu_backend
from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, dataset, loader


class SampleCounter(Regressor):
    """Counts the samples each validation and training epoch sees."""

    def on_validation_epoch_start(self):
        self.validated = 0

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.validated += batch[0].shape[0]

    def on_train_epoch_start(self):
        self.trained, self.validations = 0, []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained += batch[0].shape[0]

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking and self.trainer.state.fn == "fit":
            self.validations.append(getattr(self, "trained", 0))


def _fit(accelerator: str, **flags) -> tuple[SampleCounter, list[str]]:
    """One epoch on 48 training and 40 validation samples in batches of 4 (2 per host call)."""
    options = dict(training_opts=ipu_backend.Options(device_iterations=2),
                   inference_opts=ipu_backend.Options(device_iterations=2))
    strategy = dict(strategy=IPUStrategy(**options)) if accelerator == "ipu" else {}
    module = SampleCounter()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_epochs=1, num_sanity_val_steps=0,
                         **strategy, **flags, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(dataset(48), 4), loader(dataset(40), 4))
    return module, [str(w.message) for w in caught if "counts host calls" in str(w.message)]


def test_a_validation_fraction_splitting_calls_is_warned_of_with_what_runs():
    module, messages = _fit("ipu", limit_val_batches=0.5)      # the CPU: 5 of 10 batches
    assert module.validated == 16
    assert len(messages) == 1
    assert messages[0].startswith("limit_val_batches=0.5 counts host calls on IPUs: it runs 2 of the 5 calls "
                                  "(4 of the loader's 10 batches), where the CPU runs 5")
    assert "(0.2, 0.25, 0.4)" in messages[0]


@pytest.mark.parametrize("flags", [dict(limit_val_batches=0.4), dict(val_check_interval=0.5),
                                   dict(limit_train_batches=0.5, val_check_interval=0.35)])
def test_fractions_rounding_alike_run_the_samples_of_the_cpu_without_a_warning(flags):
    module, messages = _fit("ipu", **flags)
    reference, _ = _fit("cpu", **flags)
    assert not messages
    assert (module.validated, module.trained, module.validations) == \
        (reference.validated, reference.trained, reference.validations)


def test_a_validation_interval_splitting_calls_is_warned_of():
    module, messages = _fit("ipu", val_check_interval=0.25)    # the CPU: every 3 of 12 batches
    assert module.validations == [8, 16, 24, 32, 40, 48]
    assert messages == ["val_check_interval=0.25 counts host calls on IPUs: validation runs every 1 call "
                        "(2 batches), where the CPU validates every 3 batches; each call combines 2 "
                        "batches. Give val_check_interval a fraction the CPU rounds alike (0.2, 0.35, "
                        "0.4) or an int number of calls."]


def test_overfit_batches_are_named_as_the_fraction_given():
    _, messages = _fit("ipu", overfit_batches=0.25)         # validation: 1 of 5 calls, 2 of 10 batches
    assert len(messages) == 1
    assert messages[0].startswith("overfit_batches=0.25 counts host calls on IPUs: it runs 1 of the 6 calls "
                                  "(2 of the loader's 12 batches), where the CPU runs 3")


def test_a_test_fraction_splitting_calls_is_warned_of():
    strategy = IPUStrategy(inference_opts=ipu_backend.Options(device_iterations=2))
    trainer = pl.Trainer(accelerator="ipu", devices=1, limit_test_batches=0.5, strategy=strategy, **QUIET)
    with pytest.warns(UserWarning, match=r"limit_test_batches=0.5 counts host calls on IPUs: it runs 2 of the 5 "):
        trainer.test(Regressor(), loader(dataset(40), 4))


def test_the_whole_epoch_is_not_warned_of_as_a_fraction():
    """limit_train_batches=1.0 with a loader whose 11 batches do not divide into calls of 2: the
    loader warns of the batch it drops; the default limit is not warned of as a fraction."""
    module = SampleCounter()
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, num_sanity_val_steps=0, limit_val_batches=0,
                         strategy=IPUStrategy(device_iterations=2), **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(dataset(44), 4))
    assert not [w for w in caught if "counts host calls" in str(w.message)]
    assert module.trained == 40                                   # 5 calls of 2 batches; the 11th dropped
