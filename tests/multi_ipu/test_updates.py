"""Optimizer updates of a model split over IPUs that need more than one stage's gradients:
gradient clipping by the global norm, tied weights read by two stages, and half-precision weights
with float32 master copies and stochastic rounding. Each equals plain torch (fp32: 1e-5 relative)
or, where torch has no counterpart (stochastic rounding), the single-IPU step."""

import jax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.executor import PoplarExecutor
from ipu_backend.runtime.multi_ipu import multi_ipu_program
from ipu_backend.runtime.weights import weight_store
from tests.multi_ipu.models import ATOL, RTOL, TwoStages, assert_same_parameters, regression_data, twins

ACCUMULATION, MICRO = 3, 4


def options(**keywords):
    return poptorch.Options(gradient_accumulation=ACCUMULATION, output_mode="all", **keywords)


def torch_steps(model, optimizer, x, y, clip=None):
    """Plain torch, one optimizer step per ACCUMULATION micro-batches; ``clip(parameters)`` runs
    between the backward passes and the step. Returns the losses."""
    losses = []
    for step in range(x.shape[0] // (ACCUMULATION * MICRO)):
        optimizer.zero_grad()
        for a in range(ACCUMULATION):
            start = (step * ACCUMULATION + a) * MICRO
            _, loss = model(x[start:start + MICRO], y[start:start + MICRO])
            (loss / ACCUMULATION).backward()
            losses.append(loss.detach())
        if clip is not None:
            clip(list(model.parameters()))
        optimizer.step()
    return torch.stack(losses)


def total_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


CLIPPINGS = {
    # Lightning's gradient_clip_val by norm, then PopTorch's optimizer option max_grad_norm (both
    # clip_grad_norm_ over every parameter the optimizer updates), each clipping
    "lightning_norm_then_max_grad_norm": (
        GradientClipping(0.05, "norm"),
        lambda ps: (torch.nn.utils.clip_grad_norm_(ps, 0.05), torch.nn.utils.clip_grad_norm_(ps, 0.03))),
    # by value, then max_grad_norm over the clipped gradients
    "lightning_value_then_max_grad_norm": (
        GradientClipping(0.02, "value"),
        lambda ps: (torch.nn.utils.clip_grad_value_(ps, 0.02), torch.nn.utils.clip_grad_norm_(ps, 0.03))),
}


@pytest.mark.parametrize("case", CLIPPINGS)
def test_gradient_clipping_uses_the_norm_over_every_stage(case):
    clipping, torch_clip = CLIPPINGS[case]
    torch.manual_seed(7)
    model, reference = twins(TwoStages())
    x, y = regression_data(2 * ACCUMULATION * MICRO, seed=7)
    norms = []
    expected = torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.5), x, y,
                           clip=lambda ps: (norms.append(total_norm(reference)), torch_clip(ps)))
    assert min(norms) > 0.05                    # every step is clipped, by the norm of both stages
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.5, max_grad_norm=0.03)
    ipu = PoplarExecutor(model, options(device_iterations=2), training=True, optimizer=optimizer,
                         gradient_clipping=clipping)
    _, losses = ipu(x, y)
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)


class TiedEmbedding(nn.Module):
    """A language-model shape: the embedding on IPU 0, the output projection on IPU 1 with the
    embedding's weight (tied), so the weight's gradient comes from both IPUs."""

    def __init__(self, vocabulary: int = 10, width: int = 4):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.hidden = nn.Linear(width, width)

    def forward(self, tokens, targets):
        with poptorch.Block("embed", ipu_id=0):
            h = torch.tanh(self.hidden(self.embedding(tokens)))
        with poptorch.Block("project", ipu_id=1):
            logits = F.linear(h, self.embedding.weight)
            loss = F.cross_entropy(logits, targets)
        return logits, loss


def test_tied_weights_sum_both_stages_gradients_and_stay_equal():
    torch.manual_seed(8)
    model, reference = twins(TiedEmbedding())
    tokens = torch.randint(0, 10, (2 * ACCUMULATION * MICRO,))
    targets = torch.randint(0, 10, (2 * ACCUMULATION * MICRO,))
    expected = torch_steps(reference, torch.optim.AdamW(reference.parameters(), lr=0.05), tokens, targets)
    ipu = poptorch.trainingModel(model, options(), torch.optim.AdamW(model.parameters(), lr=0.05))
    losses = torch.cat([ipu(tokens[:12], targets[:12])[1], ipu(tokens[12:], targets[12:])[1]])
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    # Updated on IPU 0, which owns it (and its optimizer state); IPU 1 holds a copy.
    assert ipu.ipuPlacement() == {"embedding.weight": 0, "hidden.weight": 0, "hidden.bias": 0}
    assert weight_store(model).params["embedding.weight"].devices() == {jax.devices()[0]}
    multi = multi_ipu_program(ipu)
    assert multi.stages[1].plan.borrowed == ("embedding.weight",)
    assert multi.memory[1].weights == 10 * 4 * 4 and multi.memory[1].optimizer == 0
    inference = poptorch.inferenceModel(model, poptorch.Options(device_iterations=2))
    logits, _ = inference(tokens[:4], targets[:4])
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(tokens[:4], targets[:4])[0], rtol=RTOL, atol=ATOL)


class TwoScales(nn.Module):
    """``sum(x · w0 · w1)`` with w0 on IPU 0 and w1 on IPU 1: each step moves both weights by
    about lr, below half of float16's spacing at 1.0 (2^-11)."""

    def __init__(self):
        super().__init__()
        self.w0 = nn.Parameter(torch.ones(4))
        self.w1 = nn.Parameter(torch.ones(4))

    def forward(self, x):
        with poptorch.Block("B1", ipu_id=0):
            h = x * self.w0
        with poptorch.Block("B2", ipu_id=1):
            return poptorch.identity_loss(h * self.w1, "sum")


STEPS, LR = 8, 1e-4


def scales_training(strategy, **keywords):
    model = TwoScales().half()
    opts = poptorch.Options(device_iterations=STEPS, gradient_accumulation=ACCUMULATION, random_seed=0,
                            **keywords).setExecutionStrategy(strategy)
    ipu = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=LR))
    ipu(torch.ones(STEPS * ACCUMULATION, 4).half())
    return model


def test_master_weights_and_stochastic_rounding_over_stages():
    reference = TwoScales()                      # float32: what the master copies follow
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        reference(torch.ones(1, 4)).backward()
        optimizer.step()
    stochastic = {"master_weights": True, "stochastic_rounding": True}
    split = scales_training(poptorch.PipelinedExecution("B1", "B2"), **stochastic)
    for name in ("w0", "w1"):
        # the master copy kept every update (1.0 is more than float16's spacing away): the weight
        # is one of its two float16 neighbours
        torch.testing.assert_close(getattr(split, name).float(), getattr(reference, name).detach(),
                                   rtol=0, atol=2 ** -11)
        assert not torch.equal(getattr(split, name), torch.ones(4).half())
    # Stochastic rounding draws the single-IPU step's random numbers for each weight.
    fused = scales_training(poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0)), **stochastic)
    for name in ("w0", "w1"):
        assert torch.equal(getattr(split, name), getattr(fused, name)), name
