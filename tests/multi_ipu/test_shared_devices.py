"""A model split over IPUs on fewer JAX devices than emulated IPUs (one GPU, one CPU device):
each replica's stages share its devices, with the numbers of torch eager and of the run with a
device per IPU, and the same memory figures per emulated IPU."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.runtime.multi_ipu import multi_ipu_program
from tests.multi_ipu.models import ATOL, RTOL, TwoStages, regression_data, torch_training, twins

STRATEGIES = {"pipelined": poptorch.PipelinedExecution, "sharded": poptorch.ShardedExecution}


def _options(strategy: str):
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(3)
    return opts.setExecutionStrategy(STRATEGIES[strategy]("B1", "B2"))


def _train(strategy: str):
    """TwoStages trained by AdamW over two calls: the model, the losses and the memory per IPU."""
    torch.manual_seed(0)
    model = TwoStages()
    ipu = poptorch.trainingModel(model, _options(strategy), torch.optim.AdamW(model.parameters(), lr=0.02))
    x, y = regression_data(24)
    losses = torch.cat([ipu(x[:12], y[:12])[1], ipu(x[12:], y[12:])[1]])
    usage = [dataclasses.asdict(u) for u in multi_ipu_program(ipu).memory]
    return model, losses, usage


ONE_DEVICE = textwrap.dedent("""
    import json, sys, warnings
    from tests.multi_ipu.test_shared_devices import _train
    import jax
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, losses, usage = _train(sys.argv[1])
    print(json.dumps({"devices": jax.device_count(), "losses": losses.tolist(), "usage": usage,
                      "weights": {n: p.detach().tolist() for n, p in model.named_parameters()},
                      "warnings": [str(w.message) for w in caught]}))
""")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stages_on_one_device_equal_torch_and_a_device_per_ipu(strategy):
    done = subprocess.run([sys.executable, "-c", ONE_DEVICE, strategy], capture_output=True, text=True,
                          env={**os.environ, "IPU_BACKEND_CPU_DEVICES": "1"}, check=True)
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert shared["devices"] == 1
    assert any("2 IPUs × 1 replicas run on 1 JAX CPU device" in w and "IPU_BACKEND_CPU_DEVICES=2" in w
               for w in shared["warnings"]), shared["warnings"]

    model, losses, usage = _train(strategy)             # this process: a device per IPU
    torch.manual_seed(0)
    _, reference = twins(TwoStages())
    x, y = regression_data(24)
    _, expected_losses = torch_training(reference, torch.optim.AdamW(reference.parameters(), lr=0.02),
                                        x, y, accumulation=3, micro=2)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(torch.tensor(shared["weights"][name]), p.detach(), rtol=RTOL,
                                   atol=ATOL, msg=name)
        torch.testing.assert_close(torch.tensor(shared["weights"][name]), dict(model.named_parameters())[name].detach(),
                                   rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(torch.tensor(shared["losses"]), expected_losses, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(shared["losses"]), losses, rtol=RTOL, atol=ATOL)
    assert shared["usage"] == usage
