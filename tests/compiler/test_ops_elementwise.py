"""Elementwise lowerings against torch: arithmetic, math functions, rounding, min/max/clamp,
activations and bitwise ops, forward and gradients.

Inputs put values on the points where torch's semantics are delicate: exact halves for
rounding, ties for maximum/minimum, clamp/hardtanh/relu/abs at their kinks, negative operands
for integer division and remainders. Several ops share one case to keep the file fast (each
case is an export and two XLA compilations).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ipu_backend.compiler import compile_module, to_jax, to_torch
from tests.compiler.harness import FnModule, OpCase, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
EXACT_FLOATS = (torch.float32, torch.bfloat16)  # ops exact in any precision: one half type suffices
INTS = (torch.int32, torch.int64)


def away_from_zero(*shape):
    """Random magnitudes in [0.5, 2] with random signs: safe divisors."""
    return (0.5 + 1.5 * torch.rand(*shape)) * torch.randn(*shape).sign()


def nonzero_integers(*shape):
    magnitude = torch.randint(1, 6, shape)
    return magnitude * torch.where(torch.rand(shape) < 0.5, -1, 1)


def arithmetic_inputs(dtype):
    x = torch.randn(4, 3).to(dtype).t()  # non-contiguous
    return x, away_from_zero(4).to(dtype), torch.randn(()).to(dtype), torch.randn(3, 4).to(dtype)


def divisions_inputs(dtype):
    """Dividends with exact multiples of the divisors (remainder -0.0 and 0.0) and both signs."""
    x = torch.cat([torch.tensor([3.0, -3.0, 0.0, -0.0, 4.5, -4.5]), 4 * torch.randn(6)]).view(3, 4)
    y = torch.cat([torch.tensor([1.5, 1.5, -2.0, 2.0, -1.5, 1.5]), away_from_zero(6)]).view(3, 4)
    return x.to(dtype), y.to(dtype)


def rounding_inputs(dtype):
    halves = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.0, -0.0, 1.25, -1.75, 0.05, 3.0])
    zeros = torch.tensor([0.0, -0.0, 0.25, 4.0])
    return torch.cat([halves, 4 * torch.randn(12)]).view(4, 6).to(dtype), zeros.to(dtype), zeros.to(dtype).clone()


def ties_inputs(dtype):
    x = torch.randn(3, 4)
    y = torch.randn(3, 4)
    y[:, ::2] = x[:, ::2]
    return x.to(dtype), y.to(dtype), torch.randn(4).to(dtype)


def nan_inputs(dtype):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, 1.0, nan, -2.0, 0.5, -0.0, inf, -inf, 0.0, 2.0])
    y = torch.tensor([1.0, nan, nan, 3.0, 0.5, 0.0, 1.0, nan, -inf, inf])
    return x.to(dtype), y.to(dtype)


def clamp_inputs(dtype):
    x = torch.cat([torch.tensor([-0.5, 0.5, 0.0, 1.0, -1.0, 0.25]), torch.randn(6)]).view(2, 6)
    low = torch.cat([torch.tensor([-0.5, 0.5, 0.5, 1.0, -1.0, 0.5]), torch.randn(6) - 1]).view(2, 6)
    high = torch.cat([torch.tensor([0.5, 0.5, 0.5, 1.0, -2.0, 0.0]), torch.randn(6) + 1]).view(2, 6)
    return x.to(dtype), low.to(dtype), high.to(dtype), torch.randn(6).to(dtype)


def activation_inputs(dtype):
    corners = torch.tensor([0.0, -1.0, 1.0, 6.0, -0.25, 25.0])
    return torch.cat([corners, 3 * torch.randn(18)]).view(4, 6).to(dtype),


def integer_pairs(dtype):
    a = torch.cat([torch.tensor([7, -7, 7, -7, 6, -6, 0]), torch.randint(-20, 20, (5,))]).view(3, 4)
    b = torch.cat([torch.tensor([2, 2, -2, -2, 3, -3, 5]), nonzero_integers(5)]).view(3, 4)
    return a.to(dtype), b.to(dtype)


def integer_inputs(dtype):
    """Operands of both signs (divisors nonzero), and powers with negative exponents."""
    base = torch.cat([torch.tensor([2, 1, -1, 0, -2, 3, 0, -3]), torch.randint(-4, 5, (4,))]).view(3, 4)
    exponent = torch.cat([torch.tensor([-1, -2, -3, 2, -2, 0, 0, 3]), torch.randint(0, 4, (4,))]).view(3, 4)
    return integer_pairs(dtype) + (base.to(dtype), exponent.to(dtype))


def powers_inputs(dtype):
    """One input per power (see one_input_per_op); exact zeros where the derivative is special."""
    def signed():
        return 4 * torch.rand(3, 4) - 2

    def positive():
        return 0.2 + 2.8 * torch.rand(3, 4)

    zeros_and_positive = torch.tensor([0.0, 0.5, 1.0, 2.0])
    inputs = (signed(), signed(), positive(), positive(), positive(), positive(), positive(), signed(), positive(),
              signed(), signed(), zeros_and_positive, zeros_and_positive.clone(), zeros_and_positive.clone(),
              zeros_and_positive.clone(), positive(), torch.randn(3, 4), torch.randn(3, 4),
              torch.randint(-2, 4, (3, 4)).float())
    return tuple(t.to(dtype) for t in inputs)


def _powers(a, b, c, d, e, f, g, h, i, j, k, z0, z1, z2, z3, p, q, s, n):
    return (a ** 2, b ** 3, c ** 0.5, d ** -0.5, e ** -1, f ** -2, g ** 2.5, h ** 0, i ** 1.5, 2 ** j, 0.5 ** k,
            z0 ** 0, z1 ** 2, z2 ** 0.5, z3 ** 1.5, p ** q, s ** n)


def bitwise_inputs(dtype):
    if dtype == torch.bool:
        return torch.rand(3, 4) < 0.5, torch.rand(4) < 0.5
    return torch.randint(-50, 50, (3, 4), dtype=dtype), torch.randint(-50, 50, (4,), dtype=dtype)


def shift_inputs(dtype):
    values = torch.cat([torch.tensor([1, -1, 5, -8, 3, -3]), torch.randint(-100, 100, (6,))]).view(3, 4)
    shifts = torch.cat([torch.tensor([31, 31, 0, 1, -1, 32]), torch.randint(0, 20, (6,))]).view(3, 4)
    return values.to(dtype), shifts.to(dtype)


def one_input_per_op(*fns_and_domains):
    """``fn(*inputs)`` applying the i-th function to the i-th input, drawn uniformly from its
    domain. Separate inputs keep half-precision gradients from being sums of many terms that
    torch and XLA round differently."""
    fns = [fn for fn, _, _ in fns_and_domains]

    def make_inputs(dtype):
        return tuple((low + (high - low) * torch.rand(3, 4)).to(dtype) for _, low, high in fns_and_domains)

    return (lambda *xs: tuple(fn(x) for fn, x in zip(fns, xs))), make_inputs


def repeated(make_one, count):
    """``count`` copies of ``make_one``'s single input (distinct tensors: export merges aliases)."""
    return lambda dtype: tuple(make_one(dtype)[0].clone() for _ in range(count))


def _bitwise(a, b):
    scalar = True if a.dtype == torch.bool else 12
    return a & b, a | b, a ^ b, ~a, a & scalar, a | scalar, a ^ scalar


CASES = [
    OpCase("arithmetic",
           lambda x, y, s, w: (x + y, torch.add(x, y, alpha=2.5), x - y, torch.sub(x, s, alpha=0.5), x * y, x * s,
                               x / y, x / s, x + 1.5, 2 - x, x * 3.0, x / 4,
                               aten.add.Scalar(w, 2.5), aten.add.Scalar(w, 2, alpha=3), aten.sub.Scalar(w, 0.5),
                               aten.sub.Scalar(w, 1, alpha=-2), aten.mul.Scalar(w, -1.5), aten.div.Scalar(w, 3),
                               aten.div.Scalar_mode(w, 0.75, rounding_mode="floor"),
                               aten.div.Scalar_mode(w, 0.75, rounding_mode="trunc"),
                               aten.div.Scalar_mode(w, 4, rounding_mode=None)),
           arithmetic_inputs, FLOATS,
           ops=(aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
                aten.mul.Scalar, aten.div.Scalar, aten.div.Scalar_mode)),
    OpCase("floor_trunc_remainder_fmod",
           # Not x // y: torch has no derivative for floor_divide (div with rounding_mode has one, 0).
           lambda x, y: (torch.div(x, y, rounding_mode="trunc"), torch.div(x, y, rounding_mode="floor"),
                         x % y, torch.fmod(x, y), x % 1.5, x % -1.5, torch.fmod(x, -1.5),
                         5.0 % y.detach()),  # torch has no derivative for remainder.Scalar_Tensor
           divisions_inputs, FLOATS,
           ops=(aten.div.Tensor_mode, aten.remainder.Tensor, aten.remainder.Scalar, aten.fmod.Tensor,
                aten.fmod.Scalar, aten.remainder.Scalar_Tensor)),
    OpCase("integer_ops",
           lambda a, b, base, exponent: (
               a + b, torch.add(a, b, alpha=3), a - b, a * b, a * 3, a / b, a / 2, a // b,
               torch.div(a, b, rounding_mode="trunc"), a % b, torch.fmod(a, b), a // -3, a % 4, torch.fmod(a, -4),
               a % 2.5, a * 0.5, base ** exponent, base ** 2, base ** 3, 2 ** exponent.abs(), base ** 0.5,
               exponent ** 2.0, -a, a.abs(), a.sign(), a.floor(), a.ceil(), a.round(), a.trunc(), a.relu(), a.exp(),
               a.reciprocal(), a.sigmoid(), b.sqrt(), a.isnan(), a.isinf(), a.signbit(), torch.maximum(a, b),
               torch.minimum(a, b), a.clamp(-3, 4), a.clamp(min=b), a.clamp(max=2.5), torch.copysign(a, b),
               torch.atan2(a, b)),
           # The float results (a / b, exp, sigmoid...) are float32 math: float32's tolerance, not exact.
           integer_inputs, INTS, tolerances={dtype: (1e-5, 1e-6) for dtype in INTS},
           ops=(aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.div.Tensor_mode, aten.remainder.Tensor,
                aten.fmod.Tensor, aten.remainder.Scalar, aten.fmod.Scalar, aten.pow.Tensor_Tensor,
                aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.neg.default, aten.abs.default, aten.sign.default,
                aten.floor.default, aten.round.default, aten.relu.default, aten.exp.default, aten.isnan.default,
                aten.signbit.default, aten.maximum.default, aten.clamp.default, aten.clamp.Tensor,
                aten.copysign.Tensor)),
    OpCase("powers", _powers, powers_inputs, FLOATS,
           ops=(aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.pow.Tensor_Tensor)),
    OpCase("math_functions", *one_input_per_op(
        (torch.exp, -3, 3), (torch.exp2, -3, 3), (torch.expm1, -2, 2), (torch.log, 0.1, 4), (torch.log2, 0.1, 4),
        (torch.log10, 0.1, 4), (torch.log1p, -0.5, 3), (torch.sqrt, 0.1, 4), (torch.rsqrt, 0.2, 4),
        (torch.reciprocal, 0.3, 3), (torch.lgamma, 0.2, 5), (torch.digamma, 0.3, 5), (torch.acosh, 1.1, 4),
        (torch.sin, -3, 3), (torch.cos, -3, 3), (torch.tan, -1.2, 1.2), (torch.atan, -3, 3), (torch.sinh, -3, 3),
        (torch.cosh, -3, 3), (torch.tanh, -3, 3), (torch.asinh, -3, 3), (torch.sigmoid, -5, 5),
        (torch.erf, -2, 2), (torch.erfc, -2, 2), (torch.asin, -0.9, 0.9), (torch.acos, -0.9, 0.9),
        (torch.atanh, -0.9, 0.9), (torch.erfinv, -0.9, 0.9), (lambda t: torch.atan2(t[0], t.flip(0)), -3, 3)),
           FLOATS,
           ops=(aten.exp.default, aten.exp2.default, aten.expm1.default, aten.log.default, aten.log2.default,
                aten.log10.default, aten.log1p.default, aten.sqrt.default, aten.rsqrt.default,
                aten.reciprocal.default, aten.lgamma.default, aten.digamma.default, aten.acosh.default,
                aten.sin.default, aten.cos.default, aten.tan.default, aten.atan.default, aten.sinh.default,
                aten.cosh.default, aten.tanh.default, aten.asinh.default, aten.sigmoid.default, aten.erf.default,
                aten.erfc.default, aten.asin.default, aten.acos.default, aten.atanh.default, aten.erfinv.default,
                aten.atan2.default)),
    OpCase("activations",
           lambda *x: (F.gelu(x[0]), F.gelu(x[1], approximate="tanh"), F.leaky_relu(x[2], 0.2), F.elu(x[3]),
                       F.elu(x[4], 0.5), F.selu(x[5]), F.celu(x[6], 1.5), F.hardtanh(x[7]),
                       F.hardtanh(x[8], -0.25, 1.0), F.relu6(x[9]), F.softplus(x[10]),
                       F.softplus(x[11], beta=2.0, threshold=5.0), F.silu(x[12]), F.mish(x[13]),
                       F.hardsigmoid(x[14]), F.hardswish(x[15])),
           repeated(activation_inputs, 16), FLOATS,
           ops=(aten.gelu.default, aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default,
                aten.softplus.default, aten.hardsigmoid.default, aten.hardswish.default)),
    OpCase("gradients_where_a_formula_branches",
           # torch's derivatives, finite where a decomposition's untaken branch would give NaN:
           # softplus and mish past exp's overflow, sinc at 0, atan2 at (0, 0); hardsigmoid and
           # hardswish at their ends (+-3); a power of 0 with exponent 0 or -1, and xlogy at (0, 0).
           lambda big, x, ends, base, exponent: (
               F.softplus(big), F.softplus(big, beta=2.0), F.mish(big), torch.sinc(x),
               torch.atan2(x * (x.abs() > 1), x * (x.abs() > 0.5)), F.hardsigmoid(ends), F.hardswish(ends),
               torch.pow(base, exponent), torch.xlogy(base, exponent.abs())),
           lambda dtype: (torch.tensor([-100.0, -30.0, -1.0, 0.0, 1.0, 30.0, 50.0, 100.0]).to(dtype),
                          torch.tensor([0.0, 0.25, -0.75, 0.6, -2.0, 1.5]).to(dtype),
                          torch.tensor([-3.0, 3.0, -2.5, 2.5, -4.0, 4.0]).to(dtype),
                          torch.tensor([0.0, 0.0, 0.0, 1.5, 2.0, 0.5]).to(dtype),
                          torch.tensor([0.0, -1.0, 2.0, 0.0, -1.5, 1.0]).to(dtype)),
           FLOATS, ops=(aten.softplus.default, aten.sinc.default, aten.atan2.default, aten.hardsigmoid.default,
                        aten.hardswish.default, aten.pow.Tensor_Tensor, aten.xlogy.Tensor)),
    OpCase("gradients_at_poles",
           # torch's derivatives where the function has none: hypot's at (0, 0) is NaN (0 / 0);
           # lgamma's at ±0 is digamma's ∓inf, and digamma's, trigamma computed by reflection below
           # 1/2, is finite at negative integers (sin(pi x) is not 0 in float32). One input per op: a
           # NaN gradient of one would hide the other's.
           lambda x, y, z, w: (torch.hypot(x, y), torch.lgamma(z), torch.digamma(w)),
           lambda dtype: (torch.tensor([0.0, -0.0, 3.0, float("inf"), 0.0]).to(dtype),
                          torch.tensor([0.0, 0.0, 4.0, 1.0, -2.0]).to(dtype),
                          *(torch.tensor([0.0, -0.0, -1.0, -2.0, -100.0, -2.5, -10.7, 1e-30, float("inf"),
                                          -float("inf")]).to(dtype) for _ in range(2))),
           ops=(aten.hypot.default, aten.lgamma.default, aten.digamma.default)),
    OpCase("products_with_a_mask",
           # x * False is x * 0: -0.0 for a negative x (1 / it is -inf), NaN for an infinite x.
           lambda x: (1 / (x * (x.abs() > 1)), (x / 0) * (x > 0), torch.atan2(x * (x > 5), -x.abs())),
           lambda dtype: (torch.tensor([-0.75, 2.0, -3.0, 0.5, 0.0]).to(dtype),), FLOATS, grad=False,
           ops=(aten.mul.Tensor,)),
    OpCase("rounding_sign_abs",
           # At 0, sqrt's derivative is inf, and abs's, grad * sign(x), makes it NaN as in torch.
           lambda x, z, w: (x.floor(), x.ceil(), x.round(), x.round(decimals=1), x.round(decimals=-1), x.trunc(),
                            x.frac(), x.sign(), -x, x.abs(), x.relu(), z.sqrt(), w.abs().sqrt()),
           rounding_inputs, EXACT_FLOATS,
           ops=(aten.floor.default, aten.ceil.default, aten.round.default, aten.round.decimals,
                aten.trunc.default, aten.sign.default, aten.neg.default, aten.abs.default, aten.relu.default,
                aten.sqrt.default)),
    OpCase("maximum_minimum_clamp",
           lambda x, y, r, c, lo, hi, row: (
               torch.maximum(x, y), torch.minimum(x, y), torch.fmax(x, y), torch.fmin(x, y), torch.maximum(x, r),
               torch.fmin(r, x), c.clamp(-0.5, 0.5), c.clamp(min=0.0), c.clamp(max=0.5), c.clamp(0.5, -0.5),
               c.clamp(lo, hi), c.clamp(min=lo), c.clamp(max=hi), c.clamp(max=row), torch.clamp(c, lo, row)),
           lambda dtype: ties_inputs(dtype) + clamp_inputs(dtype), EXACT_FLOATS,
           ops=(aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
                aten.clamp.default, aten.clamp.Tensor)),
    OpCase("nan_and_infinity",
           lambda x, y: (torch.maximum(x, y), torch.minimum(x, y), torch.fmax(x, y), torch.fmin(x, y),
                         x.clamp(-1, 1), x.relu(), x.sign(), F.hardtanh(x), x.isnan(), x.isinf(), x.isfinite(),
                         x.signbit(), torch.nan_to_num(x), torch.nan_to_num(x, nan=0.5, posinf=9.0, neginf=-9.0)),
           nan_inputs, FLOATS, grad=False,
           ops=(aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
                aten.isnan.default, aten.isinf.default, aten.signbit.default)),
    OpCase("copysign_hypot_lerp_addcmul",
           lambda x, y, w: (torch.copysign(x, y), torch.copysign(x, -1.0), torch.hypot(x, y),
                            torch.lerp(x, y, 0.3), torch.lerp(x, y, w), torch.addcmul(x, y, w, value=0.5),
                            torch.addcdiv(x, y, w + 2, value=-2.0)),
           lambda dtype: (torch.tensor([0.0, -0.0, 1.5, -2.0, 0.5, 3.0]).to(dtype),
                          torch.tensor([-1.0, 1.0, -0.5, 2.0, -0.0, 1.0]).to(dtype), torch.rand(6).to(dtype)),
           FLOATS, ops=(aten.copysign.Tensor, aten.copysign.Scalar, aten.hypot.default)),
    OpCase("bitwise", _bitwise, bitwise_inputs, INTS + (torch.bool,),
           ops=(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor, aten.bitwise_not.default,
                aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar)),
    OpCase("shifts",
           lambda a, s: (a << s, a >> s, a << 3, a >> 2, torch.bitwise_left_shift(a, s.abs()),
                         torch.bitwise_right_shift(a, s.abs())),
           shift_inputs, (torch.int32,),
           ops=(aten.__lshift__.Tensor, aten.__rshift__.Tensor, aten.__lshift__.Scalar, aten.__rshift__.Scalar,
                aten.bitwise_left_shift.Tensor, aten.bitwise_right_shift.Tensor)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_elementwise(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("dtype", INTS)
def test_integer_division_by_zero_gives_zero(dtype):
    """torch raises ZeroDivisionError for integer ``//``, ``%``, fmod and trunc division by zero;
    the lowerings give 0 (as in NumPy), and an executor's call then raises
    (tests/runtime/test_integer_faults.py)."""
    def divisions(a, b):
        return a // b, torch.div(a, b, rounding_mode="trunc"), a % b, torch.fmod(a, b)

    a = torch.tensor([7, -7, 0, 5, -6], dtype=dtype)
    b = torch.tensor([0, 0, 0, -2, 4], dtype=dtype)
    program = compile_module(FnModule(lambda a, b: divisions(a, b) + (a // 0, a % 0)), (a, b))
    outputs, _ = program.fn({}, {}, (to_jax(a), to_jax(b)), None)
    by_zero, by_nonzero = b == 0, b != 0
    for actual, want in zip(outputs, divisions(a[by_nonzero], b[by_nonzero])):
        actual = to_torch(actual, dtype)
        assert torch.equal(actual[by_nonzero], want)
        assert actual[by_zero].eq(0).all()
    for actual in outputs[4:]:
        np.testing.assert_array_equal(np.asarray(actual), 0)
