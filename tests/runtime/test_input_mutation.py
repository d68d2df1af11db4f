"""A model that updates its inputs in place: the caller's tensors get the new values, as in
PopTorch (and torch eager); a plain tensor attribute changed in place keeps its new value as a
buffer would; where that cannot be emulated, a clear error (a global tensor changed in place names
the fix: a buffer or an input)."""

import copy

import pytest
import torch

import ipu_backend as poptorch


class Updating(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, x, counter):
        counter += 1
        out = self.layer(x)
        x.mul_(2)
        return out, out.pow(2).mean()


def test_inputs_updated_in_place_reach_the_caller_in_training_and_inference():
    torch.manual_seed(0)
    model = Updating()
    reference = copy.deepcopy(model)
    x, counter = torch.randn(2, 3), torch.zeros(1, dtype=torch.int32)
    x_eager, counter_eager = x.clone(), counter.clone()
    out, loss = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))(x, counter)
    expected_out, expected_loss = reference(x_eager, counter_eager)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, x_eager)
    torch.testing.assert_close(counter, counter_eager)
    inference = poptorch.inferenceModel(Updating())
    inference(x, counter)
    torch.testing.assert_close(counter, torch.full((1,), 2, dtype=torch.int32))


class _UpdatingRows(torch.nn.Module):
    """Updates its input with a sum over the micro-batch: the new values tell micro-batches apart."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 3)

    def forward(self, x, counter):
        counter += x.sum()
        out = self.layer(x + 0)          # torch's backward of the layer must not see x change
        x.add_(x.sum(0, keepdim=True))
        return out, out.pow(2).mean()


@pytest.mark.parametrize("iterations, replicas, accumulation, training", [
    (2, 1, 1, False), (2, 2, 1, False), (2, 2, 2, True)])
def test_several_micro_batches_update_their_rows_of_the_inputs_with_output_mode_all(
        iterations, replicas, accumulation, training):
    """Each micro-batch's new values reach its rows of the caller's tensors, as PopTorch copies the
    anchored new values back; torch eager runs the micro-batches one after another."""
    torch.manual_seed(0)
    model = _UpdatingRows()
    reference = copy.deepcopy(model)
    count, rows = iterations * replicas * accumulation, 2
    x, counter = torch.randn(count * rows, 3), torch.zeros(count, 1)
    x_eager, counter_eager = x.clone(), counter.clone()
    options = poptorch.Options().deviceIterations(iterations).replicationFactor(replicas)
    options.outputMode(poptorch.OutputMode.All)
    if training:
        options.Training.gradientAccumulation(accumulation)
        ipu = poptorch.trainingModel(model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        ipu = poptorch.inferenceModel(model, options)
    out, _ = ipu(x, counter)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected, per_step = [], replicas * accumulation
    for i in range(count):           # each device iteration's micro-batches, then its optimizer step
        result, loss = reference(x_eager[i * rows:(i + 1) * rows], counter_eager[i:i + 1])
        expected.append(result)
        (loss / per_step).backward()
        if training and (i + 1) % per_step == 0:
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(out, torch.cat(expected).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, x_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(counter, counter_eager, rtol=1e-6, atol=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_several_micro_batches_returning_some_results_refuse_input_updates():
    updating = Updating()
    model = poptorch.trainingModel(updating, poptorch.Options().deviceIterations(2),
                                   optimizer=torch.optim.SGD(updating.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"updates its input\(s\) \[0, 1\] in place, which a call of "
                                             r"several micro-batches with OutputMode.Final"):
        model(torch.randn(4, 3), torch.zeros(2, 1))


class _Counting(torch.nn.Module):
    def __init__(self, as_buffer):
        super().__init__()
        if as_buffer:
            self.register_buffer("total", torch.zeros(1), persistent=False)
        else:
            self.total = torch.zeros(1)

    def forward(self, x):
        self.total += x.sum()
        return x * self.total


@pytest.mark.parametrize("as_buffer", [False, True])
def test_a_tensor_attribute_changed_in_place_keeps_its_value_from_call_to_call(as_buffer):
    """A plain tensor attribute becomes a non-persistent buffer of its module (its value as
    before the capture, the state_dict unchanged), so the program keeps it as torch does."""
    model = _Counting(as_buffer)
    reference = copy.deepcopy(model)
    ipu = poptorch.inferenceModel(model)
    x = torch.arange(2.0)
    for _ in range(3):
        torch.testing.assert_close(ipu(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(model.total, reference.total, rtol=0, atol=0)
    assert list(model.state_dict()) == list(reference.state_dict())


class _Doubling(torch.nn.Module):
    """No inputs, no outputs: only its attribute changes (PopTorch's test_no_inputs_no_output)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.x = torch.tensor([1.0])

    def forward(self):
        self.inner.x += self.inner.x


def test_a_model_without_inputs_or_outputs_updates_its_attribute_as_torch():
    model = _Doubling()
    reference = copy.deepcopy(model)
    ipu = poptorch.inferenceModel(model)
    for _ in range(2):
        assert ipu() is None and reference() is None
        torch.testing.assert_close(model.inner.x, reference.inner.x, rtol=0, atol=0)
    torch.testing.assert_close(model.inner.x, torch.tensor([4.0]), rtol=0, atol=0)


_GLOBAL_TOTAL = torch.zeros(1)


class _GlobalCounting(torch.nn.Module):
    def forward(self, x):
        _GLOBAL_TOTAL.add_(x.sum())
        return x * 2


def test_a_tensor_changed_in_place_outside_the_model_is_refused_with_the_fix():
    with pytest.raises(poptorch.Error, match=r"forward of _GlobalCounting changes a tensor in place at "
                                             r".*_GLOBAL_TOTAL\.add_.*neither an input nor an attribute.*"
                                             r"register_buffer"):
        poptorch.inferenceModel(_GlobalCounting())(torch.ones(2))


_CONSTANTS = (torch.tensor([1, 2]), torch.tensor([3, 4]))


class _Constants(torch.nn.Module):
    """No inputs, parameters or buffers: only tensors of its own (PopTorch's test_cpu_output)."""

    def forward(self):
        first, second = _CONSTANTS
        return first + second, ([first, second], [first, second]), second


def test_a_model_without_inputs_parameters_or_buffers_returns_torchs_outputs():
    expected = _Constants()()
    actual = poptorch.inferenceModel(_Constants())()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
