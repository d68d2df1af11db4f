"""Random lowerings: distributions, dtypes, determinism and independence; dropout against torch.

Sampled values cannot equal torch's generator, so each sampled case checks statistics of its
draws (moments, ranges, Kolmogorov-Smirnov distances with bounds that a correct sampler exceeds
with probability well under 1e-3), that one key gives the same values twice and another key
different ones. Cases whose result does not depend on the draws (dropout with p = 0 or 1, or
not training) go through the parity harness.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_backend.compiler import compile_module, to_jax, to_torch
from ipu_backend.compiler.dtypes import jax_dtype
from tests.compiler.harness import FnModule, OpCase, case_params, check_case, graph_ops

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SAMPLE_SHAPE = (100, 200)
N = math.prod(SAMPLE_SHAPE)


@dataclass
class SampledCase(OpCase):
    """A random case: ``check(outputs, inputs, dtype)`` judges the draws (numpy float64 arrays)."""

    check: Callable | None = None


def normal_samples(*shapes):
    return lambda dtype: tuple(torch.randn(*shape).to(dtype) for shape in shapes)


def _resolution(dtype) -> float:
    """How far rounding to ``dtype`` can move a value near 1 (bounds discretization in KS)."""
    return float(jnp.finfo(jax_dtype(dtype)).eps)


def assert_ks(samples, cdf, dtype=torch.float32):
    """Kolmogorov-Smirnov distance below 1.95 / sqrt(n) (p < 0.001) plus rounding to ``dtype``."""
    values = np.sort(np.ravel(samples))
    n = values.size
    expected = cdf(values)
    distance = max(np.max(np.arange(1, n + 1) / n - expected), np.max(expected - np.arange(n) / n))
    assert distance < 1.95 / math.sqrt(n) + _resolution(dtype), f"KS distance {distance:.4g} for n={n}"


def assert_fraction(observed, p, n, what):
    """A binomial fraction within 5 standard deviations of ``p``."""
    bound = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(observed - p) <= bound, f"{what}: fraction {observed:.4f}, expected {p} +- {bound:.4f}"


def uniform_cdf(low, high):
    return lambda v: np.clip((v - low) / (high - low), 0, 1)


def normal_cdf(mean, std):
    erf = np.vectorize(math.erf)
    return lambda v: 0.5 * (1 + erf((v - mean) / (std * math.sqrt(2))))


def assert_uniform(samples, low, high, dtype):
    assert samples.min() >= low and samples.max() < high
    assert_ks(samples, uniform_cdf(low, high), dtype)


def check_uniform_family(outputs, inputs, dtype):
    rand, rand_generator, rand_like, uniform = outputs
    for samples in (rand, rand_generator, rand_like):
        assert_uniform(samples, 0.0, 1.0, dtype)
    assert_uniform(uniform, -2.0, 3.0, dtype)
    assert not np.array_equal(rand, rand_like), "two rand nodes drew the same values"


def check_normal_family(outputs, inputs, dtype):
    randn, randn_generator, randn_like, normal_scalars, normal_inplace = outputs
    for samples in (randn, randn_generator, randn_like):
        assert_ks(samples, normal_cdf(0.0, 1.0), dtype)
    assert_ks(normal_scalars, normal_cdf(2.0, 3.0), dtype)
    assert_ks(normal_inplace, normal_cdf(-1.0, 0.5), dtype)


def check_normal_tensor_params(outputs, inputs, dtype):
    """Rows of ``mean``/``std`` differ; each row's draws follow its own parameters."""
    mean, std = (x[:, 0].tolist() for x in inputs)
    row_params = [zip(mean, std), zip(mean, [2.0, 2.0]), zip([1.0, 1.0], std)]
    for samples, params in zip(outputs, row_params):
        for row, (row_mean, row_std) in enumerate(params):
            assert_ks(samples[row], normal_cdf(row_mean, row_std))


def check_integers(outputs, inputs, dtype):
    """Every value in range and each about equally frequent (within 5 standard deviations)."""
    for samples, (low, high) in zip(outputs, [(0, 10), (-3, 4), (0, 7), (5, 9), (2, 6)]):
        assert samples.min() >= low and samples.max() < high
        assert np.array_equal(samples, np.round(samples))
        counts = np.bincount((samples - low).astype(np.int64).ravel(), minlength=high - low)
        for value, count in enumerate(counts):
            assert_fraction(count / samples.size, 1 / (high - low), samples.size, f"value {low + value}")


def check_bernoulli(outputs, inputs, dtype):
    constant_p, *tensor_p = outputs
    assert set(np.unique(constant_p)) <= {0.0, 1.0}
    assert_fraction(constant_p.mean(), 0.3, constant_p.size, "bernoulli(0.3)")
    for samples in tensor_p:
        for row, p in enumerate((0.2, 0.9)):
            assert_fraction(samples[row].mean(), p, samples[row].size, f"bernoulli row with p={p}")


def check_exponential(outputs, inputs, dtype):
    (samples,) = outputs
    assert samples.min() >= 0
    assert_ks(samples, lambda v: 1 - np.exp(-2.0 * v), dtype)


def check_dropout(outputs, inputs, dtype):
    """About 1 - p kept; kept values are ``x / (1 - p)`` rounded as torch rounds; others 0."""
    output, mask = outputs
    x = inputs[0]
    assert_fraction(mask.mean(), 0.7, mask.size, "kept fraction")
    scaled = (x.float() * torch.tensor(1 / 0.7, dtype=torch.float32)).to(dtype).double().numpy()
    np.testing.assert_array_equal(output, np.where(mask.astype(bool), scaled, 0.0))


def check_channel_dropout(outputs, inputs, dtype):
    """``F.dropout2d``: whole channels kept (scaled by 2) or zeroed, about half of each."""
    (output,) = outputs
    x = inputs[0].double().numpy()
    kept = np.all(output == 2 * x, axis=(2, 3))
    dropped = np.all(output == 0, axis=(2, 3))
    assert np.all(kept ^ dropped)
    assert_fraction(kept.mean(), 0.5, kept.size, "kept channels")


def check_rrelu(outputs, inputs, dtype):
    """Positive inputs pass, zeros stay zero, negative ones are scaled by slopes uniform in [0.1, 0.3)."""
    (output,) = outputs
    x = inputs[0].double().numpy()
    np.testing.assert_array_equal(output[x >= 0], x[x >= 0])
    slopes = output[x < 0] / x[x < 0]
    assert_uniform(slopes, 0.1 - 1e-6, 0.3 + 1e-6, torch.float32)


def check_randperm(outputs, inputs, dtype):
    for samples, n in zip(outputs, (50, 7)):
        np.testing.assert_array_equal(np.sort(samples), np.arange(n))


WEIGHTS = torch.tensor([1.0, 2.0, 3.0, 0.0])
PROBABILITIES = (WEIGHTS / WEIGHTS.sum()).numpy()


def check_multinomial(outputs, inputs, dtype):
    with_replacement, without_replacement, one_row = outputs
    for category, p in enumerate(PROBABILITIES):
        assert_fraction(np.mean(with_replacement == category), p, with_replacement.size, f"category {category}")
        assert_fraction(np.mean(without_replacement[:, 0] == category), p, without_replacement.shape[0],
                        f"first draw of category {category}")
    for draws in (without_replacement, one_row[None]):
        assert np.all(draws != 3), "drew a category of weight 0"
        assert np.all(np.diff(np.sort(draws, axis=1), axis=1) != 0), "drew a category twice"


def uniform_family(x):
    return (torch.rand(*SAMPLE_SHAPE, dtype=x.dtype), torch.rand(*SAMPLE_SHAPE, generator=None, dtype=x.dtype),
            torch.rand_like(x), torch.empty_like(x).uniform_(-2.0, 3.0))


def normal_family(x):
    return (torch.randn(*SAMPLE_SHAPE, dtype=x.dtype), torch.randn(*SAMPLE_SHAPE, generator=None, dtype=x.dtype),
            torch.randn_like(x), torch.normal(2.0, 3.0, SAMPLE_SHAPE, dtype=x.dtype),
            torch.empty_like(x).normal_(-1.0, 0.5))


def normal_tensor_params(dtype):
    mean = torch.tensor([[-1.0], [3.0]]).expand(2, N // 2).contiguous()
    std = torch.tensor([[0.5], [2.0]]).expand(2, N // 2).contiguous()
    return mean.to(dtype), std.to(dtype)


def integers(x, counts):
    """Integer draws in torch's default int64, in int32, and in float dtypes (as ``like`` gives)."""
    return (torch.randint(10, SAMPLE_SHAPE), torch.randint(-3, 4, SAMPLE_SHAPE, dtype=torch.int32),
            torch.randint_like(x, 7), torch.randint_like(counts, 5, 9),
            torch.randint(2, 6, SAMPLE_SHAPE, dtype=torch.float16))


def float_and_int_samples(dtype):
    return torch.randn(*SAMPLE_SHAPE), torch.zeros(*SAMPLE_SHAPE, dtype=torch.int64)


def bernoulli_probabilities(dtype):
    p = torch.tensor([[0.2], [0.9]]).expand(2, N // 2).contiguous()
    return torch.zeros(*SAMPLE_SHAPE).to(dtype), p.to(dtype)


def bernoulli_family(x, p):
    """``torch.bernoulli(p)`` itself decomposes to ``rand(...) < p``."""
    return torch.bernoulli(x, 0.3), torch.empty_like(p).bernoulli_(p), torch.bernoulli(p)


def signed_samples(dtype):
    x = torch.randn(*SAMPLE_SHAPE)
    x[0, :10] = 0.0
    return (x.to(dtype),)


SAMPLED = [
    SampledCase("uniform_family", uniform_family, normal_samples(SAMPLE_SHAPE), FLOATS,
                check=check_uniform_family,
                ops=(aten.rand.default, aten.rand.generator, aten.rand_like.default, aten.uniform.default)),
    SampledCase("normal_family", normal_family, normal_samples(SAMPLE_SHAPE), (torch.float32, torch.bfloat16),
                check=check_normal_family,
                ops=(aten.randn.default, aten.randn.generator, aten.randn_like.default, aten.normal.float_float,
                     aten.normal_functional.default)),
    SampledCase("normal_tensor_params",
                lambda mean, std: (torch.normal(mean, std), torch.normal(mean, 2.0), torch.normal(1.0, std)),
                normal_tensor_params, check=check_normal_tensor_params,
                ops=(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor)),
    SampledCase("integers", integers, float_and_int_samples, check=check_integers,
                ops=(aten.randint.default, aten.randint.low, aten.randint_like.default,
                     aten.randint_like.low_dtype)),
    SampledCase("bernoulli", bernoulli_family, bernoulli_probabilities, check=check_bernoulli,
                ops=(aten.bernoulli.p, aten.bernoulli.Tensor)),
    SampledCase("exponential", lambda x: torch.empty_like(x).exponential_(2.0), normal_samples(SAMPLE_SHAPE),
                check=check_exponential, ops=(aten.exponential.default,)),
    SampledCase("dropout", lambda x: torch.native_dropout(x, 0.3, True), normal_samples(SAMPLE_SHAPE),
                (torch.float32, torch.float16), check=check_dropout, ops=(aten.native_dropout.default,)),
    SampledCase("channel_dropout", lambda x: F.dropout2d(x, 0.5), normal_samples((50, 40, 3, 3)),
                check=check_channel_dropout, ops=(aten.bernoulli.p,)),
    SampledCase("rrelu_train", lambda x: F.rrelu(x, 0.1, 0.3, training=True), signed_samples,
                check=check_rrelu, ops=(aten.rrelu_with_noise_functional.default,)),
    SampledCase("randperm", lambda x: (torch.randperm(50), torch.randperm(7, dtype=torch.int32)),
                normal_samples((1,)), check=check_randperm, ops=(aten.randperm.default,)),
    SampledCase("multinomial",
                lambda w: (torch.multinomial(w.expand(N // 4, 4), 4, replacement=True),
                           torch.multinomial(w.expand(N // 4, 4), 3), torch.multinomial(w, 3)),
                lambda dtype: (WEIGHTS.to(dtype),), check=check_multinomial, ops=(aten.multinomial.default,)),
]

DETERMINISTIC = [
    OpCase("dropout_p0_is_identity", lambda x: torch.native_dropout(x, 0.0, True), normal_samples((4, 5)),
           (torch.float32, torch.bfloat16), ops=(aten.native_dropout.default,)),
    OpCase("dropout_p1_is_zero", lambda x: torch.native_dropout(x, 1.0, True),
           lambda dtype: (torch.tensor([[1.5, -2.0, 0.0], [float("inf"), float("nan"), -0.25]], dtype=dtype),),
           ops=(aten.native_dropout.default,)),
    OpCase("dropout_not_training", lambda x: torch.native_dropout(x, 0.5, False), normal_samples((3, 4)),
           ops=(aten.native_dropout.default,)),
    OpCase("bernoulli_p0_p1", lambda x: (torch.bernoulli(x, 0.0), torch.bernoulli(x, 1.0)),
           normal_samples((3, 4)), grad=False, ops=(aten.bernoulli.p,)),
    OpCase("rrelu_eval", lambda x: F.rrelu(x, 0.1, 0.3), signed_samples,
           ops=(aten.rrelu_with_noise_functional.default,)),
]

CASES = SAMPLED + DETERMINISTIC


@pytest.mark.parametrize("case,dtype", case_params(DETERMINISTIC))
def test_deterministic_random_ops(case, dtype):
    check_case(case, dtype)


def _compile(fn, inputs):
    program = compile_module(FnModule(fn), inputs)
    jax_inputs = tuple(to_jax(x) for x in inputs)
    return program, jax.jit(lambda key: jax.tree_util.tree_leaves(program.fn({}, {}, jax_inputs, key)[0]))


@pytest.mark.parametrize("case,dtype", case_params(SAMPLED))
def test_sampled_random_ops(case, dtype):
    """Claimed ops in the graph; torch's shapes and dtypes; same key same draws, other key other
    draws; and the case's statistics."""
    torch.manual_seed(0)
    inputs = case.make_inputs(dtype)
    program, sample = _compile(case.fn, inputs)
    missing = set(case.ops) - graph_ops(program.graph_module)
    assert not missing, f"{case.name}: the graph does not call {missing}"
    draws = sample(jax.random.key(0))
    expected = [e for e in jax.tree_util.tree_leaves(case.fn(*inputs)) if isinstance(e, torch.Tensor)]
    assert [(d.shape, d.dtype) for d in draws] == [(tuple(e.shape), jax_dtype(e.dtype)) for e in expected]
    for first, again, other in zip(draws, sample(jax.random.key(0)), sample(jax.random.key(1))):
        np.testing.assert_array_equal(first, again)
        assert not np.array_equal(first, other), "another key gave the same draws"
    case.check([to_torch(d).double().numpy() for d in draws], inputs, dtype)


def test_two_dropouts_in_one_program_draw_different_masks():
    x = torch.ones(64, 64)
    _, sample = _compile(lambda x: (F.dropout(x, 0.5), F.dropout(x, 0.5)), (x,))
    first, second = sample(jax.random.key(0))
    assert not np.array_equal(first, second)


def test_dropout_module_train_and_eval():
    """nn.Dropout compiled in training mode drops; in eval mode it is the identity."""
    torch.manual_seed(0)
    x = torch.randn(50, 40)
    for train in (True, False):
        module = nn.Dropout(0.25).train(train)
        program = compile_module(module, (x,))
        (output, _) = program.fn({}, {}, (to_jax(x),), jax.random.key(3))
        output = np.asarray(output)
        if train:
            assert_fraction(np.mean(output != 0), 0.75, output.size, "kept fraction")
        else:
            np.testing.assert_array_equal(output, x.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_gradient_is_mask_times_scale(dtype):
    """JAX's gradient equals torch's native_dropout_backward applied to our mask."""
    torch.manual_seed(0)
    x = torch.randn(20, 30).to(dtype)
    program = compile_module(FnModule(lambda x: torch.native_dropout(x, 0.4, True)), (x,))
    key = jax.random.key(0)
    (output, mask), vjp = jax.vjp(lambda x: program.fn({}, {}, (x,), key)[0], to_jax(x))
    cotangent = torch.randn(20, 30).to(dtype)
    (grad,) = vjp((to_jax(cotangent), np.zeros(mask.shape, jax.dtypes.float0)))
    expected = aten.native_dropout_backward(cotangent, to_torch(mask), 1 / 0.6)
    np.testing.assert_array_equal(to_torch(grad).float().numpy(), expected.float().numpy())


def test_rrelu_gradient_is_the_drawn_slope():
    """torch's backward multiplies by the noise: the drawn slope, 1 for positive inputs."""
    (x,) = signed_samples(torch.float32)
    program = compile_module(FnModule(lambda x: F.rrelu(x, 0.1, 0.3, training=True)), (x,))
    key = jax.random.key(0)
    output, vjp = jax.vjp(lambda x: program.fn({}, {}, (x,), key)[0], to_jax(x))
    (grad,) = vjp(jnp.ones_like(output))
    x, output, grad = x.numpy(), np.asarray(output), np.asarray(grad)
    np.testing.assert_array_equal(grad[x > 0], 1.0)
    np.testing.assert_allclose(grad[x < 0], output[x < 0] / x[x < 0], rtol=1e-6)
    assert np.all((grad[x <= 0] >= 0.1) & (grad[x <= 0] < 0.3))


def test_sampler_parameters_get_no_gradient():
    """torch gives normal's mean/std and bernoulli's p zero gradients (no reparameterization)."""
    mean, std = torch.randn(6), torch.rand(6) + 0.5
    p = torch.rand(6)

    def fn(mean, std, p):
        return torch.normal(mean, std) + torch.empty_like(p).bernoulli_(p)

    leaves = [t.clone().requires_grad_(True) for t in (mean, std, p)]
    torch_grads = torch.autograd.grad(fn(*leaves).sum(), leaves)
    program = compile_module(FnModule(fn), (mean, std, p))
    jax_grads = jax.grad(lambda *args: program.fn({}, {}, args, jax.random.key(0))[0].sum(), argnums=(0, 1, 2))(
        *(to_jax(t) for t in (mean, std, p)))
    for jax_grad, torch_grad in zip(jax_grads, torch_grads):
        np.testing.assert_array_equal(np.asarray(jax_grad), torch_grad.numpy())
