"""Lowerings: elementwise arithmetic, math functions, rounding, activations and bitwise ops.

Each rule computes in torch's output dtype (read from ``ctx.out``), so int/float promotion
follows torch. float16 and bfloat16 are computed in float32 and rounded once, as torch's CPU
kernels do (their "opmath" type); the interpreter casts every result back to torch's dtype.
Where torch's autograd picks a particular subgradient (relu, abs and clamp at their kinks,
hardtanh at its corners, copysign at zero) the rule is written so that JAX's derivative is
the same one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.registry import lowering

aten = torch.ops.aten
_HALF_FLOATS = (jnp.float16, jnp.bfloat16)


def compute_dtype(ctx) -> np.dtype:
    """torch's output dtype, widened to float32 for float16/bfloat16 (torch's CPU opmath)."""
    dtype = np.dtype(jax_dtype(ctx.out.dtype))
    return np.dtype(jnp.float32) if dtype in _HALF_FLOATS else dtype


def operands(ctx, *values):
    """``values`` (arrays or Python numbers) as arrays of the compute dtype."""
    dtype = compute_dtype(ctx)
    return tuple(jnp.asarray(value, dtype) for value in values)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


# Arithmetic -------------------------------------------------------------------------------------

@lowering(aten.add.Tensor, aten.add.Scalar)
def add(ctx, x, y, alpha=1):
    x, y = operands(ctx, x, y)
    return x + y if alpha == 1 else x + alpha * y


@lowering(aten.sub.Tensor, aten.sub.Scalar)
def sub(ctx, x, y, alpha=1):
    x, y = operands(ctx, x, y)
    return x - y if alpha == 1 else x - alpha * y


@lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, x, y):
    """A float times a mask (a bool tensor) is ``x * 0`` where the mask is false, as in torch: -0.0
    for a negative ``x`` (``atan2`` and ``1 / x`` read the sign), NaN for an infinite one. XLA
    would make the product a select of 0."""
    masks = [_is_mask(value) for value in (x, y)]
    x, y = operands(ctx, x, y)
    if masks.count(True) == 1 and _is_float(x):
        mask, value = (x, y) if masks[0] else (y, x)
        return jnp.where(mask != 0, value, value * 0)
    return x * y


def _is_mask(value) -> bool:
    return isinstance(value, jax.Array) and value.dtype == jnp.bool_


@lowering(aten.div.Tensor, aten.div.Scalar)
def div(ctx, x, y):
    """True division; integer operands divide as floats (torch's output dtype is float)."""
    x, y = operands(ctx, x, y)
    return x / y


def _nonzero_divisor(y):
    return jnp.where(y == 0, jnp.ones_like(y), y)


def _trunc_divide_int(x, y):
    """C division. Division by zero gives 0 (as in NumPy); the call then raises, as torch does
    (``integer_faults``)."""
    return jnp.where(y == 0, 0, lax.div(x, _nonzero_divisor(y)))


def _floor_divide_int(x, y):
    """Python's ``//``: the truncated quotient less one when the remainder is nonzero and its sign
    differs from the divisor's. Division by zero gives 0 (as in NumPy); the call then raises, as
    torch does (``integer_faults``)."""
    safe_y = _nonzero_divisor(y)
    quotient, remainder = lax.div(x, safe_y), lax.rem(x, safe_y)
    quotient = jnp.where((remainder != 0) & ((remainder < 0) != (safe_y < 0)), quotient - 1, quotient)
    return jnp.where(y == 0, 0, quotient)


def _floor_divide_float(x, y):
    """torch's (and Python's) float floor division: derived from fmod so that the quotient is
    exact, rounded to the nearest integer, signed zero kept; division by zero gives x / y."""
    remainder = lax.rem(x, y)
    quotient = (x - remainder) / y
    quotient = jnp.where((remainder != 0) & ((y < 0) != (remainder < 0)), quotient - 1, quotient)
    floored = jnp.floor(quotient)
    floored = jnp.where(quotient - floored > 0.5, floored + 1, floored)
    floored = jnp.where(quotient == 0, jnp.copysign(jnp.zeros_like(quotient), x / y), floored)
    return jnp.where(y == 0, x / y, floored)


@lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx, x, y, *, rounding_mode=None):
    """``rounding_mode`` None, "trunc" or "floor". Rounded quotients have zero gradient in torch."""
    x, y = operands(ctx, x, y)
    if rounding_mode is None:
        return x / y
    if _is_float(x):
        rounded = jnp.trunc(x / y) if rounding_mode == "trunc" else _floor_divide_float(x, y)
        return lax.stop_gradient(rounded)
    return _trunc_divide_int(x, y) if rounding_mode == "trunc" else _floor_divide_int(x, y)


@lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(ctx, x, y):
    """Python's ``%``: the result takes the divisor's sign. Integer remainder by zero gives 0 (as in
    NumPy) and the call then raises, as torch does (``integer_faults``); float remainder by zero is
    NaN."""
    x, y = operands(ctx, x, y)
    safe_y = y if _is_float(y) else _nonzero_divisor(y)
    truncated = lax.rem(x, safe_y)
    result = jnp.where((truncated != 0) & ((truncated < 0) != (safe_y < 0)), truncated + safe_y, truncated)
    return result if _is_float(y) else jnp.where(y == 0, 0, result)


@lowering(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(ctx, x, y):
    """C's fmod: the result takes the dividend's sign. Integer fmod by zero gives 0 (as in NumPy)
    and the call then raises, as torch does (``integer_faults``); float fmod by zero is NaN."""
    x, y = operands(ctx, x, y)
    if _is_float(y):
        return lax.rem(x, y)
    return jnp.where(y == 0, 0, lax.rem(x, _nonzero_divisor(y)))


@lowering(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(ctx, x, exponent):
    """Integral exponents multiply (torch special-cases 2, 3, -1, -2 the same way, and the
    derivative of x**0 is 0 at x = 0, not NaN); 0.5 and -0.5 are sqrt and rsqrt as in torch."""
    (x,) = operands(ctx, x)
    if float(exponent).is_integer():
        return lax.integer_pow(x, int(exponent))
    if exponent == 0.5:
        return jnp.sqrt(x)
    if exponent == -0.5:
        return lax.rsqrt(x)
    return lax.pow(x, jnp.asarray(exponent, x.dtype))


@lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_(ctx, x, y):
    """Integer powers follow torch: a negative exponent gives 0 unless the base is 1 or -1.
    Float powers have torch's derivatives (:func:`_float_power`)."""
    x, y = operands(ctx, x, y)
    return _float_power(x, y) if _is_float(x) else jnp.power(x, y)


@jax.custom_jvp
def _float_power(x, y):
    return jnp.power(x, y)


@_float_power.defjvp
def _float_power_jvp(primals, tangents):
    """torch's ``pow_backward_self`` and ``pow_backward_exponent``: a zero exponent passes the
    base no gradient (where ``0 * 0**-1`` is NaN), and a zero base with an exponent of at least
    0 passes the exponent none (where ``0**y * log 0`` is NaN)."""
    (x, y), (dx, dy) = primals, tangents
    result = jnp.power(x, y)
    by_base = jnp.where(y == 0, 0, y * jnp.power(x, y - 1))
    by_exponent = jnp.where((x == 0) & (y >= 0), 0, result * jnp.log(x))
    return result, by_base * dx + by_exponent * dy


@lowering(aten.xlogy.Tensor)
def xlogy(ctx, x, y):
    """``x * log(y)``, 0 where ``x`` is 0 (unless ``y`` is NaN), with torch's derivative in ``x``:
    ``log(y)``, but 0 where ``x`` is 0 and ``y`` at most 0 (where the product's would be NaN)."""
    x, y = operands(ctx, x, y)
    return _xlogy(x, y)


@jax.custom_jvp
def _xlogy(x, y):
    return jnp.where((x == 0) & ~jnp.isnan(y), 0, x * jnp.log(y))


@_xlogy.defjvp
def _xlogy_jvp(primals, tangents):
    (x, y), (dx, dy) = primals, tangents
    return _xlogy(x, y), jnp.where((x == 0) & (y <= 0), 0, jnp.log(y)) * dx + x / y * dy


@lowering(aten.hardsigmoid.default)
def hardsigmoid(ctx, x):
    (x,) = operands(ctx, x)
    return _hardsigmoid(x)


@jax.custom_jvp
def _hardsigmoid(x):
    return jnp.clip(x + 3, 0, 6) / 6


@_hardsigmoid.defjvp
def _hardsigmoid_jvp(primals, tangents):
    """torch's derivative: 1/6 strictly inside (-3, 3), 0 from either end on."""
    (x,), (dx,) = primals, tangents
    return _hardsigmoid(x), jnp.where((x > -3) & (x < 3), dx / 6, 0)


@lowering(aten.hardswish.default)
def hardswish(ctx, x):
    (x,) = operands(ctx, x)
    return _hardswish(x)


@jax.custom_jvp
def _hardswish(x):
    return x * jnp.clip(x + 3, 0, 6) / 6


@_hardswish.defjvp
def _hardswish_jvp(primals, tangents):
    """torch's derivative: ``x / 3 + 1/2`` strictly inside (-3, 3), 0 from -3 down, 1 from 3 up."""
    (x,), (dx,) = primals, tangents
    slope = jnp.where(x <= -3, 0, jnp.where(x >= 3, 1, x / 3 + 0.5))
    return _hardswish(x), slope * dx


# Sign, magnitude and rounding -------------------------------------------------------------------

@lowering(aten.neg.default)
def neg(ctx, x):
    return -x


@jax.custom_jvp
def _float_abs(x):
    return jnp.abs(x)


# torch's derivative, ``grad * sign(x)``: 0 at 0 (JAX's would be 1), NaN for an infinite grad at 0.
_float_abs.defjvps(lambda tangent, result, x: tangent * jnp.sign(x))


@lowering(aten.abs.default)
def abs_(ctx, x):
    if x.dtype == jnp.bool_:
        return x
    return _float_abs(x) if _is_float(x) else jnp.abs(x)


@lowering(aten.sign.default)
def sign(ctx, x):
    """torch's sign of NaN is 0."""
    if x.dtype == jnp.bool_:
        return x
    return jnp.where(jnp.isnan(x), jnp.zeros_like(x), jnp.sign(x)) if _is_float(x) else jnp.sign(x)


def _float_rounding(fn):
    def rule(ctx, x):
        return fn(x) if _is_float(x) else x
    rule.__name__ = rule.__qualname__ = fn.__name__
    return rule


for _op, _fn in {
    aten.floor.default: jnp.floor,
    aten.ceil.default: jnp.ceil,
    aten.trunc.default: jnp.trunc,
    aten.round.default: jnp.round,  # half to even, as torch
}.items():
    lowering(_op)(_float_rounding(_fn))


@lowering(aten.round.decimals)
def round_decimals(ctx, x, *, decimals=0):
    """torch's formula: scale by 10**|decimals| (multiplying or dividing), round half to even,
    undo the scaling."""
    (x,) = operands(ctx, x)
    scale = jnp.asarray(10.0 ** abs(decimals), x.dtype)
    if decimals < 0:
        return jnp.round(x / scale) * scale
    return jnp.round(x * scale) / scale


# Float math functions ---------------------------------------------------------------------------

@jax.custom_jvp
def _digamma(x):
    """torch's digamma(±0) is ∓inf (JAX gives NaN)."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), lax.digamma(x))


def _trigamma(x):
    """torch's trigamma (digamma's derivative), computed its way: reflected below 1/2, six steps
    of the recurrence, then the asymptotic series. ``lax.polygamma(1, x)`` is wrong for most
    negative ``x`` and infinite at negative integers, where torch's reflection gives large finite
    values (``sin(pi x)`` is not 0 in float32)."""
    pi = jnp.asarray(np.pi, x.dtype)
    reflected = x < 0.5
    sin_pi_x = jnp.sin(pi * x)
    result = jnp.where(reflected, -(pi * pi) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflected, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    inverse_square = 1 / (x * x)
    series = 1 / 6 - inverse_square * (1 / 30 - inverse_square / 42)
    result = result + (1 + 1 / (2 * x) + inverse_square * series) / x
    return jnp.where(reflected, -result, result)


_digamma.defjvps(lambda dx, result, x: dx * _trigamma(x))


@jax.custom_jvp
def _lgamma(x):
    return lax.lgamma(x)


# torch's derivative, ``grad * digamma(x)``: ∓inf at ±0, where lax.lgamma's is NaN.
_lgamma.defjvps(lambda dx, result, x: dx * _digamma(x))


_FLOAT_MATH = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: jnp.reciprocal,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: _lgamma,
    aten.digamma.default: _digamma,
}


def _float_math(fn):
    def rule(ctx, x):
        (x,) = operands(ctx, x)
        return fn(x)
    rule.__name__ = rule.__qualname__ = fn.__name__
    return rule


for _op, _fn in _FLOAT_MATH.items():
    lowering(_op)(_float_math(_fn))


@jax.custom_jvp
def _atan2(y, x):
    return jnp.arctan2(y, x)


@_atan2.defjvp
def _atan2_jvp(primals, tangents):
    """torch's derivative, ``(x dy - y dx) / (x^2 + y^2)``, 0 where the denominator is (JAX's: NaN)."""
    (y, x), (dy, dx) = primals, tangents
    denominator = x * x + y * y
    zero = denominator == 0
    return jnp.arctan2(y, x), jnp.where(zero, 0, (x * dy - y * dx) / _nonzero_divisor(denominator))


@lowering(aten.atan2.default)
def atan2(ctx, y, x):
    y, x = operands(ctx, y, x)
    return _atan2(y, x)


@lowering(aten.softplus.default)
def softplus(ctx, x, beta=1, threshold=20):
    """``log1p(exp(beta x)) / beta``, ``x`` itself where ``beta x > threshold``, computed whole
    (``capture._KEPT_WHOLE``): decomposed, the untaken branch's overflow reaches the gradient as
    ``0 * inf``, NaN where torch's is 1 (``beta x`` over 88, ``F.mish`` too)."""
    (x,) = operands(ctx, x)
    linear = x * beta > threshold
    return jnp.where(linear, x, jnp.log1p(jnp.exp(jnp.where(linear, 0, x * beta))) / beta)


@lowering(aten.sinc.default)
def sinc(ctx, x):
    """``sin(pi x) / (pi x)``, 1 at 0 with gradient 0 there as torch's (decomposed: NaN)."""
    (x,) = operands(ctx, x)
    scaled = jnp.pi * _nonzero_divisor(x)
    return jnp.where(x == 0, 1, jnp.sin(scaled) / scaled)


@lowering(aten.hypot.default)
def hypot(ctx, x, y):
    x, y = operands(ctx, x, y)
    return _hypot(x, y)


@jax.custom_jvp
def _hypot(x, y):
    return jnp.hypot(x, y)


# torch's derivative, ``grad * x / result``: NaN at (0, 0), where JAX's picks a finite subgradient.
_hypot.defjvps(lambda dx, result, x, y: dx * x / result, lambda dy, result, x, y: dy * y / result)


@lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(ctx, x, y):
    """Derivative 0 where x is 0 (torch's), and none with respect to the sign source."""
    x, y = operands(ctx, x, y)
    result = jnp.copysign(x, y)
    return jnp.where(x == 0, lax.stop_gradient(result), result)


# Minimum, maximum and clamping ------------------------------------------------------------------

@lowering(aten.maximum.default)
def maximum(ctx, x, y):
    """NaN propagates; at ties the gradient is split equally, as in torch."""
    x, y = operands(ctx, x, y)
    return jnp.maximum(x, y)


@lowering(aten.minimum.default)
def minimum(ctx, x, y):
    """NaN propagates; at ties the gradient is split equally, as in torch."""
    x, y = operands(ctx, x, y)
    return jnp.minimum(x, y)


@lowering(aten.fmax.default)
def fmax(ctx, x, y):
    """NaN is ignored unless both are NaN; at ties torch gives the whole gradient to x."""
    x, y = operands(ctx, x, y)
    return jnp.where((x >= y) | jnp.isnan(y), x, y) if _is_float(x) else jnp.maximum(x, y)


@lowering(aten.fmin.default)
def fmin(ctx, x, y):
    """NaN is ignored unless both are NaN; at ties torch gives the whole gradient to x."""
    x, y = operands(ctx, x, y)
    return jnp.where((x <= y) | jnp.isnan(y), x, y) if _is_float(x) else jnp.minimum(x, y)


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def _clamp(x, lo, hi):
    """``min(max(x, lo), hi)`` (hi wins when lo > hi; NaN in x propagates when lo <= hi) with torch's
    gradients: x's where lo <= x <= hi, lo's where x < lo < hi, hi's where x > hi or hi < lo,
    nobody's elsewhere (NaN in x, or x < lo == hi). The three masks are disjoint."""
    clamped = jnp.minimum(jnp.maximum(x, lo), hi)
    result = jnp.where((x > hi) | (hi < lo), hi, lax.stop_gradient(clamped))
    result = jnp.where((x < lo) & (lo < hi), lo, result)
    return jnp.where((x >= lo) & (x <= hi), x, result)


@lowering(aten.clamp.default, aten.clamp.Tensor)
def clamp(ctx, x, min=None, max=None):
    dtype = compute_dtype(ctx)
    lo = jnp.asarray(_lowest(dtype) if min is None else min, dtype)
    hi = jnp.asarray(_highest(dtype) if max is None else max, dtype)
    return _clamp(jnp.asarray(x, dtype), lo, hi)


# Activations ------------------------------------------------------------------------------------

@lowering(aten.relu.default)
def relu(ctx, x):
    """NaN propagates; derivative 0 at 0, as in torch."""
    return jnp.where(x <= 0, jnp.zeros_like(x), x)


@lowering(aten.leaky_relu.default)
def leaky_relu(ctx, x, negative_slope=0.01):
    (x,) = operands(ctx, x)
    return jnp.where(x > 0, x, x * negative_slope)


@lowering(aten.elu.default)
def elu(ctx, x, alpha=1, scale=1, input_scale=1):
    """At 0 the derivative is the negative side's, as in torch. The exponential only sees
    non-positive inputs, so that large positive ones give no inf * 0 = NaN in the gradient."""
    (x,) = operands(ctx, x)
    negative = jnp.expm1(jnp.where(x > 0, 0, x) * input_scale) * (alpha * scale)
    return jnp.where(x > 0, x * scale, negative)


@lowering(aten.hardtanh.default)
def hardtanh(ctx, x, min_val=-1, max_val=1):
    """torch's derivative is 0 at both corners (unlike clamp's) and passes through NaN."""
    (x,) = operands(ctx, x)
    outside = (x <= min_val) | (x >= max_val)
    return jnp.where(outside, lax.stop_gradient(jnp.clip(x, min_val, max_val)), x)


@lowering(aten.gelu.default)
def gelu(ctx, x, *, approximate="none"):
    """The tanh form ``0.5 x (1 + tanh(u))`` is computed as ``x sigmoid(2u)``, the same function
    without the cancellation in ``1 + tanh(u)`` for negative x, where XLA's tanh (a few ulp off)
    would put the derivative outside float32 tolerance of torch's."""
    (x,) = operands(ctx, x)
    if approximate == "tanh":
        inner = np.sqrt(2 / np.pi) * (x + 0.044715 * x * x * x)
        return x * jax.nn.sigmoid(2 * inner)
    return 0.5 * x * (1 + lax.erf(x * np.sqrt(0.5)))


# Float classification ---------------------------------------------------------------------------

@lowering(aten.isnan.default)
def isnan(ctx, x):
    return jnp.isnan(x) if _is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.isinf.default)
def isinf(ctx, x):
    return jnp.isinf(x) if _is_float(x) else jnp.zeros(x.shape, jnp.bool_)


@lowering(aten.signbit.default)
def signbit(ctx, x):
    return jnp.zeros(x.shape, jnp.bool_) if x.dtype == jnp.bool_ else jnp.signbit(x)


# Bitwise ----------------------------------------------------------------------------------------

@lowering(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)
def bitwise_and(ctx, x, y):
    x, y = operands(ctx, x, y)
    return x & y


@lowering(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)
def bitwise_or(ctx, x, y):
    x, y = operands(ctx, x, y)
    return x | y


@lowering(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)
def bitwise_xor(ctx, x, y):
    x, y = operands(ctx, x, y)
    return x ^ y


@lowering(aten.bitwise_not.default)
def bitwise_not(ctx, x):
    return ~x


@lowering(aten.__lshift__.Scalar, aten.__lshift__.Tensor, aten.bitwise_left_shift.Tensor)
def left_shift(ctx, x, shift):
    """Shifts by a negative amount or by the bit width or more give 0, as in torch."""
    x, shift = operands(ctx, x, shift)
    return lax.shift_left(x, shift)


@lowering(aten.__rshift__.Scalar, aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor)
def right_shift(ctx, x, shift):
    """Arithmetic for signed types; shifts by a negative amount or by the bit width or more fill
    with the sign bit, as in torch."""
    x, shift = operands(ctx, x, shift)
    return jnp.right_shift(x, shift)
