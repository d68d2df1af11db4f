"""Normalization lowerings against torch: forward, gradients and BatchNorm's running statistics."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_backend.compiler import compile_module, to_jax
from tests.compiler.harness import TOLERANCES, OpCase, assert_close, case_params, check_case

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# Running statistics are constants of the traced function (torch does not differentiate them),
# one pair per dtype because torch's kernels want them in the input's dtype.
RUNNING_STATS = {dtype: (torch.tensor([0.5, -1.0, 0.25]).to(dtype), torch.tensor([1.5, 0.5, 2.0]).to(dtype))
                 for dtype in FLOATS}


def running_stats(x):
    return RUNNING_STATS[x.dtype]


def channel_inputs(shape, affine=True):
    """``x`` of ``shape`` plus, when ``affine``, a weight and bias of its channel dim (dim 1)."""
    def make(dtype):
        x = torch.randn(*shape).to(dtype)
        if not affine:
            return (x,)
        return x, torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
    return make


def last_dims_inputs(shape, normalized, weight=True, bias=True):
    """``x`` plus a weight and/or bias of the normalized trailing dims."""
    def make(dtype):
        params = [torch.randn(*normalized).to(dtype) for wanted in (weight, bias) if wanted]
        return (torch.randn(*shape).to(dtype), *params)
    return make


def channels_last_inputs(dtype):
    """A non-contiguous (channels-last) 4-d input: torch's CPU kernels take another path for it."""
    x = torch.randn(2, 4, 5, 3).permute(0, 3, 1, 2).to(dtype)
    return x, torch.randn(3).to(dtype), torch.randn(3).to(dtype)


def batch_norm_train(x, weight, bias):
    """All five outputs, the updated running statistics included."""
    return aten._native_batch_norm_legit_functional(x, weight, bias, *running_stats(x), True, 0.1, 1e-5)


def batch_norm_train_momentum(x):
    return aten._native_batch_norm_legit_functional(x, None, None, *running_stats(x), True, 0.7, 1e-3)


def batch_norm_eval(x, weight, bias):
    return F.batch_norm(x, *running_stats(x), weight, bias, training=False, eps=1e-4)


def batch_norm_batch_stats(x, weight, bias):
    """All three outputs: the normalized input and the batch's mean and rstd."""
    return aten._native_batch_norm_legit.no_stats(x, weight, bias, True, 0.1, 1e-5)


BATCH_NORM_TRAIN = (aten._native_batch_norm_legit_functional.default,)
BATCH_NORM_EVAL = (aten._native_batch_norm_legit_no_training.default,)
BATCH_NORM_NO_STATS = (aten._native_batch_norm_legit.no_stats,)
LAYER_NORM = (aten.native_layer_norm.default,)
GROUP_NORM = (aten.native_group_norm.default,)

CASES = [
    OpCase("batch_norm_train_1d", batch_norm_train, channel_inputs((6, 3)), FLOATS, ops=BATCH_NORM_TRAIN),
    OpCase("batch_norm_train_2d_channels_last", batch_norm_train, channels_last_inputs, ops=BATCH_NORM_TRAIN),
    OpCase("batch_norm_train_3d", batch_norm_train, channel_inputs((2, 3, 2, 3, 4)), ops=BATCH_NORM_TRAIN),
    OpCase("batch_norm_train_1d_sequence_no_affine_momentum", batch_norm_train_momentum,
           channel_inputs((5, 3, 4), affine=False), ops=BATCH_NORM_TRAIN),
    OpCase("batch_norm_eval_2d", batch_norm_eval, channel_inputs((2, 3, 4, 5)), (torch.float32, torch.bfloat16),
           ops=BATCH_NORM_EVAL),
    OpCase("batch_norm_eval_no_affine", lambda x: batch_norm_eval(x, None, None),
           channel_inputs((2, 3, 4), affine=False), ops=BATCH_NORM_EVAL),
    OpCase("batch_norm_batch_stats_2d", batch_norm_batch_stats, channel_inputs((2, 3, 4, 5)),
           (torch.float32, torch.float16), ops=BATCH_NORM_NO_STATS),
    OpCase("layer_norm", lambda x, w, b: aten.native_layer_norm(x, [5], w, b, 1e-5),
           last_dims_inputs((2, 3, 5), (5,)), FLOATS, ops=LAYER_NORM),
    OpCase("layer_norm_two_dims_no_bias", lambda x, w: F.layer_norm(x, (3, 5), w, eps=1e-3),
           last_dims_inputs((2, 3, 5), (3, 5), bias=False), ops=LAYER_NORM),
    OpCase("layer_norm_no_affine", lambda x: F.layer_norm(x, (4,)),
           last_dims_inputs((3, 4), (4,), weight=False, bias=False), ops=LAYER_NORM),
    OpCase("group_norm", lambda x, w, b: F.group_norm(x, 3, w, b), channel_inputs((2, 6, 4, 3)), FLOATS,
           ops=GROUP_NORM),
    OpCase("group_norm_2d_input_no_affine", lambda x: F.group_norm(x, 2, eps=1e-3),
           channel_inputs((3, 4), affine=False), ops=GROUP_NORM),
    # torch differentiates mean and rstd of native_group_norm in its own way; outputs only here.
    OpCase("group_norm_all_outputs", lambda x: aten.native_group_norm(x, None, None, 2, 6, 4, 3, 1e-5),
           channel_inputs((2, 6, 4), affine=False), grad=False, ops=GROUP_NORM),
    OpCase("instance_norm", lambda x, w, b: F.instance_norm(x, weight=w, bias=b), channel_inputs((2, 3, 4, 5)),
           ops=BATCH_NORM_NO_STATS),
    OpCase("instance_norm_no_affine", F.instance_norm, channel_inputs((2, 3, 6), affine=False),
           ops=BATCH_NORM_NO_STATS),
    OpCase("rms_norm", lambda x, w: F.rms_norm(x, (5,), w), last_dims_inputs((2, 3, 5), (5,), bias=False),
           (torch.float32, torch.bfloat16)),
    OpCase("normalize", lambda x: F.normalize(x, dim=1), channel_inputs((2, 3, 4), affine=False)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_normalization(case, dtype):
    check_case(case, dtype)


def _run_module(module, x, seed=0):
    """Compile ``module`` for ``x``; returns (outputs, new buffers, program, params, buffers)."""
    program = compile_module(module, (x,))
    params, buffers = program.state(module)
    outputs, new_buffers = jax.jit(program.fn)(params, buffers, (to_jax(x),), jax.random.key(seed))
    return outputs, new_buffers, program, params, buffers


def _assert_buffers_match(new_buffers, module, dtype=torch.float32):
    for name, expected in module.named_buffers():
        assert_close(new_buffers[name], expected, *TOLERANCES[dtype], f"buffer {name}")


BATCH_NORM_MODULES = [
    pytest.param(lambda: nn.BatchNorm1d(3), (6, 3), torch.float32, id="1d"),
    pytest.param(lambda: nn.BatchNorm1d(3, momentum=0.4, affine=False), (4, 3, 5), torch.float32,
                 id="1d_sequence_no_affine"),
    pytest.param(lambda: nn.BatchNorm2d(3), (2, 3, 4, 3), torch.float16, id="2d_float16"),
    pytest.param(lambda: nn.BatchNorm3d(3, momentum=1.0), (2, 3, 2, 3, 2), torch.float32, id="3d_momentum_1"),
]


@pytest.mark.parametrize("make_module,shape,dtype", BATCH_NORM_MODULES)
def test_batch_norm_module_updates_running_stats(make_module, shape, dtype):
    """One training forward: output and running_mean/var/num_batches_tracked equal torch's."""
    torch.manual_seed(0)
    module = make_module().train()
    with torch.no_grad():
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    module.to(dtype)
    x = torch.randn(*shape).to(dtype)
    outputs, new_buffers, program, _, buffers = _run_module(module, x)
    assert set(program.mutated_buffers) == {"running_mean", "running_var", "num_batches_tracked"}
    expected = module(x)
    assert_close(outputs, expected, *TOLERANCES[dtype], "output")
    _assert_buffers_match(new_buffers, module, dtype)
    assert int(new_buffers["num_batches_tracked"]) == int(buffers["num_batches_tracked"]) + 1


def test_batch_norm_module_gradients():
    """A compiled BatchNorm2d in training: output, buffers and the gradients of input, weight and
    bias equal torch's."""
    torch.manual_seed(0)
    module = nn.BatchNorm2d(3, eps=1e-3).train()
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 4, 4)
    cotangent = torch.randn(2, 3, 4, 4)
    program = compile_module(module, (x,))
    params, buffers = program.state(module)

    def loss(params, x_jax):
        outputs, new_buffers = program.fn(params, buffers, (x_jax,), jax.random.key(0))
        return (outputs * to_jax(cotangent)).sum(), (outputs, new_buffers)

    (param_grads, x_grad), (outputs, new_buffers) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        params, to_jax(x))
    x_torch = x.clone().requires_grad_(True)
    expected = module(x_torch)
    (expected * cotangent).sum().backward()
    assert_close(outputs, expected, 1e-5, 1e-6, "output")
    _assert_buffers_match(new_buffers, module)
    assert_close(x_grad, x_torch.grad, 1e-5, 1e-6, "input gradient")
    assert_close(param_grads["weight"], module.weight.grad, 1e-5, 1e-6, "weight gradient")
    assert_close(param_grads["bias"], module.bias.grad, 1e-5, 1e-6, "bias gradient")


def test_batch_norm_module_eval_keeps_running_stats():
    torch.manual_seed(0)
    module = nn.BatchNorm2d(3)
    with torch.no_grad():
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
    module.eval()
    x = torch.randn(2, 3, 4, 5)
    outputs, new_buffers, program, _, _ = _run_module(module, x)
    assert program.mutated_buffers == ()
    assert_close(outputs, module(x), 1e-5, 1e-6, "output")
    _assert_buffers_match(new_buffers, module)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_module_without_running_stats(train):
    """track_running_stats=False normalizes with batch statistics in both modes."""
    torch.manual_seed(0)
    module = nn.BatchNorm1d(3, track_running_stats=False).train(train)
    x = torch.randn(5, 3, 2)
    outputs, new_buffers, program, _, _ = _run_module(module, x)
    assert new_buffers == {}
    assert_close(outputs, module(x), 1e-5, 1e-6, "output")


def test_instance_norm_module_with_running_stats():
    torch.manual_seed(0)
    module = nn.InstanceNorm1d(3, affine=True, track_running_stats=True).train()
    x = torch.randn(2, 3, 6)
    outputs, new_buffers, _, _, _ = _run_module(module, x)
    assert_close(outputs, module(x), 1e-5, 1e-6, "output")
    _assert_buffers_match(new_buffers, module)


def test_batch_norm_cumulative_average_momentum():
    torch.manual_seed(0)
    module = nn.BatchNorm1d(3, momentum=None).train()
    x = torch.randn(6, 3)
    outputs, new_buffers, _, _, _ = _run_module(module, x)
    assert_close(outputs, module(x), 1e-5, 1e-6, "output")
    _assert_buffers_match(new_buffers, module)


def test_layer_norm_module_half_precision_parameters():
    """LayerNorm as a module in bfloat16: parameters and input in bfloat16, as after ``.to()``."""
    torch.manual_seed(0)
    module = nn.LayerNorm(8).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 8).to(torch.bfloat16)
    outputs, _, _, _, _ = _run_module(module, x)
    assert_close(outputs, module(x), *TOLERANCES[torch.bfloat16], "output")
    assert outputs.dtype == jnp.bfloat16
