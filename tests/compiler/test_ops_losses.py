"""Loss functions through the compiler against torch, forward and gradient.

Every loss here decomposes to core-ATen ops (log_softmax, gather, where, sum, mean, ...), so
``losses.py`` lowers nothing: these cases check the composition, and each claims the ops of
``reductions.py`` it exercises. Class weights and ``pos_weight`` are constants of the function
(not inputs) because torch's fused loss kernels are not differentiable with respect to them.
"""

import pytest
import torch
import torch.nn.functional as F

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

CASES = CROSS_ENTROPY_CASES + NLL_CASES + REGRESSION_CASES + BINARY_CASES + KL_CASES


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_losses(case, dtype):
    check_case(case, dtype)
