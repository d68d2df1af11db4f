"""Where Lightning drives, a compilation's phases are printed through the Trainer's progress bar."""

import contextlib
import io

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

from ipu_backend.runtime import program_cache
from tests.lightning.helpers import Regressor, dataset


@pytest.fixture(autouse=True)
def compiles_afresh(monkeypatch):
    """Each test's first call compiles: no program from another test, in memory or on disk."""
    monkeypatch.setattr(program_cache, "SHARED", program_cache.ProgramCache())
    monkeypatch.setenv("IPU_BACKEND_CACHE_DIR", "off")


class Recording(TQDMProgressBar):
    """Lightning's progress bar, keeping what is printed through it."""

    def __init__(self):
        super().__init__()
        self.printed = []

    def print(self, *args, **kwargs):
        self.printed.append(" ".join(map(str, args)))


def fit(**flags) -> str:
    """What a short fit prints on standard error (a terminal)."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stderr = Terminal()
    trainer = pl.Trainer(accelerator="ipu", devices=1, max_epochs=1, limit_val_batches=0, logger=False,
                         enable_model_summary=False, enable_checkpointing=False, **flags)
    with contextlib.redirect_stderr(stderr):
        trainer.fit(Regressor(), DataLoader(dataset(16), batch_size=8))
    return stderr.getvalue()


def test_the_phases_are_printed_through_the_progress_bar():
    bar = Recording()
    fit(callbacks=[bar])
    phases = [line.split(":")[1].split("...")[0].strip() for line in bar.printed[:-1]]
    assert phases == ["capture", "lowering", "XLA compile"], bar.printed
    assert bar.printed[-1].startswith("Graph compilation: done in")


def test_no_progress_bar_shows_nothing():
    assert "Graph compilation" not in fit(enable_progress_bar=False)
