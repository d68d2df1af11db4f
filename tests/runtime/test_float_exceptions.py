"""Options.Precision.enableFloatingPointExceptions(True): a call whose results hold a NaN or an
infinity raises, as PopTorch's IPU traps; off (the default), they propagate as in torch."""

import pytest
import torch

import ipu_backend as poptorch


class Divide(torch.nn.Module):
    def forward(self, x, y):
        return x / y, torch.sqrt(x - 2)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, x, y):
        out = self.fc(x)
        return out, torch.nn.functional.mse_loss(out, y)


def test_an_inference_output_of_inf_or_nan_raises_and_propagates_as_torch_when_off():
    x, y = torch.full((4,), 3.0), torch.tensor([1.0, 2.0, 0.0, 4.0])
    trapping = poptorch.inferenceModel(Divide(), poptorch.Options(floating_point_exceptions=True))
    finite = trapping(x, torch.ones(4))
    torch.testing.assert_close(finite, Divide()(x, torch.ones(4)))
    with pytest.raises(poptorch.Error, match=r"floating point exception: .*\(in output 0\).*"
                                             r"enableFloatingPointExceptions\(True\)"):
        trapping(x, y)
    with pytest.raises(poptorch.Error, match=r"in output 1\)"):
        trapping(torch.ones(4), torch.ones(4))            # the root of -1
    with pytest.raises(poptorch.Error, match="input 1 of the call holds a NaN"):
        trapping(x, torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    propagating = poptorch.inferenceModel(Divide())
    for actual, expected in zip(propagating(torch.ones(4), y), Divide()(torch.ones(4), y)):
        torch.testing.assert_close(actual, expected, equal_nan=True)


def test_a_training_step_that_overflows_the_weights_raises_naming_the_weight():
    torch.manual_seed(0)
    model, reference = Regression(), Regression()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 1) * 1e30
    opts = poptorch.Options()
    opts.Precision.enableFloatingPointExceptions(True)
    assert opts.Precision.floating_point_exceptions and opts.toDict()["floating_point_exceptions"]
    trapping = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=1e10))
    with pytest.raises(poptorch.Error, match=r"in state \['params'\]\['fc\.(weight|bias)'\]"):
        trapping(x, y)
    trapping.destroy()
    propagating = poptorch.trainingModel(reference, optimizer=torch.optim.SGD(reference.parameters(), lr=1e10))
    _, loss = propagating(x, y)
    propagating.copyWeightsToHost()
    eager = Regression()
    eager.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(eager.parameters(), lr=1e10)
    eager_loss = eager(x, y)[1]
    eager_loss.backward()
    optimizer.step()
    # Past the float32 range torch's own kernels disagree on inf against NaN (its CPU sum gives
    # NaN); what is compared is that neither raises and both give up finite numbers.
    assert not torch.isfinite(eager_loss) and not torch.isfinite(loss)
    for actual, expected in zip(reference.parameters(), eager.parameters()):
        assert not torch.isfinite(actual).all() and not torch.isfinite(expected).all()
