"""The lightning-ipu console script runs a YAML config that says accelerator: ipu, with nested
ipu_backend.Options; pytorch_lightning gets the IPU classes when it is imported."""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("lightning-ipu")

CONFIG = """\
seed_everything: 3
trainer:
  accelerator: ipu
  devices: 2
  max_steps: 4
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  strategy:
    class_path: lightning_ipu.IPUStrategy
    init_args:
      device_iterations: 2
      training_opts:
        class_path: ipu_backend.Options
        init_args:
          device_iterations: 2
          replication_factor: 2
      inference_opts:
        replication_factor: 2
model:
  class_path: tests.lightning.helpers.Regressor
  init_args:
    optimizer: adam
    lr: 0.01
data:
  class_path: tests.lightning.helpers.RandomData
  init_args:
    batch_size: 4
"""


def test_a_yaml_config_with_accelerator_ipu_trains_with_no_user_script(tmp_path):
    config = tmp_path / "ipu.yaml"
    config.write_text(CONFIG.format(root=tmp_path))
    result = subprocess.run([str(SCRIPT), "fit", "--config", str(config)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = list(tmp_path.glob("**/*.ckpt"))
    assert [c.name for c in checkpoints] == ["epoch=0-step=4.ckpt"]
    saved = torch.load(checkpoints[0], weights_only=False)
    assert set(saved["optimizer_states"][0]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["global_step"] == 4 and (tmp_path / "config.yaml").exists()


def test_importing_pytorch_lightning_after_lightning_ipu_registers_the_ipu_classes():
    program = textwrap.dedent("""
        import lightning_ipu
        import pytorch_lightning as pl
        trainer = pl.Trainer(accelerator="ipu", devices=4, logger=False)
        print(type(trainer.strategy).__module__, type(trainer.precision_plugin).__name__, trainer.num_devices)
    """)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["lightning_ipu.pytorch_lightning.strategy", "IPUPrecision", "4"]
