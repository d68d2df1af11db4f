"""Model parity harness: a whole torch module through the compiler against torch eager on the CPU.

``check_model`` compiles the module (with its loss, when one is given), runs the program's
forward and ``jax.grad`` of the loss through it, and compares with one eager forward and
``backward()`` of an identical copy of the module: every output, the loss, the gradient of every
parameter, and every buffer after the step (BatchNorm's running statistics and
``num_batches_tracked`` in train mode, unchanged ones in eval mode).

Without a ``loss_fn`` the loss is ``sum(output_i * cotangent_i)`` over the floating outputs, with
fixed random cotangents, so every output's gradient path is exercised, not only its sum. That
loss is the test's own construction, not compared itself: it sums hundreds of products that cancel,
so its rounding is far above 1e-6; the outputs it is made of are compared element by element.
"""

import copy
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler import compile_module, to_jax
from ipu_backend.compiler.lowering_options import lowering_options
from tests.compiler.harness import assert_close

RTOL = 1e-5
ATOL = 1e-6


class WithLoss(torch.nn.Module):
    """``(model(*inputs), loss_fn(model(*inputs), *targets))``: the loss is compiled with the model."""

    def __init__(self, model: torch.nn.Module, loss_fn, n_inputs: int):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args):
        output = self.model(*args[:self.n_inputs])
        return output, self.loss_fn(output, *args[self.n_inputs:])


@dataclass
class ModelRun:
    """What a test may inspect further after ``check_model``."""

    program: object
    params: dict
    buffers: dict
    inputs: tuple
    key: jax.Array
    outputs: object
    loss: jax.Array
    grads: dict


def _tensor_to_jax(tree):
    return torch_pytree.tree_map(lambda x: to_jax(x) if isinstance(x, torch.Tensor) else x, tree)


def _differentiable(leaf) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad


def _cotangents(torch_leaves, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(leaf.shape, generator=generator) if _differentiable(leaf) else None
            for leaf in torch_leaves]


def _torch_loss(outputs, loss_fn, cotangents):
    if loss_fn is not None:
        return outputs[1]
    leaves = torch_pytree.tree_leaves(outputs)
    return sum((leaf * c).sum() for leaf, c in zip(leaves, cotangents) if c is not None)


def _jax_loss(outputs, loss_fn, cotangents):
    if loss_fn is not None:
        return outputs[1]
    leaves = torch_pytree.tree_leaves(outputs)
    return sum(jnp.sum(leaf * to_jax(c)) for leaf, c in zip(leaves, cotangents) if c is not None)


def _compare_outputs(actual, expected, rtol, atol):
    actual_leaves, actual_spec = torch_pytree.tree_flatten(actual)
    expected_leaves, expected_spec = torch_pytree.tree_flatten(expected)
    assert actual_spec == expected_spec, f"output structure {actual_spec} != torch's {expected_spec}"
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        if isinstance(e, torch.Tensor):
            assert_close(a, e, rtol, atol, f"output {i}")
        else:
            assert a == e, f"output {i}: {a!r} != torch's {e!r}"


def check_model(module: torch.nn.Module, inputs: tuple, loss_fn=None, targets: tuple = (),
                train: bool = True, *, rtol: float = RTOL, atol: float = ATOL,
                grad_atol: float | None = None, conv_algorithm: str = "xla",
                seed: int = 0) -> ModelRun:
    """Outputs, loss, every parameter's gradient and every buffer after the step equal torch's.

    ``loss_fn(output, *targets)`` is compiled with the model (so loss lowerings are tested too).
    ``grad_atol`` (default ``atol``) is for gradients that sum long products, where a test must
    say why 1e-6 is too tight. ``conv_algorithm`` is the convolution lowering traced.
    """
    module.train(train)
    subject = module if loss_fn is None else WithLoss(module, loss_fn, len(inputs))
    reference = copy.deepcopy(subject)
    args = tuple(inputs) + tuple(targets)

    program = compile_module(subject, args)
    params, buffers = program.state(subject)
    named_params = dict(reference.named_parameters())
    assert set(params) == set(named_params), (
        f"program parameters {sorted(params)} != module parameters {sorted(named_params)}")

    expected = reference(*args)
    expected_leaves = torch_pytree.tree_leaves(expected)
    cotangents = _cotangents(expected_leaves, seed)
    expected_loss = _torch_loss(expected, loss_fn, cotangents)
    expected_loss.backward()

    jax_inputs = _tensor_to_jax(args)
    key = jax.random.key(seed)

    def objective(p):
        outputs, new_buffers = program.fn(p, buffers, jax_inputs, key)
        return _jax_loss(outputs, loss_fn, cotangents), (outputs, new_buffers)

    with lowering_options(conv_algorithm=conv_algorithm):
        step = jax.jit(jax.value_and_grad(objective, has_aux=True))
        (loss, (outputs, new_buffers)), grads = step(params)

    if loss_fn is not None:
        assert_close(loss, expected_loss, rtol, atol, "loss")
    _compare_outputs(outputs, expected, rtol, atol)
    for name, param in named_params.items():
        expected_grad = param.grad if param.grad is not None else torch.zeros_like(param)
        assert_close(grads[name], expected_grad, rtol, atol if grad_atol is None else grad_atol,
                     f"gradient of {name}")
    expected_buffers = dict(reference.named_buffers())
    assert set(new_buffers) == set(expected_buffers), (
        f"program buffers {sorted(new_buffers)} != module buffers {sorted(expected_buffers)}")
    for name, value in expected_buffers.items():
        assert_close(new_buffers[name], value, rtol, atol, f"buffer {name} after the step")
    return ModelRun(program, params, buffers, jax_inputs, key, outputs, loss, grads)
