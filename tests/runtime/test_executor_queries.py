"""PopTorch's executor queries and helpers: compilationTime, cycleCount and the performance
counters (measured host times), rng_state (replays random numbers), copyNamedBuffersToDevice,
copyWeightsToHostIfNeeded, destroy() on the wrapped model, repr/module_repr, compile hooks, and
PopTorch's errors for each."""

import copy
import datetime

import pytest
import torch

import ipu_backend as poptorch


class Noisy(torch.nn.Module):
    """Dropout (random numbers) and a buffer added to the output."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return torch.nn.functional.dropout(self.layer(x), 0.5, training=True) + self.offset


def test_compilation_time_and_cycle_count_with_poptorch_errors():
    x = torch.randn(4, 4)
    plain = poptorch.inferenceModel(Noisy(), poptorch.Options().showCompilationProgressBar(False))
    with pytest.raises(poptorch.Error, match="Please compile the model before obtaining compilation time."):
        plain.compilationTime()
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled. Please set option "
                                             "logCycleCount to True to enable."):
        plain.cycleCount()
    plain(x)
    with pytest.raises(poptorch.Error, match="Please set showCompilationProgressBar option to obtain "
                                             "compilation time."):
        plain.compilationTime()

    opts = poptorch.Options().logCycleCount(True).deviceIterations(2).outputMode(poptorch.OutputMode.All)
    timed = poptorch.inferenceModel(Noisy(), opts)
    timed.compile(x)
    assert timed.compilationTime() > datetime.timedelta(0)
    with pytest.raises(poptorch.Error, match="Please run the model at least once before obtaining cycle count."):
        timed.cycleCount()
    timed(x)
    assert timed.cycleCount() > 0
    counters = timed.getPerfCounters()
    assert [len(counters[k]) for k in ("input", "input_complete", "output", "output_complete")] == [1, 1, 1, 1]
    assert len(counters["input"][0]) == len(counters["output"][0]) == 2          # one per device iteration
    assert counters["input"][0][0] <= counters["input_complete"][0][0] <= counters["output"][0][0] \
        <= counters["output"][0][1] <= counters["output_complete"][0][1]
    low, high, mean = timed.getLatency()
    assert 0 < low <= mean <= high
    assert timed.getComputeLatency()[1] <= high and timed.getHostIpuLatency()[0] >= 0


@pytest.mark.parametrize("mode, output_steps", [(poptorch.OutputMode.All, 8), (poptorch.OutputMode.Final, 2),
                                                 (poptorch.OutputMode.EveryN, 4)])
def test_perf_counters_count_each_micro_batch_of_each_replica_as_poptorch(mode, output_steps):
    """PopTorch's counts: inputs per micro-batch of each replica (2 iterations x 2 accumulated x 2
    replicas), outputs per the output mode's steps on each replica."""
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2).outputMode(mode, 2)
    opts.Training.gradientAccumulation(2)
    model = Summed()
    executor = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    executor(torch.ones(16, 2))
    counters = executor.getPerfCounters()
    assert [len(steps) for steps in counters["input"]] == [8]
    assert [len(steps) for steps in counters["output"]] == [len(steps) for steps in counters["output_complete"]] \
        == [output_steps]


def test_rng_state_replays_random_numbers():
    model = poptorch.inferenceModel(Noisy())
    x = torch.ones(4, 4)
    with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
        model.rng_state
    model.compile(x)
    state = model.rng_state
    first, second = model(x), model(x)
    assert not torch.equal(first, second)
    model.rng_state = state
    torch.testing.assert_close(model(x), first, rtol=0, atol=0)
    torch.testing.assert_close(model(x), second, rtol=0, atol=0)


def test_copy_named_buffers_to_device_and_the_next_call_compute_with_the_hosts_buffers():
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.layer = torch.nn.Linear(3, 3)
    module.register_buffer("shift", torch.zeros(3))
    module.register_buffer("scale", torch.ones(3))
    module.forward = lambda x: module.layer(x) * module.scale + module.shift
    x = torch.randn(2, 3)
    model = poptorch.inferenceModel(module, poptorch.Options().updatableNamedBuffers(["shift"]))
    with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
        model.copyNamedBuffersToDevice()
    model(x)
    with torch.no_grad():
        module.shift.fill_(1.0)
        module.scale.fill_(2.0)
    model.copyNamedBuffersToDevice()
    expected = module.layer(x) * 2.0 + 1.0          # as torch: host writes reach the next call
    torch.testing.assert_close(model(x), expected.detach(), rtol=1e-5, atol=1e-6)
    unmarked = poptorch.inferenceModel(torch.nn.Linear(3, 3))
    unmarked(x)
    with pytest.raises(poptorch.Error, match="No named buffers marked as updatable via "
                                             "updatableNamedBuffers option"):
        unmarked.copyNamedBuffersToDevice()


def test_updatable_named_buffers_naming_a_missing_buffer_fail_the_first_call():
    module = torch.nn.BatchNorm1d(3)
    model = poptorch.inferenceModel(module, poptorch.Options().updatableNamedBuffers(["running_meen"]))
    with pytest.raises(poptorch.Error, match=r"updatableNamedBuffers names buffers the model does not "
                                             r"have: \['running_meen'\].*running_mean"):
        model(torch.randn(2, 3))


class Summed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(x).sum()


def test_the_wrapped_model_copies_weights_and_destroys_its_executors():
    module = Summed()
    model = poptorch.trainingModel(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    x = torch.ones(4, 2)
    model.compile(x)
    before = torch.nn.Module.__getattr__(module, "layer").weight.detach().clone()
    model(x)                                   # one training step
    assert module.copyWeightsToHostIfNeeded() is True
    assert not torch.equal(module.layer.weight.detach(), before)
    assert module.copyWeightsToHostIfNeeded() is False and model.copyWeightsToHostIfNeeded() is False
    module.destroy()
    assert type(module) is Summed


def test_a_destroyed_model_called_again_compiles_again_and_goes_on_from_the_host():
    """PopTorch compiles a destroyed executor again when it is called: training goes on from the
    weights and optimizer state destroy() left on the host, as torch's uninterrupted steps; an
    inference model takes inputs of a new structure."""
    torch.manual_seed(0)
    module, reference = Summed(), Summed()
    reference.load_state_dict(module.state_dict())
    model = poptorch.trainingModel(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    inputs = [torch.randn(4, 2) for _ in range(4)]
    for step, x in enumerate(inputs):
        if step == 2:
            model.destroy()
            assert type(module) is Summed
        model(x)
        optimizer.zero_grad()
        reference(x).backward()
        optimizer.step()
    model.copyWeightsToHost()
    for actual, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-5, atol=1e-6)

    inference = poptorch.inferenceModel(torch.nn.Linear(2, 2))
    x = torch.randn(3, 2)
    inference(x)
    inference.destroy()
    wider = torch.randn(5, 2)
    torch.testing.assert_close(inference(wider), inference.model(wider).detach())


def test_a_second_training_wrapper_waits_for_the_first_to_be_destroyed():
    """PopTorch's rule and sentence; an inference wrapper may join, and training goes on from the
    destroyed wrapper's weights as torch's steps do."""
    torch.manual_seed(0)
    module = Summed()
    reference = copy.deepcopy(module)
    x = torch.ones(4, 2)
    first = poptorch.trainingModel(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.5))
    first(x)
    poptorch.inferenceModel(module)
    with pytest.raises(RuntimeError, match=r"Model has already been wrapped in 'poptorch.trainingModel'. "
                                           r"Call model.destroy\(\) on the model to unwrap before wrapping again."):
        poptorch.trainingModel(module)
    module.destroy()
    poptorch.trainingModel(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.5))(x)
    eager = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        eager.zero_grad()
        reference(x).backward()
        eager.step()
    for got, expected in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.layer(x)


def test_an_inference_call_leaves_the_host_weights_fresh_unless_it_updates_a_buffer():
    """As in PopTorch, inference does not make the host's weights stale (no copy back for nothing);
    a buffer the call updates is brought back, as torch eager counts it."""
    plain = torch.nn.Linear(2, 2)
    executor = poptorch.inferenceModel(plain)
    x = torch.randn(3, 2)
    executor(x)
    executor(x)
    assert executor.copyWeightsToHostIfNeeded() is False
    torch.testing.assert_close(executor(x), plain(x).detach())
    counting, eager = Counting(), Counting()
    eager.load_state_dict(counting.state_dict())
    counted = poptorch.inferenceModel(counting)
    for _ in range(2):
        counted(x)
        eager(x)
    assert counted.copyWeightsToHostIfNeeded() is True
    assert float(counting.calls) == float(eager.calls) == 2.0


def test_repr_shows_begin_blocks_and_compile_hooks_run():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    poptorch.BeginBlock(model[1], "second", ipu_id=1)
    assert "(1): BeginBlock(user_id=second, ipu_id=1) ReLU()" in poptorch.module_repr(model)
    assert "BeginBlock" not in repr(model)
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        executor = poptorch.inferenceModel(torch.nn.Linear(2, 2))
        executor.compile(torch.ones(1, 2))
    finally:
        pre.remove()
        post.remove()
    assert calls == ["pre", "post"]
    assert repr(executor) == repr(executor.model)
    with pytest.raises(RuntimeError, match="Pre-compile hook must be callable"):
        poptorch.registerPreCompileHook(3)


def test_weights_cannot_be_copied_once_destroyed():
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2))
    model.destroy()
    for copy_weights in (model.copyWeightsToHost, model.copyWeightsToDevice):
        with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
            copy_weights()
