"""Options.enableSyntheticData: each input made on the device (one micro-batch, read by every
micro-batch of every replica and iteration, drawn from Options.randomSeed), nothing copied between
host and device. Training ends with the weights torch eager gets on the generated micro-batch
(fp32: 1e-5 relative, 1e-6 absolute); the caller's tensors are never read (NaN inputs, labels and
embedding indices out of range) nor written; outputs are zeros; no input/output steps, zero latency."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime import synthetic_data

RTOL, ATOL = 1e-5, 1e-6
MICRO = 3


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, labels):
        out = self.head(torch.tanh(self.hidden(x)))
        return out, F.cross_entropy(out, labels)


def generated(seed: int, index: int, shape: tuple, dtype) -> torch.Tensor:
    """The micro-batch an executor with ``seed`` makes for its input number ``index``."""
    return torch.from_numpy(np.array(synthetic_data.micro_batch(seed, index, shape, dtype)))


def unusable_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs that would poison or crash a real run: NaN features, labels out of range."""
    return torch.full((batch, 4), float("nan")), torch.full((batch,), 99, dtype=torch.long)


def eager_weights(model: torch.nn.Module, seed: int, steps: int) -> dict:
    """``model`` trained by torch eager for ``steps`` steps on the micro-batch the device makes."""
    x, labels = generated(seed, 0, (MICRO, 4), np.float32), generated(seed, 1, (MICRO,), np.int32).long()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x, labels)[1].backward()
        optimizer.step()
    return model.state_dict()


def train_synthetic(model: torch.nn.Module, opts: poptorch.Options, batch: int, calls: int = 2):
    executor = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                             momentum=0.9))
    x, labels = unusable_batch(batch)
    for _ in range(calls):
        out, loss = executor(x, labels)
    assert torch.isnan(x).all() and (labels == 99).all()           # the caller's tensors, untouched
    return executor, out, loss


@pytest.mark.parametrize("iterations, replicas, accumulation", [(2, 1, 1), (2, 2, 3)])
def test_training_on_synthetic_data_equals_torch_eager_on_the_generated_micro_batch(iterations, replicas,
                                                                                     accumulation):
    torch.manual_seed(0)
    model = Classifier()
    reference, start = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    opts = poptorch.Options().randomSeed(11).deviceIterations(iterations).replicationFactor(replicas)
    opts.enableSyntheticData(True).Training.gradientAccumulation(accumulation)
    executor, out, loss = train_synthetic(model, opts, MICRO * iterations * replicas * accumulation)

    assert out.shape == (replicas * MICRO, 3) and not out.any() and not loss.any()
    assert (generated(11, 1, (MICRO,), np.int32) == 0).all()     # integer inputs: zeros, a valid class
    expected = eager_weights(reference, 11, steps=2 * iterations)  # identical micro-batches: one's gradient
    executor.copyWeightsToHost()
    for name, value in model.state_dict().items():
        assert not torch.equal(value, start[name]), name
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL, msg=name)


def test_synthetic_data_follows_the_random_seed():
    def weights(seed):
        torch.manual_seed(0)
        model = Classifier()
        train_synthetic(model, poptorch.Options().randomSeed(seed).enableSyntheticData(True), MICRO, calls=1)
        return model.hidden.weight.detach().clone()

    assert torch.equal(weights(5), weights(5)) and not torch.equal(weights(5), weights(6))


def test_a_pipelined_model_trains_on_synthetic_data_as_torch_eager():
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    poptorch.BeginBlock(model.head, ipu_id=1)
    opts = poptorch.Options().randomSeed(3).deviceIterations(2).enableSyntheticData(True)
    opts.setExecutionStrategy(poptorch.PipelinedExecution()).Training.gradientAccumulation(4)
    executor, out, loss = train_synthetic(model, opts, MICRO * 2 * 4, calls=1)
    assert not out.any() and not loss.any()
    expected = eager_weights(reference, 3, steps=2)
    executor.copyWeightsToHost()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=ATOL, msg=name)


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 4)

    def forward(self, ids, x):
        return self.embedding(ids).sum(1) + x


def test_inference_returns_zeros_and_counts_no_host_io():
    opts = poptorch.Options().deviceIterations(4).enableSyntheticData(True)
    executor = poptorch.inferenceModel(Lookup(), opts)
    ids, x = torch.full((8, 2), 7), torch.full((8, 4), float("nan"))   # index 7 of 5 rows: never read
    out = executor(ids, x)
    assert out.shape == (8, 4) and out.dtype == torch.float32 and not out.any()

    perf = executor.getPerfCounters()
    assert [len(perf[name]) for name in ("input", "input_complete", "output", "output_complete")] == [2, 2, 1, 1]
    assert all(steps == [] for counters in perf.values() for steps in counters)
    for latency in (executor.getLatency(), executor.getHostIpuLatency(), executor.getComputeLatency(),
                    executor.getIpuHostLatency()):
        assert latency == (0.0, 0.0, 0.0)

    real = poptorch.inferenceModel(Lookup(), poptorch.Options().deviceIterations(4))
    with pytest.raises(poptorch.Error, match="index out of range"):
        real(ids, x)


def test_inputs_updated_in_place_are_left_as_the_caller_gave_them():
    class Accumulate(torch.nn.Module):
        def forward(self, total, x):
            total += x
            return total * 2

    total = torch.ones(2, 3)
    out = poptorch.inferenceModel(Accumulate(), poptorch.Options().enableSyntheticData(True))(total, torch.ones(2, 3))
    assert torch.equal(total, torch.ones(2, 3)) and not out.any()


def test_unsupported_synthetic_data_settings_raise_naming_the_option():
    popart_uniform = poptorch.Options()
    popart_uniform._Popart.set("syntheticDataMode", 3)
    with pytest.raises(poptorch.Error, match="syntheticDataMode 3 is not emulated"):
        poptorch.inferenceModel(torch.nn.Linear(2, 2), popart_uniform)
    with pytest.raises(poptorch.Error, match=r"enableSyntheticData\(True\) with several processes"):
        synthetic_data.check_mode(synthetic_data.RANDOM_NORMAL, processes=2)   # what each executor checks


def test_zeros_mode_feeds_zeros():
    zeros = poptorch.Options().randomSeed(1)
    zeros._Popart.set("syntheticDataMode", synthetic_data.ZEROS)
    torch.manual_seed(0)
    model = Classifier()
    reference = copy.deepcopy(model)
    executor, _, _ = train_synthetic(model, zeros, MICRO, calls=1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference(torch.zeros(MICRO, 4), torch.zeros(MICRO, dtype=torch.long))[1].backward()
    optimizer.step()
    executor.copyWeightsToHost()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=RTOL, atol=ATOL, msg=name)
