"""Lightning's weight averaging callbacks (EMA, SWA) under device iterations: an average taken
only where a host call ends equals the CPU's; one inside a call is refused."""

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, assert_same_weights, dataset, loader, twins


class EverySecondStep(EMAWeightAveraging):
    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None and (step_idx + 1) % 2 == 0


@pytest.mark.parametrize("averaging", [lambda: EverySecondStep(decay=0.5),
                                       lambda: EMAWeightAveraging(decay=0.5, update_every_n_steps=0,
                                                                  update_starting_at_epoch=0)],
                         ids=["every-second-step", "per-epoch"])
def test_an_average_taken_where_calls_end_equals_the_cpus(averaging):
    ipu, cpu = twins()
    pl.Trainer(accelerator="cpu", max_epochs=2, callbacks=[averaging()], **QUIET).fit(cpu, loader(dataset(32), 4))
    pl.Trainer(accelerator="ipu", max_epochs=2, strategy=IPUStrategy(device_iterations=2), callbacks=[averaging()],
               **QUIET).fit(ipu, loader(dataset(32), 4))
    assert_same_weights(ipu, cpu)


def test_an_average_after_every_optimizer_step_is_refused():
    trainer = pl.Trainer(accelerator="ipu", max_epochs=1, strategy=IPUStrategy(device_iterations=2),
                         callbacks=[EMAWeightAveraging()], **QUIET)
    with pytest.raises(MisconfigurationException, match=r"^EMAWeightAveraging averages the weights after optimizer "
                                                        r"step 1, inside a batch of device_iterations=2 .*"
                                                        r"\(step_idx \+ 1\) % 2 == 0"):
        trainer.fit(twins()[0], loader(dataset(32), 4))
