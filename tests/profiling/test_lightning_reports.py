"""``IPUStrategy(autoreport=True)``: each stage's model writes its reports into its own folder."""

import json
import os

import lightning.pytorch as pl
import torch.nn.functional as F

from lightning_ipu import IPUStrategy
from tests.lightning.helpers import QUIET, Regressor, dataset, loader

REPORTS = {"compile_report.json", "compile_report.html", "execution_report.json", "execution_report.html",
           "execution_trace.json"}


def test_autoreport_writes_training_validation_and_predict_reports_into_ipu_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = pl.Trainer(accelerator="ipu", devices=2, strategy=IPUStrategy(autoreport=True), max_steps=3,
                         limit_val_batches=1, **QUIET)
    module = Regressor()
    trainer.fit(module, loader(dataset(48), 4), loader(dataset(16, seed=1), 4))
    trainer.predict(module, loader(dataset(16, seed=2), 4))
    root = tmp_path / "ipu_reports"
    assert sorted(os.listdir(root)) == ["predict", "training", "validation"]
    for stage in ("predict", "training", "validation"):
        assert set(os.listdir(root / stage)) == REPORTS
    training = json.loads((root / "training" / "execution_report.json").read_text())["programs"][0]
    assert training["calls"] == 3                     # one host call per optimizer step
    compiled = json.loads((root / "training" / "compile_report.json").read_text())["programs"][0]
    assert compiled["kind"] == "training" and compiled["schedule"]["replicas"] == 2
    predicted = json.loads((root / "predict" / "compile_report.json").read_text())["programs"][0]
    assert predicted["kind"] == "inference"
    trace = json.loads((root / "predict" / "execution_trace.json").read_text())
    forwards = [e for e in trace["traceEvents"] if e.get("cat") == "forward"]
    assert len(forwards) == 2 * 2        # 2 calls (16 samples in batches of 4 × 2 replicas) × 2 replicas
    assert {e["tid"] for e in forwards} == {0, 1}


def test_autoreport_dir_is_used_as_given(tmp_path):
    strategy = IPUStrategy(autoreport=True, autoreport_dir=str(tmp_path / "mine"))
    trainer = pl.Trainer(accelerator="ipu", devices=1, strategy=strategy, max_steps=1, **QUIET)
    trainer.validate(Regressor(), loader(dataset(8), 4), verbose=False)
    assert os.listdir(tmp_path / "mine") == ["validation"]
    assert trainer.strategy.inference_opts.profiling_dir == str(tmp_path / "mine")


def test_no_reports_without_autoreport(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = pl.Trainer(accelerator="ipu", devices=1, strategy=IPUStrategy(), **QUIET)
    trainer.validate(Regressor(), loader(dataset(8), 4), verbose=False)
    assert os.listdir(tmp_path) == []



class TwoManualSteps(Regressor):
    """Manual optimization: two backward passes, each followed by an optimizer step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        for _ in range(2):
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self.net(x), y))
            optimizer.step()


def test_a_manual_optimization_step_reports_its_backward_passes_and_optimizer_steps(tmp_path):
    trainer = pl.Trainer(accelerator="ipu", devices=2, max_steps=2, **QUIET,
                         strategy=IPUStrategy(autoreport=True, autoreport_dir=str(tmp_path)))
    trainer.fit(TwoManualSteps(), loader(dataset(16), 4))
    directory = tmp_path / "training"
    compiled = json.loads((directory / "compile_report.json").read_text())["programs"][0]
    assert compiled["schedule"]["manual_passes"] == ["backward", "update", "backward", "update"]
    assert compiled["schedule"]["execution"] == "single IPU, manual optimization"
    trace = json.loads((directory / "execution_trace.json").read_text())
    for replica in (0, 1):
        names = [e["name"] for e in sorted(trace["traceEvents"], key=lambda e: e.get("ts", -1))
                 if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == replica and e["args"]["call"] == 0]
        assert names == ["F0", "B0", "update", "B0", "update"]
