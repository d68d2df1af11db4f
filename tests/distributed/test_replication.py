"""A PopTorch training run over several processes on jax.distributed (gloo between this host's
CPU devices): 2 instances x 2 replicas, started by ipu-run, train as one process with 4 replicas
does on the same global batch, and as torch eager; each instance returns its replicas' outputs.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.distributed import launcher
from tests.distributed import tiny

ROOT = Path(__file__).resolve().parents[2]
INSTANCE = str(ROOT / "tests" / "distributed" / "poptorch_instance.py")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def instances_environment(monkeypatch):
    """What the instances inherit: this tree on the path, two CPU devices each (one per replica)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("IPU_BACKEND_CPU_DEVICES", "2")
    return monkeypatch


def run_two_instances(out: Path) -> int:
    return launcher.main(["--num-instances", "2", "--num-replicas", str(tiny.REPLICAS), "--",
                          sys.executable, INSTANCE, str(out)])


def test_two_instances_of_two_replicas_train_as_one_of_four(tmp_path, instances_environment):
    assert run_two_instances(tmp_path) == 0
    results = [np.load(tmp_path / f"instance{i}.npz") for i in range(2)]

    single, losses, noises = tiny.train(poptorch.Options().replicationFactor(tiny.REPLICAS), 0, tiny.REPLICAS)
    eager = dict(tiny.torch_eager().named_parameters())
    for name, weight in single.named_parameters():
        for result in results:                    # the weights are the same in every instance
            torch.testing.assert_close(torch.from_numpy(result[name]), weight.detach(), rtol=RTOL, atol=ATOL,
                                       msg=name)
        torch.testing.assert_close(weight.detach(), eager[name].detach(), rtol=RTOL, atol=ATOL, msg=name)

    # Each instance returns its own replicas' outputs: its rows of the single process's losses and
    # random numbers, which are ordered (iteration, micro-batch, replica[, sample]).
    micro_batches = tiny.ITERATIONS * tiny.ACCUMULATION
    for name, everything in (("losses", losses), ("noises", noises)):
        everything = np.stack(everything).reshape(tiny.CALLS, micro_batches, tiny.REPLICAS, -1)
        for index, result in enumerate(results):
            mine = everything[:, :, index * 2:(index + 1) * 2].reshape(result[name].shape)
            np.testing.assert_allclose(result[name], mine, rtol=RTOL, atol=ATOL, err_msg=name)
