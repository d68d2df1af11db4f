"""Every example runs in a reduced form (few images, few steps, the cheapest options its mode
allows) through its own ``main(argv)``, with the flags a user would type, and the assertions
read what it prints: losses finite and falling, accuracy clearly above chance (10 %), the scaling
curves within the fp32 contract, reports and plots written. ``lightning_digits.yaml`` runs through
``lightning-ipu``'s entry point (its console script is run by tests/lightning/test_cli.py).

The runs share this test process rather than each starting one: an interpreter importing torch,
JAX and Lightning costs as much as a reduced run's compilation, and the suite's time is short."""

import contextlib
import csv
import io
import math
import re
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NUMBER = r"([-+0-9.e]+|nan|inf)"


@pytest.fixture(scope="module", autouse=True)
def examples_importable():
    """The examples import each other by bare name (``from digits import ...``), as when run from examples/."""
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each run in its own directory, leaving torch's random state and Lightning's seed variable as they were."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")        # restored afterwards; the examples seed 0
    with torch.random.fork_rng(devices=[]):
        yield


def run(capsys, module: str, *argv: str) -> str:
    capsys.readouterr()
    __import__(module).main(list(argv))
    return capsys.readouterr().out


def numbers(pattern: str, text: str) -> list[float]:
    found = [float(value) for match in re.findall(pattern, text)
             for value in (match if isinstance(match, tuple) else (match,))]
    assert found, f"{pattern!r} not in the output:\n{text}"
    assert all(math.isfinite(value) for value in found), text
    return found


def assert_report_pages(directory: Path, models: tuple[str, ...]) -> None:
    for model in models:
        for page in ("compile_report.html", "execution_report.html"):
            assert (directory / model / page).stat().st_size > 0, f"{directory / model / page} missing"


def test_scaling_1_and_8_replicas_give_torch_eager_loss_curve(capsys, tmp_path):
    """The extremes of the example's 1, 2, 4, 8 (each replica count is one more compilation)."""
    out = run(capsys, "scaling", "--replicas", "1", "8", "--epochs", "1", "--train-images", "192",
              "--device-iterations", "1", "--plot", "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert numbers(r"(\d+) replicas × micro-batch", out) == [1, 8]
    assert max(numbers(r"max relative deviation from torch " + NUMBER, out)) <= 1e-5
    between, from_torch = numbers(r"between curves: " + NUMBER + "; from torch eager: " + NUMBER, out)
    assert between <= 1e-5 and from_torch <= 1e-5
    first, last = numbers(r"first loss " + NUMBER + ", last loss " + NUMBER, out)
    assert last < first


def test_porting_a_poptorch_script_changes_only_the_import(capsys):
    imports = re.findall(r"^(?:import|from) .*", (EXAMPLES / "porting_poptorch.py").read_text(), re.M)
    assert [line for line in imports if "poptorch" in line] == [
        "import ipu_backend as poptorch  # the one line that changed: was ``import poptorch``"]
    out = run(capsys, "porting_poptorch", "--epochs", "2", "--train-images", "384", "--test-images", "64",
              "--device-iterations", "1", "--gradient-accumulation", "1")
    losses = numbers(r"epoch \d+: loss " + NUMBER, out)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert numbers(r"test accuracy " + NUMBER + "%", out)[0] >= 60


def test_lightning_tutorial_pipelined_and_replicated_with_autoreport(capsys, tmp_path):
    out = run(capsys, "lightning_tutorial", "--epochs", "1", "--train-images", "384", "--test-images", "32",
              "--device-iterations", "1", "--gradient-accumulation", "3", "--profile", "--profile-dir", "reports")
    assert "2 pipeline stages × 2 replicas = 4 IPUs" in out
    first, last = numbers(r"train loss: first batch " + NUMBER + ", last batch " + NUMBER, out)
    assert last < first
    assert numbers(r"test accuracy " + NUMBER + "%", out)[0] >= 60
    assert_report_pages(tmp_path / "reports", ("training", "validation", "test"))


PIPELINING_REDUCED = ("--epochs", "2", "--train-images", "560", "--test-images", "80", "--learning-rate", "0.003",
                      "--device-iterations", "1", "--gradient-accumulation", "7")


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory):
    """The PopTorch pipelining tutorial pipelined over 4 IPUs, with ``--profile``: (output, report dir)."""
    reports = tmp_path_factory.mktemp("pipelining_reports")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(out):
        patch.chdir(reports)
        __import__("pipelining").main([*PIPELINING_REDUCED, "--profile", "--profile-dir", "."])
    return out.getvalue(), reports


def test_pipelining_tutorial_pipelined_learns_and_writes_reports(pipelined_run):
    out, reports = pipelined_run
    assert out.startswith("pipelined over 4 IPUs")
    losses = numbers(r"Epoch \d/2: loss " + NUMBER, out)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert numbers(r"Accuracy on test set: " + NUMBER + "%", out)[0] >= 80
    assert_report_pages(reports, ("training", "inference"))


def test_pipelining_tutorial_sharded_prints_the_pipelined_numbers(capsys, pipelined_run):
    out = run(capsys, "pipelining", *PIPELINING_REDUCED, "--strategy", "sharded")
    assert out.startswith("sharded over 4 IPUs")
    assert numbers(r"loss " + NUMBER, out) == numbers(r"loss " + NUMBER, pipelined_run[0])
    assert numbers(r"Accuracy on test set: " + NUMBER, out) == numbers(r"Accuracy on test set: " + NUMBER,
                                                                        pipelined_run[0])


def test_pipelining_lightning_learns(capsys):
    out = run(capsys, "pipelining_lightning", *PIPELINING_REDUCED)
    loss, accuracy = numbers(r"train loss " + NUMBER + "; test accuracy " + NUMBER, out)
    assert loss < 0.5 * math.log(10)       # half the loss of a uniform guess over the 10 classes
    assert accuracy >= 80


def test_lightning_digits_yaml_through_the_cli(tmp_path):
    from lightning_ipu.cli import main
    main(["fit", "--config", str(EXAMPLES / "lightning_digits.yaml"), "--trainer.max_epochs", "1",
          "--trainer.limit_train_batches", "16", "--trainer.limit_val_batches", "2",
          "--trainer.strategy.init_args.training_opts.init_args.device_iterations", "1",
          "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(tmp_path),
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)])
    (metrics,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert len(losses) == 16 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]
    (checkpoint,) = tmp_path.glob("**/*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 16
    val_acc = [float(row["val_acc"]) for row in rows if row.get("val_acc")]
    assert val_acc and val_acc[-1] >= 0.4
