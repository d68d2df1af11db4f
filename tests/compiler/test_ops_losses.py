"""Loss functions through the compiler against torch, forward and gradient.

Every loss here but the CTC loss decomposes to core-ATen ops (log_softmax, gather, where, sum,
mean, ...): these cases check the composition, and each claims the ops of ``reductions.py`` it
exercises. The CTC loss is captured whole and lowered by ``losses.py``; its gradient is torch's. Class weights and ``pos_weight`` are constants of the function
(not inputs) because torch's fused loss kernels are not differentiable with respect to them.
"""

import jax
import pytest
import torch
import torch.nn.functional as F

import ipu_backend
from ipu_backend.compiler import compile_module, fused_losses, loss_checks, runtime_checks, to_jax
from ipu_backend.compiler.custom_ops import NO_GRAD_UPDATE
from ipu_backend.compiler.fused_losses import CTC_LOSS
from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CLASS_WEIGHT = torch.tensor([0.2, 1.0, 2.5, 0.7, 1.3])
REDUCTIONS = ("none", "mean", "sum")


def weight(x):
    return CLASS_WEIGHT.to(x.dtype)


def logits_and_classes(*shape, ignored=None):
    """Logits of ``shape`` (N, C, d...) and class indices (N, d...), with ``ignored`` (a class
    index to be ignored) put into the first target."""
    def make(dtype):
        target = torch.randint(0, shape[1], (shape[0],) + shape[2:])
        if ignored is not None:
            target.view(-1)[0] = ignored
        return torch.randn(shape).to(dtype), target
    return make


def logits_and_probabilities(*shape):
    return lambda dtype: (torch.randn(shape).to(dtype), torch.randn(shape).softmax(1).to(dtype))


def pairs(*shape):
    return lambda dtype: (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))


def probabilities_and_targets(*shape):
    """Probabilities away from 0 and 1 (where torch's fused backward clamps its denominator)."""
    return lambda dtype: ((torch.rand(shape) * 0.9 + 0.05).to(dtype), torch.rand(shape).to(dtype))


def log_probabilities_pair(*shape):
    return lambda dtype: (torch.randn(shape).log_softmax(1).to(dtype),
                          torch.randn(shape).softmax(1).to(dtype))


def gaussian_inputs(*shape, variances=None):
    """Means, targets and variances of shape ``variances`` (``shape`` unless given), every third
    variance below the loss's ``eps``: torch clamps those without stopping their gradient."""
    def make(dtype):
        var = torch.rand(variances or shape) + 0.1
        var.view(-1)[::3] = 1e-8
        return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), var.to(dtype)
    return make


def every_reduction(loss):
    """``loss(*inputs, reduction=r)`` for none, mean and sum."""
    return lambda *inputs: tuple(loss(*inputs, reduction=r) for r in REDUCTIONS)


CROSS_ENTROPY_CASES = [
    OpCase("cross_entropy_and_label_smoothing",
           lambda x, t: (F.cross_entropy(x, t), F.cross_entropy(x, t, weight=weight(x), label_smoothing=0.1)),
           logits_and_classes(6, 5), FLOATS, ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
    OpCase("cross_entropy_reductions_nd", every_reduction(F.cross_entropy), logits_and_classes(3, 5, 2, 2),
           ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
    OpCase("cross_entropy_weight_ignore_index_nd",
           every_reduction(lambda x, t, **kw: F.cross_entropy(x, t, weight=weight(x), ignore_index=2, **kw)),
           logits_and_classes(4, 5, 3, ignored=2), ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
    OpCase("cross_entropy_label_smoothing_weight_ignore_index",
           every_reduction(lambda x, t, **kw: F.cross_entropy(x, t, weight=weight(x), ignore_index=-100,
                                                               label_smoothing=0.2, **kw)),
           logits_and_classes(6, 5, ignored=-100), ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
    OpCase("cross_entropy_probability_targets", every_reduction(F.cross_entropy),
           logits_and_probabilities(4, 5),
           ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
    OpCase("cross_entropy_probability_targets_weight_label_smoothing_nd",
           lambda x, p: F.cross_entropy(x, p, weight=weight(x), label_smoothing=0.3),
           logits_and_probabilities(3, 5, 2), (torch.float32, torch.bfloat16),
           ops=(aten._log_softmax.default, aten.sum.dim_IntList)),
]

NLL_CASES = [
    OpCase("nll_loss_reductions_ignore_index", every_reduction(F.nll_loss),
           logits_and_classes(5, 4, ignored=-100),
           ops=(aten.sum.dim_IntList,)),
    OpCase("nll_loss_weight_nd",
           every_reduction(lambda x, t, **kw: F.nll_loss(x, t, weight=weight(x), ignore_index=1, **kw)),
           logits_and_classes(3, 5, 2, 2, ignored=1), ops=(aten.sum.dim_IntList,)),
    OpCase("nll_loss_unbatched", lambda x, t: F.nll_loss(x[0], t[0]), logits_and_classes(1, 5),
           ops=(aten.sum.dim_IntList,)),
]

REGRESSION_CASES = [
    # The gradient sums those of the three reductions; in bfloat16 terms of magnitude ~8 (ulp
    # 0.03) cancel to ~0.2, so the absolute error is a few ulps of the terms, not of the result.
    OpCase("mse_loss", every_reduction(F.mse_loss), pairs(3, 4), FLOATS,
           tolerances={torch.bfloat16: (2e-2, 3e-2)},
           ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("l1_loss", every_reduction(F.l1_loss), pairs(3, 4), (torch.float32, torch.float16),
           ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("smooth_l1_loss_beta",
           lambda x, y: (F.smooth_l1_loss(x, y), F.smooth_l1_loss(x, y, beta=0.5, reduction="sum"),
                         F.smooth_l1_loss(x, y, beta=0.0, reduction="none")),
           pairs(4, 5), (torch.float32, torch.bfloat16), ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("huber_loss_delta",
           lambda x, y: (F.huber_loss(x, y), F.huber_loss(x, y, delta=0.4, reduction="sum"),
                         F.huber_loss(x, y, delta=2.0, reduction="none")),
           pairs(4, 5), ops=(aten.mean.default, aten.sum.dim_IntList)),
    # F.gaussian_nll_loss checks its variance in Python; captured, the check is a run-time one.
    OpCase("gaussian_nll_loss_heteroscedastic", every_reduction(F.gaussian_nll_loss), gaussian_inputs(4, 5),
           ops=(aten._assert_async.msg, NO_GRAD_UPDATE)),
    OpCase("gaussian_nll_loss_homoscedastic_full",
           lambda x, y, v: (F.gaussian_nll_loss(x, y, v, full=True), F.gaussian_nll_loss(x, y, v.unsqueeze(-1)),
                            torch.nn.GaussianNLLLoss(eps=1e-3, reduction="sum")(x, y, v)),
           gaussian_inputs(4, 5, variances=(4,)), ops=(NO_GRAD_UPDATE,)),
    OpCase("gaussian_nll_loss_broadcast_and_float_variance",
           lambda x, y, v: (F.gaussian_nll_loss(x, y, v[:, :1, :]), F.gaussian_nll_loss(x, y, 0.5, reduction="none")),
           gaussian_inputs(2, 3, 4, variances=(2, 1, 4))),
]

BINARY_CASES = [
    OpCase("binary_cross_entropy", every_reduction(F.binary_cross_entropy), probabilities_and_targets(3, 4),
           FLOATS,
           ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("binary_cross_entropy_weight",
           every_reduction(lambda p, y, **kw: F.binary_cross_entropy(p, y, weight=weight(p), **kw)),
           probabilities_and_targets(3, 5), ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("binary_cross_entropy_log_clamped_at_0_and_1", F.binary_cross_entropy,
           lambda dtype: (torch.tensor([0.0, 1.0, 0.5, 1.0]), torch.tensor([0.3, 0.6, 1.0, 1.0])), grad=False,
           ops=(aten.mean.default,)),
    OpCase("binary_cross_entropy_with_logits", every_reduction(F.binary_cross_entropy_with_logits),
           lambda dtype: (torch.randn(3, 4).to(dtype) * 4, torch.rand(3, 4).to(dtype)), FLOATS,
           ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("binary_cross_entropy_with_logits_weight_pos_weight",
           every_reduction(lambda x, y, **kw: F.binary_cross_entropy_with_logits(
               x, y, weight=weight(x)[:, None], pos_weight=weight(x).flip(0), **kw)),
           lambda dtype: (torch.randn(5, 5).to(dtype) * 4, torch.rand(5, 5).to(dtype)),
           ops=(aten.mean.default, aten.sum.dim_IntList)),
]

KL_CASES = [
    OpCase("kl_div_batchmean", lambda x, y: F.kl_div(x, y, reduction="batchmean"),
           log_probabilities_pair(4, 5),
           (torch.float32, torch.float16), ops=(aten.sum.dim_IntList,)),
    OpCase("kl_div_reductions", every_reduction(F.kl_div), log_probabilities_pair(4, 5),
           ops=(aten.mean.default, aten.sum.dim_IntList)),
    OpCase("kl_div_zero_target", lambda x, y: F.kl_div(x, y, reduction="sum"),
           lambda dtype: (torch.randn(2, 3).log_softmax(1), torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])),
           ops=(aten.sum.dim_IntList,)),
    OpCase("kl_div_log_target",
           lambda x, y: (F.kl_div(x, y, reduction="batchmean", log_target=True),
                         F.kl_div(x, y, reduction="none", log_target=True)),
           lambda dtype: tuple(torch.randn(4, 5).log_softmax(1).to(dtype) for _ in range(2)),
           (torch.float32, torch.bfloat16), ops=(aten.sum.dim_IntList,)),
]

def ctc_inputs(steps=8, batch=3, classes=5, longest=4, blank=0, padded=True, impossible=False):
    """Unnormalised scores ``[T, N, C]`` (torch's CTC gradient is not the true one for them, which
    the lowering must follow), targets without ``blank``, varying input and target lengths; with
    ``impossible``, the last sample's target is longer than its input."""
    def make(dtype):
        scores = torch.randn(steps, batch, classes).to(dtype)
        targets = torch.randint(0, classes - 1, (batch, longest))
        targets[targets >= blank] += 1
        input_lengths = torch.randint(steps - 2, steps + 1, (batch,))
        target_lengths = torch.randint(1, longest + 1, (batch,))
        if impossible:
            input_lengths[-1], target_lengths[-1] = 2, longest
        if not padded:
            targets = torch.cat([row[:length] for row, length in zip(targets, target_lengths)])
        return scores, targets, input_lengths, target_lengths
    return make


def ctc(blank=0, zero_infinity=False):
    def loss(scores, targets, input_lengths, target_lengths):
        return tuple(F.ctc_loss(scores, targets, input_lengths, target_lengths, blank=blank, reduction=r,
                                zero_infinity=zero_infinity) for r in REDUCTIONS)
    return loss


CTC_CASES = [
    OpCase("ctc_loss_padded_targets", ctc(), ctc_inputs(), ops=(CTC_LOSS,)),
    OpCase("ctc_loss_concatenated_targets_blank_3", ctc(blank=3), ctc_inputs(blank=3, padded=False),
           ops=(CTC_LOSS,)),
    OpCase("ctc_loss_lengths_as_lists",
           lambda x, y: F.ctc_loss(x, y, [8, 7, 6], [2, 4, 1], blank=2, reduction="mean"),
           lambda dtype: (torch.randn(8, 3, 5).to(dtype), torch.tensor([1, 3, 4, 1, 0, 1, 4])),
           ops=(CTC_LOSS,)),
    OpCase("ctc_loss_zero_infinity", ctc(zero_infinity=True), ctc_inputs(impossible=True),
           ops=(CTC_LOSS,)),
    OpCase("ctc_loss_unbatched",
           lambda x, y: F.ctc_loss(x.log_softmax(-1), y, [6], [3], reduction="none"),
           lambda dtype: (torch.randn(6, 4).to(dtype), torch.tensor([1, 1, 2])), ops=(CTC_LOSS,)),
]

CASES = CROSS_ENTROPY_CASES + NLL_CASES + REGRESSION_CASES + BINARY_CASES + KL_CASES + CTC_CASES


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_losses(case, dtype):
    check_case(case, dtype)


def test_ctc_loss_outside_a_capture_is_torchs_own():
    """The stand-in a capture puts in place of torch.ctc_loss is torch's function elsewhere:
    eager training (backward included) is unchanged."""
    check_case(CTC_CASES[0], torch.float32)                # a capture installs it
    scores, targets, input_lengths, target_lengths = ctc_inputs()(torch.float32)
    results = []
    for ctc_loss in (torch.ctc_loss, fused_losses._TORCH_CTC_LOSS):
        x = scores.clone().requires_grad_(True)
        loss = ctc_loss(x, targets, input_lengths, target_lengths, 0, 1, False)
        loss.backward()
        results.append((loss.detach(), x.grad))
    assert torch.ctc_loss is not fused_losses._TORCH_CTC_LOSS
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


class GaussianNLL(torch.nn.Module):
    def __init__(self, var):
        super().__init__()
        self.var = var

    def forward(self, x, y, var):
        return F.gaussian_nll_loss(x, y, var if self.var is None else self.var)


def test_gaussian_nll_loss_refuses_what_torch_refuses_at_capture_and_after_a_call():
    x, y, var = gaussian_inputs(4, 5)(torch.float32)
    for bad_var, message in ((-0.5, "var has negative entry"), (var[:, :2], "var is of incorrect size")):
        with pytest.raises(ValueError, match=message):
            GaussianNLL(bad_var)(x, y, var)                         # torch's own
        with pytest.raises(ValueError, match=message):
            compile_module(GaussianNLL(bad_var), (x, y, var))
    program = compile_module(GaussianNLL(None), (x, y, var))
    runtime_checks.forget_recorded()
    jax.jit(program.fn)({}, {}, tuple(to_jax(t) for t in (x, y, -var)), jax.random.key(0))
    with pytest.raises(ipu_backend.Error, match="var has negative entry"):
        runtime_checks.raise_recorded()
    assert F.gaussian_nll_loss is not loss_checks._TORCH_GAUSSIAN_NLL_LOSS, "the capture installed its stand-in"
    with pytest.raises(ValueError, match="var has negative entry"):
        F.gaussian_nll_loss(x, y, -var)                             # outside a capture: torch's own
