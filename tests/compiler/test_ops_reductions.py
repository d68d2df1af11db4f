"""Reduction, scan, norm and softmax lowerings against torch.

Inputs with many ties (small integers as floats) check torch's tie rules: max/min/argmax pick
the first index, cummax/cummin the last, median the lower middle of a stable sort, and the
gradients of amax/amin/max()/min()/median() are split evenly among ties while those of max.dim/
min.dim/cummax/median.dim reach the selected index only. Half-precision tolerances are the
harness defaults: torch and this backend both accumulate in float32 and round once.
Ops returning (values, indices) are unpacked into plain tuples: a torch.return_types result is
not a JAX pytree, so a compiled program cannot return one.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.compiler.harness import OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
NAN = math.nan
INF = math.inf


def randn(*shapes):
    return lambda dtype: tuple(torch.randn(shape).to(dtype) for shape in shapes)


def ties(*shapes):
    """Small integers (as ``dtype``): exact in every dtype, and full of ties."""
    return lambda dtype: tuple(torch.randint(-2, 3, shape).to(dtype) for shape in shapes)


def given(*values):
    """Fixed tensors (lists of numbers) as ``dtype``."""
    return lambda dtype: tuple(torch.tensor(value, dtype=dtype) for value in values)


def bools(*shapes):
    return lambda dtype: tuple(torch.rand(shape) > 0.5 for shape in shapes)


def randn_with_zeros(shape, zeros):
    """Normal values around 1 with zeros at ``zeros`` (index tuples): the subgradients of prod,
    cumprod and the norms."""
    def make(dtype):
        x = torch.randn(shape) * 0.5 + 1
        for index in zeros:
            x[index] = 0
        return (x.to(dtype),)
    return make


NAN_ROWS = given([[1.0, 3.0, 3.0, 0.0], [2.0, NAN, 5.0, NAN], [-1.0, -1.0, -4.0, -4.0]])


def integer_inputs(dtype):
    """Small int64 and bool tensors (ties everywhere), and floats to be summed as int32."""
    return (torch.randint(-3, 3, (6, 4)), torch.rand(4, 5) > 0.5,
            torch.tensor([[1.5, -2.7], [2.5, 0.9], [-0.5, 3.99]]))


def integer_reductions(x, b, f):
    """Integer sums, products and scans promote to int64 (int32 here); bool ones too; a float
    sum with dtype=int32 truncates every element before adding."""
    return (x.sum(0), b.sum(-1), f.sum(0, dtype=torch.int32), x.prod(), b.prod(1),
            x.mean(1, dtype=torch.float32), x.cumsum(0), b.cumsum(1), *x.max(0), x.amax(1),
            *torch.aminmax(x), torch.argmin(x, keepdim=True), *x.median(0), *x.cummax(0),
            x.any((0, 1), keepdim=True), b.any(1))


INTEGER_CASES = [
    OpCase("integer_and_bool_inputs", integer_reductions, integer_inputs, (torch.int64,), grad=False,
           ops=(aten.sum.dim_IntList, aten.prod.default, aten.prod.dim_int, aten.mean.dim,
                aten.cumsum.default, aten.max.dim, aten.amax.default, aten.amin.default,
                aten.argmin.default, aten.median.dim, aten.cummax.default, aten.any.dims, aten.any.dim)),
]

SUM_CASES = [
    OpCase("sum_all", torch.sum, randn((3, 4)), (torch.float32, torch.bfloat16), ops=(aten.sum.dim_IntList,)),
    OpCase("sum_dims_keepdim_empty_list_0d",
           lambda x, s: (x.permute(2, 0, 1).sum((0, -1), keepdim=True), torch.sum(x, []), s.sum(0)),
           randn((3, 4, 5), ()), ops=(aten.sum.dim_IntList,)),
    OpCase("sum_half_accumulates_in_float32", lambda x, y: (x.sum(), y.sum(1, dtype=torch.float32)),
           lambda dtype: (torch.ones(4000, dtype=dtype), torch.randn(3, 70).to(dtype)), (torch.float16,),
           ops=(aten.sum.dim_IntList,)),
    OpCase("count_nonzero", lambda x: torch.count_nonzero(x, 1), given([[0.0, 1.0, -2.0], [0.0, 0.0, NAN]]),
           ops=(aten.sum.dim_IntList,)),
    OpCase("mean_all", torch.mean, randn((3, 5)), (torch.float32, torch.float16), ops=(aten.mean.default,)),
    OpCase("mean_dims", lambda x: (x.mean(-1, keepdim=True), x.mean((0, 2))), randn((2, 3, 4)),
           ops=(aten.mean.dim,)),
    OpCase("prod_with_zeros", lambda x: (x.prod(), x.prod(1), x.prod(0, keepdim=True)),
           randn_with_zeros((3, 4), [(0, 1), (0, 3), (1, 2)]), (torch.float32, torch.bfloat16),
           ops=(aten.prod.default, aten.prod.dim_int)),
]

MAX_MIN_CASES = [
    OpCase("amax_amin_ties_split_gradient", lambda x: (x.amax(1), x.amin(), x.amax((0, -1), keepdim=True)),
           ties((3, 4, 5)), ops=(aten.amax.default, aten.amin.default)),
    OpCase("amax_amin_nan", lambda x: (x.amax(1), x.amin(1)), NAN_ROWS,
           ops=(aten.amax.default, aten.amin.default)),
    OpCase("max_min_all_ties_split_gradient", lambda x: (x.max(), x.min()), ties((3, 4)),
           ops=(aten.max.default, aten.min.default)),
    OpCase("max_min_all_nan_gradient_to_nans", lambda x: (x.max(), x.min()), NAN_ROWS,
           ops=(aten.max.default, aten.min.default)),
    OpCase("max_min_dim_first_index_and_0d", lambda x, s: (*x.max(1), *x.min(-2, keepdim=True), *s.max(0)),
           ties((3, 5, 6), ()), ops=(aten.max.dim, aten.min.dim)),
    OpCase("max_min_dim_nan", lambda x: (*x.max(1), *x.min(1)), NAN_ROWS, ops=(aten.max.dim, aten.min.dim)),
    OpCase("argmax_argmin_ties_first_index", lambda x: (x.argmax(), x.argmax(1, keepdim=True), x.argmin(0)),
           ties((6, 5)), ops=(aten.argmax.default, aten.argmin.default)),
    OpCase("argmax_argmin_nan", lambda x: (x.argmax(1), x.argmin(1), x.argmax()), NAN_ROWS,
           ops=(aten.argmax.default, aten.argmin.default)),
]

STATISTICS_CASES = [
    OpCase("var_dim", lambda x: x.var(1), randn((3, 6)), (torch.float32, torch.float16),
           ops=(aten.var.correction,)),
    OpCase("var_population_keepdim_and_std", lambda x: (x.var(dim=None, correction=0, keepdim=True), x.std()),
           randn((3, 4)), ops=(aten.var.correction,)),
    # Gradients too, one input each (a NaN gradient would hide the others): torch's var_backward scales
    # by 2 / (n - correction), n the listed dims' sizes (1 for []), so inf at n = correction and
    # negative beyond; with no dims listed, grad * inf (NaN where x is the mean).
    OpCase("var_too_few_degrees_of_freedom",
           lambda *x: (x[0].var(1, correction=3), x[1].var(1, correction=2), x[2].var(correction=4),
                       x[3].var(correction=5), x[4].var([], correction=0), x[5].std(1, correction=3),
                       *torch.std_mean(x[6], 1, correction=2), *torch.var_mean(x[7], 0, correction=3)),
           given(*8 * [[[1.0, 3.0], [2.0, 2.0]]]),
           ops=(aten.var.correction, aten.std.correction, aten.std_mean.correction, aten.var_mean.correction)),
    OpCase("var_mean_and_std_mean", lambda x: (*torch.var_mean(x, (0, 2), correction=0),
                                               *torch.std_mean(x, -1, keepdim=True)),
           randn((3, 4, 2)), ops=(aten.var_mean.correction,)),
    # torch's std gradient is 0 where the deviation is 0; sqrt(var) differentiated would be NaN
    OpCase("std_and_std_mean_of_a_constant_row", lambda x: (x.std(1), *torch.std_mean(x, 1, correction=0)),
           given([[2.0, 2.0, 2.0], [1.0, -1.0, 3.0]]), ops=(aten.std.correction, aten.std_mean.correction)),
    OpCase("median_nanmedian_all_ties", lambda x: (x.median(), x.nanmedian()), ties((3, 5)),
           ops=(aten.median.default, aten.nanmedian.default)),
    OpCase("median_nanmedian_all_nan", lambda x: (x.median(), x.nanmedian()), NAN_ROWS,
           ops=(aten.median.default, aten.nanmedian.default)),
    OpCase("median_dim_stable_tie_index_signed_zero",
           lambda x, z: (*x.median(1), *z.median(0, keepdim=True)),
           lambda dtype: (*ties((6, 9))(dtype), torch.tensor([[0.0, -0.0], [-0.0, 0.0], [1.0, -0.0]])),
           ops=(aten.median.dim,)),
    # Rows with some NaNs only: for an all-NaN row torch's nanmedian index is an artifact of
    # std::nth_element (2 of 4, 0 of 3); its value, NaN, is checked by the next case.
    OpCase("median_nanmedian_dim_nan", lambda x: (*x.median(1), *x.nanmedian(1)),
           given([[1.0, NAN, 3.0, NAN], [NAN, 0.5, NAN, NAN], [2.0, 2.0, -1.0, 5.0]]),
           ops=(aten.median.dim, aten.nanmedian.dim)),
    OpCase("nanmedian_dim_all_nan_value", lambda x: x.nanmedian(1).values, given([[NAN, NAN], [NAN, 1.0]]),
           ops=(aten.nanmedian.dim,)),
]

LOGICAL_CASES = [
    OpCase("any_all_bool", lambda x: (x.any(), x.all(), x.all(0)), bools((4, 3)), (torch.bool,),
           ops=(aten.any.default, aten.any.dims, aten.any.dim)),
    OpCase("any_float_nan_is_true", lambda x: (x.any(1), x.any((0, 1), keepdim=True)),
           given([[0.0, 0.0], [0.0, NAN], [-0.0, 2.0]]), ops=(aten.any.dim, aten.any.dims)),
]

SCAN_CASES = [
    OpCase("cumsum", lambda x: x.cumsum(1), randn((3, 40)), (torch.float32, torch.bfloat16),
           ops=(aten.cumsum.default,)),
    OpCase("cumsum_permuted_and_0d", lambda x, s: (x.permute(1, 0).cumsum(-1), s.cumsum(0)),
           randn((5, 3), ()),
           ops=(aten.cumsum.default,)),
    # torch rounds the incoming float32 gradient to float16 before its reverse cumsum; autodiff
    # here sums the float32 gradient and rounds once, so over 60 terms the float16 gradients
    # differ by up to ~60 float16 roundings (absolute 1e-2 on sums of magnitude ~8).
    OpCase("cumsum_dtype", lambda x: x.cumsum(0, dtype=torch.float32), randn((60,)), (torch.float16,),
           tolerances={torch.float16: (1e-2, 1e-2)}, ops=(aten.cumsum.default,)),
    OpCase("cumprod_with_zeros", lambda x: x.cumprod(1), randn_with_zeros((3, 5), [(0, 1), (0, 3), (2, 4)]),
           (torch.float32, torch.float16), ops=(aten.cumprod.default,)),
    OpCase("logcumsumexp", lambda x: x.logcumsumexp(0), randn((6, 3)), (torch.float32, torch.bfloat16),
           ops=(aten.logcumsumexp.default,)),
    # torch's gradient is NaN at +inf and at a leading -inf, 0 after a +inf, finite before it.
    OpCase("logcumsumexp_infinities", lambda x: x.logcumsumexp(1),
           given([[1.0, INF, 2.0, 0.5], [-INF, -INF, 1.0, -INF], [-INF, 0.0, -INF, 2.0], [0.5, -INF, 3.0, INF]]),
           ops=(aten.logcumsumexp.default,)),
    OpCase("cummax_cummin_last_tie_index", lambda x: (*x.cummax(1), *x.cummin(0)), ties((6, 7)),
           ops=(aten.cummax.default, aten.cummin.default)),
    OpCase("cummax_cummin_nan", lambda x: (*x.cummax(0), *x.cummin(0)),
           given([3.0, NAN, 3.0, 2.0, NAN, 5.0, 5.0]), ops=(aten.cummax.default, aten.cummin.default)),
]


def vector_norms(*arguments):
    """``vector_norm(x, ord, dim, keepdim)`` for each ``(ord, dim, keepdim)``."""
    return lambda x: tuple(torch.linalg.vector_norm(x, *a) for a in arguments)


NORM_ZEROS = randn_with_zeros((3, 4), [(0, slice(None)), (1, 2)])  # a zero row, a zero entry

NORM_CASES = [
    OpCase("vector_norm_2_all", vector_norms((2,)), randn((3, 4)), (torch.float32, torch.bfloat16),
           ops=(aten.linalg_vector_norm.default,)),
    OpCase("vector_norm_2_1_0_at_zeros", vector_norms((2, 1), (1, -1, True), (0, 1)), NORM_ZEROS,
           ops=(aten.linalg_vector_norm.default,)),
    OpCase("vector_norm_3_1_5_0_5_at_zeros", vector_norms((3, 1), (1.5, 1), (0.5, 1), (3, (0, 1), True)),
           NORM_ZEROS, ops=(aten.linalg_vector_norm.default,)),
    OpCase("vector_norm_inf_ties", vector_norms((INF, 1), (-INF, 0, True)), ties((4, 5)),
           ops=(aten.linalg_vector_norm.default,)),
    OpCase("norm_fro_and_dtype", lambda x: (torch.norm(x), torch.linalg.vector_norm(x, dtype=torch.float32)),
           randn((3, 4)), (torch.float16,), ops=(aten.linalg_vector_norm.default,)),
    OpCase("normalize", lambda x: F.normalize(x, dim=1), randn((4, 3)),
           ops=(aten.linalg_vector_norm.default,)),
    # torch floors the norms at eps without autograd: below eps (a row of norm 0.1, a zero row) the
    # gradient is the unfloored norm's, where a clamp's would be 0. Broadcast rows, and int with float.
    OpCase("cosine_similarity_norms_below_eps",
           lambda a, b, c, d, e: (F.cosine_similarity(a, b, eps=0.5), F.cosine_similarity(c, d, -1),
                                  F.cosine_similarity(e, torch.tensor([[1, 0, 2]]))),
           lambda dtype: (torch.tensor([[0.1, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=dtype),
                          torch.tensor([[0.2, 0.1, 0.0], [-1.0, 2.0, 0.0], [1.0, 1.0, 0.0]], dtype=dtype),
                          *randn((3, 1, 4), (5, 4), (2, 3))(dtype)),
           FLOATS, ops=(aten.cosine_similarity.default,)),
    OpCase("dist_broadcast_ties", lambda x, y: tuple(torch.dist(x, y, p) for p in (2, 1, 3, 0.5, INF)),
           ties((3, 4), (4,)), ops=(aten.dist.default,)),
    # Small integers: zero distances, zero differences and ties for the largest difference, where
    # cdist's gradient differs from vector_norm's (p=inf: every tie gets the whole gradient).
    OpCase("cdist_batched_ties", lambda a, b: tuple(torch.cdist(a, b, p) for p in (2.0, 1.0, 0.5, 3.0, INF)),
           ties((2, 5, 3), (4, 3)), ops=(aten._cdist_forward.default,)),
    # Over 25 rows torch computes p=2 distances as one product; a point and itself (zero distance)
    # passes no gradient, where the square root's would be NaN. Small integers: the product is exact.
    OpCase("cdist_product_form_with_zero_distances", lambda a, b: (torch.cdist(a, a), torch.cdist(a, b)),
           lambda dtype: (torch.randint(-2, 3, (30, 3), generator=torch.Generator().manual_seed(0)).to(dtype),
                          torch.randint(-2, 3, (2, 27, 3), generator=torch.Generator().manual_seed(1)).to(dtype)),
           (torch.float32,), ops=(aten._euclidean_dist.default,)),
]

SOFTMAX_CASES = [
    OpCase("softmax", lambda x: torch.softmax(x, -1), randn((3, 5)), FLOATS, ops=(aten._softmax.default,)),
    OpCase("log_softmax", lambda x: torch.log_softmax(x, 1), randn((2, 5, 3)), FLOATS,
           ops=(aten._log_softmax.default,)),
    OpCase("softmax_log_softmax_large_values_and_0d",
           lambda x, s: (torch.softmax(x * 300, 0), torch.log_softmax(x.permute(1, 0) * 300, -1),
                         torch.softmax(s, 0)),
           randn((4, 3), ()), ops=(aten._softmax.default, aten._log_softmax.default)),
    OpCase("softmax_log_softmax_masked", lambda x: (torch.softmax(x, 1), torch.log_softmax(x, 1)),
           given([[-INF, 1.0, -INF], [-INF, -INF, -INF]]), grad=False,
           ops=(aten._softmax.default, aten._log_softmax.default)),
    OpCase("log_softmax_masked_gradient", lambda x: torch.log_softmax(x, 0), given([-INF, 0.5, 2.0]),
           ops=(aten._log_softmax.default,)),
    OpCase("softmax_log_softmax_half_in_float32_out",
           lambda x: (F.softmax(x, 1, dtype=torch.float32), F.log_softmax(x, 0, dtype=torch.float32)),
           randn((3, 6)), (torch.float16, torch.bfloat16),
           ops=(aten._softmax.default, aten._log_softmax.default)),
    OpCase("logsumexp", lambda x: torch.logsumexp(x, 1), randn((3, 5)),
           ops=(aten.amax.default, aten.sum.dim_IntList)),
]

CASES = (INTEGER_CASES + SUM_CASES + MAX_MIN_CASES + STATISTICS_CASES + LOGICAL_CASES + SCAN_CASES
         + NORM_CASES + SOFTMAX_CASES)


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_reductions(case, dtype):
    check_case(case, dtype)
